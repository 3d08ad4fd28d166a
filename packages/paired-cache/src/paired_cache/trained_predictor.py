"""The Deja Vu predictor: per MLP, a small low-rank network trained to predict which
neurons the oracle keeps.

For each layer, logits = (x @ proj_in) @ proj_out + bias with proj_in (hidden, r),
proj_out (r, N), bias (N,): x -> rank r -> N logits. It is trained with binary
cross-entropy against the oracle's kept set (the k rows with the largest
|act(gate x) * up x|) on the MLP inputs of a calibration text, and keeps the k rows with
the largest logits per token. Cost per token: r (hidden + N) multiply-adds, against
2 hidden N for computing gate and up densely. Saved with safetensors beside the pool file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import Activation, MaskSource, _top_k_mask, active_rows

FORMAT = "paired-cache-predictor-1"


@dataclass
class TrainConfig:
    """rank: r of the predictor, in [1, min(hidden, N)]; steps: Adam steps per layer;
    batch: tokens per step; lr: Adam's learning rate; weight_decay: AdamW's; seed: init
    and batch order."""

    rank: int = 128
    steps: int = 300
    batch: int = 256
    lr: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "steps", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PairedCacheError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise PairedCacheError(f"{name} must be a number >= 0, got {value!r}")


def oracle_labels(
    gate: torch.Tensor, up: torch.Tensor, act: Activation, x: torch.Tensor, k: int
) -> torch.Tensor:
    """gate, up: (N, hidden); x: (T, hidden) -> (T, N) bool, the oracle's top-k per token."""
    h = (act(x @ gate.T) * (x @ up.T)).abs()  # (T, N)
    labels = torch.zeros_like(h, dtype=torch.bool)
    labels.scatter_(1, torch.topk(h, k, dim=1, sorted=False).indices, True)
    return labels


def fit_predictor(
    gate: torch.Tensor,
    up: torch.Tensor,
    act: Activation,
    fraction: float,
    calibration: torch.Tensor,
    config: TrainConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Train one layer's predictor on calibration (T, hidden) inputs of this MLP; returns
    {"proj_in": (hidden, r), "proj_out": (r, N), "bias": (N,)} float32."""
    config = TrainConfig() if config is None else config
    n, hidden = gate.shape
    if calibration.dim() != 2 or calibration.shape[1] != hidden:
        raise PairedCacheError(
            f"calibration has shape {tuple(calibration.shape)}, expected (T, {hidden})"
        )
    if config.rank > min(hidden, n):
        raise PairedCacheError(
            f"rank must be in [1, min(hidden, N)={min(hidden, n)}], got {config.rank}"
        )
    k = active_rows(fraction, n)
    x = calibration.float()
    with torch.no_grad():
        y = oracle_labels(gate.float(), up.float(), act, x, k).float()  # (T, N)
    gen = torch.Generator().manual_seed(config.seed)
    proj_in = (torch.randn(hidden, config.rank, generator=gen) / hidden**0.5).requires_grad_()
    proj_out = (torch.randn(config.rank, n, generator=gen) / config.rank**0.5).requires_grad_()
    # The prior: each row is kept with probability k / N.
    prior = torch.full((n,), float(torch.logit(torch.tensor(k / n).clamp(1e-4, 1 - 1e-4))))
    bias = prior.clone().requires_grad_()
    opt = torch.optim.AdamW(
        [proj_in, proj_out, bias], lr=config.lr, weight_decay=config.weight_decay
    )
    # Inputs are centred and scaled once so one learning rate fits every layer.
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
    xs = (x - mean) / scale
    with torch.enable_grad():
        for _ in range(config.steps):
            idx = torch.randint(0, x.shape[0], (min(config.batch, x.shape[0]),), generator=gen)
            logits = (xs[idx] @ proj_in) @ proj_out + bias  # (B, N)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        # Fold the normalisation into the weights: logits = x @ proj_in' @ proj_out + bias'.
        folded_in = proj_in / scale[:, None]
        folded_bias = bias - (mean @ folded_in) @ proj_out
    return {
        "proj_in": folded_in.detach().contiguous(),
        "proj_out": proj_out.detach().contiguous(),
        "bias": folded_bias.detach().contiguous(),
    }


class TrainedPredictor(MaskSource):
    """The k rows with the largest predicted logits: (x @ proj_in) @ proj_out + bias.

    weights: {"proj_in": (hidden, r), "proj_out": (r, N), "bias": (N,)} from fit_predictor
    or load_predictors.
    """

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        act: Activation,
        fraction: float,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__(gate.shape[0], fraction)
        n, hidden = gate.shape
        if not isinstance(weights, dict) or set(weights) != {"proj_in", "proj_out", "bias"}:
            raise PairedCacheError(
                "mask source 'trained' needs weights={'proj_in', 'proj_out', 'bias'} "
                "(fit_predictor, or load_predictors of a saved file)"
            )
        p_in, p_out, bias = weights["proj_in"], weights["proj_out"], weights["bias"]
        r = p_in.shape[-1] if p_in.dim() == 2 else -1
        if p_in.shape != (hidden, r) or p_out.shape != (r, n) or bias.shape != (n,):
            raise PairedCacheError(
                f"predictor weights proj_in {tuple(p_in.shape)}, proj_out {tuple(p_out.shape)}, "
                f"bias {tuple(bias.shape)} do not fit hidden={hidden}, N={n}"
            )
        self.proj_in, self.proj_out, self.bias = (
            t.float().contiguous() for t in (p_in, p_out, bias)
        )

    def select(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.addmv(self.bias, self.proj_out.T, x.float() @ self.proj_in)  # (N,)
        return _top_k_mask(logits, self.k)


def fit_predictors(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    fraction: float,
    config: TrainConfig | None = None,
    progress=None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Train a predictor for every gated MLP of a dense model from the MLP inputs of
    calibration_ids (1, T); {mlp name: weights}."""
    from paired_cache.sparse_mlp import collect_mlp_inputs

    inputs = collect_mlp_inputs(model, calibration_ids)
    out = {}
    for name, x in inputs.items():
        mlp = model.get_submodule(name)
        out[name] = fit_predictor(
            mlp.gate_proj.weight.detach(),
            mlp.up_proj.weight.detach(),
            mlp.act_fn,
            fraction,
            x,
            config,
        )
        if progress is not None:
            progress(name)
    return out


def save_predictors(
    path: str | os.PathLike, predictors: dict[str, dict[str, torch.Tensor]], fraction: float
) -> None:
    """Write predictors with safetensors (tensor "<mlp name>.<part>"), atomically."""
    import tempfile

    from safetensors.torch import save_file

    from paired_cache.pool_file import umask_mode

    path = Path(path)
    tensors = {
        f"{name}.{part}": t.contiguous() for name, w in predictors.items() for part, t in w.items()
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": FORMAT, "fraction": repr(float(fraction))})
        os.chmod(tmp, umask_mode())  # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_predictors(path: str | os.PathLike) -> dict[str, dict[str, torch.Tensor]]:
    """Read a file written by save_predictors: {mlp name: weights}."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                raise PairedCacheError(f"{path}: not a paired-cache predictor file ({FORMAT})")
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name, _, part = key.rpartition(".")
                out.setdefault(name, {})[part] = f.get_tensor(key)
    except (OSError, ValueError, SafetensorError) as exc:
        if isinstance(exc, PairedCacheError):
            raise
        raise PairedCacheError(f"{path}: cannot read predictors ({exc})") from None
    return out


def recall(predicted: torch.Tensor, oracle: torch.Tensor) -> float:
    """Share of the oracle's rows that the predicted masks keep; both (T, N) bool."""
    return float((predicted & oracle).sum()) / max(1, int(oracle.sum()))


__all__ = [
    "TrainConfig",
    "TrainedPredictor",
    "fit_predictor",
    "fit_predictors",
    "load_predictors",
    "oracle_labels",
    "recall",
    "save_predictors",
]


def _register() -> None:
    from paired_cache.mask_sources import MASK_SOURCES

    MASK_SOURCES["trained"] = TrainedPredictor


_register()
