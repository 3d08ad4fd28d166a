"""SmolLM2-135M-Instruct: 8da4w and 8da4w-mixed perplexity on more held-out text than
``smollm2_quality.py``'s paragraph (145 tokens): the three texts of different kinds that
moe-expert-cache's benchmarks use (prose, a chat transcript, Python source; written for
membound or MIT source, read from ``packages/moe-expert-cache/benchmarks/texts.py``), up to
1,000 tokens each. Each quantization eight ways, side by side: as 0.10 did (min-max,
float embedding: ``clip=False, int8_embedding=False``); as 0.11 did with a tokenizer (int4
groups clipped on the package's calibration text and rounded to nearest, int8 embedding:
``gptq=False``); as 0.12 did with a tokenizer (the clip's scales, GPTQ's codes) and without
one (clipped on random token ids, rounded to nearest), each ``grid=False,
head_int8_share=0``; as 0.13 did with and without a tokenizer (layers already on a 4-bit
grid, SmolLM2's Q4_1 linear layers, keep it: ``grid=True``; the tied lm_head as 0.12, but
for the twelfth of its rows likeliest on the calibration ids, which are int8); as 0.14
does (the same, but only the v_proj, o_proj and down_proj layers keep their grid; the
others as 0.12). Since 0.14 every int4 scale is bfloat16 in the eager model, as in the
program, so the older rows are those quantizations as the program runs them. Eager model
with the export's own quantizers (a program's static cache of 256 would not take a 1,000-token
prefill); no timing.

    python packages/diffulex-edge/benchmarks/smollm2_quant_texts.py
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MOE_BENCHMARKS = HERE.parents[1] / "moe-expert-cache" / "benchmarks"
COMMAND = "python packages/diffulex-edge/benchmarks/smollm2_quant_texts.py"
MAX_TOKENS = 1000
BEFORE_013 = {"grid": False, "head_int8_share": 0}  # quantize_8da4w as it was before 0.13
sys.path.insert(0, str(HERE))

from smollm2_quant_ablation import perplexity  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(MOE_BENCHMARKS))
    from texts import texts
    from transformers import PreTrainedTokenizerFast

    from diffulex_edge import load_checkpoint
    from diffulex_edge.calibration import calibration_ids
    from diffulex_edge.export import MIXED_INT8_LAYERS, quantize_8da4w
    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_result

    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    base = load_checkpoint(model_dir).eval()
    text_ids = calibration_ids(tokenizer)
    models = {"fp32": base}
    for scheme, int8 in (("8da4w", ()), ("8da4w-mixed", MIXED_INT8_LAYERS)):
        for way, options in (
            ("min-max (0.10)", {"clip": False, "int8_embedding": False, **BEFORE_013}),
            (
                "clipped, package text (0.11)",
                {"calibration": text_ids, "gptq": False, **BEFORE_013},
            ),
            ("GPTQ, package text (0.12)", {"calibration": text_ids, **BEFORE_013}),
            ("clipped, random ids (0.12)", BEFORE_013),
            ("every grid + GPTQ, package text (0.13)", {"calibration": text_ids, "grid": True}),
            ("every grid + clipped, random ids (0.13)", {"grid": True}),
            ("v/o/down grids + GPTQ, package text (0.14)", {"calibration": text_ids}),
            ("v/o/down grids + clipped, random ids (0.14)", {}),
        ):
            quantized = quantize_8da4w(copy.deepcopy(base), int8_layers=int8, **options)
            models[f"{scheme} {way}"] = quantized
    rows, worst = [], dict.fromkeys(list(models)[1:], 0.0)
    for name, text in texts().items():
        ids = torch.tensor([tokenizer(text)["input_ids"][:MAX_TOKENS]])
        ppl = {label: perplexity(model, ids) for label, model in models.items()}
        row = [name, ids.shape[1], round(ppl["fp32"], 2)]
        for label in worst:
            ratio = ppl[label] / ppl["fp32"]
            worst[label] = max(worst[label], ratio)
            row.append(round(ratio, 3))
        rows.append(row)
        print(row, flush=True)
    write_result(
        HERE / "results",
        package="diffulex-edge",
        name="smollm2_quant_texts",
        title="SmolLM2-135M-Instruct: 8da4w and 8da4w-mixed perplexity / fp32 on three more "
        "texts, min-max against calibrated clipping and GPTQ",
        command=COMMAND,
        columns=["text", "tokens", "fp32 perplexity", *(f"{label} x fp32" for label in worst)],
        rows=rows,
        targets=[
            {
                "target": f"{label} perplexity <= 1.1x fp32's on every text",
                "measured": f"worst {ratio:.3f}x",
                "met": ratio <= 1.1,
            }
            for label, ratio in worst.items()
        ],
        notes="One causal prefill of the eager model (diffulex-edge's SDAR port of SmolLM2, "
        "block size 1) per text and scheme, after the export's own quantize_8da4w; 8da4w-mixed "
        f"keeps {' and '.join(MIXED_INT8_LAYERS)} in int8 weights, one scale per row. "
        f"Calibration: the package's text ({text_ids.numel()} tokens) or "
        "diffulex_edge.calibration.random_ids (2,048, seed 0). Texts: "
        "moe-expert-cache/benchmarks/texts.py, the first "
        f"{MAX_TOKENS} tokens of each.",
    )


if __name__ == "__main__":
    main()
