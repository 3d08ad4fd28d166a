"""Which cached block replaces which stock mlx-lm MoE block; the model types served are
the architectures (mlx-lm model files) these stock blocks come from."""

from __future__ import annotations

import mlx.nn as nn

from moe_expert_cache.deepseek_blocks import (
    CachedDeepseekBlock,
    CachedDeepseekV2Block,
    CachedDeepseekV3Block,
    CachedGlm4MoeBlock,
)
from moe_expert_cache.moe_blocks import (
    CachedGptOssBlock,
    CachedGraniteMoeBlock,
    CachedMixtralBlock,
    CachedMoeBlock,
    CachedOlmoeBlock,
    CachedPhiMoeBlock,
    CachedQwen2MoeBlock,
    CachedQwen3MoeBlock,
    CachedQwen3NextBlock,
)

BLOCKS: dict[type[nn.Module], type[CachedMoeBlock]] = {
    cls.stock_class: cls
    for cls in (
        CachedMixtralBlock,
        CachedQwen2MoeBlock,
        CachedQwen3MoeBlock,
        CachedOlmoeBlock,
        CachedGptOssBlock,
        CachedPhiMoeBlock,
        CachedQwen3NextBlock,
        CachedGraniteMoeBlock,
        CachedDeepseekBlock,
        CachedDeepseekV2Block,
        CachedDeepseekV3Block,
        CachedGlm4MoeBlock,
    )
}


def supported_model_types() -> set[str]:
    """The ``model_type`` values (mlx-lm model files) whose MoE blocks are served."""
    return {cls.__module__.rsplit(".", 1)[1] for cls in BLOCKS}
