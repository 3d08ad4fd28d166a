"""The static cache: its size formula, and a state machine against the dynamic cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from random_sdar import random_model

from diffulex_edge.backends import EagerBlockKV, EagerCacheIO
from diffulex_edge.config import tiny_config
from diffulex_edge.kv_cache import DynamicKVCache, StaticCacheLayout


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 4),
    kv=st.integers(1, 4),
    blocks=st.integers(1, 8),
    hd=st.sampled_from([2, 8, 16]),
    bs=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_formula_equals_the_allocated_tensor(layers, kv, blocks, hd, bs, dtype):
    layout = StaticCacheLayout(layers, 1, kv, blocks * bs, hd, bs, dtype)
    cache = layout.allocate()
    assert tuple(cache.shape) == layout.shape
    assert layout.nbytes == cache.numel() * cache.element_size()


def test_design_example_bf16_against_the_allocated_storage():
    # The design note prints "117 MB" for 28 layers x 2048 x 8 KV heads x 128 in bf16. Two
    # of those layers are allocated here (the storage torch actually reserves, not the
    # formula); 28 layers are 14 times that, twice the note's figure.
    two_layers = StaticCacheLayout(2, 1, 8, 2048, 128, 4, torch.bfloat16)
    storage = two_layers.allocate().untyped_storage().nbytes()
    assert two_layers.nbytes == storage == 16_777_216
    assert StaticCacheLayout(28, 1, 8, 2048, 128, 4, torch.bfloat16).nbytes == 14 * storage


def test_a_cache_the_block_size_does_not_fit_is_rejected():
    with pytest.raises(ValueError, match="max_seq 30 is not a multiple of block_size 4"):
        StaticCacheLayout(2, 1, 2, 30, 8, 4)
    with pytest.raises(ValueError, match="block_size"):
        StaticCacheLayout(2, 1, 2, 32, 8, 0)


MODEL = random_model(tiny_config(), seed=5)
BS, MAX = 4, 24


class StaticCacheMachine(RuleBasedStateMachine):
    """Static caches (both graphs) against a plain list of committed blocks."""

    def __init__(self):
        super().__init__()
        layout = StaticCacheLayout.for_model(MODEL.config, MAX, BS)
        self.static = [EagerCacheIO(MODEL, layout), EagerBlockKV(MODEL, layout)]
        self.blocks: list[torch.Tensor] = []  # the dumb model: what was committed

    @precondition(lambda self: len(self.blocks) < MAX // BS)
    @rule(tokens=st.lists(st.integers(0, 61), min_size=BS, max_size=BS))
    def commit(self, tokens):
        ids = torch.tensor([tokens])
        for backend in self.static:
            backend.commit(ids)
        self.blocks.append(ids)

    @rule(tokens=st.lists(st.integers(0, 63), min_size=BS, max_size=BS))
    def denoise_leaves_the_cache_alone(self, tokens):
        if len(self.blocks) == MAX // BS:
            return
        before = [b.kv_cache.clone() for b in self.static]
        for backend, kv in zip(self.static, before, strict=True):
            backend.denoise(torch.tensor([tokens]))
            assert torch.equal(backend.kv_cache, kv)

    @rule()
    def reset(self):
        for backend in self.static:
            backend.reset()
        self.blocks = []

    @invariant()
    def cache_holds_exactly_the_committed_blocks(self):
        n = len(self.blocks) * BS
        ref = DynamicKVCache(MODEL.config.num_hidden_layers)
        if self.blocks:
            ids = torch.cat(self.blocks, dim=1)
            blk = torch.arange(n) // BS
            with torch.no_grad():
                MODEL(ids, torch.arange(n)[None], ref, (blk[None] <= blk[:, None])[None], True)
        for backend in self.static:
            assert backend.cache_len == n
            assert not backend.kv_cache[..., n:, :].any()
            for i in range(MODEL.config.num_hidden_layers):
                if n:
                    torch.testing.assert_close(
                        backend.kv_cache[i, 0, ..., :n, :], ref.layer(i)[0], rtol=0, atol=1e-5
                    )
                    torch.testing.assert_close(
                        backend.kv_cache[i, 1, ..., :n, :], ref.layer(i)[1], rtol=0, atol=1e-5
                    )


StaticCacheMachine.TestCase.settings = settings(
    max_examples=5, stateful_step_count=8, deadline=None
)
TestStaticCache = StaticCacheMachine.TestCase
