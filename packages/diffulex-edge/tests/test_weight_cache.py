"""One packed copy of the weights for a program's forward and prefill methods (XNNPACK's
weight cache, switched through ExecuTorch's backend options)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from diffulex_edge.model import SDARModel
from diffulex_edge.pte_record import read_record
from diffulex_edge.xnnpack_weight_cache import (
    set_weight_cache,
    shared_packed_weights,
    weight_cache_enabled,
)


def test_the_switch_reads_back_and_is_restored_after_loading():
    assert weight_cache_enabled() is False  # ExecuTorch's default: each delegate packs its own
    with shared_packed_weights():
        assert weight_cache_enabled() is True
    assert weight_cache_enabled() is False
    set_weight_cache(True)
    try:
        with shared_packed_weights():
            assert weight_cache_enabled() is True
        assert weight_cache_enabled() is True  # it was on before: left on
    finally:
        set_weight_cache(False)
    assert weight_cache_enabled() is False


def test_the_switch_refuses_a_value_that_is_not_a_bool():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        set_weight_cache(1)
    assert weight_cache_enabled() is False


# Loads the program in a fresh process (no memory freed by earlier tests to reuse) and
# reports how much anonymous memory the engine added: the program's methods, their packed
# weights, the static cache.
_LOAD = textwrap.dedent(
    """
    import json, re, sys, warnings
    from pathlib import Path
    from diffulex_edge import runtime, xnnpack_weight_cache
    from diffulex_edge.executorch_import import runtime as executorch_runtime

    def rss_anon():
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"RssAnon:\\s+(\\d+) kB", status).group(1)) * 1024

    executorch_runtime()
    if sys.argv[2] == "unshared":  # a runtime whose backend options cannot be reached
        xnnpack_weight_cache._SET = xnnpack_weight_cache._GET = "no_such_symbol"
    before = rss_anon()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = runtime.PteEngine(sys.argv[1])
    print(json.dumps({
        "grown": rss_anon() - before,
        "shared": engine.shares_packed_weights,
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }))
    """
)


def _load_in_fresh_process(path, mode):
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), mode], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_forward_and_prefill_hold_one_packed_copy_of_the_weights(smollm2_pte):
    """Each XNNPACK delegate packs the weights it uses; SmolLM2's forward and prefill use all
    of them (the tied embedding as lm_head). Two copies would add at least twice the
    weights' bytes; one adds the weights once plus the static cache and the runtime's
    buffers."""
    with torch.device("meta"):
        model = SDARModel(read_record(smollm2_pte).config)
    weight_bytes = 4 * sum(p.numel() for p in model.parameters())  # fp32, tied pair once
    assert weight_bytes > 500 * 2**20

    shared = _load_in_fresh_process(smollm2_pte, "shared")
    assert shared["shared"] is True and shared["warnings"] == []
    assert 0.9 * weight_bytes < shared["grown"] < 1.5 * weight_bytes, (shared, weight_bytes)

    unshared = _load_in_fresh_process(smollm2_pte, "unshared")
    assert unshared["shared"] is False
    assert len(unshared["warnings"]) == 1
    assert "each method packs its own copy of the weights" in unshared["warnings"][0]
    assert unshared["grown"] > 1.9 * weight_bytes, (unshared, weight_bytes)
