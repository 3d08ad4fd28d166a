"""The test-model builder: an SDARModel with seeded random weights, for the tests, the
benchmarks and the integration tests (not in the wheel; the CLI's ``--tiny`` builds the same
model, ``random_model(tiny_config(), seed=0)``)."""

from __future__ import annotations

import torch

from diffulex_edge.config import SDARConfig
from diffulex_edge.model import SDARModel


def random_model(config: SDARConfig, seed: int = 0) -> SDARModel:
    """An SDARModel with seeded random weights (norm gains perturbed too, so q/k norm and
    RMSNorm weights are exercised), in eval mode.

    Args:
        config: the model's geometry and token ids.
        seed: seeds the weights; the same seed gives the same model.

    Returns:
        The model, in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    model = SDARModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()
