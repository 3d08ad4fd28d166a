"""Compressed pools (#54): convert(compress=True) writes each neuron's up | down_T row as
one zstd frame, load_sparse reads a token's frames in place; and every SparseMLP over a
pool with a gate from the safetensors exposes it as its gate_proj child.

Tolerance. In float64 the C kernel is not used, so a compressed pool's model runs the
uncompressed pool's torch path over the same decompressed values in the same order:
torch.equal. In float32 the uncompressed pool's decoding runs the C kernel, which sums
each row's products in another order than torch's matrix-vector product; both are
float32 roundings of the same sums, so they are held to the rule of the support matrix:
within ROUNDING_FACTOR times the dense float32 model's own distance from float64.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from membound_testing.families import tiny_model
from paired_cache import PairedCacheError, SparseMLP, convert, load_sparse, save_dense
from paired_cache.cli import main
from paired_cache.compressed_mlp import CompressedSparseMLP, keep_decoded
from paired_cache.compressed_pool import FrameReader, encode_layer
from paired_cache.pool_file import COMPRESSED_FORMAT_VERSION, TRAILER, PoolFile

FAMILIES = ("llama", "phi3")  # split gate_proj, and Phi-3's fused gate_up_proj
IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
ROUNDING_FACTOR = 4


def on_q4_grid(model: nn.Module) -> nn.Module:
    """The model with every MLP weight on a 4-bit grid per block of 32 values, as a Q4_1
    GGUF dequantizes to (SmolLM2's float copy): 16 distinct values per block, which zstd
    finds, where uniformly random float32 bytes do not compress."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp." not in name:
                continue
            blocks = p.view(-1, 32)
            lo, hi = blocks.min(1, keepdim=True).values, blocks.max(1, keepdim=True).values
            step = (hi - lo) / 15
            blocks.copy_(lo + torch.round((blocks - lo) / step) * step)
    return model


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, dtype) -> (model dir, compressed pool, gate-less pool, full pool)."""
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for family in FAMILIES:
        for dtype in (torch.float32, torch.float64):
            name = f"{family}-{str(dtype)[6:]}"
            model_dir = save_dense(on_q4_grid(tiny_model(family).to(dtype)), root / name)
            paths = (root / f"{name}.z", root / f"{name}.slim", root / f"{name}.full")
            convert(model_dir, paths[0], compress=True, progress=False)
            convert(model_dir, paths[1], gate=False, progress=False)
            convert(model_dir, paths[2], progress=False)
            out[family, dtype] = (model_dir, *paths)
    return out


def mlps(model) -> list[SparseMLP]:
    return [m for m in model.modules() if isinstance(m, SparseMLP)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", ["sparse", "dense"])
def test_compressed_pool_gives_the_uncompressed_pools_logits_at_full_fraction(
    models, family, prefill
):
    model_dir, packed, slim, _ = models[family, torch.float64]
    pools = PoolFile(packed)
    assert pools.compressed and pools.codec == {"name": "zstd", "level": 3}
    assert all(layer.gate_cols == 0 for layer in pools.layers)
    model = load_sparse(model_dir, packed, "cats", 1.0, prefill=prefill)
    assert [type(m) for m in mlps(model)] == [CompressedSparseMLP] * len(pools.layers)
    reference = load_sparse(model_dir, slim, "cats", 1.0, prefill=prefill)
    assert torch.equal(logits(model), logits(reference))
    # Decoding: one token at a time after the prompt.
    assert torch.equal(logits(model, IDS[:, :1]), logits(reference, IDS[:, :1]))


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_pool_in_float32_is_within_rounding_of_dense(models, family):
    model_dir, packed, slim, _ = models[family, torch.float32]
    dense32 = logits(on_q4_grid(tiny_model(family)))
    dense64 = logits(on_q4_grid(tiny_model(family)).double())
    rounding = (dense32.double() - dense64).abs().max().item()
    for prefill in ("sparse", "dense"):
        out = logits(load_sparse(model_dir, packed, "cats", 1.0, prefill=prefill))
        assert (out.double() - dense64).abs().max().item() <= ROUNDING_FACTOR * rounding
    # A dense prefill runs the same products as the uncompressed pool's, in one order.
    slim_dense = load_sparse(model_dir, slim, "cats", 1.0, prefill="dense")
    assert torch.equal(
        logits(load_sparse(model_dir, packed, "cats", 1.0, prefill="dense")), logits(slim_dense)
    )


def test_compressed_pool_reads_fewer_bytes_per_token_at_half_the_rows(models):
    model_dir, packed, slim, _ = models["llama", torch.float32]
    model = load_sparse(model_dir, packed, "cats", 0.5, prefill="sparse")
    reference = load_sparse(model_dir, slim, "cats", 0.5, prefill="sparse")
    out, ref = logits(model), logits(reference)
    assert (out - ref).abs().max().item() < 1e-4  # the same rows picked
    for m, r in zip(mlps(model), mlps(reference), strict=True):
        assert m.pool_rows_read == r.pool_rows_read == IDS.shape[1] * 48
        # Fewer bytes for the same rows: the weights are on a Q4_1 grid, as SmolLM2's.
        assert 0 < m.pool_bytes_read < r.pool_bytes_read


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", ["sparse", "dense"])
def test_kept_rows_give_the_same_logits_and_are_read_once(models, family, prefill):
    model_dir, packed, _, _ = models[family, torch.float64]
    model = load_sparse(model_dir, packed, "cats", 0.5, prefill=prefill)
    reference = load_sparse(model_dir, packed, "cats", 0.5, prefill=prefill)
    layers = mlps(model)
    kept = keep_decoded(model, 10 * layers[0].decoded_bytes)
    assert len(kept) == len(layers) and all(m.kept_rows == 0 for m in layers)
    asked = [[] for _ in layers]  # the rows each layer asks will_read_rows for
    for m, a in zip(layers, asked, strict=True):
        m.will_read_rows = lambda rows, a=a: a.append(rows.clone())
    first = [logits(model), logits(model, IDS[:, 3:4])]
    assert torch.equal(first[0], logits(reference))
    assert torch.equal(first[1], logits(reference, IDS[:, 3:4]))
    read = [m.pool_bytes_read for m in layers]
    assert all(r > 0 for r in read)
    for m in layers:  # each kept row was read once: the bytes are those of its frame
        have = m._kept[2].nonzero().flatten().numpy()
        assert 0 < m.kept_rows == have.shape[0] <= m.frames.n_rows
        assert m.pool_bytes_read == m.frames.compressed_bytes(have)
        if prefill == "dense":
            assert m.kept_rows == m.frames.n_rows
    for m, a in zip(layers, asked, strict=True):  # each row asked for once, before its read
        rows = torch.cat(a).numpy() if a else np.empty(0, dtype=np.int64)
        assert np.unique(rows).shape == rows.shape
        if prefill == "sparse":
            assert np.array_equal(np.sort(rows), m._kept[2].nonzero().flatten().numpy())
    # The same tokens again: every row they pick is kept, nothing is read or asked for.
    n_asked = [len(a) for a in asked]
    again = [logits(model), logits(model, IDS[:, 3:4])]
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    assert [m.pool_bytes_read for m in layers] == read
    assert [len(a) for a in asked] == n_asked
    ref_read = sum(m.pool_bytes_read for m in mlps(reference))
    assert sum(read) < ref_read
    # Dropped: every token reads its rows again.
    keep_decoded(model, 0)
    assert all(m.kept_rows == 0 for m in layers)
    assert torch.equal(logits(model, IDS[:, 3:4]), first[1])
    assert all(m.pool_bytes_read > r for m, r in zip(layers, read, strict=True))


def test_keep_decoded_keeps_whole_layers_in_order_up_to_the_bytes(models):
    model_dir, packed, _, _ = models["llama", torch.float32]
    model = load_sparse(model_dir, packed, "cats", 0.5)
    layers = mlps(model)
    assert len(layers) >= 2
    size = layers[0].decoded_bytes
    assert size == layers[0].frames.n_rows * layers[0].frames.frame_size
    names = [n for n, m in model.named_modules() if isinstance(m, CompressedSparseMLP)]
    assert keep_decoded(model, size + size // 2) == names[:1]
    assert [m._kept is not None for m in layers] == [True] + [False] * (len(layers) - 1)
    logits(model)  # the dense prefill fills the kept layer, and only it
    assert [m.kept_rows for m in layers] == [layers[0].frames.n_rows] + [0] * (len(layers) - 1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "auto", None])
def test_keep_decoded_refuses_a_bad_byte_count_and_changes_nothing(models, bad):
    model_dir, packed, _, _ = models["llama", torch.float32]
    model = load_sparse(model_dir, packed, "cats", 0.5)
    with pytest.raises(PairedCacheError, match="max_bytes must be an int >= 0"):
        keep_decoded(model, bad)
    assert all(m._kept is None for m in mlps(model))
    with pytest.raises(PairedCacheError, match="keep must be a bool"):
        mlps(model)[0].keep_decoded("yes")


def test_keep_decoded_refuses_a_model_without_a_compressed_pool(models):
    model_dir, _, slim, _ = models["llama", torch.float32]
    with pytest.raises(PairedCacheError, match="no CompressedSparseMLP"):
        keep_decoded(load_sparse(model_dir, slim, "cats", 0.5), 1 << 30)


def test_will_read_rows_asks_for_the_picked_frames(models):
    _, packed, _, _ = models["llama", torch.float32]
    pools = PoolFile(packed)
    reader = pools.frame_reader(1)
    begin = pools.layers[1].offset + pools.layers[1].table_bytes
    runs = pools.row_runs(1, [0, 1, 2])
    assert runs == [(begin, begin + int(reader.offsets[3]))]
    assert pools.row_runs(1, [5]) == [
        (begin + int(reader.offsets[5]), begin + int(reader.offsets[6]))
    ]


class CountingGate(nn.Module):
    """A stand-in for another package's compressed linear: x @ W.T (through F.linear, over
    the same W: a copy at another alignment rounds the last bit differently), counting
    its calls."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.w, self.calls = weight.detach(), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.linear(x, self.w)


@pytest.mark.parametrize("pool", [1, 2, 3])  # compressed, gate-less, with its gate
@pytest.mark.parametrize("family", FAMILIES)
def test_a_replaced_gate_proj_is_what_the_source_and_prefill_call(models, family, pool):
    model_dir, *paths = models[family, torch.float32]
    model = load_sparse(model_dir, paths[pool - 1], "cats", 0.5, prefill="dense")
    before, before_one = logits(model), logits(model, IDS[:, :1])
    first = mlps(model)[0]
    linear = first.gate_proj
    assert type(linear) is nn.Linear and linear.bias is None
    assert linear.weight.data_ptr() == first.source.gate.data_ptr()  # the mapped gate, no copy
    counters = []
    for m in mlps(model):
        m.gate_proj = CountingGate(m.gate_proj.weight)
        counters.append(m.gate_proj)
    assert torch.equal(logits(model), before)  # the prompt: one dense call per layer
    assert torch.equal(logits(model, IDS[:, :1]), before_one)  # one token: the source's call
    assert all(c.calls == 2 for c in counters)


def test_cli_convert_compresses(models, tmp_path, capsys):
    model_dir = models["llama", torch.float32][0]
    out = tmp_path / "cli.pcpool"
    assert (
        main(
            ["convert", str(model_dir), str(out), "--compress", "--compress-level", "1", "--quiet"]
        )
        == 0
    )
    assert PoolFile(out).codec == {"name": "zstd", "level": 1}
    assert "MLP pools" in capsys.readouterr().out


@pytest.mark.parametrize("level", [0, 23, True, "19", 2.0])
def test_a_bad_level_is_refused_and_nothing_written(models, tmp_path, level):
    model_dir = models["llama", torch.float32][0]
    with pytest.raises(PairedCacheError, match=r"compress_level must be an int in \[1, 22\]"):
        convert(model_dir, tmp_path / "x.pcpool", compress=True, compress_level=level)
    assert list(tmp_path.iterdir()) == []


def test_a_gate_is_refused_in_a_compressed_pool(models, tmp_path):
    model_dir = models["llama", torch.float32][0]
    with pytest.raises(PairedCacheError, match="a compressed pool holds no gate"):
        convert(model_dir, tmp_path / "x.pcpool", gate=True, compress=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs", [{"rows": "copy"}, {"window": 2}, {"rows": "copy", "window": 4}])
def test_copied_rows_are_refused_over_a_compressed_pool(models, kwargs):
    model_dir, packed, _, _ = models["llama", torch.float32]
    with pytest.raises(PairedCacheError, match=r"use rows='in_place'.*or an uncompressed pool"):
        load_sparse(model_dir, packed, "cats", 0.5, **kwargs)


def test_a_source_that_needs_the_pools_gate_is_refused(models):
    model_dir, packed, _, _ = models["llama", torch.float32]
    with pytest.raises(PairedCacheError, match=r"does not compute act\(gate x\)"):
        load_sparse(model_dir, packed, "oracle", 0.5)
    pools = PoolFile(packed)
    with pytest.raises(PairedCacheError, match="a compressed pool holds no gate; pass gate="):
        CompressedSparseMLP.from_pool_file(pools, 0, torch.nn.SiLU(), "cats", 0.5)
    with pytest.raises(PairedCacheError, match=r"CompressedSparseMLP\.from_pool_file"):
        SparseMLP.from_pool_file(pools, 0, torch.nn.SiLU(), "cats", 0.5, rows="in_place")


def test_a_corrupted_frame_is_found_by_verify_and_by_decoding(models, tmp_path):
    packed = models["llama", torch.float32][1]
    data = bytearray(packed.read_bytes())
    pools = PoolFile(packed)
    layer = pools.layers[1]
    reader = pools.frame_reader(1)
    at = layer.offset + layer.table_bytes + int(reader.offsets[7]) + 20  # inside frame 7
    data[at] ^= 0x5A
    bad = tmp_path / "bad.pcpool"
    bad.write_bytes(bytes(data))
    damaged = PoolFile(bad)  # opening reads no frame
    with pytest.raises(PairedCacheError, match=r"layer model\.layers\.1\.mlp pool checksum"):
        damaged.verify()
    damaged.frame_reader(1).rows(np.array([6], dtype=np.int64))  # its neighbour decodes
    with pytest.raises(PairedCacheError, match="frame is damaged"):
        damaged.frame_reader(1).rows(np.array([6, 7], dtype=np.int64))
    pools.verify()  # the original is whole


def test_a_truncated_or_mislabelled_file_is_refused(models, tmp_path):
    _, packed, _, _ = models["llama", torch.float32]
    data = packed.read_bytes()
    cut = tmp_path / "cut.pcpool"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(PairedCacheError, match="damaged trailer"):
        PoolFile(cut)
    # A header whose codec another reader wrote (checksummed, so it is the header's word).
    header_len = TRAILER.unpack(data[-TRAILER.size :])[0]
    header_start = len(data) - TRAILER.size - header_len
    meta = json.loads(data[header_start : len(data) - TRAILER.size])
    assert meta["format_version"] == COMPRESSED_FORMAT_VERSION
    for codec in ({"name": "lz4", "level": 1}, {"name": "zstd", "level": 40}):
        header = json.dumps({**meta, "codec": codec}).encode()
        other = tmp_path / "other.pcpool"
        trailer = TRAILER.pack(len(header), hashlib.sha256(header).digest(), data[-8:])
        other.write_bytes(data[:header_start] + header + trailer)
        with pytest.raises(PairedCacheError, match=r"codec|compress_level"):
            PoolFile(other)
    # Frame offsets that run past the layer.
    off = meta["layers"][0]["offset"]
    table = bytearray(data)
    table[off + 8 : off + 16] = struct.pack("<Q", 2**40)
    broken = tmp_path / "table.pcpool"
    broken.write_bytes(bytes(table))
    with pytest.raises(PairedCacheError, match="damaged frame offsets"):
        PoolFile(broken)


@settings(max_examples=25, deadline=None)
@given(
    n=st.one_of(st.integers(1, 9), st.integers(60, 140)),  # DECODE_ROWS frames a call
    up_cols=st.integers(1, 13),
    hidden=st.integers(1, 13),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    level=st.integers(1, 22),
    seed=st.integers(0, 2**16),
)
def test_frames_round_trip_every_dtype(n, up_cols, hidden, dtype, level, seed):
    gen = torch.Generator().manual_seed(seed)
    up = torch.randn(n, up_cols, generator=gen).to(dtype)
    down = torch.randn(hidden, n, generator=gen).to(dtype)
    data, offsets = encode_layer(up, down, level)
    table = (n + 1) * 8
    reader = FrameReader(
        memoryview(data)[table:], offsets.astype(np.int64), 0, up_cols, hidden, dtype
    )
    rows = np.flatnonzero(np.random.default_rng(seed).random(n) < 0.6).astype(np.int64)
    got_up, got_down = reader.rows(rows)
    assert torch.equal(got_up.view(torch.uint8), up[rows].view(torch.uint8))
    assert torch.equal(got_down.view(torch.uint8), down.t()[rows].contiguous().view(torch.uint8))
    all_up, all_down = reader.rows()
    assert torch.equal(_bytes(all_up), _bytes(up)) and torch.equal(
        _bytes(all_down), _bytes(down.t())
    )
    out = (torch.empty(n, up_cols, dtype=dtype), torch.empty(n, hidden, dtype=dtype))
    assert reader.rows(out=out)[0] is out[0]  # into a scratch: the same bytes
    assert torch.equal(_bytes(out[0]), _bytes(up)) and torch.equal(_bytes(out[1]), _bytes(down.t()))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's elements in row-major order, as bytes (whatever its strides)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kept", [False, True])
def test_one_float32_token_gives_the_in_place_pools_logits_bit_for_bit(models, family, kept):
    """One token in float32 runs the C kernel over the rows decompressed (or kept
    decoded): the products of the uncompressed pool's in-place kernel, in its order."""
    model_dir, packed, slim, _ = models[family, torch.float32]
    model = load_sparse(model_dir, packed, "cats", 0.5)
    reference = load_sparse(model_dir, slim, "cats", 0.5, rows="in_place")
    if kept:
        keep_decoded(model, 1 << 30)
    for ids in (IDS[:, :1], IDS[:, 5:6], IDS[:, :1]):
        assert torch.equal(logits(model, ids), logits(reference, ids))


def test_rows_mlp_split_is_the_pools_kernel_and_refuses_bad_input():
    from paired_cache.cache import rows_mlp_split

    gen = torch.Generator().manual_seed(1)
    up, down_T = torch.randn(40, 24, generator=gen), torch.randn(40, 20, generator=gen)
    x, idx = torch.randn(24, generator=gen), torch.tensor([3, 7, 8, 39], dtype=torch.int32)
    g = torch.randn(4, generator=gen)
    got = rows_mlp_split(x, g, idx, up, down_T)
    # The same rows, packed at 0..m-1: the same products in the same order.
    packed = rows_mlp_split(
        x, g, torch.arange(4, dtype=torch.int32), up[idx.long()], down_T[idx.long()]
    )
    assert torch.equal(got, packed)
    expected = (g.double() * (up[idx.long()].double() @ x.double())) @ down_T[idx.long()].double()
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5)
    for bad, match in (
        ({"idx": torch.tensor([0, 1, 2, 40], dtype=torch.int32)}, r"outside \[0, 40\)"),
        ({"idx": idx.long()}, "idx must be a CPU torch.int32"),
        ({"up": up.double()}, "up must be a CPU torch.float32"),
        ({"down_T": down_T[:39]}, r"down_T has shape \(39, 20\)"),
        ({"x": x[:5]}, r"x has shape \(5,\)"),
        ({"g": g[:3]}, r"g has shape \(3,\)"),
    ):
        args = {"x": x, "g": g, "idx": idx, "up": up, "down_T": down_T, **bad}
        with pytest.raises(PairedCacheError, match=match):
            rows_mlp_split(**args)
