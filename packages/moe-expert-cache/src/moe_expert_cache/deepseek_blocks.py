"""Cached blocks of the DeepSeek family: DeepSeek-MoE (V1), V2, V3 and GLM-4.5, whose
stock ``MoEGate`` returns the routing itself and whose shared experts run on every token.
"""

from __future__ import annotations

from mlx_lm.models import deepseek, deepseek_v2, deepseek_v3, glm4_moe

from moe_expert_cache.moe_blocks import CachedMoeBlock


class CachedDeepseekV2Block(CachedMoeBlock):
    """DeepSeek-V2: the stock ``MoEGate`` (softmax, greedy or group-limited greedy top-k,
    times ``routed_scaling_factor``), plus the always-on shared experts."""

    stock_class = deepseek_v2.DeepseekV2MoE

    def __init__(self, stock, cache):
        super().__init__(stock, cache)
        if stock.config.n_shared_experts is not None:
            self.shared_experts = stock.shared_experts

    def route(self, x):
        # The gate reads (batch, length) from its input's shape for the grouped top-k.
        inds, scores = self.gate(x[None])  # (1, N, k) each
        return inds[0], scores[0]

    def finish(self, x, y):
        return y + self.shared_experts(x) if "shared_experts" in self else y


class CachedDeepseekBlock(CachedDeepseekV2Block):
    """DeepSeek-MoE (V1): softmax, greedy top-k, shared experts."""

    stock_class = deepseek.DeepseekMoE


class CachedDeepseekV3Block(CachedDeepseekV2Block):
    """DeepSeek-V3: the stock ``MoEGate`` (sigmoid scores, a correction bias for the
    choice only, group-limited top-k, normalised when ``norm_topk_prob``, times
    ``routed_scaling_factor``), plus the shared experts."""

    stock_class = deepseek_v3.DeepseekV3MoE

    @property
    def normalizes_topk(self) -> bool:
        return self.top_k > 1 and bool(self.gate.norm_topk_prob)

    @property
    def topk_scale(self) -> float:
        return float(self.gate.routed_scaling_factor)

    def mix(self, y, scores):
        return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


class CachedGlm4MoeBlock(CachedDeepseekV3Block):
    """GLM-4.5 (``glm4_moe``): DeepSeek-V3's gate and shared experts."""

    stock_class = glm4_moe.MoE
