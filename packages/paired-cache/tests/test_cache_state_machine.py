"""PairedCache against a plain numpy model, rule by rule (hypothesis state machine).

The model is a bool array of active rows plus the original weights; after every rule the
cache must hold exactly the model's rows, in some order, with consistent metadata.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_weights
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paired_cache import PairedCacheConfig
from paired_cache.cache import PairedCache
from paired_cache.pool_file import PoolFile, write_pool_file

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def as_bits(t: torch.Tensor) -> np.ndarray:
    """Exact bit patterns (numpy has no bfloat16)."""
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.contiguous().view(ints).numpy()


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        dtype=st.sampled_from(DTYPES),
        with_gate=st.booleans(),
        n=st.integers(1, 70),
        cols=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)),
        capacity_frac=st.floats(0.05, 1.0),
        tau=st.sampled_from([0.0, 0.5, 1.0, 1.8, 2.0, float("inf")]),
        threads=st.integers(1, 4),
        grain=st.integers(1, 8),
        seed=st.integers(0, 2**16),
        mapped=st.booleans(),
        gate_rows=st.booleans(),
    )
    def setup(
        self, dtype, with_gate, n, cols, capacity_frac, tau, threads, grain, seed, mapped, gate_rows
    ):
        gate_cols, up_cols, hidden = cols
        gate, up, _ = make_weights(n, up_cols, dtype, seed, gate_cols=gate_cols)
        down = torch.randn(hidden, n, generator=torch.Generator().manual_seed(seed + 1))
        down = down.to(dtype)
        self.gate, self.up, self.down = (gate if with_gate else None), up, down
        self.capacity = max(1, round(capacity_frac * n))
        self.tau = tau
        # gate_rows=False: the active rows hold up and down only (needs a gate to leave out).
        self.gate_rows = gate_rows = gate_rows or not with_gate
        config = PairedCacheConfig(
            hybrid_tau=tau, grain=grain, par_threshold=2, num_threads=threads
        )
        if mapped:
            # The same cache over a pool file, mapped read-only: rows are copied from the
            # mapping, and the pool views alias it.
            path = Path(tempfile.mkdtemp(prefix="pc-sm-")) / "pool.pcpool"
            no_gate = torch.empty(n, 0, dtype=dtype)
            write_pool_file(path, [("mlp", gate if with_gate else no_gate, up, down)])
            self.cache = PairedCache.from_pool_file(
                PoolFile(path), 0, capacity=self.capacity, config=config, gate_rows=gate_rows
            )
            assert self.cache.pool_is_mapped
            path.unlink()  # the mapping keeps the data; nothing is left behind
            path.parent.rmdir()
        else:
            self.cache = PairedCache(
                up, down, self.gate, capacity=self.capacity, config=config, gate_rows=gate_rows
            )
            assert not self.cache.pool_is_mapped
        self.model = np.zeros(n, dtype=bool)
        self.updates = 0
        self.rng = np.random.default_rng(seed)

    def _apply(self, mask: np.ndarray) -> None:
        old = self.model
        info = self.cache.update(torch.from_numpy(mask.copy()))
        added, removed = int((mask & ~old).sum()), int((old & ~mask).sum())
        assert (info.added, info.removed) == (added, removed)
        # The hybrid rule: rebuild when k > tau * m, m the mean of the rows before and after.
        k, mean_m = added + removed, (int(old.sum()) + int(mask.sum())) / 2
        assert info.rebuilt == (k > 0 and k > self.tau * mean_m)
        if not info.rebuilt:
            # Paired replacement never moves more than max(|A|, |R|) rows, nor more than the
            # rebuild it replaces would (the new count): why tau may default close to 2.
            assert info.rows_copied <= max(added, removed)
            assert info.rows_copied <= int(mask.sum())
        else:
            assert info.rows_copied == int(mask.sum())
        self.model = mask.copy()
        self.updates += 1

    @rule(data=st.data())
    def random_mask(self, data):
        count = data.draw(st.integers(0, self.capacity))
        mask = np.zeros(self.model.shape[0], dtype=bool)
        mask[self.rng.choice(mask.shape[0], size=count, replace=False)] = True
        self._apply(mask)

    @rule(flips=st.integers(1, 6))
    def flip_a_few(self, flips):
        mask = self.model.copy()
        for i in self.rng.integers(0, mask.shape[0], size=flips):
            mask[i] = ~mask[i]
        if mask.sum() <= self.capacity:
            self._apply(mask)

    @rule()
    def empty(self):
        self._apply(np.zeros_like(self.model))

    @rule()
    def unchanged(self):
        self._apply(self.model.copy())
        assert self.cache.update(torch.from_numpy(self.model.copy())).rows_copied == 0
        self.updates += 1

    @precondition(lambda self: self.capacity == self.model.shape[0])
    @rule()
    def full(self):
        self._apply(np.ones_like(self.model))

    @precondition(lambda self: self.capacity < self.model.shape[0])
    @rule()
    def over_capacity_is_rejected(self):
        mask = np.zeros_like(self.model)
        mask[self.rng.choice(mask.shape[0], size=self.capacity + 1, replace=False)] = True
        before = (self.cache.active_indices(), self.cache.stats)
        with pytest.raises(ValueError, match=rf"selects {self.capacity + 1} rows but capacity"):
            self.cache.update(torch.from_numpy(mask))
        assert torch.equal(self.cache.active_indices(), before[0])
        assert self.cache.stats == before[1]

    @invariant()
    def matches_model(self):
        self.cache.check_valid()
        assert np.array_equal(self.cache.mask().numpy(), self.model)
        idx = self.cache.active_indices().long()
        assert self.cache.num_active == int(self.model.sum()) == idx.numel()
        assert np.array_equal(np.sort(idx.numpy()), np.flatnonzero(self.model))
        positions = self.cache.index_to_position()
        assert torch.equal(positions[idx], torch.arange(idx.numel(), dtype=torch.int32))
        assert int((positions >= 0).sum()) == idx.numel()
        if self.gate is not None and self.gate_rows:
            assert np.array_equal(as_bits(self.cache.gate()), as_bits(self.gate[idx]))
        elif self.gate is not None:
            with pytest.raises(ValueError, match=r"gate_rows=False"):
                self.cache.gate()
        assert np.array_equal(as_bits(self.cache.up()), as_bits(self.up[idx]))
        row = (self.cache.gate_cols if self.gate_rows else 0) + self.up.shape[1]
        assert (
            self.cache.active_bytes
            == idx.numel() * (row + self.down.shape[0]) * self.up.element_size()
        )
        assert np.array_equal(as_bits(self.cache.down()), as_bits(self.down[:, idx]))
        assert self.cache.stats.updates == self.updates

    @invariant()
    def pool_views_hold_the_weights(self):
        # Updates only read the neuron pool: its gate/up/down_T views stay the weights, and
        # they stay views of the one pool (a copy would still compare equal here).
        pool = self.cache.neuron_pool
        blocks = [self.up, self.down.t()]
        if self.gate is not None:
            blocks.insert(0, self.gate)
            assert np.array_equal(as_bits(self.cache.gate_pool), as_bits(self.gate))
            assert self.cache.gate_pool.data_ptr() == pool.data_ptr()
        else:
            assert self.cache.gate_pool is None
        assert np.array_equal(as_bits(pool), as_bits(torch.cat(blocks, dim=1)))
        assert np.array_equal(as_bits(self.cache.up_pool), as_bits(self.up))
        assert np.array_equal(as_bits(self.cache.down_pool_T), as_bits(self.down.t()))
        size = pool.element_size()
        assert self.cache.up_pool.data_ptr() == pool.data_ptr() + self.cache.gate_cols * size
        assert self.cache.down_pool_T.data_ptr() == (
            pool.data_ptr() + (self.cache.gate_cols + self.cache.up_cols) * size
        )


CacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPairedCacheStateMachine = CacheMachine.TestCase
