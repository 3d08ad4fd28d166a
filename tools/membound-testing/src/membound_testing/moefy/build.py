"""The build: a dense Llama checkpoint in, a sealed mlx-lm MoE checkpoint out, written to a
temporary directory beside its place and renamed into it; found, not rebuilt, when the
place already holds the same build (:func:`build_key`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from membound_testing.__about__ import __version__
from membound_testing.moefy.calibration import calibration_text
from membound_testing.moefy.config import BuildPlan, MoefyConfig, MoefyError, dense_config
from membound_testing.moefy.split import layer_activations, split_layer

BUILD_RECORD = "moefy.json"
# In the build key: bump it when what a build writes changes (the algorithm, the files,
# or moe-expert-cache's integrity record that ``seal`` writes), so old builds are not found.
BUILD_FORMAT = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def load_dense(dense_dir: str | Path) -> llama.Model:
    """The dense model as a stock mlx-lm Llama.

    Args:
        dense_dir: A float Llama checkpoint directory (``config.json``, ``*.safetensors``).

    Returns:
        The model, float32, with its config's RoPE base.

    Raises:
        MoefyError: The checkpoint is not a Llama moefy takes (:func:`dense_config`).
    """
    cfg = dense_config(dense_dir)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    weights = {}
    for f in sorted(Path(dense_dir).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    if "model.embed_tokens.weight" not in weights and cfg.get("tie_word_embeddings"):
        # The cached float copy kept the tied matrix under lm_head's name.
        weights["model.embed_tokens.weight"] = weights["lm_head.weight"]
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def build_key(dense_dir: str | Path, calibration_ids: Sequence[int], config: MoefyConfig) -> str:
    """What decides the build: format, settings, source and calibration.

    The source's ``config.json`` counts by its content, less ``transformers_version`` (which
    transformers release wrote the file): a copy converted by another release is the same
    model and finds the same build.

    Args:
        dense_dir: The dense checkpoint directory.
        calibration_ids: The calibration token ids.
        config: The build's settings.

    Returns:
        A SHA-256 hex digest.
    """
    h = hashlib.sha256()
    h.update(f"{BUILD_FORMAT}/{json.dumps(asdict(config), sort_keys=True)}".encode())
    source = json.loads((Path(dense_dir) / "config.json").read_text())
    source.pop("transformers_version", None)
    h.update(json.dumps(source, sort_keys=True).encode())
    for f in sorted(Path(dense_dir).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(np.asarray(calibration_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def moefy(
    dense_dir: str | Path,
    out_dir: str | Path,
    calibration_ids: Sequence[int],
    config: MoefyConfig | None = None,
    progress: bool = True,
    *,
    seal: Callable[[Path], object],
) -> Path:
    """Build (or find, when ``out_dir`` already holds this build) the MoE of a dense Llama.

    Args:
        dense_dir: The dense float Llama checkpoint (``config.json``, ``*.safetensors``,
            tokenizer files, copied into the build).
        out_dir: Where the build goes; a directory holding another build is refused.
        calibration_ids: (T,) token ids, at least 2 x ``num_experts``.
        config: The settings (default ``MoefyConfig()``: a Mixtral, 16 experts, top-4).
        progress: Show a progress bar over the layers.
        seal: Writes the checkpoint's integrity record: moe-expert-cache's ``seal_model``
            (passed in, so that this helper imports no package of the repo).

    Returns:
        ``out_dir``, a sealed mlx-lm checkpoint with its build record ``moefy.json``.

    Raises:
        MoefyError: A setting, source or calibration that does not fit, or ``out_dir``
            holding another build; nothing is written.
    """
    from tqdm import tqdm

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    plan = BuildPlan(config or MoefyConfig(), dense_config(dense_dir), calibration_ids)
    key = build_key(dense_dir, plan.ids, plan.config)
    if _holds_build(out_dir, key):
        return out_dir
    model = load_dense(dense_dir)
    weights, layer_stats = _outer_weights(model, plan), []
    desc = "moefy: cluster + fit router"
    with tqdm(total=plan.n_layers, desc=desc, unit="layer", disable=not progress) as bar:
        for i, (x, act) in enumerate(layer_activations(model, plan.chunks())):
            stats, layer_weights = split_layer(model.model.layers[i], i, x, act, plan)
            layer_stats.append(stats)
            weights.update(layer_weights)
            bar.update(1)
    record = {
        "format": BUILD_FORMAT,
        "key": key,
        "built_by": f"membound-testing {__version__}",
        "source": str(dense_dir),
        "calibration_tokens": len(plan.ids),
        "config": asdict(plan.config),
        "layers": layer_stats,
    }
    _write_build(out_dir, dense_dir, weights, plan, record, seal)
    return out_dir


def _outer_weights(model: llama.Model, plan: BuildPlan) -> dict[str, mx.array]:
    """The weights outside the decoder layers: embedding, final norm and, for a Qwen2-MoE
    (which always has one), the ``lm_head``."""
    weights = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
    }
    if plan.config.shared_size:
        lm_head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
        weights["lm_head.weight"] = lm_head.weight
    return weights


def _holds_build(out_dir: Path, key: str) -> bool:
    """``out_dir`` holds the build ``key`` (True), or does not exist (False); else refused."""
    record_path = out_dir / BUILD_RECORD
    if record_path.is_file() and json.loads(record_path.read_text()).get("key") == key:
        return True
    if out_dir.exists():
        raise MoefyError(f"{out_dir} exists and holds another build; remove it first")
    return False


def _write_build(
    out_dir: Path, dense_dir: Path, weights: dict, plan: BuildPlan, record: dict, seal
) -> None:
    """Checkpoint, tokenizer, integrity record and build record, in a temporary directory
    beside ``out_dir`` renamed into place, with the mode a plain ``mkdir`` gives."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        _write_checkpoint(tmp, weights, plan.moe_config(), plan.n_layers, plan.config.shards)
        for name in TOKENIZER_FILES:
            if (dense_dir / name).is_file():
                shutil.copyfile(dense_dir / name, tmp / name)
        seal(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=1))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it 0o700
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_checkpoint(path: Path, weights: dict, cfg: dict, n_layers: int, shards: int) -> None:
    """Shards of whole layers (the embedding and final norm in the first) plus the index."""
    shards = min(shards, n_layers)
    groups: list[dict[str, mx.array]] = [{} for _ in range(shards)]
    for name, w in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else 0
        groups[layer * shards // n_layers][name] = w
    weight_map, total = {}, 0
    for s, group in enumerate(groups):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), group, metadata={"format": "mlx"})
        for name, w in group.items():
            weight_map[name] = fname
            total += w.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def moefy_cached(
    dense_dir: str | Path,
    cache_root: str | Path,
    config: MoefyConfig | None = None,
    progress: bool = True,
    *,
    seal: Callable[[Path], object],
) -> Path:
    """:func:`moefy` calibrated on :func:`~membound_testing.moefy.calibration_text`, built
    once into ``cache_root``.

    The build's name carries its settings and the first 12 digits of its build key, so a
    new format, setting, source or calibration builds anew and an old build is never taken
    for a new one.

    Args:
        dense_dir: The dense float Llama checkpoint; its tokenizer encodes the calibration.
        cache_root: The directory that holds the builds.
        config: The settings (default ``MoefyConfig()``).
        progress: Show a progress bar over the layers.
        seal: moe-expert-cache's ``seal_model``, as for :func:`moefy`.

    Returns:
        The checkpoint's directory,
        ``<dense_dir name>-moe<E>-top<k>[-shared<S>]-<key>``.

    Raises:
        MoefyError: As :func:`moefy`.
    """
    from mlx_lm.utils import load_tokenizer

    config = config or MoefyConfig()
    dense_dir = Path(dense_dir)
    ids = load_tokenizer(dense_dir).encode(calibration_text())
    key = build_key(dense_dir, ids, config)[:12]
    shared = f"-shared{config.shared_size}" if config.shared_size else ""
    name = f"{dense_dir.name}-moe{config.num_experts}-top{config.top_k}{shared}-{key}"
    return moefy(dense_dir, Path(cache_root) / name, ids, config, progress, seal=seal)
