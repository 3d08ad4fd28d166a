"""Checkers and format-aware mutations for the fuzz test and benchmark.

A checker loads a mutant the way a user would and returns True when what it loaded is what
the file says, False when it differs; a refusal raises. The references (the good model
directory, state and trace) come from the JSON file named by ``MOE_FUZZ_REFS``; the worker
processes of :mod:`membound_testing.fuzz` inherit it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from membound_testing import fuzz
from moe_expert_cache import ExpertCacheConfig, config_from_state, load_cached_model, read_state
from moe_expert_cache.checked_json import dumps_checksummed
from moe_expert_cache.expert_store import ExpertStore
from moe_expert_cache.slots import ExpertSlots
from moe_expert_cache.trace import RouterTrace

# The fuzz model: a 2-layer, 8-expert, top-2 MoE (the conftest's random model).
NUM_EXPERTS, TOP_K = [8, 8], 2
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@functools.cache
def refs() -> dict:
    return json.loads(Path(os.environ["MOE_FUZZ_REFS"]).read_text())


@functools.cache
def reference_weights(model_dir: str) -> dict[str, np.ndarray]:
    out = {}
    for name in SHARDS:
        out.update({k: np.array(v) for k, v in mx.load(str(Path(model_dir) / name)).items()})
    return out


def _same(a: mx.array, b: np.ndarray) -> bool:
    a = np.array(a)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _store_matches(store: ExpertStore, want: dict[str, np.ndarray]) -> bool:
    """Every tensor the store serves (non-expert whole, experts row by row) is the
    reference's, and the store serves every reference tensor."""
    got = store.non_expert_weights()
    served = set(got)
    for name, arr in got.items():
        if name not in want or not _same(arr, want[name]):
            return False
    for block in store.blocks:
        for e in range(store.num_experts(block)):
            for proj, params in store.read_expert(block, e).items():
                for param, arr in params.items():
                    name = f"{block}.switch_mlp.{proj}.{param}"
                    served.add(name)
                    if (
                        name not in want
                        or e >= want[name].shape[0]
                        or not _same(arr, want[name][e])
                    ):
                        return False
    return served == set(want)


def check_store(path: str) -> bool:
    """The expert store over a mutant model directory."""
    store = ExpertStore(path)
    try:
        return _store_matches(store, reference_weights(refs()["model"]))
    finally:
        store.close()


def _model_matches(path: str) -> bool:
    cached = load_cached_model(path, ExpertCacheConfig(capacity=4))
    want = reference_weights(refs()["model"])
    # The model mlx-lm built: its arguments (keys mlx-lm ignores do not count) and weights.
    good_args = type(cached.model.args).from_dict(
        json.loads((Path(refs()["model"]) / "config.json").read_text())
    )
    if _args(cached.model.args) != _args(good_args):
        return False
    prefixes = tuple(f"{layer.block_path}.switch_mlp." for layer in cached.manager.layers)
    for name, arr in tree_flatten(cached.model.parameters()):
        if not name.startswith(prefixes) and (name not in want or not _same(arr, want[name])):
            return False
    return _store_matches(cached.store, want)


def _args(args) -> str:
    return json.dumps(vars(args), sort_keys=True, default=repr)


def check_model(path: str) -> bool:
    """``load_cached_model`` over a mutant model directory."""
    return _model_matches(path)


def _payload_only(path: str) -> bool:
    """Whether the mutant differs from the good model only inside a shard's weight bytes
    (same size, same header): the one change a shard without an integrity record cannot
    reveal (README, Limits)."""
    good = Path(refs()["foreign"])
    for name in SHARDS:
        a, b = (good / name).read_bytes(), (Path(path) / name).read_bytes()
        if a != b:
            (n,) = struct.unpack("<Q", a[:8])
            return len(a) == len(b) and a[: 8 + n] == b[: 8 + n]
    return False


def check_model_foreign(path: str) -> bool:
    """``load_cached_model`` over a checkpoint without an integrity record: a changed
    weight payload with header and size intact loads (it cannot be told from the file, see
    README Limits) and counts as benign; every other difference counts as silent."""
    same = _model_matches(path)
    return same or _payload_only(path)


def _declared_state(path: str):
    """The state the file itself declares when its digest verifies, else None."""
    data = Path(path).read_bytes()
    prefix = b'{"sha256": "'
    if (
        data.startswith(prefix)
        and hashlib.sha256(prefix + data[76:]).hexdigest().encode() == (data[12:76])
    ):
        return json.loads(data)
    return None


def check_state(path: str) -> bool:
    """A warm start: ``read_state``, ``config_from_state`` and the slots of the 2-layer,
    8-expert model. A re-sealed (forged) state must load exactly as written or be refused;
    any other change must be refused."""
    state = read_state(path)
    config = config_from_state(ExpertCacheConfig(), state)
    caps = config.layer_capacities(NUM_EXPERTS, TOP_K)
    slots = [
        ExpertSlots(NUM_EXPERTS[i], caps[i], TOP_K, config.pinned.get(i, ()), config.initial.get(i))
        for i in range(len(caps))
    ]
    doc = _declared_state(path) or json.loads(Path(refs()["state"]).read_text())
    want = doc["state"]
    loaded = {
        "num_experts": [s.num_experts for s in slots],
        "top_k": TOP_K,
        "resident": [s.slot_to_expert.tolist() for s in slots],
        "pinned": [sorted(s.pinned) for s in slots],
    }
    return json.dumps(loaded, sort_keys=True) == json.dumps(want, sort_keys=True) and (
        json.dumps(state, sort_keys=True) == json.dumps(want, sort_keys=True)
    )


def check_trace(path: str) -> bool:
    """``RouterTrace.load``; a re-sealed (forged) trace must load exactly as written or be
    refused; any other change must be refused."""
    trace = RouterTrace.load(path)
    data = Path(path).read_bytes()
    if hashlib.sha256(data[:-32]).digest() != data[-32:]:
        data = Path(refs()["trace"]).read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + n])
    rows = np.frombuffer(data[12 + n : -32], dtype="<i4")
    return (
        (trace.num_layers, trace.num_experts, trace.top_k)
        == (header["num_layers"], header["num_experts"], header["top_k"])
        and header["records"] == len(trace.rows())
        and trace.rows().tobytes() == rows.tobytes()
    )


def forge_state(data: bytes, rng: random.Random) -> bytes:
    """A state with one field rewritten and its SHA-256 recomputed (a crafted file)."""
    doc = json.loads(data)
    del doc["sha256"]
    return dumps_checksummed(fuzz.mutate_json(doc, rng))


def forge_trace(data: bytes, rng: random.Random) -> bytes:
    """A trace with one header field or one row value rewritten and its SHA-256
    recomputed (a crafted file)."""
    (n,) = struct.unpack("<I", data[8:12])
    header, rows = json.loads(data[12 : 12 + n]), bytearray(data[12 + n : -32])
    if rng.random() < 0.5 or not rows:
        head = json.dumps(fuzz.mutate_json(header, rng), allow_nan=True).encode()
    else:
        head = data[12 : 12 + n]
        i = rng.randrange(len(rows) // 4)
        value = rng.choice([99, -1, 8, 2**31 - 1, -(2**31), rng.randrange(8), rng.randrange(2)])
        rows[4 * i : 4 * i + 4] = struct.pack("<i", value)
    body = data[:8] + struct.pack("<I", len(head)) + head + bytes(rows)
    return body + hashlib.sha256(body).digest()


def make_references(root: Path) -> Path:
    """Write the good files under ``root`` (a sealed 4-bit Qwen3-MoE, the same without its
    integrity record, a saved warm-start state and a router trace) and the JSON naming
    them; returns the JSON's path (for ``MOE_FUZZ_REFS``)."""
    import shutil

    from membound_testing.random_moe import random_moe_config, write_random_moe
    from moe_expert_cache import generate, seal_model
    from moe_expert_cache.expert_store import INTEGRITY_FILE

    sealed = write_random_moe(
        root / "sealed", random_moe_config("qwen3_moe"), bits=4, seal=seal_model
    )
    foreign = root / "foreign"
    shutil.copytree(sealed, foreign)
    (foreign / INTEGRITY_FILE).unlink()
    cached = load_cached_model(sealed, ExpertCacheConfig(capacity=4, pinned={1: [7]}, mode="skip"))
    cached.manager.start_trace()
    generate(cached.model, [3, 17, 42, 99], 8, cached.manager)
    cached.manager.save_state(root / "state.json")
    cached.manager.trace.save(root / "router.trace")
    paths = {
        "model": str(sealed),
        "foreign": str(foreign),
        "state": str(root / "state.json"),
        "trace": str(root / "router.trace"),
    }
    (root / "refs.json").write_text(json.dumps(paths))
    return root / "refs.json"


def _header_bytes(path: Path) -> int:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + n


def loaders(refs_path: Path) -> dict[str, tuple[list, str]]:
    """Loader name -> (fuzz targets, checker). Every loader here must reach 0 crash, hang,
    unclear and silent; see :func:`foreign_config` for the one that cannot."""
    from moe_expert_cache.expert_store import INTEGRITY_FILE

    r = json.loads(Path(refs_path).read_text())
    sealed, foreign = Path(r["model"]), Path(r["foreign"])
    index = "model.safetensors.index.json"

    def shard_targets(root):
        return [
            fuzz.Target(
                root, s, fuzz.mutate_safetensors_header, header_bytes=_header_bytes(root / s)
            )
            for s in SHARDS
        ] + [fuzz.Target(root, index, fuzz.mutate_json_bytes)]

    return {
        "expert store (sealed shards, index, integrity record)": (
            [*shard_targets(sealed), fuzz.Target(sealed, INTEGRITY_FILE, fuzz.mutate_json_bytes)],
            "fuzz_checkers:check_store",
        ),
        "load_cached_model (config.json, sealed)": (
            [fuzz.Target(sealed, "config.json", fuzz.mutate_json_bytes, header_bytes=256)],
            "fuzz_checkers:check_model",
        ),
        "load_cached_model (shards and index without integrity record)": (
            shard_targets(foreign),
            "fuzz_checkers:check_model_foreign",
        ),
        "warm-start state (read_state + slots)": (
            [fuzz.Target(Path(r["state"]), structured=forge_state, header_bytes=128)],
            "fuzz_checkers:check_state",
        ),
        "RouterTrace.load": (
            [fuzz.Target(Path(r["trace"]), structured=forge_trace, header_bytes=128)],
            "fuzz_checkers:check_trace",
        ),
    }


def foreign_config(refs_path: Path) -> tuple[list, str]:
    """``config.json`` of a checkpoint without an integrity record: a rewritten value that
    is valid but different (``rope_theta``, ``rms_norm_eps``, ``norm_topk_prob``,
    ``num_experts_per_tok``) cannot be told from the file (README, Limits)."""
    foreign = Path(json.loads(Path(refs_path).read_text())["foreign"])
    return (
        [fuzz.Target(foreign, "config.json", fuzz.mutate_json_bytes, header_bytes=256)],
        "fuzz_checkers:check_model",
    )


CLEAN_ERRORS = ["moe_expert_cache.ExpertCacheError"]
