"""SmolLM2-135M-Instruct: diffulex-edge's int4 programs beside optimum-executorch's int4 recipe
(#58), same model, texts and machine, every program through its own .pte:

- optimum-executorch 1.1.0, exported here: ``recipe="xnnpack"``, custom SDPA and KV cache,
  ``qlinear="8da4w"`` (int8 dynamic activations, int4 weights in groups of 32, min-max) and
  ``qembedding="8w"`` (int8 embedding, one scale per row);
- diffulex-edge's static_kv 8da4w and 8da4w-mixed programs, and 0.10's 8da4w, from
  ``smollm2_quality.py --keep DIR``.

Per program: size; perplexity / eager fp32 transformers' on the first 255 tokens of each of
the three held-out texts (prose, chat, code: ``smollm2_quant_texts.py``'s; a program's
static cache holds 256) and on ``smollm2_quality.py``'s paragraph, one token per forward;
the 32 greedy tokens after the chat question against fp32 transformers' and whether they
say "Paris"; decode tokens/s (31 tokens after the first, one thread: ExecuTorch's
threadpool reset to 1; the programs in turn, median of 5).

    hatch run diffulex-edge-optimum:python packages/diffulex-edge/benchmarks/optimum_int4.py DIR

``DIR/optimum-8da4w`` keeps optimum's program, for ``pte_min_limits.py DIR``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MOE_BENCHMARKS = HERE.parents[1] / "moe-expert-cache" / "benchmarks"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(MOE_BENCHMARKS))

from optimum_side_by_side import (  # noqa: E402
    MAX_SEQ,
    QUESTION,
    DiffulexRunner,
    EagerRunner,
    OptimumRunner,
)

COMMAND = (
    "hatch run diffulex-edge-optimum:python packages/diffulex-edge/benchmarks/optimum_int4.py DIR"
)
NEW_TOKENS, ROUNDS = 32, 5
OURS = {  # label -> file under DIR (smollm2_quality.py --keep)
    "diffulex-edge 8da4w": "diffulex-static_kv-8da4w.pte",
    "diffulex-edge 8da4w-mixed": "diffulex-static_kv-8da4w-mixed.pte",
    "diffulex-edge 8da4w, 0.10 (min-max)": "diffulex-static_kv-8da4w-0.10.pte",
}
OPTIMUM = "optimum-executorch 8da4w + 8w embedding"


def export_optimum(model_dir: Path, out: Path) -> tuple[Path, float]:
    """optimum-executorch's int4 recipe into ``out`` (written fresh): its .pte, seconds."""
    from optimum.exporters.executorch import main_export

    start = time.perf_counter()
    main_export(
        model_name_or_path=str(model_dir),
        output_dir=out,
        task="text-generation",
        recipe="xnnpack",
        max_seq_len=MAX_SEQ,
        use_custom_sdpa=True,
        use_custom_kv_cache=True,
        qlinear="8da4w",
        qembedding="8w",
    )
    seconds = time.perf_counter() - start
    for name in ("config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            (out / name).write_bytes((model_dir / name).read_bytes())
    return next(out.glob("*.pte")), seconds


def perplexity(runner, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:], one token per forward."""
    logits = runner.prefill(ids[:1])
    nll = 0.0
    for i in range(1, len(ids)):
        nll -= float(torch.log_softmax(logits.reshape(-1).float(), -1)[ids[i]])
        if i + 1 < len(ids):
            logits = runner.step(ids[i], i)
    return math.exp(nll / (len(ids) - 1))


def greedy(runner, prompt: list[int]) -> tuple[list[int], float]:
    """NEW_TOKENS greedy tokens after ``prompt``, and the seconds of all but the first."""
    tokens = [int(runner.prefill(prompt).argmax())]
    start = time.perf_counter()
    while len(tokens) < NEW_TOKENS:
        tokens.append(int(runner.step(tokens[-1], len(prompt) + len(tokens) - 1).argmax()))
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="smollm2_quality.py --keep's directory")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from executorch.extension.pybindings import portable_lib
    from smollm2_quality import TEXT
    from texts import texts
    from transformers import PreTrainedTokenizerFast

    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_result

    portable_lib._unsafe_reset_threadpool(1)  # its kernels' threads, not torch's
    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    missing = [f for f in OURS.values() if not (args.dir / f).is_file()]
    if missing:
        raise SystemExit(f"{args.dir} lacks {missing}: run smollm2_quality.py --keep {args.dir}")
    pte, export_s = export_optimum(model_dir, args.dir / "optimum-8da4w")
    print(f"optimum export: {export_s:.0f} s, {pte.stat().st_size / 2**20:.1f} MiB", flush=True)
    sizes = {
        OPTIMUM: pte.stat().st_size,
        **{k: (args.dir / f).stat().st_size for k, f in OURS.items()},
    }
    runners = {
        "fp32 transformers (eager)": EagerRunner(str(model_dir)),
        OPTIMUM: OptimumRunner(str(pte.parent)),
        **{k: DiffulexRunner(str(args.dir / f)) for k, f in OURS.items()},
    }
    samples = {"paragraph": tokenizer(TEXT)["input_ids"]}
    samples.update({k: tokenizer(t)["input_ids"] for k, t in texts().items()})
    samples = {k: ids[: MAX_SEQ - 1] for k, ids in samples.items()}
    ppl = {label: {} for label in runners}
    for name, ids in samples.items():
        for label, runner in runners.items():
            ppl[label][name] = perplexity(runner, ids)
        print(name, len(ids), {k: round(v[name], 3) for k, v in ppl.items()}, flush=True)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(chat)["input_ids"]
    tokens, seconds = {}, {label: [] for label in runners}
    for _ in range(ROUNDS):
        for label, runner in runners.items():
            tokens[label], took = greedy(runner, prompt)
            seconds[label].append(took)
    reference = tokens["fp32 transformers (eager)"]
    rows = []
    for label in runners:
        answer = tokenizer.decode(tokens[label], skip_special_tokens=True)
        ratios = [ppl[label][k] / ppl["fp32 transformers (eager)"][k] for k in samples]
        rows.append(
            [
                label,
                round(sizes[label] / 2**20, 1) if label in sizes else "",
                *(f"{r:.3f}x" for r in ratios),
                round((NEW_TOKENS - 1) / statistics.median(seconds[label]), 1),
                tokens[label] == reference,
                "Paris" in answer,
            ]
        )
        print(rows[-1], repr(answer[:60]), flush=True)
    write_result(
        HERE / "results",
        package="diffulex-edge",
        name="optimum_int4",
        title="SmolLM2-135M-Instruct: diffulex-edge's int4 .pte beside optimum-executorch's "
        "int4 recipe",
        command=COMMAND,
        columns=[
            "program",
            ".pte MiB",
            *(f"{k} ppl x fp32" for k in samples),
            "decode tok/s",
            "tokens = fp32 transformers",
            "Paris",
        ],
        rows=rows,
        targets=[],
        notes=f"Perplexity: the first {MAX_SEQ - 1} tokens of each text (the paragraph has "
        f"{len(samples['paragraph'])}), one token per forward through each program, against "
        "eager fp32 transformers on the same tokens. Decode: the 31 tokens after the first of "
        f"{NEW_TOKENS} greedy after the chat question, one thread, the programs in turn, median "
        f"of {ROUNDS}. optimum-executorch 1.1.0 export: recipe xnnpack, custom SDPA and KV "
        f"cache, qlinear 8da4w (group 32), qembedding 8w; {export_s:.0f} s. diffulex-edge's "
        "programs: smollm2_quality.py --keep (static_kv, prefill 32).",
    )


if __name__ == "__main__":
    main()
