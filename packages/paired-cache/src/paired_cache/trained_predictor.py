"""Trained predictors: per MLP, a small network fitted on a calibration text to pick the
neurons the oracle (top-k |act(gate x) * up x|) would keep for a token. Two kinds, both
fitted in closed form from sums over the calibration tokens (so any number of tokens fits
in a few MiB per layer), and one predictor serves every fraction (the top k of the same
scores):

- "gated" (the default): the gate is computed exactly, as CATS does (the gate stays
  resident), and up x is predicted at rank r: u_hat = (x @ up_in) @ up_out, the rank-r map
  closest to up on the calibration inputs (the top r principal directions of up x). The
  score is |act(gate x)| * E|u|, the expected magnitude of up x given u_hat and the spread
  of what rank r leaves out (up_sd, per neuron, from the same sums): a neuron whose up x
  rank r captures badly is not dropped for a small u_hat. Cost per token: N hidden (the
  gate) + r (hidden + N) multiply-adds, against 2 N hidden for gate and up densely.
  Measured on SmolLM2-135M at 50% active rows, rank 64 (benchmarks/quality.py):
  perplexity 31.1 against dense 28.0, oracle 29.3, CATS 40.0 and the linear kind 91.
- "linear" (the Deja Vu recipe): logits = (x @ proj_in) @ proj_out + bias, x -> rank r
  -> N logits, the least-squares fit of log(|act(gate x) * up x| + LOG_EPS) reduced to
  rank r (reduced-rank regression). It needs no gate, and costs r (hidden + N).

Why the linear kind is not the default: |act(gate x) * up x| is not monotone in any
linear function of x (the sign of up x drops out), so a linear predictor of a SwiGLU MLP
has a ceiling below CATS. On SmolLM2-135M at 50% (layer 12), BCE with AdamW (Deja Vu's
loss) on ~1,000 calibration tokens recalled 0.78 of the oracle's rows on those tokens and
0.56 on held-out text (overfit); on 32,768 tokens 0.69 and 0.63 after 1,000 steps (149 s
for one layer), the same as the closed form on the same tokens (seconds). Even a
full-rank affine map fitted on 32,768 tokens recalls only 0.72 on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from paired_cache.errors import PairedCacheError
from paired_cache.mask_sources import (
    Activation,
    MaskSource,
    _top_k_mask,
    expected_abs,
    rows_mask,
    top_k_rows,
)
from paired_cache.mlp_layouts import is_gated_mlp
from paired_cache.pool_file import umask_mode
from paired_cache.safetensors_map import SafetensorsMap

FORMAT = "paired-cache-predictor-1"  # linear predictors only, as 0.6-0.7 wrote
FORMAT_GATED = "paired-cache-predictor-2"  # any gated predictor: 0.7 cannot read it
PARTS = {"gated": ("up_in", "up_out", "up_sd"), "linear": ("proj_in", "proj_out", "bias")}
KINDS = tuple(PARTS)  # ("gated", "linear")
DEFAULT_RANKS = {"gated": 64, "linear": 128}
LOG_EPS = 1e-6  # log(|h| + LOG_EPS): rows that are exactly zero get a finite target
WINDOW = 512  # calibration tokens per sequence in fit_predictors


def check_kind(kind) -> None:
    if kind not in KINDS:
        raise PairedCacheError(f"kind must be one of {KINDS}, got {kind!r}")


@dataclass
class TrainConfig:
    """rank: r of the predictor, in [1, min(hidden, N)]; None: DEFAULT_RANKS[kind] (gated
    64, linear 128), capped at min(hidden, N). ridge: the linear kind's least-squares
    regulariser, relative to the mean of diag(X^T X), >= 0. kind: "gated" or "linear"
    (see the module's docstring)."""

    rank: int | None = None
    ridge: float = 1e-2
    kind: str = "gated"

    def __post_init__(self) -> None:
        check_kind(self.kind)
        rank = self.rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise PairedCacheError(f"rank must be an int >= 1 or None, got {rank!r}")
        ridge = self.ridge
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not 0 <= ridge < 1e30:
            raise PairedCacheError(f"ridge must be a finite number >= 0, got {ridge!r}")

    def rank_for(self, n: int, hidden: int) -> int:
        """The rank this config fits for an MLP of N rows and `hidden` inputs."""
        if self.rank is None:
            return min(DEFAULT_RANKS[self.kind], hidden, n)
        if self.rank > min(hidden, n):
            raise PairedCacheError(
                f"rank must be in [1, min(hidden, N)={min(hidden, n)}], got {self.rank}"
            )
        return self.rank


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
    X^T X (float64) with X = [x, 1] (T, hidden + 1), and for the linear kind X^T Z with
    Z = log(|h| + LOG_EPS) (T, N). gate, up: (N, hidden), the MLP's weights."""

    def __init__(
        self, gate: torch.Tensor, up: torch.Tensor, act: Activation, kind: str = "gated"
    ) -> None:
        if gate.dim() != 2 or gate.shape != up.shape:
            raise PairedCacheError(
                f"gate and up must be (N, hidden) of one shape, got {tuple(gate.shape)} "
                f"and {tuple(up.shape)}"
            )
        check_kind(kind)
        self.gate, self.up, self.act, self.kind = gate.float(), up.float(), act, kind
        n, hidden = gate.shape
        self.xtx = torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64)
        # The gated kind needs only X^T X: no oracle scores to compute.
        self.xtz = torch.zeros(hidden + 1, n, dtype=torch.float64) if kind == "linear" else None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """x: (T, hidden) float, inputs of this MLP."""
        hidden = self.gate.shape[1]
        if x.dim() != 2 or x.shape[1] != hidden:
            raise PairedCacheError(
                f"calibration has shape {tuple(x.shape)}, expected (T, {hidden})"
            )
        x = x.float()
        xa = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1).double()  # (T, hidden + 1)
        self.xtx += xa.T @ xa
        if self.xtz is not None:
            z = torch.log(oracle_scores(self.gate, self.up, self.act, x) + LOG_EPS)  # (T, N)
            self.xtz += xa.T @ z.double()
        self.tokens += x.shape[0]

    def solve(self, config: TrainConfig | None = None) -> dict[str, torch.Tensor]:
        """The predictor's weights (PARTS[kind]), float32: gated {"up_in": (hidden, r),
        "up_out": (r, N), "up_sd": (N,)}, linear {"proj_in": (hidden, r), "proj_out":
        (r, N), "bias": (N,)}."""
        config = TrainConfig(kind=self.kind) if config is None else config
        if config.kind != self.kind:
            raise PairedCacheError(
                f"these sums were accumulated for a {self.kind!r} predictor, the config asks "
                f"for {config.kind!r}"
            )
        n, hidden = self.gate.shape
        rank = config.rank_for(n, hidden)
        if self.tokens == 0:
            raise PairedCacheError("no calibration inputs were added")
        if self.kind == "gated":
            return self._solve_gated(rank)
        eye = torch.eye(hidden + 1, dtype=torch.float64)
        reg = self.xtx + config.ridge * float(self.xtx.diagonal().mean()) * eye
        b = torch.linalg.solve(reg, self.xtz)  # (hidden + 1, N), the full-rank fit
        # Rank r: project the fit's outputs on their top r right singular vectors, the
        # top eigenvectors of (X B)^T (X B) = B^T X^T X B.
        v = torch.linalg.eigh(b.T @ self.xtx @ b).eigenvectors[:, -rank:]  # (N, r)
        return {
            "proj_in": (b[:hidden] @ v).float().contiguous(),
            "proj_out": v.T.float().contiguous(),
            "bias": (b[hidden] @ v @ v.T).float().contiguous(),
        }

    def _solve_gated(self, rank: int) -> dict[str, torch.Tensor]:
        hidden = self.gate.shape[1]
        up = self.up.double()
        # Sum over the tokens of (up x)(up x)^T: its top r eigenvectors V span the rank-r
        # subspace closest to up's outputs; u_hat = V V^T up x.
        second = up @ self.xtx[:hidden, :hidden] @ up.T  # (N, N)
        values, vectors = torch.linalg.eigh(second)
        v, kept = vectors[:, -rank:], values[-rank:]
        # Per neuron, the mean square of what rank r leaves out: diag((I - V V^T) S (I -
        # V V^T)) = diag(S) - sum_j lambda_j v_ij^2.
        left = (second.diagonal() - (v * v) @ kept).clamp_min(0) / self.tokens
        return {
            "up_in": (up.T @ v).float().contiguous(),
            "up_out": v.T.float().contiguous(),
            "up_sd": left.sqrt().float().contiguous(),
        }


def fit_predictor(
    gate: torch.Tensor,
    up: torch.Tensor,
    act: Activation,
    calibration: torch.Tensor,
    config: TrainConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Fit one layer's predictor on calibration (T, hidden) inputs of this MLP; returns its
    weights (PARTS[config.kind], float32), for any fraction."""
    config = TrainConfig() if config is None else config
    fit = PredictorFit(gate, up, act, config.kind)
    config.rank_for(*fit.gate.shape)  # before the work, not after
    fit.add(calibration)
    return fit.solve(config)


def predictor_kind(weights: dict[str, torch.Tensor]) -> str:
    """ "gated" or "linear", from the names of a predictor's weights."""
    for kind, parts in PARTS.items():
        if isinstance(weights, dict) and set(weights) == set(parts):
            return kind
    got = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
    raise PairedCacheError(
        f"predictor weights must be {{'up_in', 'up_out', 'up_sd'}} (gated) or {{'proj_in', "
        f"'proj_out', 'bias'}} (linear), from fit_predictor or load_predictors; got {got}"
    )


class TrainedPredictor(MaskSource):
    """The k rows with the largest predicted scores.

    weights: from fit_predictor or load_predictors, of either kind: gated {"up_in":
    (hidden, r), "up_out": (r, N), "up_sd": (N,)} scores |act(gate x)| * E|up x| (gate is
    read in full every token, as CATS does); linear {"proj_in": (hidden, r), "proj_out":
    (r, N), "bias": (N,)} scores (x @ proj_in) @ proj_out + bias.
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
        if weights is None:
            raise PairedCacheError(
                "mask source 'trained' needs weights= (fit_predictor, or load_predictors of "
                "a saved file)"
            )
        self.kind = predictor_kind(weights)
        self.gives_gate = self.kind == "gated"
        p_in, p_out, vec = (weights[part] for part in PARTS[self.kind])
        r = p_in.shape[-1] if p_in.dim() == 2 else -1
        if p_in.shape != (hidden, r) or p_out.shape != (r, n) or vec.shape != (n,):
            names = PARTS[self.kind]
            raise PairedCacheError(
                f"predictor weights {names[0]} {tuple(p_in.shape)}, {names[1]} "
                f"{tuple(p_out.shape)}, {names[2]} {tuple(vec.shape)} do not fit "
                f"hidden={hidden}, N={n}"
            )
        self.proj_in, self.proj_out, vec = (t.float().contiguous() for t in (p_in, p_out, vec))
        if self.kind == "gated":
            if not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
                raise PairedCacheError("predictor weights up_sd must be finite and >= 0")
            self.gate, self.act, self.up_sd = gate, act, vec
        else:
            self.bias = vec

    @classmethod
    def gives_gate_for(cls, weights=None, **options) -> bool:
        return weights is not None and predictor_kind(weights) == "gated"

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return self.select_with_gate(x)[0]

    def _gate_and_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated kind's act(gate x) (N,) and predicted up x (N,) float32."""
        gate = self.act(self.gate_x(x))
        return gate, (x.float() @ self.proj_in) @ self.proj_out

    def select_with_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "linear":
            logits = torch.addmv(self.bias, self.proj_out.T, x.float() @ self.proj_in)  # (N,)
            return _top_k_mask(logits, self.k), None
        gate, up = self._gate_and_up(x)
        return rows_mask(top_k_rows(gate, self.k, up, self.up_sd)[0], self.n_rows), gate

    def select_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.kind == "linear":
            return super().select_rows(x)
        gate, up = self._gate_and_up(x)
        return top_k_rows(gate, self.k, up, self.up_sd)


def fit_predictors(
    model: torch.nn.Module,
    calibration_ids: torch.Tensor,
    config: TrainConfig | None = None,
    progress=None,
    window: int = WINDOW,
    batch: int = 4,
) -> dict[str, dict[str, torch.Tensor]]:
    """Fit a predictor for every gated MLP of a dense model.

    The ids run through the model as sequences of `window` tokens, `batch` at a time (a
    shorter last one on its own), and every MLP's sums are accumulated from its inputs on
    the way, so memory does not grow with T.

    Args:
        model: a dense transformers model.
        calibration_ids: (1, T) or (T,) integer token ids.
        config: the TrainConfig (None: its defaults).
        progress: called with each MLP's name once it is fitted, or None.
        window: tokens per sequence.
        batch: sequences per forward.

    Returns:
        {mlp name: weights}, for save_predictors.
    """
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
            config.rank_for(*module.gate_proj.weight.shape)
            fits[name] = PredictorFit(
                module.gate_proj.weight.detach(),
                module.up_proj.weight.detach(),
                module.act_fn,
                config.kind,
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


def python_docs_ids(tokenizer, tokens: int = 16384) -> torch.Tensor:
    """A calibration text every Python has: Python's own documentation (the stdlib's
    pydoc_data.topics, English prose and code, topics in name order; ~113,000 tokens for
    SmolLM2's tokenizer).

    Args:
        tokenizer: a transformers tokenizer.
        tokens: how many token ids to return.

    Returns:
        The first `tokens` token ids, (1, tokens).
    """
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise PairedCacheError(f"pydoc_data.topics holds {ids.shape[1]} tokens, {tokens} asked")
    return ids[:, :tokens]


def save_predictors(
    path: str | os.PathLike, predictors: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Write predictors with safetensors (tensor "<mlp name>.<part>"), atomically.

    Args:
        path: the file to write.
        predictors: {mlp name: weights}, as fit_predictors returns.
    """
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    kinds = {name: predictor_kind(w) for name, w in predictors.items()}  # before writing
    # A file of linear predictors only keeps 0.6-0.7's format, which they can read.
    fmt = FORMAT_GATED if "gated" in kinds.values() else FORMAT
    tensors = {
        f"{name}.{part}": t.contiguous() for name, w in predictors.items() for part, t in w.items()
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": fmt})
        os.chmod(tmp, umask_mode())  # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_predictors(
    path: str | os.PathLike, *, mapped: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """Read a file written by save_predictors.

    Args:
        path: the file.
        mapped: True: read-only views of the file mapped, file-backed pages as the pool's
            are, no anonymous copy (load_sparse reads them so); writing to them faults.
            False: tensors of their own.

    Returns:
        {mlp name: weights}.
    """
    from safetensors import SafetensorError, safe_open

    out: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            fmt = (f.metadata() or {}).get("format")
            if fmt not in (FORMAT, FORMAT_GATED):
                raise PairedCacheError(
                    f"{path}: not a paired-cache predictor file ({FORMAT} or {FORMAT_GATED})"
                )
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name, _, part = key.rpartition(".")
                out.setdefault(name, {})[part] = None if mapped else f.get_tensor(key)
        if mapped:
            views = SafetensorsMap(path)
            for name, weights in out.items():
                for part in weights:
                    weights[part] = views.tensor(f"{name}.{part}")
    except (OSError, ValueError, SafetensorError) as exc:
        if isinstance(exc, PairedCacheError):
            raise
        raise PairedCacheError(f"{path}: cannot read predictors ({exc})") from None
    for name, weights in out.items():
        try:
            kind = predictor_kind(weights)
        except PairedCacheError as exc:
            raise PairedCacheError(f"{path}: {name}: {exc}") from None
        if kind == "gated" and fmt == FORMAT:
            raise PairedCacheError(f"{path}: {name} is a gated predictor in a {FORMAT} file")
    return out


def recall(predicted: torch.Tensor, oracle: torch.Tensor) -> float:
    """Share of the oracle's rows that the predicted masks keep; both (T, N) bool."""
    return float((predicted & oracle).sum()) / max(1, int(oracle.sum()))


__all__ = [
    "KINDS",
    "PredictorFit",
    "TrainConfig",
    "TrainedPredictor",
    "expected_abs",
    "fit_predictor",
    "fit_predictors",
    "load_predictors",
    "oracle_labels",
    "oracle_scores",
    "predictor_kind",
    "python_docs_ids",
    "recall",
    "save_predictors",
]
