"""Bytes a sparse MLP reads per token from a mapped pool, counted in 4 KiB pages (#54).

A token that multiplies k of an MLP's N neuron rows where they lie in a mapped file reads
every page its rows touch, not only the rows' bytes: a row smaller than a page shares its
pages with its neighbours, and at 50% rows most pages hold a picked row. This counts, on
SmolLM2-135M's real weights and a real text, the pages each token's rows touch for

- the uncompressed rows of a gate-less pool (one neuron's up row | down_T row, 4,608 bytes
  in float32), in the pool's order and with the neurons reordered by how often they are
  picked (hot neurons side by side);
- the same rows as one zstd frame each (byte-shuffled, level 19; paired-cache's compressed
  pool writes the same frames), in both orders;

at each ``--fractions``, and sets beside them the bytes zstd-linear's codec stores the
whole MLP in (gate, up and down, read in full by every token). The rows a token picks are
the oracle's (top k of |act(gate x) * up x|, which the trained predictor approximates).
Counting, not timing: it runs anywhere.

    hatch run python tests-integration/benchmarks/page_touch.py [--tokens T]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

MiB = 2**20
PAGE = 4096
COMMAND = "hatch run python tests-integration/benchmarks/page_touch.py"
RESULTS = (
    Path(__file__).resolve().parents[2] / "packages" / "paired-cache" / "benchmarks" / "results"
)


def frame_sizes(up: torch.Tensor, down: torch.Tensor, level: int) -> list[int]:
    """The compressed size of each neuron's up row | down_T row, byte-shuffled."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=level)
    sizes = []
    for j in range(up.shape[0]):
        row = torch.cat([up[j], down[:, j]]).contiguous()
        planes = row.view(torch.uint8).view(-1, row.element_size()).T.contiguous()
        sizes.append(len(comp.compress(planes.numpy().tobytes())))
    return sizes


def pages_touched(picked: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> int:
    """Distinct pages of the byte ranges [starts[i], ends[i]) of the picked rows."""
    first = starts[picked] // PAGE
    last = (ends[picked] - 1) // PAGE
    span = int((last - first).max()) + 1
    pages = first[:, None] + torch.arange(span)[None, :]  # (k, span)
    return int(torch.unique(pages[pages <= last[:, None]]).numel())


def layout_offsets(sizes: list[int], order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end byte of each neuron's row when the rows lie in ``order``."""
    size = torch.tensor(sizes, dtype=torch.long)
    placed = size[order]
    start_in_order = torch.cumsum(placed, 0) - placed
    starts = torch.empty_like(size)
    starts[order] = start_in_order
    return starts, starts + size


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="text tokens whose rows count")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--level", type=int, default=19, help="zstd level of the row frames")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)

    from membound_testing import load_smollm2
    from membound_testing.results import write_result
    from zstd_linear.codec import encode_weight

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]
    scores: dict[int, torch.Tensor] = {}

    def hook_for(index):
        def hook(mlp, inputs):
            x = inputs[0][0]
            scores[index] = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).abs()

        return hook

    for index, layer in enumerate(model.model.layers):
        layer.mlp.register_forward_pre_hook(hook_for(index))
    with torch.no_grad():
        model(ids)

    totals: dict[tuple, float] = {}
    stored = {"raw": 0, "zstd": 0}
    zlin_mlp = 0
    for index, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        up, down = mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
        n = up.shape[0]
        row_bytes = (up.shape[1] + down.shape[0]) * up.element_size()
        sizes = {"raw": [row_bytes] * n, "zstd": frame_sizes(up, down, args.level)}
        for kind, s in sizes.items():
            stored[kind] += sum(s)
        for w in (mlp.gate_proj.weight, up, down):
            zlin_mlp += encode_weight(w.detach()).compressed_bytes
        for fraction in args.fractions:
            k = max(1, round(fraction * n))
            picked = torch.topk(scores[index], k, dim=1).indices  # (T, k)
            counts = torch.bincount(picked.reshape(-1), minlength=n)
            orders = {
                "pool order": torch.arange(n),
                "hot first": torch.argsort(counts, descending=True, stable=True),
            }
            for kind, s in sizes.items():
                for order_name, order in orders.items():
                    starts, ends = layout_offsets(s, order)
                    read = sum(pages_touched(p, starts, ends) for p in picked) * PAGE
                    key = (kind, fraction, order_name)
                    totals[key] = totals.get(key, 0.0) + read / picked.shape[0]
        print(f"layer {index} counted", flush=True)

    gate_bytes = sum(layer.mlp.gate_proj.weight.nbytes for layer in model.model.layers)
    rows = []
    for (kind, fraction, order_name), per_token in totals.items():
        rows.append(
            [
                "up | down_T rows, " + ("float32" if kind == "raw" else f"zstd {args.level}"),
                f"{round(fraction * 100)}%",
                order_name,
                round(stored[kind] / MiB, 1),
                round(fraction * stored[kind] / MiB, 1),
                round(per_token / MiB, 1),
                round(100 * per_token / stored[kind], 1),
            ]
        )
    rows.append(
        ["whole MLP (gate, up, down), zstd-linear codec", "100%", "-", round(zlin_mlp / MiB, 1)]
        + [round(zlin_mlp / MiB, 1)] * 2
        + [100.0]
    )
    notes = (
        f"SmolLM2-135M-Instruct (float32 from the Q4_1 GGUF), its first {ids.shape[1]} tokens "
        "of the root README as the text; per token, the oracle's top k rows of every MLP "
        "(|act(gate x) * up x|). 'MiB read/token' counts the distinct 4 KiB pages the "
        "picked rows' bytes lie in, summed over the 30 MLPs and averaged over the tokens; "
        "'hot first' lays the rows out by how often the text picked them (fitted on the "
        "same tokens, so a best case). The rows exclude the gate: the gated predictor "
        f"reads all of it every token ({gate_bytes / MiB:.1f} MiB in float32, less through "
        "zstd-linear)."
    )
    write_result(
        RESULTS,
        package="paired-cache",
        name="page_touch",
        title="A sparse MLP's reads per token, in pages (SmolLM2-135M, oracle rows)",
        command=COMMAND,
        columns=[
            "rows",
            "rows picked",
            "layout",
            "MiB stored",
            "MiB picked/token",
            "MiB read/token (4 KiB pages)",
            "% of stored read",
        ],
        rows=rows,
        notes=notes,
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
