"""Cached replacements for mlx-lm's sparse MoE blocks.

These are real modules put in place of the stock blocks (``layer.mlp = ...``), not a
``__call__`` assigned on an instance: Python looks special methods up on the type, so an
instance attribute named ``__call__`` is never called. Each subclass mirrors its stock
block's routing line for line, so with every needed expert resident the output is the stock
output; the base class adds the cache: remap expert ids to slots, and in ``skip`` mode drop
the misses.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import (
    gpt_oss,
    granitemoe,
    mixtral,
    olmoe,
    phimoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)

from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.layer_cache import LayerCache


def block_top_k(stock: nn.Module) -> int:
    """Experts per token of a stock block (some keep it on their router only)."""
    for owner in (stock, stock.get("gate"), stock.get("router")):
        for name in ("num_experts_per_tok", "top_k"):
            if hasattr(owner, name):
                return getattr(owner, name)
    raise ExpertCacheError(f"{type(stock).__name__} names no experts-per-token count")


class CachedMoeBlock(nn.Module):
    """Base of the cached blocks. ``route`` is the stock router; ``normalizes_topk`` says
    whether the stock block makes the top-k scores sum to ``topk_scale`` (one, or
    DeepSeek-V3's ``routed_scaling_factor``), which decides whether the skip mode
    renormalises the surviving scores.

    ``gate_attr`` / ``switch_attr``: the stock block's names for its router and its
    ``SwitchGLU``, kept so that the checkpoint's tensor names address the cached block.
    """

    stock_class: ClassVar[type[nn.Module]]
    gate_attr: ClassVar[str] = "gate"
    switch_attr: ClassVar[str] = "switch_mlp"

    def __init__(self, stock: nn.Module, cache: LayerCache):
        super().__init__()
        setattr(self, self.gate_attr, getattr(stock, self.gate_attr))
        setattr(self, self.switch_attr, getattr(stock, self.switch_attr))
        self.top_k = block_top_k(stock)
        self.cache = cache

    @property
    def switch(self) -> nn.Module:
        """The stock ``SwitchGLU``, its projections cut to the resident slots."""
        return self[self.switch_attr]

    @property
    def normalizes_topk(self) -> bool:
        return bool(getattr(self, "norm_topk_prob", False))

    @property
    def topk_scale(self) -> float:
        return 1.0

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x: (N, D) -> expert ids (N, k) uint32 and their scores (N, k) float."""
        raise NotImplementedError

    def mix(self, y: mx.array, scores: mx.array) -> mx.array:
        """y: (N, k, D) expert outputs, scores: (N, k) -> (N, D)."""
        return (y * scores[..., None]).sum(axis=-2)

    def finish(self, x: mx.array, y: mx.array) -> mx.array:
        """Add what the block computes besides the routed experts (a shared expert)."""
        return y

    def __call__(self, x: mx.array) -> mx.array:
        """x: (B, L, D) float -> (B, L, D)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        inds, scores = self.route(x)
        cache = self.cache
        if cache.full:
            # Every expert resident: nothing can miss, so neither mode masks or synchronises.
            cache.record(inds, None)
            y = self.switch(x, inds if cache.identity else cache.lookup[inds])
        elif cache.skip:
            y, scores = self._skip(x, inds, scores)
        else:
            y = self._exact(x, inds)
        return self.finish(x, self.mix(y, scores)).reshape(shape)

    def _skip(self, x, inds, scores):
        """Skip mode, lazy: misses run on slot 0 and get score 0, so never count."""
        cache = self.cache
        hit = cache.hit_mask[inds]  # (N, k) bool
        cache.record(inds, hit)
        y = self.switch(x, cache.lookup[inds])
        kept = mx.where(hit, scores, mx.zeros_like(scores))
        if self.normalizes_topk:
            denom = mx.maximum(kept.sum(axis=-1, keepdims=True), 1e-30)
            # Only rows with a miss are rescaled: rows that hit everything stay bit-exact.
            renormalised = kept / denom
            if self.topk_scale != 1.0:
                renormalised = renormalised * self.topk_scale
            kept = mx.where(hit.all(axis=-1, keepdims=True), kept, renormalised)
        return y, kept

    def _exact(self, x, inds):
        """Exact mode: reading the router's choice is a synchronisation point; the expert
        matmuls stay lazy unless the tokens need more experts than fit at once."""
        cache = self.cache
        idx = np.array(inds)  # (N, k)
        # Rows read ahead by the speculative prefetch; the experts that were not asked for
        # are dropped below, so a wrong guess costs its read and evicts nothing.
        staged = cache.take_prefetched()
        groups = cache.token_groups(idx)
        outs = []
        for start, end in groups:
            part = idx[start:end]
            hit = cache.slots.expert_to_slot[part] >= 0
            if staged:
                hit |= np.isin(part, list(staged))
            cache.record(part, hit)
            cache.ensure_resident(part, staged)
            y = self.switch(x[start:end], cache.lookup[inds[start:end]])
            if len(groups) > 1:
                # The next group's swaps replace the stacks; finish this one with them first.
                mx.eval(y)
            outs.append(y)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


class CachedMixtralBlock(CachedMoeBlock):
    stock_class = mixtral.MixtralSparseMoeBlock

    @property
    def normalizes_topk(self) -> bool:
        return True  # softmax over the top-k logits

    def route(self, x):
        gates = self.gate(x)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        return inds, mx.softmax(scores, axis=-1, precise=True)


class CachedQwen2MoeBlock(CachedMoeBlock):
    stock_class = qwen2_moe.Qwen2MoeSparseMoeBlock

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        self.shared_expert = stock.shared_expert
        self.shared_expert_gate = stock.shared_expert_gate

    def route(self, x):
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        return inds, mx.take_along_axis(gates, inds, axis=-1)

    def finish(self, x, y):
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class CachedQwen3MoeBlock(CachedMoeBlock):
    stock_class = qwen3_moe.Qwen3MoeSparseMoeBlock

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        self.norm_topk_prob = stock.norm_topk_prob

    def route(self, x):
        gates = mx.softmax(self.gate(x), axis=-1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores

    def mix(self, y, scores):
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


class CachedOlmoeBlock(CachedMoeBlock):
    stock_class = olmoe.OlmoeSparseMoeBlock

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        self.norm_topk_prob = stock.norm_topk_prob

    def route(self, x):
        weights = mx.softmax(self.gate(x), axis=1, precise=True)
        k = self.top_k
        inds = mx.stop_gradient(mx.argpartition(-weights, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(weights, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores


class CachedQwen3NextBlock(CachedQwen3MoeBlock):
    """Qwen3-Next: Qwen3-MoE's routing plus Qwen2-MoE's gated shared expert."""

    stock_class = qwen3_next.Qwen3NextSparseMoeBlock

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        self.shared_expert = stock.shared_expert
        self.shared_expert_gate = stock.shared_expert_gate

    def mix(self, y, scores):
        return (y * scores[..., None]).sum(axis=-2)

    def finish(self, x, y):
        return y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class CachedGraniteMoeBlock(CachedMoeBlock):
    """Granite-MoE: its ``router`` takes the top-k logits and softmaxes them."""

    stock_class = granitemoe.GraniteMoeMoE
    gate_attr = "router"

    @property
    def normalizes_topk(self) -> bool:
        return True

    def route(self, x):
        return self.router(x)

    def mix(self, y, scores):
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


class CachedGptOssBlock(CachedMoeBlock):
    """GPT-OSS: the router is ``router`` (with a bias), the experts ``experts``, a
    ``SwitchGLU`` with biases and its own clamped SwiGLU; softmax over the top-k logits."""

    stock_class = gpt_oss.MLPBlock
    gate_attr = "router"
    switch_attr = "experts"

    @property
    def normalizes_topk(self) -> bool:
        return True

    def route(self, x):
        scores, inds = gpt_oss.mlx_topk(self.router(x), k=self.top_k, axis=-1)
        return inds, mx.softmax(scores, axis=-1, precise=True)


class CachedPhiMoeBlock(CachedMoeBlock):
    """Phi-3.5-MoE: sparsemixer routing (each pick's score is a softmax over the logits
    within a jitter band of it), which does not normalise the top-k scores."""

    stock_class = phimoe.PhiMoESparseMoeBlock

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        self.jitter_eps = stock.jitter_eps

    def route(self, x):
        return phimoe.sparsemixer(self.gate(x), top_k=self.top_k, jitter_eps=self.jitter_eps)
