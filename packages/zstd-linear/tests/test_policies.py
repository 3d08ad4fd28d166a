"""Caching policies on a toy model whose blocks share short names."""

from __future__ import annotations

import pytest
import torch
from conftest import make_toy
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from zstd_linear import (
    POLICIES,
    compress_model,
    compressed_layers,
    compression_stats,
    decompress_model,
    reset_stats,
    set_policy,
)
from zstd_linear.policies import PerPassPrefetch

N_LAYERS = 9  # 3 blocks x (q_proj, up_proj, down_proj)
SLAB = 32 * 64 * 4  # the largest weight: (64, 32) float32


def options(policy: str) -> dict:
    return {"budget_bytes": 3 * SLAB} if policy == "budget" else {}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_outputs_match_the_plain_model_for_several_passes(policy):
    plain, model = make_toy(), make_toy()
    report = compress_model(model, policy=policy, **options(policy))
    assert len(report.layers) == N_LAYERS and report.skipped == {}
    xs = [torch.randn(2, 5, 32) for _ in range(4)]
    with torch.no_grad():
        for x in xs:
            assert torch.equal(model(x), plain(x))
    stats = compression_stats(model)
    assert stats.forward_passes == 4
    expected = {"none": 36, "per_pass": 36, "per_pass_prefetch": None, "resident": 9}
    if expected.get(policy) is not None:
        assert stats.decompressions == expected[policy]


def test_per_pass_decodes_each_layer_once_per_pass():
    model = make_toy()
    compress_model(model, policy="per_pass")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 32))
    stats = compression_stats(model)
    assert stats.decompressions_per_pass == N_LAYERS
    assert stats.peak_decoded_bytes == sum(
        lyr.encoded.original_bytes for lyr in compressed_layers(model).values()
    )


def test_layers_are_keyed_by_fully_qualified_name():
    """The seed's short-name bug gave every q_proj the first q_proj's weights."""
    plain, model = make_toy(), make_toy()
    compress_model(model)
    layers = compressed_layers(model)
    assert sorted(layers) == sorted(
        f"blocks.{i}.{n}" for i in range(3) for n in ("q_proj", "up_proj", "down_proj")
    )
    for i in range(3):
        assert torch.equal(layers[f"blocks.{i}.q_proj"].weight, plain.blocks[i].q_proj.weight)
    assert not torch.equal(layers["blocks.0.q_proj"].weight, layers["blocks.1.q_proj"].weight)


@pytest.mark.parametrize("window", [1, 2, 3, 20])
def test_prefetch_bounds_decoded_memory_by_the_window(window):
    plain, model = make_toy(), make_toy()
    compress_model(model, policy="per_pass_prefetch", window=window)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 32)
            assert torch.equal(model(x), plain(x))
    stats = compression_stats(model)
    assert stats.peak_decoded_bytes <= max(window, 1) * SLAB + SLAB  # + one on-demand slab
    if window < N_LAYERS:
        # steady passes decode each layer exactly once, ahead of use
        assert stats.decompressions <= 5 * N_LAYERS + window
    policy = model.zstd_linear_runtime.policy
    assert isinstance(policy, PerPassPrefetch)
    assert policy.sequence == [
        f"blocks.{i}.{n}" for i in range(3) for n in ("q_proj", "up_proj", "down_proj")
    ]


def test_prefetch_recovers_when_the_call_order_changes():
    plain, model = make_toy(), make_toy()
    compress_model(model, policy="per_pass_prefetch", window=2)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 32)
            assert torch.equal(model(x), plain(x))
        for m in (model, plain):  # a different control flow: the blocks run reversed
            m.blocks = torch.nn.ModuleList(list(m.blocks)[::-1])
        for _ in range(3):
            x = torch.randn(2, 32)
            assert torch.equal(model(x), plain(x))
    assert model.zstd_linear_runtime.policy.sequence[0] == "blocks.2.q_proj"


def test_decompress_model_restores_plain_linears():
    plain, model = make_toy(), make_toy()
    compress_model(model)
    with torch.no_grad():
        model(torch.randn(1, 32))
    decompress_model(model)
    assert type(model.blocks[0].q_proj) is torch.nn.Linear
    for (n1, p1), (n2, p2) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    assert "zstd_linear_runtime" not in model.__dict__
    assert not model._forward_pre_hooks
    compress_model(model)  # can be compressed again


def test_tied_linear_stays_plain_and_is_reported():
    model = make_toy()
    model.blocks[1].q_proj.weight = model.blocks[0].q_proj.weight
    report = compress_model(model)
    assert set(report.skipped) == {"blocks.0.q_proj", "blocks.1.q_proj"}
    assert "tied" in report.skipped["blocks.0.q_proj"]
    assert len(report.layers) == N_LAYERS - 2


def test_bad_arguments_leave_the_model_unchanged():
    model = make_toy()
    before = [type(m) for m in model.modules()]
    for kwargs, message in [
        ({"policy": "lru"}, "policy must be one of"),
        ({"policy": "budget", "budget_bytes": 10}, "budget_bytes must be >="),
        ({"policy": "per_pass_prefetch", "window": 0}, "window must be"),
        ({"policy": "none", "window": 2}, "bad options"),
        ({"include": "blocks"}, "must match an nn.Linear, it matches \\['ModuleList'\\]"),
        ({"include": "nothing.here"}, "it matches \\['nothing'\\]"),
        ({"exclude": "*"}, "no nn.Linear to compress"),
        ({"level": 99}, "level"),
        ({"threads": 0}, "threads"),
    ]:
        with pytest.raises(ValueError, match=message):
            compress_model(model, **kwargs)
        assert [type(m) for m in model.modules()] == before
        assert "zstd_linear_runtime" not in model.__dict__
    with pytest.raises(ValueError, match="not compressed"):
        set_policy(model, "none")


def test_double_compression_and_bad_policy_switch_are_rejected():
    model = make_toy()
    compress_model(model, policy="none")
    with pytest.raises(ValueError, match="already compressed"):
        compress_model(model)
    with pytest.raises(ValueError, match="budget_bytes"):
        set_policy(model, "budget", budget_bytes=1)
    assert model.zstd_linear_runtime.policy.name == "none"  # unchanged
    reset_stats(model)
    assert compression_stats(model).decompressions == 0


class BudgetMachine(RuleBasedStateMachine):
    """The budget policy against a plain list used as an LRU of layer names."""

    @initialize(capacity=st.integers(1, 5))
    def setup(self, capacity):
        self.plain, self.model = make_toy(), make_toy()
        compress_model(self.model, policy="budget", budget_bytes=capacity * SLAB + 7)
        self.capacity = capacity
        self.names = sorted(compressed_layers(self.model))
        self.lru: list[str] = []
        self.decodes = 0

    @rule(index=st.integers(0, N_LAYERS - 1))
    def call_layer(self, index):
        name = self.names[index]
        x = torch.randn(2, self.model.get_submodule(name).in_features)
        with torch.no_grad():
            assert torch.equal(self.model.get_submodule(name)(x), self.plain.get_submodule(name)(x))
        if name in self.lru:
            self.lru.remove(name)
        else:
            self.decodes += 1
            if len(self.lru) == self.capacity:
                self.lru.pop(0)
        self.lru.append(name)

    @invariant()
    def matches_the_model(self):
        if not hasattr(self, "model"):
            return
        assert self.model.zstd_linear_runtime.policy.cached() == self.lru
        stats = compression_stats(self.model)
        assert stats.decompressions == self.decodes
        assert stats.decoded_bytes <= self.capacity * SLAB


TestBudgetLRU = BudgetMachine.TestCase
TestBudgetLRU.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
