"""load_sparse's keep_cached: under a memory limit, what each token reads in full stays
cached for the blocks kept and is paged out for the others, largest blocks kept first."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from paired_cache import PairedCacheError
from paired_cache._pages import memory_groups, page_cache_room
from paired_cache.cli import main
from paired_cache.model_io import load_sparse
from paired_cache.read_ahead import PageKeeper
from paired_cache.safetensors_map import SafetensorsMap

MiB = 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A private copy of the SmolLM2 float directory: a page another mapping holds (the
    session's transformers-loaded SmolLM2 maps the shared copy) is never paged out, and
    these tests check what is."""
    import shutil

    from membound_testing import smollm2_float_dir

    copy = tmp_path_factory.mktemp("smollm2") / "model"
    shutil.copytree(smollm2_float_dir(), copy)
    for path in copy.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # clean pages: dirty ones are written back, not dropped
    return copy


@pytest.fixture(scope="module")
def pool_path(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "smollm2-nogate.pcpool"
    assert main(["convert", str(model_dir), str(path), "--no-gate", "--quiet"]) == 0
    return path


@pytest.fixture(scope="module")
def france(model_dir):
    from transformers import PreTrainedTokenizerFast

    from membound_testing import chat_prompt

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ids = tokenizer(chat_prompt(tokenizer, "What is the capital of France?"), return_tensors="pt")
    return ids.input_ids


def test_page_out_range_drops_whole_pages_only(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "two.safetensors"
    save_file({"a": torch.rand(1 << 20), "b": torch.rand(1 << 20)}, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # dirty pages are not dropped: a model's files are clean
    views = SafetensorsMap(path)
    (a,) = views.ranges(["a"])
    (b,) = views.ranges(["b"])
    views.tensor("a").sum(), views.tensor("b").sum()  # read every page of both
    assert views.is_cached(*a) and views.is_cached(*b)
    assert views.page_out_range(*a)
    page = mmap.PAGESIZE
    inner = (-(-a[0] // page) * page, a[1] // page * page)
    assert inner[1] - inner[0] >= (4 << 20) - 2 * page
    assert not views.is_cached(inner[0], inner[0] + 1) and not views.is_cached(
        inner[1] - 1, inner[1]
    )
    # The page a shares with b (a ends mid-page, b starts there) is b's too: left cached.
    assert a[1] % page and views.is_cached(a[1] - 1, a[1] + 1)
    assert views.is_cached(*b)
    views.tensor("a").sum()
    assert views.is_cached(*a)  # paged out, not lost: read again on use
    del views


def _group(root, version: int, limit: str, usage: int, file_bytes: int):
    root.mkdir(parents=True, exist_ok=True)
    if version == 2:
        (root / "memory.max").write_text(limit + "\n")
        (root / "memory.current").write_text(f"{usage}\n")
        (root / "memory.stat").write_text(f"anon {usage - file_bytes}\nfile {file_bytes}\n")
    else:
        (root / "memory.limit_in_bytes").write_text(limit + "\n")
        (root / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (root / "memory.stat").write_text(
            f"cache 1\nrss 2\ntotal_cache {file_bytes}\ntotal_rss {usage - file_bytes}\n"
        )
    return root


@pytest.mark.parametrize("version", [1, 2])
def test_page_cache_room_is_the_limit_less_what_is_not_file_pages(tmp_path, version):
    unlimited = "max" if version == 2 else "9223372036854771712"
    group = _group(tmp_path / "a", version, str(480 * MiB), 400 * MiB, 150 * MiB)
    assert page_cache_room(group) == (480 - 250) * MiB
    # No limit of its own: the nearest ancestor's, with that ancestor's usage.
    parent = _group(tmp_path / "p", version, str(900 * MiB), 700 * MiB, 100 * MiB)
    child = _group(parent / "c", version, unlimited, 10 * MiB, 0)
    assert page_cache_room(child) == 300 * MiB
    alone = _group(tmp_path / "u", version, unlimited, 10 * MiB, 0)
    assert page_cache_room(alone) is None
    # A limit of its own that is looser than an ancestor's: the ancestor's room binds.
    loose = _group(parent / "loose", version, str(2000 * MiB), 10 * MiB, 0)
    assert page_cache_room(loose) == 300 * MiB
    assert page_cache_room([loose, parent]) == 300 * MiB
    assert page_cache_room([]) is None


def _proc(tmp_path, cgroup: str, mountinfo: str):
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def test_memory_groups_are_found_through_mountinfo(tmp_path):
    # cgroup v1, the memory controller mounted somewhere unusual.
    v1 = tmp_path / "cg" / "mem"
    _group(v1 / "runner" / "job", 1, str(480 * MiB), 10 * MiB, 0)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    proc = _proc(
        tmp_path,
        "5:cpu,cpuacct:/runner/job\n4:memory:/runner/job\n",
        f"30 25 0:27 / {v1} rw,nosuid - cgroup cgroup rw,memory\n"
        f"31 25 0:28 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n",
    )
    # The group and each group above it; "runner" has no files here, so it is left out.
    assert memory_groups(proc) == [v1 / "runner" / "job", v1]
    assert page_cache_room(memory_groups(proc)) == 470 * MiB


def test_memory_groups_of_a_namespaced_v2_mount(tmp_path):
    # cgroup v2 in a container: the mount's root is the process's own group, which
    # /proc/self/cgroup shows as "/".
    mount = tmp_path / "sys" / "fs" / "cgroup"
    _group(mount, 2, str(256 * MiB), 100 * MiB, 40 * MiB)
    proc = _proc(
        tmp_path,
        "0::/\n",
        f"40 30 0:35 /kubepods/pod1/c1 {mount} rw - cgroup2 cgroup2 rw\n",
    )
    assert memory_groups(proc) == [mount]
    assert page_cache_room(memory_groups(proc)) == (256 - 60) * MiB
    # No cgroup files at all: no groups and no limit.
    assert memory_groups(tmp_path / "nowhere") == []


def _keeper(sizes: list[int], keep) -> PageKeeper:
    keeper = PageKeeper.__new__(PageKeeper)
    keeper.sizes = sizes
    keeper.order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    keeper.keep = keep
    keeper.groups = None
    return keeper


def test_plan_keeps_the_largest_blocks_that_fit(monkeypatch):
    # SmolLM2 in place: 30 layers of 13.5 MiB, then a 108 MiB lm_head.
    layer, head = int(13.5 * MiB), 108 * MiB
    keeper = _keeper([layer] * 30 + [head], 110 * MiB)
    keeper.plan()
    assert keeper.kept == {30}
    keeper.keep = head + 2 * layer
    keeper.plan()
    assert keeper.kept == {30, 0, 1}
    keeper.keep = 0
    keeper.plan()
    assert keeper.kept == set()

    import paired_cache.read_ahead as read_ahead

    room = {"bytes": 151 * MiB}
    lookups = []
    monkeypatch.setattr(read_ahead, "memory_groups", lambda: lookups.append(1) or ["g"])
    monkeypatch.setattr(
        read_ahead, "page_cache_room", lambda groups: groups == ["g"] and room["bytes"]
    )
    keeper.keep = "auto"
    keeper.plan()  # the head, and room for two layers in flight and the margin
    assert keeper.kept == {30}
    room["bytes"] = head + 2 * layer + PageKeeper.MARGIN - 1
    keeper.plan()
    # The head no longer fits beside two layers in flight, nor does a layer beside the
    # head and the last layer in flight.
    assert keeper.kept == set()
    room["bytes"] = 300 * MiB
    keeper.plan()  # the head and 11 layers: 256.5 MiB, 27 in flight, 4 of margin
    assert keeper.kept == {30, *range(11)}
    room["bytes"] = None
    keeper.plan()  # no limit: everything stays, nothing is paged out
    assert keeper.kept == set(range(31))
    # The groups are looked up once; each token reads only their usage.
    assert lookups == [1]


@pytest.mark.parametrize("bad", ["lots", -1, True, 1.5])
def test_load_sparse_refuses_a_bad_keep_cached(model_dir, pool_path, bad):
    with pytest.raises(
        PairedCacheError,
        match=f"keep_cached must be 'auto', None or a byte count >= 0, got {bad!r}",
    ):
        load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", keep_cached=bad)


def test_keep_cached_pages_out_what_it_does_not_keep_and_changes_no_logit(
    model_dir, pool_path, france
):
    ids = france[:, :6]
    plain = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", keep_cached=None)
    assert not hasattr(plain, "page_keeper")
    with torch.no_grad():
        want = plain(ids).logits
    del plain
    gc.collect()  # its mappings go: a page another mapping holds is not paged out
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", keep_cached=0)
    keeper = model.page_keeper
    assert len(keeper.sizes) == 31 and keeper.sizes[30] == max(keeper.sizes)
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert keeper.kept == set() and keeper.paged_out == sum(keeper.sizes)
    # Every block's ranges were paged out after it ran: their middle pages are not cached
    # (a page shared with a neighbour may be: a norm's few bytes; and a page mapped by
    # another process is not reclaimed: none here). Not the first layer's: the lm_head's
    # read-ahead asked for them again, for the next token.
    big = 3 * mmap.PAGESIZE
    checked = 0
    for ranges in keeper.ranges[1:]:
        for mapping, (begin, end) in ranges:
            if end - begin >= big:
                middle = (begin + end) // 2
                assert not mapping.is_cached(middle, middle + 1), (mapping, begin, end)
                checked += 1
    assert checked >= 29 * 2 + 1  # attention and gate, pool, per layer; the lm_head
    model.page_keeper.keep = keeper.sizes[30]  # the lm_head alone
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert keeper.kept == {30}
    assert all(m.is_cached(b, e) for m, (b, e) in keeper.ranges[30])
    assert not any(
        m.is_cached((b + e) // 2, (b + e) // 2 + 1)
        for m, (b, e) in keeper.ranges[29]
        if e - b >= big
    )


def test_row_runs_cover_the_picked_rows_in_page_separated_ranges(pool_path):
    from paired_cache.pool_file import PoolFile

    pool = PoolFile(pool_path)
    layer = pool.layers[4]
    stride, base = layer.row_bytes, layer.offset
    assert stride == 4608  # up | down_T of 576 float32 each
    rows = [0, 1, 2, 5, 100, 101, 1535]
    # Rows 2 and 5 are 2 rows (9,216 bytes) apart: more than a page, two ranges. Rows 0-2
    # and 100-101 are consecutive, one range each.
    assert pool.row_runs(4, rows) == [
        (base, base + 3 * stride),
        (base + 5 * stride, base + 6 * stride),
        (base + 100 * stride, base + 102 * stride),
        (base + 1535 * stride, base + 1536 * stride),
    ]
    # One row between: 4,608 bytes apart, more than a page, so two ranges.
    assert pool.row_runs(4, [7, 9]) == [
        (base + 7 * stride, base + 8 * stride),
        (base + 9 * stride, base + 10 * stride),
    ]
    assert pool.row_runs(4, []) == []


def test_a_layer_not_kept_reads_its_picked_rows_only(model_dir, pool_path, france, monkeypatch):
    """In place, a layer whose pool is not kept asks for the pages of the token's picked
    rows once its mask is known, not for its whole pool ahead; a kept layer's whole pool is
    asked for ahead, as without keep_cached."""
    from paired_cache._pages import MappedPages
    from paired_cache.pool_file import PoolFile

    asked: list[tuple[int, int]] = []
    original = MappedPages.will_need_range

    def record(self, begin, end):
        if isinstance(self, PoolFile):
            asked.append((begin, end))
        original(self, begin, end)

    monkeypatch.setattr(MappedPages, "will_need_range", record)
    monkeypatch.setattr(MappedPages, "is_cached", lambda self, b, e, sample=False: False)
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", keep_cached=0)
    pool = PoolFile(pool_path)
    mlps = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        model(france[:, :1])
    whole = {pool.layer_range(i) for i in range(30)}
    assert asked and not whole & set(asked)
    read = sum(m.pool_rows_read for m in mlps)
    assert read == 30 * 768  # 50% of 1536 rows per layer
    stride = pool.layers[0].row_bytes
    # The ranges hold the picked rows and nothing else (rows are longer than a page, so
    # only consecutive rows merge), 768 rows in each layer.
    assert sum(e - b for b, e in asked) == read * stride
    for i in (0, 13, 29):
        begin, end = pool.layer_range(i)
        mine = [(b, e) for b, e in asked if begin <= b < end]
        assert sum(e - b for b, e in mine) == 768 * stride and all(e <= end for _, e in mine)
    asked.clear()
    model.page_keeper.keep = 10**12  # everything kept: whole pools, asked for ahead
    with torch.no_grad():
        model(france[:, :1])
    assert set(asked) == whole


def test_modules_replaced_after_loading_leave_the_blocks_at_the_first_forward(
    model_dir, pool_path, france
):
    """Another package replacing modules after load_sparse (zstd-linear's load_compressed of
    the attention and the tied embedding, say): at the first forward their mapped tensors
    leave the blocks, so nothing reads them ahead or keeps them cached; the rest stay."""
    model = load_sparse(model_dir, pool_path, "cats", 0.5, rows="in_place", keep_cached=0)
    keeper = model.page_keeper
    sizes = list(keeper.sizes)
    attn = model.model.layers[3].self_attn
    held = attn.q_proj.weight.numel() * 4
    replacement = torch.nn.Linear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    with torch.no_grad():
        replacement.weight.copy_(attn.q_proj.weight)
    attn.q_proj = replacement
    with torch.no_grad():
        model(france[:, :4])
    assert keeper.sizes[3] == sizes[3] - held  # layer 3 lost its q_proj's bytes only
    assert keeper.sizes[:3] + keeper.sizes[4:] == sizes[:3] + sizes[4:]
    names = {name for _, own in keeper.blocks for _, name in own}
    assert "model.layers.3.self_attn.q_proj.weight" not in names
    assert "model.layers.4.self_attn.q_proj.weight" in names
    # The pool has no gate: each SparseMLP scores with gate_proj mapped from the
    # safetensors, which the model holds outside any module of that name.
    assert "model.layers.3.mlp.gate_proj.weight" in names
