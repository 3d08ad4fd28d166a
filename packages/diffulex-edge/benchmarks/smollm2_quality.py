"""SmolLM2-135M-Instruct: the 8da4w and 8da4w-mixed .pte against the fp32 .pte — file size
and perplexity on a held-out text, each computed through the program's own prefill method
(no timing).

    python packages/diffulex-edge/benchmarks/smollm2_quality.py [--quick]

The programs are exported once per export code (``export_code_digest``) under the membound
cache (the fp32 one is the test suite's); an export takes several minutes on 2 cores.
``--quick`` scores the first 64 tokens and does not save the JSON.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from diffulex_edge import PteEngine, export_pte, load_checkpoint
from diffulex_edge.export import MIXED_INT8_LAYERS, QUANTIZATIONS, export_code_digest

RESULTS = Path(__file__).parent / "results"
COMMAND = "python packages/diffulex-edge/benchmarks/smollm2_quality.py"
MAX_SEQ, PREFILL = 256, 32
# Held out: written for this benchmark, so it is in no training set.
TEXT = (
    "The lighthouse keeper on the northern island kept a notebook of every ship that passed. "
    "In the spring of that year he counted forty-one fishing boats, six cargo vessels and a "
    "single sailing yacht whose crew waved at him from the deck. When the fog rolled in, he "
    "lit the lamp an hour early and listened to the bell buoy ringing in the channel. His "
    "daughter, who visited every other weekend, brought bread from the mainland and asked "
    "him to tell the story of the winter storm that had torn the roof from the boathouse. "
    "He always began with the wind, then the sound of the waves against the rocks, and "
    "finished with the morning after, when the sea was calm and the gulls came back."
)


def pte_path(quantize: str | None) -> Path:
    from membound_testing.models import cache_dir

    kind = quantize or "f32"
    digest = export_code_digest()[:12]
    name = f"diffulex-edge-export-{digest}-smollm2-{kind}-{MAX_SEQ}-1-{PREFILL}.pte"
    return cache_dir() / name


def ensure_pte(quantize: str | None) -> Path:
    from membound_testing.models import smollm2_float_dir

    path = pte_path(quantize)
    if not (path.is_file() and path.with_name(path.name + ".json").is_file()):
        path.parent.mkdir(parents=True, exist_ok=True)
        model = load_checkpoint(smollm2_float_dir())
        export_pte(
            model, path, MAX_SEQ, 1, "block_kv", quantize, prefill_size=PREFILL, progress=True
        )
    return path


def perplexity(backend, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) of ids (1, n) scored by one causal prefill."""
    backend.reset()
    logits = backend.prefill_causal(ids, all_logits=True)[0, :-1].float()  # (n - 1, vocab)
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(nll.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 tokens, nothing saved")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import PreTrainedTokenizerFast

    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_result

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(smollm2_float_dir()))
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    if args.quick:
        ids = ids[:, :64]
    rows, sizes, ppl = [], {}, {}
    for quantize in (None, *QUANTIZATIONS):
        path = ensure_pte(quantize)
        engine = PteEngine(path)
        name = f"pte block_kv {quantize or 'fp32'}"
        sizes[name], ppl[name] = path.stat().st_size, perplexity(engine.backend, ids)
        rows.append([name, round(sizes[name] / 2**20, 1), round(ppl[name], 3)])
    fp32 = "pte block_kv fp32"
    targets = []
    for q in (f"pte block_kv {name}" for name in QUANTIZATIONS):
        size_ratio, ppl_ratio = sizes[q] / sizes[fp32], ppl[q] / ppl[fp32]
        targets += [
            {
                "target": f"{q.split()[-1]} .pte size <= 0.35x fp32's",
                "measured": f"{size_ratio:.3f}x",
                "met": size_ratio <= 0.35,
            },
            {
                "target": f"{q.split()[-1]} perplexity <= 1.1x fp32's",
                "measured": f"{ppl[q]:.3f} vs {ppl[fp32]:.3f} ({ppl_ratio:.3f}x)",
                "met": ppl_ratio <= 1.1,
            },
        ]
    write_result(
        RESULTS,
        package="diffulex-edge",
        name="smollm2_8da4w",
        title="SmolLM2-135M-Instruct .pte: 8da4w and 8da4w-mixed against fp32 (size, held-out perplexity)",
        command=COMMAND,
        columns=["program", ".pte MiB", "perplexity"],
        rows=rows,
        targets=targets,
        notes=f"{ids.shape[1]} tokens of a held-out English paragraph (in the script), scored "
        f"through each program's prefill method ({PREFILL}-token causal chunks, static cache "
        f"of {MAX_SEQ}); 8da4w = int8 dynamic activations, int4 weights in groups of 32 on "
        "every linear layer (torchao), embeddings left in fp32; 8da4w-mixed = the same, "
        f"except {' and '.join(MIXED_INT8_LAYERS)}: int8 weights with one scale per row "
        "(8da8w). Block size 1 (autoregressive).",
        save=not args.quick,
    )


if __name__ == "__main__":
    main()
