"""Decoder models held by transformers (or stored as GGUF) as :class:`SDARModel`.

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


def split_fused(state: dict[str, torch.Tensor], config: SDARConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused tensors as SDAR's: ``qkv_proj`` (H*hd + 2*KV*hd, hidden) into q, k and
    v rows, ``gate_up_proj`` (2*intermediate, hidden) into gate then up rows. Other tensors
    pass through; a fused tensor of the wrong size is left for the shape check to name."""
    hd = config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.qkv_proj.weight") and tensor.shape[0] == q + 2 * kv:
            p = name[: -len("qkv_proj.weight")]
            for part, rows in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                out[f"{p}{part}_proj.weight"] = rows
        elif name.endswith("mlp.gate_up_proj.weight") and tensor.shape[0] % 2 == 0:
            p = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.chunk(2, dim=0)
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = gate, up
        else:
            out[name] = tensor
    return out


def from_hf_model(hf_model, dtype: torch.dtype = torch.float32) -> SDARModel:
    """Copy a transformers causal LM of a family :mod:`diffulex_edge.hf_config` maps
    (``LlamaForCausalLM``, ``Gemma3ForCausalLM``, ``Phi3ForCausalLM``, ...) into a new
    :class:`SDARModel` (eval mode, ``dtype``); the names and shapes of its tensors are
    checked against the mapped config first.

    Args:
        hf_model: the transformers model; read, not changed.
        dtype: the floating dtype of the new model's weights.

    Returns:
        :class:`SDARModel`: a copy of the weights, in eval mode.

    Raises:
        DiffulexEdgeError: the family or one of its features is not implemented (before any
            weight is copied), or the tensors do not match the config.
    """
    config = SDARConfig.from_dict(hf_model.config.to_dict())
    # RoPE tables and Gemma 3's embedding scale are buffers SDARModel derives from the config.
    state = {
        k: v
        for k, v in hf_model.state_dict().items()
        if ".rotary_emb." not in k and not k.endswith("embed_scale")
    }
    state = split_fused(state, config)
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
    """A GGUF file (any quantisation transformers can dequantise) as a float SDARModel.

    Needs transformers and gguf (the ``hf`` extra); the tokenizer is the caller's to load
    (``AutoTokenizer.from_pretrained(directory, gguf_file=name)``).

    Args:
        path: the ``.gguf`` file.
        dtype: the floating dtype of the model's weights (dequantised to float32 first).

    Returns:
        :class:`SDARModel`: the dequantised model, in eval mode.

    Raises:
        FileNotFoundError: no file at ``path``.
        DiffulexEdgeError: transformers is not installed, or the model's family or one of
            its features is not implemented (as :func:`from_hf_model`).
    """
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
