"""The pool file: written once, mapped read-only, read in place by the C core."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import torch
from conftest import make_weights
from hypothesis import given, settings
from hypothesis import strategies as st

from paired_cache import PairedCacheError
from paired_cache.cache import PairedCache
from paired_cache.pool_file import (
    MAGIC,
    PAGE,
    TRAILER,
    PoolFile,
    mapping_rss,
    row_stride,
    write_pool_file,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _layers(count=3, n=40, hidden=12, dtype=torch.float32):
    return [
        (f"model.layers.{i}.mlp", *make_weights(n, hidden, dtype, seed=i)) for i in range(count)
    ]


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 50),
    cols=st.tuples(st.integers(0, 9), st.integers(1, 9), st.integers(1, 9)),
    seed=st.integers(0, 1000),
)
def test_mapped_pool_equals_the_in_memory_pool(tmp_path_factory, dtype, n, cols, seed):
    gate_cols, up_cols, hidden = cols
    gate, up, _ = make_weights(n, up_cols, dtype, seed, gate_cols=gate_cols)
    down = torch.randn(hidden, n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    path = tmp_path_factory.mktemp("pool") / "p.pcpool"
    write_pool_file(path, [("mlp", gate, up, down)])
    pool = PoolFile(path)
    layer = pool.layers[0]
    assert (layer.n_rows, layer.gate_cols, layer.up_cols, layer.hidden) == (n, *cols)
    assert layer.offset % PAGE == 0 and layer.row_bytes % 64 == 0
    mapped = PairedCache.from_pool_file(pool, "mlp")
    own = PairedCache(up, down, gate if gate_cols else None)
    assert mapped.pool_is_mapped and not own.pool_is_mapped
    assert torch.equal(mapped.neuron_pool.view(torch.uint8), own.neuron_pool.view(torch.uint8))
    mask = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    assert mapped.update(mask) == own.update(mask)
    mapped.check_valid()
    assert torch.equal(mapped.up().view(torch.uint8), own.up().view(torch.uint8))
    assert torch.equal(mapped.down().contiguous(), own.down().contiguous())


def test_updates_read_the_mapping_and_leave_it_file_backed(tmp_path):
    path = tmp_path / "p.pcpool"
    write_pool_file(path, _layers(count=2, n=4096, hidden=64))
    pool = PoolFile(path)
    cache = PairedCache.from_pool_file(pool, 1, capacity=2048)
    for seed in range(4):
        cache.update(torch.rand(4096, generator=torch.Generator().manual_seed(seed)) < 0.4)
    cache.check_valid()
    rss = mapping_rss(path)
    # The rows read are resident as page cache of the file; none became anonymous memory.
    assert rss["rss"] > 1 << 20
    assert rss["anonymous"] == 0
    with open(path, "rb") as f:
        assert f.read(len(MAGIC)) == MAGIC  # the file is unchanged on disk
    pool.verify()


def test_writer_checks_its_input_and_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "p.pcpool"
    good = _layers(count=1)[0]
    bad_n = ("mlp", good[1], good[2][:5], good[3])
    with pytest.raises(PairedCacheError, match=r"do not agree on N"):
        write_pool_file(path, [good, bad_n])
    with pytest.raises(PairedCacheError, match=r"one dtype"):
        write_pool_file(path, [good, ("b", *(t.double() for t in good[1:]))])
    with pytest.raises(PairedCacheError, match=r"no MLP layers"):
        write_pool_file(path, [])
    assert list(tmp_path.iterdir()) == []


def _rewrite_header(path, edit):
    data = path.read_bytes()
    length, _, _ = TRAILER.unpack(data[-TRAILER.size :])
    start = len(data) - TRAILER.size - length
    header = json.loads(data[start : start + length])
    edit(header)
    new = json.dumps(header).encode()
    trailer = TRAILER.pack(len(new), hashlib.sha256(new).digest(), MAGIC)
    path.write_bytes(data[:start] + new + trailer)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: p.write_bytes(b"NOTAPOOL" + p.read_bytes()[8:]), r"bad magic"),
        (lambda p: p.write_bytes(p.read_bytes()[:-3]), r"damaged trailer|too short"),
        (lambda p: p.write_bytes(p.read_bytes()[:-60] + b"x" + p.read_bytes()[-59:]), "checksum"),
        (lambda p: _rewrite_header(p, lambda h: h.update(format_version=2)), "format_version"),
        (lambda p: _rewrite_header(p, lambda h: h.update(dtype="int8")), r"dtype 'int8'"),
        (
            lambda p: _rewrite_header(p, lambda h: h["layers"][0].update(n_rows=10**6)),
            r"runs past the pools' end",
        ),
        (
            lambda p: _rewrite_header(p, lambda h: h["layers"][0].update(row_bytes=8)),
            r"row_bytes=8, the C core's stride is",
        ),
        (
            lambda p: _rewrite_header(p, lambda h: h["layers"][0].update(offset=4100)),
            r"not page-aligned",
        ),
        (lambda p: _rewrite_header(p, lambda h: h["layers"][0].update(hidden=-1)), r"hidden=-1"),
    ],
)
def test_damaged_files_are_refused_before_mapping(tmp_path, damage, match):
    path = tmp_path / "p.pcpool"
    write_pool_file(path, _layers(count=2))
    damage(path)
    with pytest.raises(PairedCacheError, match=match):
        PoolFile(path)


def test_verify_finds_a_damaged_pool(tmp_path):
    path = tmp_path / "p.pcpool"
    write_pool_file(path, _layers(count=2))
    data = bytearray(path.read_bytes())
    data[PAGE + 5] ^= 0xFF  # inside layer 0's pool
    path.write_bytes(bytes(data))
    with pytest.raises(PairedCacheError, match=r"model.layers.0.mlp pool checksum mismatch"):
        PoolFile(path).verify()


def test_row_stride_is_the_cores():
    assert row_stride(576, 576, 576, 4) == 6912  # SmolLM2-135M float32: no padding
    assert row_stride(5, 7, 3, 4) == 64
    with pytest.raises(PairedCacheError, match=r"out of the C core's range"):
        row_stride(0, 0, 4, 4)
    assert struct.calcsize("<Q32s8s") == TRAILER.size == 48


def test_from_pool_file_checks_its_arguments(tmp_path):
    path = tmp_path / "p.pcpool"
    write_pool_file(path, _layers(count=1))
    pool = PoolFile(path)
    with pytest.raises(PairedCacheError, match=r"has no layer 'nope'"):
        PairedCache.from_pool_file(pool, "nope")
    with pytest.raises(PairedCacheError, match=r"layer must be a name or an int in \[0, 1\)"):
        PairedCache.from_pool_file(pool, 1)
    with pytest.raises(PairedCacheError, match=r"capacity must be an int in \[1, N=40\]"):
        PairedCache.from_pool_file(pool, 0, capacity=41)
    with pytest.raises(PairedCacheError, match=r"must be a PoolFile"):
        PairedCache.from_pool_file(str(path), 0)


@pytest.mark.parametrize("layer", [-1, 1, 1.0, True, "nope"])
def test_sparse_mlp_from_pool_file_refuses_a_bad_layer(tmp_path, layer):
    from paired_cache import SparseMLP

    path = tmp_path / "p.pcpool"
    write_pool_file(path, _layers(count=1))
    with pytest.raises(PairedCacheError, match=r"layer must be a name or an int|no layer 'nope'"):
        SparseMLP.from_pool_file(PoolFile(path), layer, torch.nn.SiLU(), "cats", 0.5)


def test_sparse_mlp_from_pool_file_computes_the_masked_mlp(tmp_path):
    from paired_cache import SparseMLP

    path = tmp_path / "p.pcpool"
    layers = _layers(count=2, n=40, hidden=12)
    write_pool_file(path, layers)
    name, gate, up, down = layers[1]
    act = torch.nn.SiLU()
    sparse = SparseMLP.from_pool_file(PoolFile(path), name, act, "cats", 0.5)
    assert sparse.cache.pool_is_mapped and sparse.cache.capacity == 20
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    got = sparse(x)
    for t in range(3):
        mask = sparse.source.select(x[t])  # CATS: the 20 largest |silu(gate x)|
        assert int(mask.sum()) == 20
        want = down[:, mask] @ (act(gate[mask] @ x[t]) * (up[mask] @ x[t]))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_pool_file_takes_the_process_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_pool_file(tmp_path / "p.pcpool", _layers())
    finally:
        os.umask(old)
    assert (tmp_path / "p.pcpool").stat().st_mode & 0o777 == mode
    assert [p.name for p in tmp_path.iterdir()] == ["p.pcpool"]
