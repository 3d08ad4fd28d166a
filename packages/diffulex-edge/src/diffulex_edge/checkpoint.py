"""SDAR checkpoints in Hugging Face layout: ``config.json`` + ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``), tensor names as in
``SDARForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diffulex_edge.config import SDARConfig
from diffulex_edge.model import SDARModel

_TOP_LEVEL = ("lm_head.",)


def _hf_name(name: str) -> str:
    return name if name.startswith(_TOP_LEVEL) else f"model.{name}"


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{directory} has neither model.safetensors nor its index")
    return [single]


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32) -> SDARModel:
    """Build an :class:`SDARModel` from a Hugging Face-layout directory.

    Every parameter must be present with its exact shape (checked from the safetensors
    headers before any tensor is read); unknown tensors are an error, except a
    ``lm_head.weight`` alongside tied embeddings.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{directory} has no config.json")
    config = SDARConfig.from_json(config_path)
    with torch.device("meta"):
        skeleton = SDARModel(config)
    expected = {_hf_name(n): tuple(p.shape) for n, p in skeleton.named_parameters()}
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for shard in _shard_files(directory):
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                found[key] = (shard, tuple(f.get_slice(key).get_shape()))
    if config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if found[key][1] != shape:
            raise ValueError(
                f"{key} has shape {found[key][1]} in {directory}, config implies {shape}"
            )
    model = SDARModel(config)
    state = {}
    for key, (shard, _) in found.items():
        with safe_open(shard, framework="pt") as f:
            state[key.removeprefix("model.") if key.startswith("model.") else key] = f.get_tensor(
                key
            )
    model.load_state_dict(state, strict=False)
    return model.to(dtype).eval()


def save_checkpoint(model: SDARModel, directory: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors``, each to a temp name then renamed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_hf_name(n): p.detach().contiguous().clone() for n, p in model.named_parameters()}
    _atomic(directory / "model.safetensors", lambda p: save_file(tensors, p, {"format": "pt"}))
    text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    _atomic(directory / "config.json", lambda p: Path(p).write_text(text))


def _atomic(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is meant to be shared
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
