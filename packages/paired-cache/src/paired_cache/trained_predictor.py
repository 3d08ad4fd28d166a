"""The Deja Vu predictor: per MLP, a small low-rank network that scores each neuron for a
token, fitted to the oracle's scores on a calibration text.

For each layer, logits = (x @ proj_in) @ proj_out + bias with proj_in (hidden, r),
proj_out (r, N), bias (N,): x -> rank r -> N logits, and the source keeps the k rows with
the largest logits per token. The logits are fitted by least squares to
log(|act(gate x) * up x| + LOG_EPS), the log of the score the oracle ranks by, and the
fit is reduced to rank r (reduced-rank regression: the rank-r map whose outputs are
closest to the full least-squares fit's on the calibration inputs). The fit is closed
form and streams: it needs only X^T X and X^T Z over the calibration tokens, so any
number of tokens fits in a few MiB per layer, and one predictor serves every fraction
(top-k of the same logits). Cost per token: r (hidden + N) multiply-adds, against
2 hidden N for computing gate and up densely. Saved with safetensors beside the pool file.

Why not BCE against the top-k set, as Deja Vu does for ReLU models: on SmolLM2-135M at
50% (layer 12), BCE with AdamW on ~1,000 calibration tokens recalled 0.78 of the oracle's
rows on those tokens and 0.56 on held-out text (overfit); on 32,768 tokens 0.69 and 0.63
after 1,000 steps (149 s for one layer), the same as this closed form on the same tokens
(0.69 and 0.63, seconds). Even a full-rank affine map fitted on 32,768 tokens recalls
only 0.72 on them: |act(gate x) * up x| is not monotone in any linear function of x (the
sign of up x drops out), so a linear predictor of a SwiGLU MLP has a ceiling below CATS,
which computes the gate exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import Activation, MaskSource, _top_k_mask

FORMAT = "paired-cache-predictor-1"
LOG_EPS = 1e-6  # log(|h| + LOG_EPS): rows that are exactly zero get a finite target
WINDOW = 512  # calibration tokens per sequence in fit_predictors


@dataclass
class TrainConfig:
    """rank: r of the predictor, in [1, min(hidden, N)]; ridge: the least-squares
    regulariser, relative to the mean of diag(X^T X), >= 0."""

    rank: int = 128
    ridge: float = 1e-2

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise PairedCacheError(f"rank must be an int >= 1, got {self.rank!r}")
        ridge = self.ridge
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not 0 <= ridge < 1e30:
            raise PairedCacheError(f"ridge must be a finite number >= 0, got {ridge!r}")


def oracle_scores(
    gate: torch.Tensor, up: torch.Tensor, act: Activation, x: torch.Tensor
) -> torch.Tensor:
    """gate, up: (N, hidden); x: (T, hidden) -> (T, N) float, |act(gate x) * up x|."""
    return (act(x @ gate.T) * (x @ up.T)).abs()


def oracle_labels(
    gate: torch.Tensor, up: torch.Tensor, act: Activation, x: torch.Tensor, k: int
) -> torch.Tensor:
    """gate, up: (N, hidden); x: (T, hidden) -> (T, N) bool, the oracle's top-k per token."""
    h = oracle_scores(gate, up, act, x)  # (T, N)
    labels = torch.zeros_like(h, dtype=torch.bool)
    labels.scatter_(1, torch.topk(h, k, dim=1, sorted=False).indices, True)
    return labels


class PredictorFit:
    """The sums one layer's fit needs, accumulated over batches of calibration inputs:
    X^T X and X^T Z (float64) with X = [x, 1] (T, hidden + 1) and Z = log(|h| + LOG_EPS)
    (T, N). gate, up: (N, hidden), the MLP's weights."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, act: Activation) -> None:
        if gate.dim() != 2 or gate.shape != up.shape:
            raise PairedCacheError(
                f"gate and up must be (N, hidden) of one shape, got {tuple(gate.shape)} "
                f"and {tuple(up.shape)}"
            )
        self.gate, self.up, self.act = gate.float(), up.float(), act
        n, hidden = gate.shape
        self.xtx = torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64)
        self.xtz = torch.zeros(hidden + 1, n, dtype=torch.float64)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (T, hidden) float, inputs of this MLP."""
        hidden = self.gate.shape[1]
        if x.dim() != 2 or x.shape[1] != hidden:
            raise PairedCacheError(
                f"calibration has shape {tuple(x.shape)}, expected (T, {hidden})"
            )
        x = x.float()
        z = torch.log(oracle_scores(self.gate, self.up, self.act, x) + LOG_EPS)  # (T, N)
        xa = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1).double()  # (T, hidden + 1)
        self.xtx += xa.T @ xa
        self.xtz += xa.T @ z.double()
        self.tokens += x.shape[0]

    def solve(self, config: TrainConfig | None = None) -> dict[str, torch.Tensor]:
        """{"proj_in": (hidden, r), "proj_out": (r, N), "bias": (N,)} float32."""
        config = TrainConfig() if config is None else config
        n, hidden = self.gate.shape
        if config.rank > min(hidden, n):
            raise PairedCacheError(
                f"rank must be in [1, min(hidden, N)={min(hidden, n)}], got {config.rank}"
            )
        if self.tokens == 0:
            raise PairedCacheError("no calibration inputs were added")
        eye = torch.eye(hidden + 1, dtype=torch.float64)
        reg = self.xtx + config.ridge * float(self.xtx.diagonal().mean()) * eye
        b = torch.linalg.solve(reg, self.xtz)  # (hidden + 1, N), the full-rank fit
        # Rank r: project the fit's outputs on their top r right singular vectors, the
        # top eigenvectors of (X B)^T (X B) = B^T X^T X B.
        v = torch.linalg.eigh(b.T @ self.xtx @ b).eigenvectors[:, -config.rank :]  # (N, r)
        return {
            "proj_in": (b[:hidden] @ v).float().contiguous(),
            "proj_out": v.T.float().contiguous(),
            "bias": (b[hidden] @ v @ v.T).float().contiguous(),
        }


def fit_predictor(
    gate: torch.Tensor,
    up: torch.Tensor,
    act: Activation,
    calibration: torch.Tensor,
    config: TrainConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Fit one layer's predictor on calibration (T, hidden) inputs of this MLP; returns
    {"proj_in": (hidden, r), "proj_out": (r, N), "bias": (N,)} float32, for any fraction."""
    config = TrainConfig() if config is None else config
    fit = PredictorFit(gate, up, act)
    n, hidden = fit.gate.shape
    if config.rank > min(hidden, n):  # before the work, not after
        raise PairedCacheError(
            f"rank must be in [1, min(hidden, N)={min(hidden, n)}], got {config.rank}"
        )
    fit.add(calibration)
    return fit.solve(config)


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
    config: TrainConfig | None = None,
    progress=None,
    window: int = WINDOW,
    batch: int = 4,
) -> dict[str, dict[str, torch.Tensor]]:
    """Fit a predictor for every gated MLP of a dense model from calibration_ids (1, T) or
    (T,): the ids run through the model as sequences of `window` tokens, `batch` at a time
    (a shorter last one on its own), and every MLP's sums are accumulated from its inputs
    on the way, so memory does not grow with T. progress(name) is called per fitted MLP.
    {mlp name: weights}."""
    from paired_cache.sparse_mlp import is_gated_mlp

    config = TrainConfig() if config is None else config
    for name, value in (("window", window), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PairedCacheError(f"{name} must be an int >= 1, got {value!r}")
    if not isinstance(calibration_ids, torch.Tensor) or calibration_ids.dtype.is_floating_point:
        raise PairedCacheError("calibration_ids must be an integer tensor of token ids")
    ids = calibration_ids.reshape(-1)
    if ids.numel() < 2:
        raise PairedCacheError(f"calibration_ids hold {ids.numel()} tokens; at least 2 needed")
    fits: dict[str, PredictorFit] = {}
    hooks = []
    for name, module in model.named_modules():
        if is_gated_mlp(module):
            n, hidden = module.gate_proj.weight.shape
            if config.rank > min(hidden, n):
                raise PairedCacheError(
                    f"rank must be in [1, min(hidden, N)={min(hidden, n)}], got {config.rank}"
                )
            fits[name] = PredictorFit(
                module.gate_proj.weight.detach(), module.up_proj.weight.detach(), module.act_fn
            )

            def hook(_module, args, fit=fits[name]):
                fit.add(args[0].detach().reshape(-1, args[0].shape[-1]))

            hooks.append(module.register_forward_pre_hook(hook))
    if not fits:
        raise PairedCacheError(f"{type(model).__name__} has no gated MLP")
    full = ids.numel() // window * window
    # (<= batch, window) each; a text shorter than one window is one shorter sequence.
    chunks = list(ids[:full].view(-1, window).split(batch)) if full else []
    if full < ids.numel():
        chunks.append(ids[full:].view(1, -1))
    try:
        with torch.no_grad():
            for chunk in chunks:
                model(chunk)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, fit in fits.items():
        out[name] = fit.solve(config)
        if progress is not None:
            progress(name)
    return out


def save_predictors(
    path: str | os.PathLike, predictors: dict[str, dict[str, torch.Tensor]]
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
        save_file(tensors, tmp, metadata={"format": FORMAT})
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
    "PredictorFit",
    "TrainConfig",
    "TrainedPredictor",
    "fit_predictor",
    "fit_predictors",
    "load_predictors",
    "oracle_labels",
    "oracle_scores",
    "recall",
    "save_predictors",
]


def _register() -> None:
    from paired_cache.mask_sources import MASK_SOURCES

    MASK_SOURCES["trained"] = TrainedPredictor


_register()
