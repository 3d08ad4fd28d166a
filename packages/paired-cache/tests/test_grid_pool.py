"""Grid pools (#54): convert(compress="grid") stores each neuron's up | down_T row as the
Q4_1 / Q8_0 codes its float32 weights were dequantized from, and load_sparse decodes a
token's rows bit for bit.

Tolerance: none. A grid pool decodes to the very floats a zstd pool decompresses (both
are checked bit for bit against the weights), and the CompressedSparseMLP runs the same
torch products over them in the same order, so the logits are torch.equal.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from membound_testing.families import tiny_model
from membound_testing.grids import on_gguf_grid, q4_1, q8_0
from paired_cache import PairedCacheError, convert, load_sparse, save_dense
from paired_cache.cache import rows_mlp_split
from paired_cache.cli import main
from paired_cache.compressed_mlp import DENSE_BLOCK_ROWS, CompressedSparseMLP, keep_decoded
from paired_cache.grid_pool import BLOCK, GridReader, encode_layer, find_grid, record_bytes
from paired_cache.pool_file import GRID_FORMAT_VERSION, TRAILER, PoolFile

FAMILIES = ("llama", "phi3")  # split gate_proj, and Phi-3's fused gate_up_proj
IDS = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))


def gguf_like(model: nn.Module) -> nn.Module:
    """Every MLP weight as a GGUF dequantizes it: down_proj Q8_0, the others Q4_1 (both
    kinds, and a pool whose up and down differ)."""
    return on_gguf_grid(model, ("*.mlp.*",), ("*down_proj*",))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (model dir, grid pool, zstd pool)."""
    root = tmp_path_factory.mktemp("grid")
    out = {}
    for family in FAMILIES:
        model_dir = save_dense(gguf_like(tiny_model(family)), root / family)
        grid, zstd = root / f"{family}.grid", root / f"{family}.zstd"
        convert(model_dir, grid, compress="grid", progress=False)
        convert(model_dir, zstd, compress="zstd", progress=False)
        out[family] = (model_dir, grid, zstd)
    return out


def mlps(model) -> list[CompressedSparseMLP]:
    return [m for m in model.modules() if isinstance(m, CompressedSparseMLP)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill", ["sparse", "dense"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_grid_pool_gives_the_zstd_pools_logits(models, family, prefill, fraction):
    model_dir, grid, zstd = models[family]
    pools = PoolFile(grid)
    assert pools.compressed and pools.grid
    assert pools.codec == {"name": "grid", "block": BLOCK}
    assert [(layer.up_kind, layer.down_kind) for layer in pools.layers] == [("q4_1", "q8_0")] * len(
        pools.layers
    )
    model = load_sparse(model_dir, grid, "cats", fraction, prefill=prefill)
    reference = load_sparse(model_dir, zstd, "cats", fraction, prefill=prefill)
    assert len(mlps(model)) == len(pools.layers)
    assert torch.equal(logits(model), logits(reference))
    assert torch.equal(logits(model, IDS[:, :1]), logits(reference, IDS[:, :1]))
    for m, r in zip(mlps(model), mlps(reference), strict=True):
        assert m.pool_rows_read == r.pool_rows_read > 0


def test_a_grid_record_is_smaller_than_the_zstd_frame_of_the_same_row(models):
    model_dir, grid, zstd = models["llama"]
    model = load_sparse(model_dir, grid, "cats", 0.5)
    reference = load_sparse(model_dir, zstd, "cats", 0.5)
    logits(model), logits(reference)
    layer = PoolFile(grid).layers[0]
    # up 64 values Q4_1 (32 bytes of codes, 2 blocks x (d, m)), down_T 64 values Q8_0.
    assert layer.record_bytes == 32 + 2 * 4 + 64
    for m, r in zip(mlps(model), mlps(reference), strict=True):
        assert m.pool_bytes_read == m.pool_rows_read * layer.record_bytes
        assert 0 < m.pool_bytes_read < r.pool_bytes_read


def test_kept_rows_over_a_grid_pool_are_decoded_once(models):
    model_dir, grid, _ = models["llama"]
    model = load_sparse(model_dir, grid, "cats", 0.5)
    reference = load_sparse(model_dir, grid, "cats", 0.5)
    layers = mlps(model)
    keep_decoded(model, len(layers) * layers[0].decoded_bytes)
    first = logits(model)
    assert torch.equal(first, logits(reference))
    read = [m.pool_bytes_read for m in layers]
    assert torch.equal(logits(model), first)  # the same rows: all kept, nothing read
    assert [m.pool_bytes_read for m in layers] == read


@settings(max_examples=30, deadline=None)
@given(
    groups=st.integers(1, 5),  # up to 160 rows: decoded DECODE_ROWS at a time
    blocks=st.integers(1, 3),
    hidden=st.integers(1, 9),
    kinds=st.sampled_from([(q4_1, q4_1), (q4_1, q8_0), (q8_0, q4_1), (q8_0, q8_0)]),
    constant_block=st.booleans(),
    # 1e-5: scales below float16's smallest normal (6.1e-5), subnormals for the C decoder
    scale=st.sampled_from([0.05, 1e-5]),
    seed=st.integers(0, 2**16),
)
def test_grid_rows_round_trip_bit_for_bit(
    groups, blocks, hidden, kinds, constant_block, scale, seed
):
    gen = torch.Generator().manual_seed(seed)
    n, up_cols = groups * BLOCK, blocks * BLOCK
    up = torch.randn(n, up_cols, generator=gen) * scale
    if constant_block:  # a block of one value: d = 0
        up[0, :BLOCK] = 0.25
    down_cols = torch.randn(hidden, n, generator=gen) * scale * 20
    up, down = kinds[0](up), kinds[1](down_cols)
    data, up_kind, down_kind = encode_layer("layer", up, down)
    assert len(data) == n * record_bytes(up_kind, down_kind, up_cols, hidden) + (
        (2 if down_kind == "q4_1" else 1) * groups * hidden * 2
    )
    reader = GridReader(memoryview(data), 0, n, up_cols, hidden, up_kind, down_kind)
    rows = np.flatnonzero(np.random.default_rng(seed).random(n) < 0.5).astype(np.int64)
    got_up, got_down = reader.rows(rows)
    assert torch.equal(got_up.view(torch.int32), up[rows].view(torch.int32))
    assert torch.equal(got_down.view(torch.int32), down.t()[rows].contiguous().view(torch.int32))
    for one in (rows[:1], rows[:0]):  # one row, none
        got_up, got_down = reader.rows(one)
        assert torch.equal(got_up, up[one]) and torch.equal(got_down, down.t()[one])
    all_up, all_down = reader.rows()
    assert torch.equal(all_up.view(torch.int32), up.view(torch.int32))
    assert torch.equal(all_down.view(torch.int32), down.t().contiguous().view(torch.int32))
    # Into a scratch: the same bits, in the tensors given.
    out = (torch.full((len(rows), up_cols), float("nan")), torch.empty(len(rows), hidden))
    got = reader.rows(rows, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0].view(torch.int32), up[rows].view(torch.int32))
    assert torch.equal(out[1].view(torch.int32), down.t()[rows].contiguous().view(torch.int32))
    # Decoded in C as multiplied: the products of rows_mlp_split over the decoded rows.
    x, g = torch.randn(up_cols, generator=gen), torch.randn(len(rows), generator=gen)
    at = torch.arange(len(rows), dtype=torch.int32)
    want = rows_mlp_split(x, g, at, *reader.rows(rows))
    assert torch.equal(reader.rows_mlp(x, g, rows).view(torch.int32), want.view(torch.int32))


def test_grid_rows_mlp_refuses_bad_input_before_computing(models):
    _, grid, _ = models["llama"]
    reader = PoolFile(grid).frame_reader(0)
    x, g, rows = torch.zeros(reader.up_cols), torch.ones(2), np.array([0, 3], dtype=np.int64)
    for bad, match in (
        ((x, g, rows.astype(np.int32)), "idx must be a 1-D int64 array"),
        ((x, g, rows[:, None]), "idx must be a 1-D int64 array"),
        ((x.double(), g, rows), "x must be a CPU float32 tensor"),
        ((x[:-1], g, rows), r"x has shape"),
        ((x, g[:1], rows), r"g has shape"),
        ((x, g, np.array([0, reader.n_rows], dtype=np.int64)), "outside"),
        ((x, g, np.array([-1, 0], dtype=np.int64)), "outside"),
    ):
        with pytest.raises(PairedCacheError, match=match):
            reader.rows_mlp(*bad)


def test_single_tokens_over_a_grid_pool_decode_in_c_and_give_the_scratch_back(models):
    """A dense prefill decodes its rows into the shared scratch; a single
    token over a grid pool decodes its rows in C where they lie, and the scratch is
    unmapped, not kept at a prefill's size while tokens are generated."""
    model_dir, grid, zstd = models["llama"]
    model = load_sparse(model_dir, grid, "cats", 0.5)
    reference = load_sparse(model_dir, zstd, "cats", 0.5)
    layers = mlps(model)
    assert torch.equal(logits(model), logits(reference))  # the prompt
    assert layers[0].scratch._local.buf is not None
    for t in range(3):
        one = IDS[:, t : t + 1]
        assert torch.equal(logits(model, one), logits(reference, one))
        assert layers[0].scratch._local.buf is None
    for m, r in zip(layers, mlps(reference), strict=True):
        assert m.pool_rows_read == r.pool_rows_read > 0


@pytest.mark.parametrize("pool", [1, 2])  # the grid pool, the zstd pool
def test_a_dense_prefill_decodes_a_block_of_rows_at_a_time(models, monkeypatch, pool):
    """A dense prefill over rows not kept decodes DENSE_BLOCK_ROWS rows at a time (here 5,
    not a divisor of the rows) and sums the blocks' products: the scratch holds a block,
    the pool is read once, and the logits are those of the rows kept decoded (one product
    over every row) up to the order of the sums (1e-5 of the largest)."""
    import paired_cache.compressed_mlp as compressed_mlp

    monkeypatch.setattr(compressed_mlp, "DENSE_BLOCK_ROWS", 5)
    model_dir, path = models["llama"][0], models["llama"][pool]
    blocked, whole = (load_sparse(model_dir, path, "cats", 1.0) for _ in range(2))
    keep_decoded(whole, 1 << 30)
    got, ref = logits(blocked), logits(whole)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    layers = mlps(blocked)
    f = layers[0].frames
    assert f.n_rows > 3 * 5 and f.n_rows % 5
    assert layers[0].scratch._local.buf.numel() == 5 * (f.up_cols + f.hidden)
    for m, r in zip(layers, mlps(whole), strict=True):
        assert m.pool_bytes_read == r.pool_bytes_read == m.frames.total_bytes


def test_the_layers_decode_into_one_shared_scratch(models):
    """Every layer of a pool file decodes into one buffer, made once: a dense prefill
    (a block of rows at a time: here every row of a layer, fewer than a block) and then
    single tokens (half the rows)."""
    model_dir, _, grid = models["llama"]
    model = load_sparse(model_dir, grid, "cats", 0.5)
    layers = mlps(model)
    assert len({id(m.scratch) for m in layers}) == 1
    logits(model)  # the prompt: every row of each layer, decoded in turn
    buffer = layers[0].scratch._local.buf
    f = layers[0].frames
    assert f.n_rows <= DENSE_BLOCK_ROWS
    assert buffer.numel() == f.n_rows * (f.up_cols + f.hidden)
    for t in range(3):
        logits(model, IDS[:, t : t + 1])
    assert layers[0].scratch._local.buf is buffer  # not made again


def test_rows_into_a_wrong_scratch_are_refused(models):
    _, _, grid = models["llama"]
    reader = PoolFile(grid).frame_reader(0)
    rows = np.arange(3, dtype=np.int64)
    good = (torch.empty(3, reader.up_cols), torch.empty(3, reader.hidden))
    for bad in (
        (good[0][:2], good[1]),
        (good[0], good[1].double()),
        (torch.empty(reader.up_cols, 3).t(), good[1]),
    ):
        with pytest.raises(PairedCacheError, match=r"rows\(out=\.\.\.\) needs contiguous"):
            reader.rows(rows, out=bad)


def test_weights_off_the_grid_are_refused_by_name_and_nothing_written(tmp_path):
    model = gguf_like(tiny_model("llama"))
    with torch.no_grad():  # one value of one layer moved off its grid
        model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-3
    model_dir = save_dense(model, tmp_path / "off")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(
        PairedCacheError, match=r"model\.layers\.1\.mlp\.up: the weights are not exactly on"
    ):
        convert(model_dir, out / "x.pcpool", compress="grid", progress=False)
    assert list(out.iterdir()) == []


def test_a_model_not_dequantized_from_blocks_is_refused(tmp_path):
    model_dir = save_dense(tiny_model("llama"), tmp_path / "random")
    with pytest.raises(PairedCacheError, match="use the zstd codec"):
        convert(model_dir, tmp_path / "x.pcpool", compress="grid", progress=False)
    assert not (tmp_path / "x.pcpool").exists()


def test_find_grid_refuses_other_dtypes_and_ragged_blocks():
    with pytest.raises(PairedCacheError, match=r"w: a grid pool holds float32.*float64"):
        find_grid("w", torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(PairedCacheError, match=r"48 inputs are not a multiple of .* 32"):
        find_grid("w", torch.zeros(4, 48))
    with pytest.raises(PairedCacheError, match="40 neurons are not a multiple"):
        encode_layer("w", q4_1(torch.randn(40, 32)), q4_1(torch.randn(32, 64))[:, :40])
    with pytest.raises(PairedCacheError, match="not exactly on"):
        find_grid("w", torch.full((1, 32), float("nan")))


@pytest.mark.parametrize("bad", ["lz4", "GRID", 1, 0.0, None])
def test_a_bad_compress_is_refused(models, tmp_path, bad):
    with pytest.raises(PairedCacheError, match="compress must be False, True, 'zstd' or 'grid'"):
        convert(models["llama"][0], tmp_path / "x.pcpool", compress=bad)
    assert list(tmp_path.iterdir()) == []


def test_cli_convert_grid(models, tmp_path, capsys):
    out = tmp_path / "cli.pcpool"
    assert main(["convert", str(models["llama"][0]), str(out), "--grid", "--quiet"]) == 0
    assert PoolFile(out).grid
    assert "MLP pools" in capsys.readouterr().out


def test_a_damaged_record_is_found_and_a_bad_header_refused(models, tmp_path):
    grid = models["llama"][1]
    data = grid.read_bytes()
    pools = PoolFile(grid)
    damaged = bytearray(data)
    damaged[pools.layers[1].offset + 3] ^= 0x5A
    bad = tmp_path / "bad.pcpool"
    bad.write_bytes(bytes(damaged))
    with pytest.raises(PairedCacheError, match=r"layer model\.layers\.1\.mlp pool checksum"):
        PoolFile(bad).verify()
    pools.verify()
    header_len = TRAILER.unpack(data[-TRAILER.size :])[0]
    header_start = len(data) - TRAILER.size - header_len
    meta = json.loads(data[header_start : len(data) - TRAILER.size])
    assert meta["format_version"] == GRID_FORMAT_VERSION
    layer = meta["layers"][0]
    for change, match in (
        ({"codec": {"name": "grid", "block": 16}}, "expected {'name': 'grid', 'block': 32}"),
        ({"layers": [{**layer, "up_kind": "q4_k"}]}, "kinds among"),
        ({"layers": [{**layer, "nbytes": layer["nbytes"] - 1}]}, "a grid layer of its kinds"),
        ({"dtype": "float16"}, "expected float32"),
    ):
        header = json.dumps({**meta, **change}).encode()
        other = tmp_path / "other.pcpool"
        trailer = TRAILER.pack(len(header), hashlib.sha256(header).digest(), data[-8:])
        other.write_bytes(data[:header_start] + header + trailer)
        with pytest.raises(PairedCacheError, match=match):
            PoolFile(other)
