"""SparseMLP quality on the embedded SmolLM2-135M: perplexity on a held-out text, next-token
agreement with the dense model and recall of the oracle's rows, at 25 / 50 / 75% active
rows, per mask source (oracle, trained (gated), trained-linear, cats, lowrank, fixed), with
each source's own cost in multiply-adds. Not a timing benchmark (the fit seconds column is
context only)."""

from __future__ import annotations

import copy
import math
import sys
import time

import torch
from common import NOISE, write_result
from texts import CALIBRATION, DOCS_TOKENS, HELD_OUT, docs_ids

from paired_cache.mask_sources import DEFAULT_RANK, OracleTopK
from paired_cache.sparse_mlp import sparsify_model
from paired_cache.trained_predictor import PARTS, TrainConfig, fit_predictors

# (row name, registered source, predictor kind for "trained")
SOURCES = (
    ("oracle", "oracle", None),
    ("trained", "trained", "gated"),
    ("trained-linear", "trained", "linear"),
    ("cats", "cats", None),
    ("lowrank", "lowrank", None),
    ("fixed", "fixed", None),
)

GENERATED_TOKENS = 768  # self-generated calibration text for lowrank and fixed


def nll_and_argmax(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """logits: (1, T, V), ids: (1, T) -> mean NLL of ids[1:], argmax (T-1,)."""
    logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    nll = -logp.gather(1, ids[0, 1:, None]).mean().item()
    return nll, logits[0, :-1].argmax(-1)


def calibration_ids(model, tokenizer, quick: bool) -> torch.Tensor:
    """The calibration text of lowrank and fixed, followed by text the dense model samples
    from its opening (seeded)."""
    ids = tokenizer(CALIBRATION, return_tensors="pt").input_ids
    extra = 32 if quick else GENERATED_TOKENS
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            ids[:, :16], max_new_tokens=extra, do_sample=True, temperature=1.0, top_k=50
        )
    return torch.cat([ids, out[:, 16:]], dim=1)


def mask_cost(row: str, n: int, hidden: int, ranks: dict[str, int]) -> float:
    """Multiply-adds a source spends per token to choose its rows, as a share of the dense
    MLP's 3 N hidden."""
    dense = 3 * n * hidden
    cost = {
        "oracle": 2 * n * hidden,
        "trained": n * hidden + ranks["gated"] * (hidden + n),
        "trained-linear": ranks["linear"] * (hidden + n),
        "cats": n * hidden,
        "lowrank": 2 * min(DEFAULT_RANK, hidden, n) * (hidden + n),
        "fixed": 0,
    }[row]
    return round(cost / dense, 3)


def record_recall(mlps) -> list[list[float]]:
    """Wrap every SparseMLP's source to count, per token, the oracle's rows it keeps."""
    hits = [[0, 0] for _ in mlps]
    for i, m in enumerate(mlps):
        gate, up = m.cache.gate_pool, m.cache.up_pool
        oracle = OracleTopK(gate, up, m.act_fn, m.source.fraction)
        oracle.k = m.source.k
        # What SparseMLP calls: select_with_gate per token, select for a shared mask.
        method = "select_with_gate" if m.source.per_token else "select"
        select = getattr(m.source, method)

        def counted(x, select=select, oracle=oracle, tally=hits[i]):
            result = select(x)
            mask = result[0] if isinstance(result, tuple) else result
            want = oracle.select(x)
            tally[0] += int((mask & want).sum())
            tally[1] += int(want.sum())
            return result

        setattr(m.source, method, counted)
    return hits


def main(quick: bool, fractions=(0.25, 0.5, 0.75), tokens: int = DOCS_TOKENS) -> None:
    from membound_testing import load_smollm2

    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    held_out = tokenizer(HELD_OUT, return_tensors="pt").input_ids
    if quick:
        held_out = held_out[:, :32]
    calibration = calibration_ids(model, tokenizer, quick)
    with torch.no_grad():
        dense_nll, dense_top = nll_and_argmax(model(held_out).logits, held_out)
    rows = [["dense", "100%", 1.0, round(math.exp(dense_nll), 3), "", "", "", ""]]
    fractions = (0.5,) if quick else fractions
    docs = docs_ids(tokenizer, 1024 if quick else tokens)
    # One fit per kind for every fraction: the predictor scores rows, each fraction keeps
    # its top k.
    predictors, fit_s, ranks = {}, {}, {}
    for kind in ("gated", "linear"):
        start = time.perf_counter()
        predictors[kind] = fit_predictors(model, docs, TrainConfig(kind=kind))
        fit_s[kind] = time.perf_counter() - start
        first = next(iter(predictors[kind].values()))
        ranks[kind] = first[PARTS[kind][0]].shape[1]
        print(
            f"fitted {kind} predictors on {docs.shape[1]} tokens in {fit_s[kind]:.0f} s",
            file=sys.stderr,
        )
    names = list(predictors["gated"])  # the order sparsify_model replaces the MLPs in
    n, hidden = model.get_submodule(names[0]).gate_proj.weight.shape
    for fraction in fractions:
        for row, source, kind in SOURCES:
            sparse_model = copy.deepcopy(model)
            options = {"weights": [predictors[kind][m] for m in names]} if kind else {}
            with torch.no_grad():
                mlps = sparsify_model(
                    sparse_model, source, fraction, calibration_ids=calibration, **options
                )
                hits = record_recall(mlps)
                nll, top = nll_and_argmax(sparse_model(held_out).logits, held_out)
            updates = sum(m.cache.stats.updates for m in mlps)
            moved = sum(m.cache.stats.rows_copied for m in mlps)
            recall = sum(h[0] for h in hits) / max(1, sum(h[1] for h in hits))
            rows.append(
                [
                    row,
                    f"{round(fraction * 100)}%",
                    round((top == dense_top).double().mean().item(), 3),
                    round(math.exp(nll), 3),
                    round(recall, 3),
                    round(moved / max(updates, 1), 1),
                    mask_cost(row, n, hidden, ranks),
                    round(fit_s[kind]) if kind else "",
                ]
            )
            print(f"{row} {fraction}: {rows[-1]}", file=sys.stderr)
            del sparse_model, mlps
    write_result(
        "quality",
        f"SparseMLP on SmolLM2-135M (float32), held-out text of {held_out.shape[1]} tokens",
        [
            "mask source",
            "active rows",
            "next-token agreement",
            "perplexity",
            "recall of the oracle's rows",
            "rows copied per update",
            "mask cost (share of the dense MLP's multiply-adds)",
            "fit s (1 thread, shared machine)",
        ],
        rows,
        [
            {
                "target": "50% active rows, trained predictor: perplexity <= 1.15x dense",
                "measured": next(
                    f"{r[3]} vs dense {rows[0][3]} ({r[3] / rows[0][3]:.2f}x)"
                    for r in rows
                    if r[:2] == ["trained", "50%"]
                ),
                "met": next(r[3] for r in rows if r[:2] == ["trained", "50%"]) <= 1.15 * rows[0][3],
            }
        ],
        NOISE + " Agreement: share of positions whose argmax equals the dense model's. "
        "Recall: share of the oracle's rows (top-k |silu(gate x) * up x|) that the source "
        f"kept, over every token and layer. Calibration of lowrank and fixed: the "
        f"{CALIBRATION.count(' ') + 1}-word text of benchmarks/texts.py followed by "
        f"{calibration.shape[1] - len(tokenizer(CALIBRATION).input_ids)} tokens the dense "
        f"model samples from its opening (seed 0, top-k 50), {calibration.shape[1]} tokens "
        f"in all; lowrank uses rank {DEFAULT_RANK}. trained (the default, gated kind): the "
        f"gate computed exactly, up x predicted at rank {ranks['gated']} (its top principal "
        "directions on the calibration inputs), rows scored by |silu(gate x)| * E|up x| "
        "given that prediction and the spread rank r leaves out; trained-linear (Deja "
        f"Vu): x -> rank {ranks['linear']} -> N logits, least squares on "
        "log(|silu(gate x) * up x| + 1e-6) reduced to that rank. Both fitted once for every "
        f"fraction on the first {docs.shape[1]} tokens of Python's pydoc_data.topics "
        "(sequences of 512 tokens); fit s is the forward pass over those tokens and the "
        "fit, on a shared machine. cats computes the gate densely (top-k |silu(gate x)|). "
        "Mask cost: multiply-adds per token to choose the rows (oracle 2 N hidden, cats N "
        "hidden, gated N hidden + r (hidden + N), linear r (hidden + N), lowrank "
        "2 r (hidden + N)) over the dense MLP's 3 N hidden; the rows' own matmuls come on "
        "top. Every MLP runs token by token (one mask per token, as in decoding); fixed "
        "runs one mask for all tokens.",
        save=not quick,
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fractions", default="0.25,0.5,0.75", help="comma-separated")
    parser.add_argument("--tokens", type=int, default=DOCS_TOKENS, help="trained's calibration")
    args = parser.parse_args()
    main(args.quick, tuple(float(f) for f in args.fractions.split(",")), args.tokens)
