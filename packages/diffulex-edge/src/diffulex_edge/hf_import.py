"""Llama-family models held by transformers (or stored as GGUF) as :class:`SDARModel`.

A safetensors directory needs no transformers: :func:`diffulex_edge.load_checkpoint` reads
it directly. These two routes go through transformers (the ``hf`` extra): a model object
already in memory, and a GGUF file, which transformers dequantises to float on load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffulex_edge.checkpoint import expected_shapes
from diffulex_edge.config import SDARConfig
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.model import SDARModel


def from_hf_model(hf_model, dtype: torch.dtype = torch.float32) -> SDARModel:
    """Copy a transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``
    into a new :class:`SDARModel` (eval mode, ``dtype``); the names and shapes of its
    tensors are checked against the mapped config first."""
    config = SDARConfig.from_dict(hf_model.config.to_dict())
    state = {
        k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")
    }
    expected = expected_shapes(config)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DiffulexEdgeError(
            f"{type(hf_model).__name__} does not map onto SDARModel (qk_norm="
            f"{config.qk_norm}, qkv_bias={config.qkv_bias}): missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise DiffulexEdgeError(
                f"{name} has shape {tuple(state[name].shape)}, the config implies {shape}"
            )
    model = SDARModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name if name.startswith("lm_head.") else f"model.{name}"
            param.copy_(state[key])
    return model.to(dtype).eval()


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> SDARModel:
    """A GGUF file (any quantisation transformers can dequantise) as a float SDARModel."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise DiffulexEdgeError(
            "loading GGUF needs transformers and gguf: pip install 'diffulex-edge[hf]'"
        ) from err
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return from_hf_model(hf_model, dtype)
