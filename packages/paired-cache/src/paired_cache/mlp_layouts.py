"""The MLP layouts sparsify_model knows: where a family keeps its neuron rows.

A neuron i of an MLP is row i of the projection(s) into the intermediate space and column
i of the projection out of it. Gated MLPs (SwiGLU, GeGLU) compute
down(act(gate x) * up x); non-gated ones (GPT-NeoX, Phi-2, OPT: LLM in a Flash's setting)
compute fc2(act(fc1 x + b1)) + b2. A layout names the attributes holding those parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPLayout:
    """parts: the attribute names, in the order (gate, up, down, act) for "gated", (gate_up,
    down, act) for "gated_fused" (gate rows first, as Phi3MLP chunks them), (fc1, fc2, act)
    for "non_gated"; where: the families that use it, for messages."""

    kind: str
    parts: tuple[str, ...]
    where: str

    @property
    def gated(self) -> bool:
        return self.kind != "non_gated"


LAYOUTS = (
    MLPLayout(
        "gated",
        ("gate_proj", "up_proj", "down_proj", "act_fn"),
        "Llama, Mistral, Qwen2/3, Gemma 2/3, OLMo 2, Granite, SmolLM3",
    ),
    MLPLayout("gated_fused", ("gate_up_proj", "down_proj", "activation_fn"), "Phi-3"),
    MLPLayout("non_gated", ("dense_h_to_4h", "dense_4h_to_h", "act"), "GPT-NeoX"),
    # Phi-2's PhiMLP, and OPT's decoder layer, which holds fc1 and fc2 itself.
    MLPLayout("non_gated", ("fc1", "fc2", "activation_fn"), "Phi-2, OPT"),
)


GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def is_gated_mlp(module: nn.Module) -> bool:
    """A module computing down_proj(act_fn(gate_proj x) * up_proj x), as LlamaMLP does."""
    return all(hasattr(module, part) for part in GATED_MLP_PARTS)


def mlp_layout(module: nn.Module) -> MLPLayout | None:
    """The layout whose parts module has, or None. The split gated layout is duck-typed
    (any projection module with a weight works, as a compressed linear); the others need
    nn.Linear projections, so that an unrelated module with an fc1 is not taken for one."""
    for layout in LAYOUTS:
        if all(hasattr(module, p) for p in layout.parts) and (
            layout.kind == "gated"
            or all(isinstance(getattr(module, p), nn.Linear) for p in layout.parts[:-1])
        ):
            return layout
    return None


def linears(module: nn.Module, layout: MLPLayout) -> list[nn.Module]:
    """The projection modules of module, in layout order (the act left out)."""
    return [getattr(module, p) for p in layout.parts[:-1]]


def gated_weights(
    module: nn.Module, layout: MLPLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate (N, hidden), up (N, hidden), down (hidden, N) of a gated module, contiguous,
    detached; a fused gate_up_proj (2N, hidden) is split into its gate and up halves."""
    if layout.kind == "gated_fused":
        gate_up, down = (p.weight.detach() for p in linears(module, layout))
        n = gate_up.shape[0] // 2
        gate, up = gate_up[:n], gate_up[n:]
    else:
        gate, up, down = (p.weight.detach() for p in linears(module, layout))
    return gate.contiguous(), up.contiguous(), down.contiguous()


def activation(module: nn.Module, layout: MLPLayout):
    """The MLP's activation (SiLU, gelu-tanh, GELU, ReLU, ...)."""
    return getattr(module, layout.parts[-1])


def describe(layout: MLPLayout) -> str:
    """e.g. "non-gated (fc1, fc2, activation_fn)"."""
    kind = "non-gated" if not layout.gated else "gated"
    return f"{kind} ({', '.join(layout.parts)})"
