"""Seeded argument fuzzing of PairedCache: good scenarios, an independent spec, the checker.

The "file" :func:`membound_testing.fuzz.run` damages is a JSON object of named scenarios
(``GOOD``): the weights (described by shape, dtype and layout), capacity, PairedCacheConfig fields,
an initial mask and a few update masks (described by length, rows, dtype and kind).
``fuzz.mutate_json_bytes`` rewrites one field (to a value of ``fuzz.ODD_VALUES``, a nearby
int, a shortened or reversed list), deletes it, or adds a key. :func:`check` turns each
description into the argument it describes, or, where a description is not one this
harness can build (a shape of 2**40, an unknown dtype name, a row outside the mask), passes
the raw JSON value itself; then it constructs the cache and runs the updates, and classes
what happened against a spec of valid arguments written independently of the package:

- refused with PairedCacheError where the spec says invalid, the cache unchanged by a
  refused update: the fuzzer counts it clean;
- refused although the spec says valid: AssertionError (the fuzzer counts it unclear);
- accepted although the spec says invalid, a refused update that changed the cache, or a
  cache whose state differs from what was asked (pools, mask, capacity, config): False
  (silent);
- everything as asked: True (benign).

Kept in its own module so that the fuzzer's worker processes can import it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

N, H = 12, 4
MAX_ROWS = 2**31 - 1
MAX_INT64 = 2**63 - 1
WEIGHT_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "bool": torch.bool,
    "complex64": torch.complex64,
}
SUPPORTED = ("float32", "float16", "bfloat16", "float64")
MASK_DTYPES = {"bool": torch.bool, "uint8": torch.uint8, "int64": torch.int64}


def _weight(shape, dtype="float32", layout="contiguous"):
    return {"shape": shape, "dtype": dtype, "layout": layout}


def _mask(rows, kind="torch", n=N, dtype="bool"):
    return {"n": n, "rows": rows, "dtype": dtype, "kind": kind}


GOOD = {
    "gated_float32": {
        "up": _weight([N, H]),
        "down": _weight([H, N]),
        "gate": _weight([N, H]),
        "capacity": 6,
        "config": {"hybrid_tau": 1.8, "grain": 2, "par_threshold": 2, "num_threads": 2},
        "init_mask": _mask([0, 3, 5]),
        "updates": [_mask([1, 3, 5, 7]), _mask([0, 1, 2, 3, 4, 5]), _mask([])],
    },
    "no_gate_bfloat16": {
        "up": _weight([N, 8], "bfloat16"),
        "down": _weight([6, N], "bfloat16"),
        "gate": None,
        "capacity": None,
        "config": None,
        "init_mask": None,
        "updates": [_mask(list(range(N)), "numpy"), _mask([2, 4], "torch_strided")],
    },
    "gated_float16_rebuilds": {
        "up": _weight([N, 3], "float16"),
        "down": _weight([5, N], "float16"),
        "gate": _weight([N, 2], "float16"),
        "capacity": 4,
        "config": {"hybrid_tau": 0.0, "grain": 1, "par_threshold": 0, "num_threads": 1},
        "init_mask": _mask([11], "numpy"),
        "updates": [_mask([8, 9, 10, 11]), _mask([0, 1], "numpy")],
    },
}


def write_targets(directory: Path) -> Path:
    path = Path(directory) / "paired_cache_args.json"
    path.write_text(json.dumps(GOOD, indent=1))
    return path


# ---- building arguments from descriptions (raw JSON where a description is not buildable)


def _small_int(value, low, high) -> bool:
    return type(value) is int and low <= value <= high


def build_weight(desc, seed: int):
    """A tensor as described, or ``desc`` itself when it is not a buildable description."""
    if type(desc) is not dict or set(desc) != {"shape", "dtype", "layout"}:
        return desc
    shape, dtype, layout = desc["shape"], desc["dtype"], desc["layout"]
    if type(shape) is not list or not 1 <= len(shape) <= 3:
        return desc
    if not all(_small_int(s, 0, 64) for s in shape) or type(dtype) is not str:
        return desc
    if dtype not in WEIGHT_DTYPES or layout not in ("contiguous", "transposed", "sparse", "meta"):
        return desc
    gen = torch.Generator().manual_seed(seed)
    if layout == "transposed":
        if len(shape) != 2:
            return desc
        return torch.randn(shape[::-1], generator=gen).to(WEIGHT_DTYPES[dtype]).t()
    t = torch.randn(shape, generator=gen).to(WEIGHT_DTYPES[dtype])
    return t.to_sparse() if layout == "sparse" else t.to("meta") if layout == "meta" else t


def build_mask(desc):
    """A mask as described (torch, numpy, or a strided torch view), or ``desc`` itself."""
    if type(desc) is not dict or set(desc) != {"n", "rows", "dtype", "kind"}:
        return desc
    n, rows, dtype, kind = desc["n"], desc["rows"], desc["dtype"], desc["kind"]
    if not _small_int(n, 0, 64) or type(rows) is not list:
        return desc
    if not all(_small_int(r, 0, n - 1) for r in rows) or type(dtype) is not str:
        return desc
    if dtype not in MASK_DTYPES or kind not in ("torch", "numpy", "torch_strided"):
        return desc
    if kind == "numpy":
        mask = np.zeros(n, dtype={"bool": np.bool_, "uint8": np.uint8, "int64": np.int64}[dtype])
        mask[rows] = 1
        return mask
    mask = torch.zeros(n, dtype=MASK_DTYPES[dtype])
    mask[rows] = 1
    if kind == "torch_strided":
        wide = torch.zeros(2 * n, dtype=mask.dtype)
        wide[::2] = mask
        return wide[::2]  # the same values, stride 2
    return mask


def build_config(desc):
    from paired_cache import PairedCacheConfig

    if desc is None:
        return None
    if type(desc) is not dict or not set(desc) <= {
        "hybrid_tau",
        "grain",
        "par_threshold",
        "num_threads",
    }:
        return desc
    return PairedCacheConfig(**desc)


# ---- the spec, independent of the package


def weight_valid(t, n=None, dtype=None) -> bool:
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu":
        return False
    if t.dim() != 2 or not all(1 <= s <= MAX_ROWS for s in t.shape) or not t.is_contiguous():
        return False
    if t.dtype not in [WEIGHT_DTYPES[d] for d in SUPPORTED]:
        return False
    return (n is None or t.shape[0] == n) and (dtype is None or t.dtype == dtype)


def config_valid(desc) -> bool:
    if desc is None:
        return True
    if type(desc) is not dict or not set(desc) <= {
        "hybrid_tau",
        "grain",
        "par_threshold",
        "num_threads",
    }:
        return False
    tau = desc.get("hybrid_tau", 1.8)
    if type(tau) not in (int, float) or not tau >= 0:
        return False
    if type(tau) is int and tau > sys.float_info.max:
        return False
    return (
        _small_int(desc.get("grain", 64), 1, MAX_ROWS)
        and _small_int(desc.get("par_threshold", 64), 0, MAX_INT64)
        and _small_int(desc.get("num_threads", 1), 1, 64)
    )


def mask_rows(mask, n: int, capacity: int):
    """The set of rows of a valid mask, or None when the spec says the mask is invalid."""
    if isinstance(mask, np.ndarray):
        if mask.dtype != np.bool_:
            return None
    elif (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.layout != torch.strided
        or mask.device.type != "cpu"
    ):
        return None
    if mask.ndim != 1 or mask.shape[0] != n:
        return None
    rows = {i for i in range(n) if bool(mask[i])}
    return rows if len(rows) <= capacity else None


# ---- the checker


def _snapshot(cache):
    return (
        cache.mask(),
        cache.active_indices(),
        cache.index_to_position(),
        cache.gate_up().clone(),
        cache.active_down_T().clone(),
        cache.stats,
    )


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:5], b[:5], strict=True)) and a[5] == b[5]


def _as_asked(cache, up, down, gate, capacity, config_desc, rows) -> bool:
    """The cache holds what was asked: its pools, capacity, config and active set."""
    cache.check_valid()  # raises CacheInvariantError (unclear) if the core is inconsistent
    if cache.capacity != capacity or cache.dtype != up.dtype:
        return False
    if not torch.equal(cache.up_pool, up) or not torch.equal(cache.down_pool_T, down.t()):
        return False
    if (gate is None) != (cache.gate_pool is None):
        return False
    if gate is not None and not torch.equal(cache.gate_pool, gate):
        return False
    for name, value in (config_desc or {}).items():
        held = getattr(cache.config, name)
        if name == "hybrid_tau":
            if type(held) is not float or held != float(value):
                return False
        elif type(held) is not int or held != value:
            return False
    return (
        set(torch.nonzero(cache.mask()).flatten().tolist()) == rows
        and set(cache.active_indices().tolist()) == rows
    )


def _run_scenario(name, scenario):
    """None if the scenario ran as asked, False if silent, or the PairedCacheError raised."""
    from paired_cache import PairedCacheError
    from paired_cache.cache import PairedCache

    if type(scenario) is not dict:
        scenario = {"up": scenario}
    up = build_weight(scenario.get("up"), 1)
    down = build_weight(scenario.get("down"), 2)
    gate = build_weight(scenario.get("gate"), 3)
    n = up.shape[0] if isinstance(up, torch.Tensor) and up.dim() == 2 else None
    capacity = scenario.get("capacity")
    config_desc = scenario.get("config")
    init_mask = build_mask(scenario.get("init_mask"))
    weights_ok = (
        weight_valid(up)
        and weight_valid(down, dtype=up.dtype)
        and down.shape[1] == n
        and (gate is None or weight_valid(gate, n=n, dtype=up.dtype))
    )
    cap = n if capacity is None else capacity
    cap_ok = weights_ok and _small_int(cap, 1, n)
    init_rows = set() if init_mask is None else (mask_rows(init_mask, n, cap) if cap_ok else None)
    valid = cap_ok and config_valid(config_desc) and init_rows is not None
    try:
        config = build_config(config_desc)
        cache = PairedCache(up, down, gate, capacity=capacity, config=config, init_mask=init_mask)
    except PairedCacheError as err:
        if valid:
            raise AssertionError(f"scenario {name!r} is valid but was refused: {err}") from err
        return err
    if not valid or not _as_asked(cache, up, down, gate, cap, config_desc, init_rows):
        return False
    refusal, rows = None, init_rows
    updates = scenario.get("updates")
    for desc in updates if type(updates) is list else [updates]:
        mask = build_mask(desc)
        new_rows = mask_rows(mask, n, cap)
        before = _snapshot(cache)
        try:
            cache.update(mask)
        except PairedCacheError as err:
            if new_rows is not None:
                raise AssertionError(f"scenario {name!r}: a valid mask was refused: {err}") from err
            if not _same(before, _snapshot(cache)):
                return False
            refusal = err
            continue
        if new_rows is None:
            return False
        rows = new_rows
        if not _as_asked(cache, up, down, gate, cap, config_desc, rows):
            return False
    return refusal


def check(path: str) -> bool:
    # fuzz.run appends a NUL to a mutant that came out identical to the original.
    scenarios = json.loads(Path(path).read_bytes().rstrip(b"\0"))
    refusal = None
    for name, scenario in scenarios.items():
        outcome = _run_scenario(name, scenario)
        if outcome is False:
            return False
        refusal = refusal or outcome
    if refusal is not None:
        raise refusal
    return True
