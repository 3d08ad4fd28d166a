"""Zero-copy views over the C buffers: layout, aliasing, stability and lifetime."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import make_weights

from paired_cache._core import ffi, lib
from paired_cache.cache import PairedCache

N, H = 40, 8


def mask_of(ids, n=N):
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(ids)] = True
    return mask


def test_gate_up_is_the_concatenation_without_a_copy():
    gate, up, down = make_weights(N, H, gate_cols=5)
    c = PairedCache(up, down, gate, capacity=20, init_mask=mask_of([3, 9, 17, 30]))
    idx = c.active_indices().long()
    assert torch.equal(c.gate_up(), torch.cat([gate[idx], up[idx]], dim=1))
    assert c.gate_up().shape == (4, 5 + H) and c.gate_up().is_contiguous()
    assert c.gate().data_ptr() == c.gate_up().data_ptr()
    assert c.up().data_ptr() == c.gate_up().data_ptr() + 5 * 4
    assert c.down().shape == (H, 4)
    assert torch.equal(c.down(), down[:, idx])
    assert torch.equal(c.down().t(), c.active_down_T())


def test_buffers_never_move_and_old_views_see_new_rows():
    gate, up, down = make_weights(N, H)
    c = PairedCache(up, down, gate, capacity=10, init_mask=mask_of(range(10)))
    first = c.gate_up()
    ptrs = (c.gate_up().data_ptr(), c.active_down_T().data_ptr())
    for step in range(20):
        c.update(mask_of(range(step, step + 10)))
        assert (c.gate_up().data_ptr(), c.active_down_T().data_ptr()) == ptrs
    # The first view aliases the same memory: it now shows the current rows.
    assert torch.equal(first, c.gate_up())


def test_views_keep_the_c_memory_alive():
    gate, up, down = make_weights(N, H)
    c = PairedCache(up, down, gate, init_mask=mask_of([1, 2, 3]))
    view, expected = c.gate_up(), c.gate_up().clone()
    del c
    gc.collect()
    assert torch.equal(view, expected)


def test_views_follow_the_current_m():
    gate, up, down = make_weights(N, H)
    c = PairedCache(up, down, gate, capacity=N)
    assert c.gate_up().shape == (0, 2 * H) and c.down().shape == (H, 0)
    c.update(torch.ones(N, dtype=torch.bool))
    assert c.gate_up().shape == (N, 2 * H)
    assert c.active_bytes == N * 3 * H * 4


def test_pools_hold_the_weights_with_down_transposed():
    gate, up, down = make_weights(N, H, dtype=torch.bfloat16)
    c = PairedCache(up, down, gate)
    assert c.up_pool.dtype == torch.bfloat16
    assert torch.equal(c.gate_pool, gate) and torch.equal(c.up_pool, up)
    assert torch.equal(c.down_pool_T, down.t())
    assert c.neuron_pool.data_ptr() % 64 == 0 and c.gate_up().data_ptr() % 64 == 0
    assert c.active_down_T().data_ptr() % 64 == 0


@pytest.mark.parametrize(
    ("dtype", "gate_cols", "up_cols", "hidden", "stride_bytes"),
    [
        (torch.float32, 5, 7, 3, 64),  # 60 bytes per neuron: padded to a cache line
        (torch.bfloat16, 3, 4, 5, 64),
        (torch.float64, 0, 6, 10, 128),  # no gate: up | down_T only
        (torch.bfloat16, 32, 32, 32, 192),  # a multiple of 64 already: no padding
    ],
)
def test_pool_is_one_row_per_neuron_gate_up_down(dtype, gate_cols, up_cols, hidden, stride_bytes):
    n, size = 12, dtype.itemsize
    gen = torch.Generator().manual_seed(1)
    gate = torch.randn(n, gate_cols, generator=gen).to(dtype) if gate_cols else None
    up = torch.randn(n, up_cols, generator=gen).to(dtype)
    down = torch.randn(hidden, n, generator=gen).to(dtype)
    c = PairedCache(up, down, gate, capacity=6)
    row = gate_cols + up_cols + hidden
    expected = torch.cat([*([gate] if gate is not None else []), up, down.t()], dim=1)
    assert c.neuron_pool.shape == (n, row) and c.neuron_pool.dtype == dtype
    assert torch.equal(c.neuron_pool, expected)
    # The core's row stride: gate | up | down_T padded to whole cache lines.
    assert lib.pc_pool_row_bytes(c._handle) == stride_bytes
    assert c.neuron_pool.stride() == (stride_bytes // size, 1)
    base = c.neuron_pool.data_ptr()
    assert base == int(ffi.cast("uintptr_t", lib.pc_neuron_pool(c._handle)))
    assert base % 64 == 0
    # The per-part pools are views of the neuron pool's column blocks, same storage.
    parts = [(c.up_pool, gate_cols, up_cols), (c.down_pool_T, gate_cols + up_cols, hidden)]
    if gate is None:
        assert c.gate_pool is None
    else:
        parts.append((c.gate_pool, 0, gate_cols))
    for view, offset, cols in parts:
        assert view.shape == (n, cols) and view.dtype == dtype
        assert view.data_ptr() == base + offset * size
        assert view.stride() == c.neuron_pool.stride()
        assert view.untyped_storage().data_ptr() == c.neuron_pool.untyped_storage().data_ptr()
    # Each pool row as the C core sees it: the bytes of gate row | up row | down column.
    for i in range(n):
        raw = ffi.buffer(lib.pc_neuron_pool(c._handle) + i * stride_bytes, row * size)
        assert bytes(raw) == expected[i].contiguous().view(torch.uint8).numpy().tobytes()
    # A write through a part view lands where the core copies from.
    c.down_pool_T[4, -1] = 7
    c.up_pool[4, 0] = 3
    c.update(mask_of([2, 4], n))
    pos = c.index_to_position()[4]
    assert c.up()[pos, 0] == 3 and c.active_down_T()[pos, -1] == 7
    c.check_valid()


def test_stats_count_rows_and_bytes():
    gate, up, down = make_weights(N, H)
    c = PairedCache(up, down, gate, capacity=N)
    c.update(mask_of(range(20)))  # from empty: a rebuild of 20 rows
    info = c.update(mask_of([*range(20), 25]))  # one append
    assert (info.added, info.removed, info.rows_copied, info.rebuilt) == (1, 0, 1, False)
    info = c.update(mask_of(range(20)))  # 25 sits last: removing it moves nothing
    assert (info.removed, info.rows_copied) == (1, 0)
    info = c.update(mask_of([*range(1, 20), 30]))  # 30 takes 0's position
    assert (info.added, info.removed, info.rows_copied) == (1, 1, 1)
    assert c.active_indices()[0] == 30
    s = c.stats
    assert (s.updates, s.rebuilds, s.paired_updates, s.rows_copied) == (4, 1, 3, 22)
    assert s.bytes_moved == 22 * 3 * H * 4
