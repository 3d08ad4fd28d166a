"""benchmarks/microbench.py's command line and mask chains (no timing is asserted)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# The microbenchmark is a benchmark script, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from microbench import METHODS, BenchConfig, main, mask_chain


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), half_k=st.integers(1, 40), seed=st.integers(0, 1000))
def test_mask_chain_keeps_m_and_changes_k_rows(m, half_k, seed):
    half_k = min(half_k, m)
    chain = mask_chain(100, m, 2 * half_k, 5, seed)
    assert len(chain) == 6
    for old, new in itertools.pairwise(chain):
        assert int(new.sum()) == m
        assert int((old & ~new).sum()) == int((new & ~old).sum()) == half_k


def test_bench_cli_writes_the_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--steps", "3", "--threads", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 2 * 3 * len(METHODS)  # dtypes x ks x methods
    by_key = {(r[0], r[1], r[2]): r for r in result["rows"]}
    moved = result["columns"].index("rows moved")
    bound = result["columns"].index("x bound")
    assert by_key[("float32", 16, "paired")][moved] <= 8  # max(|A|, |R|) = k / 2
    assert by_key[("float32", 16, "torch_index_select")][moved] == 256
    # The limit moves the paired update's bytes, so it is its own bound.
    assert by_key[("float32", 16, "memcpy")][moved] == 8
    assert by_key[("float32", 16, "memcpy")][bound] == 1.0
    assert "| float32 | 16 | paired |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"m": 0}, r"m must be in \[1, N/2"), ({"ks": (3,)}, r"every k must be even")],
)
def test_bad_bench_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BenchConfig(**kwargs)
