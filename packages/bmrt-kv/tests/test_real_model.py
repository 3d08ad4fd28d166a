"""The embedded SmolLM2-135M-Instruct through the bounded cache, the stream and the CLI."""

import torch
from evaluation import passkey_sample, run_sample
from transformers import DynamicCache

from bmrt_kv import BMRTCache, BMRTConfig
from bmrt_kv.cli import main


def test_large_budget_equals_the_full_cache(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The grass is green. " * 12, return_tensors="pt").input_ids
    # The reference reads the same 16-token chunks into a full DynamicCache: the same
    # matmul shapes, so any difference is the cache's. (Against one whole-prompt forward
    # the logits differ by ~5e-5 on an Intel Xeon from GEMM blocking alone.)
    with torch.no_grad():
        full = DynamicCache(config=model.config)
        reference = torch.cat(
            [model(input_ids=c, past_key_values=full).logits for c in ids.split(16, -1)], 1
        )
        cache = BMRTCache(model, budget=ids.shape[-1], protection_divisor=4, block_size=16)
        got = torch.cat(
            [model(input_ids=c, past_key_values=cache).logits for c in ids.split(16, -1)], 1
        )
    assert torch.equal(got, reference), (got - reference).abs().max()


def test_bounded_cache_retrieves_a_pass_key(smollm2):
    model, tokenizer = smollm2
    sample = passkey_sample(tokenizer, 1000, key=27611, depth=0.3)
    config = BMRTConfig(budget=256, block_size=256, selector="snapkv", scoring="query_aware")
    result = run_sample(model, tokenizer, sample, config)
    assert result["correct"], result["output"]
    # 256 tokens of 30 layers x 3 KV heads x 64 dims x (K + V) x float32, plus one block.
    assert result["peak_kv_bytes"] == (256 + 256) * 30 * 3 * 64 * 2 * 4


def test_cli_run_answers_from_a_file(tmp_path, capsys):
    from membound_testing import smollm2_float_dir

    text = tmp_path / "notes.txt"
    text.write_text("Note: the meeting with Anna is on Tuesday at the harbour office.")
    code = main(
        [
            "run",
            str(text),
            "--model",
            str(smollm2_float_dir()),
            "--question",
            "On which day is the meeting with Anna?",
            "--budget",
            "64",
            "--divisor",
            "4",
            "--block-size",
            "32",
            "--max-new-tokens",
            "12",
        ]
    )
    assert code == 0
    assert "Tuesday" in capsys.readouterr().out


def test_cli_rejects_a_bad_config(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "x.txt"), "--model", "m", "--question", "q", "--divisor", "2"])
    assert exit_info.value.code == 2
    assert "protection_divisor" in capsys.readouterr().err


def test_cli_rejects_bad_query_aware_options(tmp_path, capsys):
    import pytest

    base = ["run", str(tmp_path / "x.txt"), "--model", "m", "--question", "q"]
    for extra, name in (
        (["--question-weight", "0"], "question_weight"),
        (["--kernel", "4"], "kernel"),
        (["--selector", "lsh", "--kernel", "3"], "--kernel"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(base + extra)
        assert exit_info.value.code == 2
        assert name in capsys.readouterr().err
