"""convert and load_sparse on the real SmolLM2-135M: the model runs from its files."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest
import torch

from paired_cache import PairedCacheError, SparseMLP
from paired_cache.cli import main
from paired_cache.model_io import load_sparse
from paired_cache.pool_file import PoolFile, mapping_rss
from paired_cache.safetensors_map import SafetensorsMap


@pytest.fixture(scope="module")
def model_dir():
    from membound_testing import smollm2_float_dir

    return smollm2_float_dir()


@pytest.fixture(scope="module")
def pool_path(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "smollm2.pcpool"
    assert main(["convert", str(model_dir), str(path), "--quiet"]) == 0
    return path


@pytest.fixture(scope="module")
def gateless_pool_path(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "smollm2-nogate.pcpool"
    assert main(["convert", str(model_dir), str(path), "--no-gate", "--quiet"]) == 0
    return path


@pytest.fixture(scope="module")
def france(smollm2):
    from membound_testing import chat_prompt

    tokenizer = smollm2[1]
    ids = tokenizer(chat_prompt(tokenizer, "What is the capital of France?"), return_tensors="pt")
    return ids.input_ids


def _file_ranges(*paths) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of the given files (/proc/self/maps)."""
    names = {str(p.resolve()) for p in paths}
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] in names:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_convert_writes_every_mlp_as_the_model_holds_it(smollm2, pool_path):
    model = smollm2[0]
    pool = PoolFile(pool_path)
    assert [layer.name for layer in pool.layers] == [f"model.layers.{i}.mlp" for i in range(30)]
    pool.verify()
    from paired_cache.cache import PairedCache

    cache = PairedCache.from_pool_file(pool, "model.layers.7.mlp", capacity=1)
    mlp = model.model.layers[7].mlp
    assert torch.equal(cache.gate_pool, mlp.gate_proj.weight)
    assert torch.equal(cache.up_pool, mlp.up_proj.weight)
    assert torch.equal(cache.down_pool_T, mlp.down_proj.weight.t())


def test_convert_reads_a_gguf_as_transformers_dequantises_it(smollm2, tmp_path):
    from membound_testing import smollm2_gguf_path
    from paired_cache.cache import PairedCache

    path = tmp_path / "gguf.pcpool"
    assert main(["convert", str(smollm2_gguf_path()), str(path), "--quiet"]) == 0
    pool = PoolFile(path)
    assert pool.dtype == torch.float32 and len(pool.layers) == 30
    pool.verify()
    # The embedded float32 SmolLM2 is this GGUF dequantised by transformers: the same rows.
    cache = PairedCache.from_pool_file(pool, "model.layers.29.mlp", capacity=1)
    mlp = smollm2[0].model.layers[29].mlp
    assert torch.equal(cache.gate_pool, mlp.gate_proj.weight)
    assert torch.equal(cache.up_pool, mlp.up_proj.weight)
    assert torch.equal(cache.down_pool_T, mlp.down_proj.weight.t())


def test_convert_refuses_a_missing_source_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "x.pcpool"
    assert main(["convert", str(tmp_path / "missing"), str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_full_fraction_matches_dense(smollm2, model_dir, pool_path, france):
    model = load_sparse(model_dir, pool_path, "cats", 1.0, rows="copy", prefill="sparse")
    ids = france[:, :12]
    with torch.no_grad():
        dense = smollm2[0](ids).logits
        got = model(ids).logits
    # Every row active, one (1, hidden) GEMM per token instead of one per prompt: float32
    # rounding apart, the same model.
    assert torch.equal(got.argmax(-1), dense.argmax(-1))
    assert (got - dense).abs().max().item() < 1e-3


def test_load_sparse_answers_from_mapped_files(smollm2, model_dir, pool_path, france):
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="copy", prefill="sparse")
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(m, SparseMLP) and m.cache.pool_is_mapped for m in mlps)
    # No dense MLP weight exists, and every parameter is a view of a mapped file.
    ranges = _file_ranges(pool_path, *model_dir.glob("*.safetensors"))
    for name, param in model.named_parameters():
        ptr = param.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in ranges), f"{name} is not file-backed"
    with torch.no_grad():
        out = model.generate(france, max_new_tokens=7, do_sample=False)
    answer = smollm2[1].decode(out[0, france.shape[1] :])
    assert "Paris" in answer, answer
    rss = mapping_rss(pool_path)
    assert rss["anonymous"] == 0 and rss["rss"] > 0
    # What was read from the pool is counted. CATS reads the gate from the pool itself, so
    # the active rows hold up and down only: every update copies rows of 2 x 576 x 4 bytes.
    assert all(not m.cache.gate_rows for m in mlps)
    assert all(m.pool_bytes_read % 4608 == 0 and m.pool_bytes_read > 0 for m in mlps)
    assert all(m.cache.active_bytes == m.cache.num_active * 4608 for m in mlps)
    # CATS scores with gate_proj mapped contiguous from the safetensors, not with the
    # pool's gate block, whose pages it shares with the up and down rows.
    weights = _file_ranges(*model_dir.glob("*.safetensors"))
    for m in mlps:
        gate = m.source.gate
        assert gate.is_contiguous() and any(lo <= gate.data_ptr() < hi for lo, hi in weights)
        assert torch.equal(gate, m.cache.gate_pool)


def test_load_sparse_in_place_keeps_no_active_rows(smollm2, model_dir, pool_path, france):
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", prefill="sparse")
    copied = load_sparse(model_dir, pool_path, "cats", 0.5, rows="copy", prefill="sparse")
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(m.in_place and m.cache.capacity == 1 for m in mlps)
    ids = france[:, :12]
    inputs: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: inputs.append(args[0])) for m in mlps]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    # Layer by layer on the same inputs: the same masks over the same rows, read from the
    # pool instead of the active buffers, agree to float32 rounding (at most 1.2e-6 of a
    # token's largest output seen). Whole models are not compared: a rounding difference
    # in one layer can flip a near-tie in a later layer's top-k, and then the masks
    # differ. Whether a prompt meets such a near-tie is luck: the whole-model comparison
    # failed (logits 2.6 apart) on this prompt as a mis-converted tokenizer encoded it.
    for i, x in enumerate(inputs):
        with torch.no_grad():
            got, want = mlps[i](x), copied.model.layers[i].mlp(x)
        # Per token, relative to its largest output: SmolLM2's first token reaches 2e4.
        err, scale = (got - want).abs().amax(-1), want.abs().amax(-1)
        assert (err <= 1e-5 * scale + 1e-5).all(), (i, (err / scale).max().item())
    with torch.no_grad():
        out = model.generate(france, max_new_tokens=7, do_sample=False)
    assert "Paris" in smollm2[1].decode(out[0, france.shape[1] :])
    assert all(m.cache.num_active == 0 and m.cache.stats.rows_copied == 0 for m in mlps)
    # Every token gathers its 768 rows (up | down_T, 4608 bytes each) from the pool.
    assert all(m.pool_bytes_read == m.tokens * 768 * 4608 for m in mlps)


def _vm_flags(path) -> list[list[str]]:
    """VmFlags of each of this process's mappings of path (/proc/self/smaps)."""
    target, flags, inside = str(path.resolve()), [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == target
            elif inside and fields[0] == "VmFlags:":
                flags.append(fields[1:])
    return flags


def test_pool_mapping_is_advised_random(pool_path):
    # An update copies scattered rows: with the device's readahead (8 MiB on this machine's
    # disk) each row's page fault would read megabytes around it.
    pool = PoolFile(pool_path)
    flags = _vm_flags(pool_path)
    assert flags and all("rr" in f for f in flags), flags
    del pool


def _resident_pages(address: int, length: int) -> np.ndarray:
    """mincore(2): which pages of [address, address + length) are in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * (-(-length // mmap.PAGESIZE)))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0
    return np.frombuffer(bytes(vec), np.uint8) & 1


def test_will_need_reads_exactly_the_tensor_asked_for(tmp_path):
    """Mapped MADV_RANDOM, a SafetensorsMap reads what will_need asks for and nothing
    stored around it (the device's read-ahead would drag in megabytes of neighbours)."""
    from safetensors.torch import save_file

    path = tmp_path / "three.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "a": torch.rand(1 << 20, generator=g),  # 4 MiB each, stored in name order
            "b": torch.rand(1 << 20, generator=g),
            "c": torch.rand(1 << 20, generator=g),
        },
        str(path),
    )
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache
    views = SafetensorsMap(path, random_access=True)
    assert all("rr" in flags for flags in _vm_flags(path))
    _, _, begin, end = views.entries["b"]
    array = np.frombuffer(views._mmap, np.uint8)
    address, size = array.ctypes.data, array.size
    page = mmap.PAGESIZE
    try:
        assert _resident_pages(address, size).sum() <= 16  # dropped (a few may stay)
        views.will_need("b")
        for _ in range(200):  # the read is asynchronous
            after = _resident_pages(address, size)
            if after[begin // page : end // page].all():
                break
            time.sleep(0.01)
        assert after[begin // page : end // page].all()
        assert after[: begin // page - 1].sum() <= 16  # a: not read
        assert after[end // page + 1 :].sum() <= 16  # c: not read ahead
    finally:
        del array
    # Without random_access the mapping keeps the kernel's default (sequential read-ahead).
    plain = SafetensorsMap(path)
    assert any("rr" not in flags for flags in _vm_flags(path))
    del plain, views


def test_read_ahead_asks_for_the_next_layer_in_ranges(model_dir, pool_path, france, monkeypatch):
    """As each decoder layer starts, load_sparse's hooks ask for the mapped tensors of the
    next one (the first layer for its own too; the last for the tied lm_head's table; the
    lm_head for the first layer's, where the next token starts): attention, norms and the
    gate the mask source reads, tensors stored side by side as one range; never the up and
    down projections the pool replaces. Ranges that look cached are not asked for."""
    asked: list[tuple[int, int]] = []
    cached = {"answer": False}
    monkeypatch.setattr(
        SafetensorsMap, "is_cached", lambda self, b, e, sample=False: cached["answer"]
    )
    monkeypatch.setattr(SafetensorsMap, "will_need_range", lambda self, b, e: asked.append((b, e)))
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="copy", prefill="sparse")
    assert all(any("rr" in f for f in _vm_flags(p)) for p in model_dir.glob("*.safetensors"))
    with torch.no_grad():
        model(france[:, :3])
    (stored,) = [SafetensorsMap(p) for p in model_dir.glob("*.safetensors")]

    def names_in(begin, end):
        return sorted(n for n, (_, _, b, e) in stored.entries.items() if begin <= b and e <= end)

    def layer(i):
        return [
            [f"model.layers.{i}.input_layernorm.weight"],
            [f"model.layers.{i}.mlp.gate_proj.weight"],
            [
                f"model.layers.{i}.{n}"
                for n in (
                    "post_attention_layernorm.weight",
                    "self_attn.k_proj.weight",
                    "self_attn.o_proj.weight",
                    "self_attn.q_proj.weight",
                    "self_attn.v_proj.weight",
                )
            ],
        ]

    # SmolLM2 ties its lm_head to the embedding: the file stores the table under one name.
    head = [
        ["lm_head.weight" if "lm_head.weight" in stored.entries else "model.embed_tokens.weight"]
    ]
    expected = layer(0) + [r for i in range(1, 30) for r in layer(i)] + head + layer(0)
    assert [names_in(b, e) for b, e in asked] == expected
    assert not any("up_proj" in n or "down_proj" in n for b, e in asked for n in names_in(b, e))

    asked.clear()
    cached["answer"] = True
    with torch.no_grad():
        model(france[:, :3])
    assert asked == []  # everything looks cached: nothing asked for

    model = load_sparse(
        model_dir, pool_path, "cats", 0.5, rows="copy", prefill="sparse", read_ahead=False
    )
    cached["answer"] = False
    with torch.no_grad():
        model(france[:, :3])
    assert asked == []


@pytest.mark.parametrize("room", ["none", "ample", "tight"])
def test_read_ahead_looks_at_a_cached_range_again_after_recheck_tokens_where_room_is_ample(
    model_dir, pool_path, france, monkeypatch, room
):
    """Where keep_cached="auto" finds no memory limit, or one that leaves room for twice
    what the blocks read, a range found cached is looked at again only RECHECK_TOKENS
    tokens later (each look is three mincore calls, ~125 ranges a token on SmolLM2); a
    range found missing is asked for and looked at every token. With less room (here every
    block kept, but not twice over) every range is looked at every token."""
    import paired_cache.read_ahead as read_ahead

    looked: list[tuple[int, int]] = []
    missing: set[tuple[int, int]] = set()

    def is_cached(self, b, e, sample=False):
        looked.append((b, e))
        return (b, e) not in missing

    rooms = {"none": None, "ample": 2**40}
    monkeypatch.setattr(read_ahead, "page_cache_room", lambda groups: rooms[room])
    monkeypatch.setattr(read_ahead, "memory_groups", lambda: [])
    monkeypatch.setattr(SafetensorsMap, "is_cached", is_cached)
    monkeypatch.setattr(SafetensorsMap, "will_need_range", lambda self, b, e: None)
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="copy", prefill="sparse")
    rooms["tight"] = int(1.5 * sum(model.page_keeper.sizes))
    per_token, first = [], []
    with torch.no_grad():
        for token in range(read_ahead.RECHECK_TOKENS + 2):
            looked.clear()
            if token == 3:  # one range goes missing: the next look finds it (at 16)
                missing.add(first[0])
            model(france[:, :1])
            per_token.append(len(looked))
            first = first or looked[:1]
    everything = per_token[0]
    assert everything > 60  # SmolLM2: 3 ranges per layer, the lm_head, layer 0 twice
    assert model.page_keeper.kept == set(range(len(model.page_keeper.sizes)))
    assert model.page_keeper.roomy == (room != "tight")
    if room == "tight":
        assert per_token == [everything] * len(per_token)
    else:
        # Looked at on the first token, then not until RECHECK_TOKENS tokens later; the
        # range that went missing (layer 0's first) is seen missing then and looked at on
        # every token after, by both hooks that ask for layer 0 (its own, and the
        # lm_head's for the next token), where a cached one is looked at once.
        assert per_token == [everything] + [0] * (read_ahead.RECHECK_TOKENS - 1) + [
            everything + 1,
            2,
        ]


def test_in_place_read_ahead_asks_for_the_next_layers_pool(
    model_dir, pool_path, france, monkeypatch
):
    """In place, each hook asks for the next layer's whole pool beside its tensors: a token
    reads about half of every row, and one request over the layer is read at the device's
    bandwidth where scattered 4 KiB faults are not."""
    from paired_cache._pages import MappedPages

    asked: list[tuple[str, int, int]] = []
    monkeypatch.setattr(MappedPages, "is_cached", lambda self, b, e, sample=False: False)
    monkeypatch.setattr(
        MappedPages, "will_need_range", lambda self, b, e: asked.append((type(self).__name__, b, e))
    )
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place")
    with torch.no_grad():
        model(france[:, :1])
    pool = PoolFile(pool_path)
    pools = [(n, b, e) for n, b, e in asked if n == "PoolFile"]
    want = [0, *range(1, 30), 0]  # layer 0 asks for its own, the lm_head for layer 0's
    assert [(b, e) for _, b, e in pools] == [pool.layer_range(i) for i in want]
    assert {n for n, _, _ in asked} == {"PoolFile", "SafetensorsMap"}

    asked.clear()
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="copy")  # no pool asks
    with torch.no_grad():
        model(france[:, :1])
    assert asked and {n for n, _, _ in asked} == {"SafetensorsMap"}


def test_load_sparse_defaults_to_in_place_rows_and_a_dense_prompt(model_dir, pool_path, france):
    # Window 1 (the default): rows multiplied where they lie, no active rows, the prompt
    # over every row; a window > 1 needs the paired-replacement cache, so it copies.
    model = load_sparse(model_dir, pool_path, "cats", 0.5)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(m.in_place and m.cache.capacity == 1 and m.prefill == "dense" for m in mlps)
    with torch.no_grad():
        model(france[:, :5])  # a 5-token prompt: every row once, no mask
    assert all(m.pool_rows_read == 1536 and m.cache.num_active == 0 for m in mlps)
    windowed = load_sparse(model_dir, pool_path, "cats", 0.5, window=4)
    assert all(not m.in_place and m.window == 4 for m in (ly.mlp for ly in windowed.model.layers))
    with pytest.raises(PairedCacheError, match="in_place"):
        load_sparse(model_dir, pool_path, "cats", 0.5, window=4, rows="in_place")


def test_is_cached_sees_dropped_and_read_pages(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "two.safetensors"
    save_file({"a": torch.rand(1 << 20), "b": torch.rand(1 << 20)}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    views = SafetensorsMap(path, random_access=True)
    (a,) = views.ranges(["a"])
    (both,) = views.ranges(["b", "a"])  # side by side: one range, in file order
    assert both[0] == a[0] and both[1] == views.entries["b"][3]
    assert not views.is_cached(*a) and not views.is_cached(*a, sample=True)
    views.tensor("a").sum()  # read every page of a
    assert views.is_cached(*a) and views.is_cached(*a, sample=True)
    assert not views.is_cached(*both)
    del views


def test_from_pool_file_refuses_a_gate_that_does_not_fit(pool_path):
    pool = PoolFile(pool_path)
    act = torch.nn.functional.silu
    want = r"gate for model.layers.3.mlp must be a \(1536, 576\) torch.float32 tensor, got "
    for gate, got in (
        (torch.zeros(1536, 575), r"\(1536, 575\) torch.float32"),
        (torch.zeros(1536, 576, dtype=torch.float64), r"\(1536, 576\) torch.float64"),
        ([[0.0]], r"list"),
    ):
        with pytest.raises(ValueError, match=want + got):
            SparseMLP.from_pool_file(pool, 3, act, "cats", 0.5, gate=gate)


def test_load_sparse_refuses_a_pool_of_another_model(model_dir, tmp_path):
    from paired_cache.pool_file import write_pool_file

    path = tmp_path / "other.pcpool"
    gate = torch.zeros(4, 576)
    write_pool_file(path, [("model.layers.0.mlp", gate, gate, torch.zeros(576, 4))])
    with pytest.raises(ValueError, match=r"holds layers"):
        load_sparse(model_dir, path, "cats", 0.5)


def test_trained_predictor_file_drives_load_sparse(model_dir, pool_path, france, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("The river rises in the hills and runs to the sea past farms and mills. " * 4)
    out = tmp_path / "predictor.safetensors"
    args = ["fit-predictor", str(model_dir), str(text), str(out), "--rank", "8"]
    assert main([*args, "--quiet"]) == 0
    model = load_sparse(
        model_dir, pool_path, "trained", 0.25, rows="copy", prefill="sparse", predictor=out
    )
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(m.source.proj_in.shape == (576, 8) for m in mlps)
    # The predictor's weights stay in the file's read-only mapping, as the pool does, and
    # the gated kind computes the gate itself: the active rows hold no gate rows.
    ranges = _file_ranges(out)
    for m in mlps:
        for t in (m.source.proj_in, m.source.proj_out, m.source.up_sd):
            assert any(lo <= t.data_ptr() < hi for lo, hi in ranges)
        assert not m.cache.gate_rows
    with torch.no_grad():
        model(france[:, :4])
    assert all(m.cache.num_active == 384 and m.tokens == 4 for m in mlps)
    assert mapping_rss(out)["anonymous"] == 0
    with pytest.raises(ValueError, match=r"not a paired-cache predictor file|cannot read"):
        load_sparse(model_dir, pool_path, "trained", 0.25, predictor=text)


def test_fit_predictor_refuses_an_unreadable_text_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "p.safetensors"
    assert main(["fit-predictor", str(model_dir), str(tmp_path / "missing.txt"), str(out)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00text")
    assert main(["fit-predictor", str(model_dir), str(binary), str(out)]) == 2
    assert "utf-8" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.txt"]


def test_pool_will_need_reads_the_layer_and_a_dense_prefill_asks_for_it(tmp_path, monkeypatch):
    # The pool is mapped MADV_RANDOM; a dense prefill reads every row of its layer, so it
    # first asks for the layer's whole range in one request (and nothing around it).
    from paired_cache.pool_file import write_pool_file

    g = torch.Generator().manual_seed(0)
    layers = [(f"l{i}", *(torch.rand(512, 256, generator=g) for _ in range(3))) for i in range(3)]
    path = tmp_path / "p.pcpool"
    write_pool_file(path, [(n, a, b, c.t().contiguous()) for n, a, b, c in layers])
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    pool = PoolFile(path)
    array = np.frombuffer(pool._mmap, np.uint8)
    page, spec = mmap.PAGESIZE, pool.layers[1]
    first, last = spec.offset // page, (spec.offset + spec.nbytes - 1) // page
    try:
        pool.will_need("l1")
        for _ in range(200):  # asynchronous
            after = _resident_pages(array.ctypes.data, array.size)
            if after[first : last + 1].all():
                break
            time.sleep(0.01)
        assert after[first : last + 1].all()
        l0 = pool.layers[0]
        assert after[l0.offset // page : (l0.offset + l0.nbytes) // page].sum() <= 16  # not read
        assert after[last + 2 :].sum() <= 16  # l2 and the header: not read ahead
    finally:
        del array
    asked = []
    monkeypatch.setattr(PoolFile, "will_need", lambda self, i: asked.append(i))
    sparse = SparseMLP.from_pool_file(
        pool, "l2", torch.nn.functional.silu, "cats", 0.5, prefill="dense"
    )
    with torch.no_grad():
        sparse(torch.rand(1, 256))  # one token: sparse, nothing asked
        assert asked == []
        sparse(torch.rand(3, 256))
    assert asked == [2]


def test_a_gateless_pool_is_a_third_smaller_and_holds_up_and_down(
    smollm2, pool_path, gateless_pool_path
):
    from paired_cache.cache import PairedCache

    full, gateless = PoolFile(pool_path), PoolFile(gateless_pool_path)
    gateless.verify()
    assert all(layer.gate_cols == 0 and layer.row_bytes == 4608 for layer in gateless.layers)
    assert gateless.pool_bytes * 3 == full.pool_bytes * 2  # rows of 4,608 bytes, not 6,912
    cache = PairedCache.from_pool_file(gateless, "model.layers.7.mlp", capacity=1)
    mlp = smollm2[0].model.layers[7].mlp
    assert cache.gate_pool is None
    assert torch.equal(cache.up_pool, mlp.up_proj.weight)
    assert torch.equal(cache.down_pool_T, mlp.down_proj.weight.t())


@pytest.mark.parametrize("rows", ["copy", "in_place"])
@pytest.mark.parametrize("prefill", ["sparse", "dense"])
def test_a_gateless_pool_computes_what_the_full_pool_does(
    model_dir, pool_path, gateless_pool_path, france, rows, prefill
):
    """The gate the source scores with comes from the safetensors either way, so the
    masks and the rows multiplied are the same; a dense prefill multiplies by that gate
    instead of the pool's strided gate block (the same values)."""
    ids = france[:, :12]
    models = [
        load_sparse(model_dir, p, "cats", 0.5, rows=rows, prefill=prefill)
        for p in (pool_path, gateless_pool_path)
    ]
    with torch.no_grad():
        want, got = (m(ids).logits for m in models)
        # One decoding step after the prompt: sparse whatever the prefill.
        step = [m(ids[:, :1]).logits for m in models]
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(step[0], step[1])
    mlps = [layer.mlp for layer in models[1].model.layers]
    assert all(m.cache.gate_cols == 0 and m.cache.active_row_bytes == 4608 for m in mlps)


def test_load_sparse_answers_in_place_from_a_gateless_pool(
    smollm2, model_dir, gateless_pool_path, france
):
    model = load_sparse(model_dir, gateless_pool_path, "cats", 0.5, rows="in_place")
    with torch.no_grad():
        out = model.generate(france, max_new_tokens=7, do_sample=False)
    assert "Paris" in smollm2[1].decode(out[0, france.shape[1] :])
    # The in-place read-ahead asks for the layer's pool: rows of up | down_T only.
    pool = PoolFile(gateless_pool_path)
    assert pool.layer_range(3)[1] - pool.layer_range(3)[0] < 1536 * 4608 + 4096


def test_a_gateless_pool_needs_a_gate_and_a_source_that_computes_it(gateless_pool_path):
    pool = PoolFile(gateless_pool_path)
    act = torch.nn.functional.silu
    with pytest.raises(ValueError, match=r"model.layers.3.mlp: the pool file holds no gate"):
        SparseMLP.from_pool_file(pool, 3, act, "cats", 0.5)
    gate = torch.zeros(1536, 576)
    with pytest.raises(ValueError, match=r"pool holds no gate .* OracleTopK does not return"):
        SparseMLP.from_pool_file(pool, 3, act, "oracle", 0.5, gate=gate)
    with pytest.raises(ValueError, match=r"gate for model.layers.3.mlp must be a \(1536, 576\)"):
        SparseMLP.from_pool_file(pool, 3, act, "cats", 0.5, gate=torch.zeros(1536, 0))


def test_a_given_gate_is_refused_beside_a_pool_that_holds_one(pool_path):
    from paired_cache.cache import PairedCache
    from paired_cache.registry import make_source

    cache = PairedCache.from_pool_file(PoolFile(pool_path), 3, capacity=768)
    act = torch.nn.functional.silu
    source = make_source("cats", cache.gate_pool, cache.up_pool, act, 0.5)
    with pytest.raises(ValueError, match=r"gate= is for a cache whose pool holds no gate"):
        SparseMLP(cache, act, source, gate=cache.gate_pool.clone())
