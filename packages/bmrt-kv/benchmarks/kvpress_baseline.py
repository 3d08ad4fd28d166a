"""kvpress's presses on the same samples as bmrt-kv, at the same kept size per layer.

Runs in its own environment (kvpress needs transformers < 5.3):
``hatch run kvpress:python packages/bmrt-kv/benchmarks/kvpress_baseline.py``.

This follows kvpress's own pipeline: the whole context is prefilled in one forward with
the press hooked in after each attention layer (each layer's cache is compressed right
after its attention, so the full-length cache of a layer and the full activations exist
during prefill: the peak is not bounded the way bmrt-kv's is), then the question is fed
with position ids continuing the original ones and the answer decoded greedily without
compression. ``compression_ratio`` is set so that every layer keeps exactly B tokens, as
bmrt-kv's budget does.

**One prefill serves every press and budget.** A press compresses a layer's cache after
that layer's attention has run, so it changes nothing the prefill computes afterwards: the
hidden states every layer sees are the same whatever the press. So this script hooks every
(press, budget) pair into one prefill (each pair calls kvpress's own ``press.compress`` on
the layer's full keys and values, exactly what ``BasePress.forward_hook`` does) and keeps
each pair's compressed cache, then decodes each one. The uncompressed cache left by that
prefill is the full-cache ceiling. Before the samples, ``--check-tokens`` (on by default)
runs every pair through kvpress's own ``with press(model):`` on a short sample and stops
the run unless every layer's kept keys and values are bitwise equal to the shared path's.

Two modes (``--modes``): ``agnostic`` compresses the context alone and feeds the question
after it, uncompressed; ``query_aware`` compresses the context with the question appended
(kvpress's ``compress_questions``: the press sees the question) except the question's last
token, which is then fed through the compressed cache to give the first answer token.

That last token is what kvpress's pipeline always feeds after compression: it prefills
through ``model.model`` (no logits at all) and gets the first answer token from a forward
of ``question + question_suffix + answer_prefix`` over the compressed cache, at least one
token even when the question sits in the context. Until bmrt-kv 0.7.4 this script decoded
query-aware answers from the prefill's own last logits instead, i.e. the first answer
token saw the whole uncompressed context, which no kvpress user gets (it decided the
answer's format, e.g. ``: insect.`` against ``"insect"``, on the single-word task).
``--tasks`` runs the RULER-style suite (``ruler_suite.py``) instead of the pass key, and
writes ``results/<name>.json`` with a task column.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import resource
import sys
import time

import torch
from common import earlier_result, write_result
from evaluation import passkey_samples
from ruler_suite import TASKS, suite_samples

PRESSES = ["streaming_llm", "snapkv", "tova", "expected_attention", "keydiff"]
COLUMNS = ["tokens", "task", "method", "B", "scoring", "correct", "kept tokens/layer"]


def make_press(name: str, ratio: float):
    from kvpress import (
        ExpectedAttentionPress,
        KeyDiffPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    classes = {
        "keydiff": KeyDiffPress,
        "streaming_llm": StreamingLLMPress,
        "snapkv": SnapKVPress,
        "tova": TOVAPress,
        "expected_attention": ExpectedAttentionPress,
    }
    return classes[name](compression_ratio=ratio)


def ratio_for(budget: int, n_tokens: int) -> float:
    """The compression ratio at which kvpress keeps ``budget`` of ``n_tokens`` per layer
    (its ``compute_n_kept`` truncates ``n * (1 - ratio)``; the half token absorbs float
    error)."""
    return max(0.0, 1.0 - (budget + 0.5) / n_tokens)


@torch.inference_mode()
def shared_prefill(model, ids: torch.Tensor, presses: dict) -> tuple:
    """One prefill of ``ids`` with every press of ``presses`` ({key: press}) compressing a
    copy of each layer's cache. Returns (last logits, the full DynamicCache, {key: [(keys,
    values) per layer]})."""
    from kvpress.presses.base_press import is_prefilling
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    kept: dict = {key: [] for key in presses}

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden.shape[1]):
            return output
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for key, press in presses.items():
            kept[key].append(press.compress(module, hidden, keys, values, output[1], kwargs))
        return output

    for press in presses.values():
        press.post_init_from_model(model)
    handles = []
    try:
        for module in (layer.self_attn for layer in model.model.layers):
            module.rotary_emb = model.model.rotary_emb  # as BasePress.__call__ does
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        cache = DynamicCache()
        logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, cache, kept


def cache_from(layers):
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (keys, values) in enumerate(layers):
        cache.update(keys, values, i)
    return cache


@torch.inference_mode()
def answer(model, tokenizer, cache, n_positions: int, question, max_new_tokens: int):
    """Feed ``question`` (ids) at positions from ``n_positions`` on, then decode greedily;
    returns the text."""
    positions = torch.arange(n_positions, n_positions + question.shape[1]).unsqueeze(0)
    logits = model(
        input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1
    ).logits
    position = n_positions + question.shape[1]
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        new.append(token)
        if token == tokenizer.eos_token_id:
            break
        logits = model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            position_ids=torch.tensor([[position]]),
            logits_to_keep=1,
        ).logits
        position += 1
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def run_sample(model, tokenizer, sample, presses: list[str], budgets: list[int], mode: str):
    """Every press at every budget, and the full cache, on one sample in one mode; returns
    {(method, budget): (correct, kept tokens per layer, answer text)}."""
    if mode == "query_aware":
        # The press sees the question; its last token comes after compression, as the
        # question suffix does in kvpress's pipeline (see the module docstring).
        ids = tokenizer(sample.context + sample.question, return_tensors="pt").input_ids
        ids, question = ids[:, :-1], ids[:, -1:]
    else:
        ids = tokenizer(sample.context, return_tensors="pt").input_ids
        question = tokenizer(sample.question, return_tensors="pt", add_special_tokens=False)
        question = question.input_ids
    n = ids.shape[1]
    pairs = {
        (name, budget): make_press(name, ratio_for(budget, n))
        for name in presses
        for budget in budgets
    }
    _, full, kept = shared_prefill(model, ids, pairs)
    out = {}
    for (name, budget), layers in kept.items():
        # Each pair feeds the question (agnostic) or its last token (query-aware) through
        # its own compressed cache before decoding.
        text = answer(model, tokenizer, cache_from(layers), n, question, sample.max_new_tokens)
        out[(f"kvpress {name}", budget)] = (sample.correct(text), layers[0][0].shape[2], text)
    text = answer(model, tokenizer, full, n, question, sample.max_new_tokens)
    out[("full", "-")] = (sample.correct(text), n, text)
    return out


@torch.inference_mode()
def check_shared(model, tokenizer, n_tokens: int, presses: list[str], budgets: list[int]):
    """Every (press, budget) through kvpress's own ``with press(model):`` on one sample of
    ``n_tokens``, against the shared prefill: every layer's kept keys and values must be
    bitwise equal. Raises SystemExit naming the first pair that differs."""
    from transformers import DynamicCache

    sample = passkey_samples(tokenizer, n_tokens, 1, seed=12345)[0]
    ids = tokenizer(sample.context, return_tensors="pt").input_ids
    n = ids.shape[1]
    budgets = [b for b in budgets if b < n]
    if not budgets:
        raise SystemExit(f"--check-tokens {n_tokens} is not above any budget {budgets}")
    pairs = {(p, b): make_press(p, ratio_for(b, n)) for p in presses for b in budgets}
    _, _, kept = shared_prefill(model, ids, pairs)
    for (name, budget), layers in kept.items():
        cache = DynamicCache()
        with make_press(name, ratio_for(budget, n))(model):
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        for i, (keys, values) in enumerate(layers):
            own = cache.layers[i]
            if keys.shape[2] != budget:
                raise SystemExit(f"{name} at B={budget} kept {keys.shape[2]} tokens")
            if not (torch.equal(own.keys, keys) and torch.equal(own.values, values)):
                raise SystemExit(
                    f"shared prefill differs from kvpress's own pipeline: {name} at "
                    f"B={budget}, layer {i}"
                )
    return len(kept), n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[7500])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--presses", nargs="+", default=PRESSES, choices=PRESSES)
    parser.add_argument(
        "--modes", nargs="+", default=["agnostic"], choices=["agnostic", "query_aware"]
    )
    parser.add_argument(
        "--tasks", nargs="+", default=None, choices=TASKS, help="suite tasks (default: pass key)"
    )
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=1500,
        help="length of the sample checked against kvpress's own pipeline (0: no check)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--name", default=None, help="results/<name>.json")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add rows to results/<name>.json (e.g. the tasks a cut-off run did not reach)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = args.name or ("kvpress_suite" if args.tasks else "kvpress_baseline")

    from membound_testing import load_smollm2

    model, tokenizer = load_smollm2()
    load_start = os.getloadavg()[0]
    checked = "no check against kvpress's own pipeline (--check-tokens 0)"
    if args.check_tokens:
        pairs, n = check_shared(model, tokenizer, args.check_tokens, args.presses, args.budgets)
        checked = (
            f"checked first: all {pairs} (press, budget) pairs below {n} tokens gave, through "
            "kvpress's own `with press(model):`, keys and values bitwise equal to the shared "
            "prefill's, in every layer"
        )
        print(checked, flush=True)
    earlier = earlier_result(name, args.append)
    rows = earlier["rows"] if earlier else []
    for n_tokens in args.lengths:
        if args.tasks:
            by_task = suite_samples(tokenizer, n_tokens, args.samples, args.seed, args.tasks)
        else:
            by_task = {"passkey": passkey_samples(tokenizer, n_tokens, args.samples, args.seed)}
        for task, samples in by_task.items():
            for mode in args.modes:
                start = time.perf_counter()
                results = [
                    run_sample(model, tokenizer, s, args.presses, args.budgets, mode)
                    for s in samples
                ]
                seconds = (time.perf_counter() - start) / len(samples)
                for key in results[0]:
                    method, budget = key
                    kept = sorted({r[key][1] for r in results})
                    rows.append(
                        [
                            n_tokens,
                            task,
                            method,
                            budget,
                            mode,
                            f"{sum(r[key][0] for r in results)}/{len(results)}",
                            str(kept[0]) if len(kept) == 1 else f"{kept[0]}-{kept[-1]}",
                        ]
                    )
                    print(rows[-1], repr(results[0][key][2][:60]), flush=True)
                print(f"{task} {mode}: {seconds:.1f} s/sample for all pairs", flush=True)
                _write(args, argv, name, rows, load_start, checked, earlier)


def _write(args, argv, name, rows, load_start, checked, earlier=None) -> None:
    """Rewrite the JSON after every task and mode, so a cut-off run keeps what it measured."""
    import transformers

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_result(
        name,
        "kvpress presses on the same samples as bmrt-kv (same kept tokens per layer)",
        COLUMNS,
        rows,
        [],
        command=(earlier["command"] + " ; then " if earlier else "")
        + "hatch run kvpress:python packages/bmrt-kv/benchmarks/kvpress_baseline.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        notes=(earlier["notes"] + " THEN (--append) " if earlier else "")
        + f"kvpress {importlib.metadata.version('kvpress')} with transformers "
        f"{transformers.__version__}; samples as bmrt-kv's "
        + ("suite.py" if args.tasks else "passkey.py")
        + f" (seed {args.seed}, {args.samples} per task and length); modes {args.modes}. "
        "One prefill per sample and mode serves every press and budget (see the script's "
        f"docstring); {checked}. 'full' is the uncompressed cache of the same prefill. The "
        "whole context is prefilled at once (kvpress's pipeline), so peak memory is the "
        f"full cache plus the full activations; peak RSS of the run {rss / 2**20:.0f} MiB. "
        f"1-minute load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the last row (2 cores).",
    )


if __name__ == "__main__":
    main()
