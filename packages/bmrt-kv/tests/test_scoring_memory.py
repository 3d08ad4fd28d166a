"""Every selector scores one block within a workspace bounded by the pool's own KV bytes.

The temporaries are counted by a TorchDispatchMode that sees every tensor an op returns,
with the storage it owns, and when the last tensor on a storage is freed: the peak of
what scoring allocates, exact, without relying on the process's RSS.
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bmrt_kv import SELECTORS, BMRTConfig, make_selector
from bmrt_kv.compress import keep_indices, protected_mask
from bmrt_kv.selectors import Pool
from bmrt_kv.selectors.attention import attention_mass


class PeakTemporaries(TorchDispatchMode):
    """Peak bytes of storages allocated inside the mode and still referenced."""

    def __init__(self, external: list[torch.Tensor]) -> None:
        super().__init__()
        self.external = {t.untyped_storage().data_ptr() for t in external}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self.external or storage.nbytes() == 0:
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.sizes[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out


# SmolLM2-135M's attention: 3 KV heads, 3 query heads per KV head, head_dim 64.
KV_HEADS, GROUPS, HEAD_DIM = 3, 3, 64
BUDGET, BLOCK = 1024, 512


def smollm2_pool(seen: int = 4096) -> tuple[Pool, BMRTConfig]:
    config = BMRTConfig(budget=BUDGET, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    pool_tokens = BUDGET + BLOCK
    # Kept tokens: anchors at the start, the rest spread over the stream, then the block.
    kept = torch.cat(
        [
            torch.arange(config.n_anchor),
            torch.linspace(config.n_anchor, seen - BLOCK - 1, BUDGET - config.n_anchor).long(),
        ]
    )
    positions = torch.cat([kept, torch.arange(seen - BLOCK, seen)]).expand(1, KV_HEADS, -1)
    pool = Pool(
        keys=torch.randn(1, KV_HEADS, pool_tokens, HEAD_DIM, generator=g),
        positions=positions.contiguous(),
        queries=torch.randn(1, KV_HEADS, GROUPS * BLOCK, HEAD_DIM, generator=g),
        query_positions=torch.arange(seen - BLOCK, seen).repeat(GROUPS),
        candidates=~protected_mask(positions, seen, config),
        query_groups=GROUPS,
        accumulated=torch.rand(1, KV_HEADS, pool_tokens, generator=g),
        key_sum=torch.randn(1, KV_HEADS, HEAD_DIM, generator=g),
    )
    return pool, config


def kv_bytes(tokens: int) -> int:
    """One layer's keys and values for ``tokens`` tokens, float32."""
    return tokens * KV_HEADS * 2 * HEAD_DIM * 4


def peak_of(fn, pool: Pool) -> int:
    external = [pool.keys, pool.positions, pool.queries, pool.query_positions]
    external += [pool.candidates, pool.accumulated, pool.key_sum]
    with PeakTemporaries(external) as tracker:
        fn()
    return tracker.peak


def test_the_tracker_sees_a_large_temporary():
    pool, _ = smollm2_pool()
    # The unchunked matrix every query x every pool token: what scoring must not hold.
    full = peak_of(lambda: torch.softmax(pool.queries @ pool.keys.transpose(-1, -2), -1), pool)
    assert full >= 2 * 1 * KV_HEADS * GROUPS * BLOCK * (BUDGET + BLOCK) * 4


@pytest.mark.parametrize("n_question", [0, 24])
@pytest.mark.parametrize(
    ("name", "options"),
    [(name, {}) for name in sorted(SELECTORS)] + [("keydiff", {"anchor": "stream"})],
)
def test_one_block_of_scoring_stays_within_the_pools_kv_bytes(name, options, n_question):
    pool, config = smollm2_pool()
    pool.n_question = n_question  # query-aware: the block's last 24 queries are a question
    selector = make_selector(name, options)
    seen = int(pool.query_positions.max()) + 1
    # Twice the layer's own KV during the block (4.5 MiB), transient and one layer at a
    # time: the KV a 1024-token budget saves on a 5.8k-token stream is 7 MiB per layer.
    # Scoring every query against the pool at once (bmrt-kv 0.4) took 67.5 MiB here.
    bound = 2 * kv_bytes(BUDGET + BLOCK)

    def score_and_select():
        if selector.stateful:
            pool.accumulated = pool.accumulated + attention_mass(pool)
        keep_indices(pool, seen, config, selector)

    peak = peak_of(score_and_select, pool)
    assert peak <= bound, f"{name}: {peak / 2**20:.2f} MiB > {bound / 2**20:.2f} MiB"
