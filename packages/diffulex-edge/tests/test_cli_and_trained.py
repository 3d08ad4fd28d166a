"""The CLI end to end, and the bundled trained model's task accuracy (eager and 8da4w)."""

import copy

import pytest
import torch

from diffulex_edge.backends import EagerDynamic, EagerStaticKV
from diffulex_edge.checkpoint import load_checkpoint
from diffulex_edge.cli import main, trained_checkpoint
from diffulex_edge.export import quantize_8da4w
from diffulex_edge.generate import GenerationConfig, generate
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.task import SortTask, encode, run_sort_task, sort_prompts


@pytest.fixture(scope="module")
def trained():
    return load_checkpoint(trained_checkpoint())


def test_bundled_checkpoint_is_small():
    size = sum(p.stat().st_size for p in trained_checkpoint().iterdir())
    assert size <= 5 * 2**20


@pytest.mark.parametrize(
    "remasking", ["sequential", "low_confidence_static", "low_confidence_dynamic"]
)
def test_trained_model_sorts(trained, remasking):
    c = trained.config
    run = run_sort_task(
        EagerDynamic(trained, 4),
        sort_prompts(8, seed=99),
        GenerationConfig(max_new_tokens=12, remasking=remasking),
        c.mask_token_id,
        c.eos_token_id,
    )
    assert run.exact_match >= 0.9
    if remasking == "low_confidence_dynamic":
        assert run.tokens_per_forward >= 2


def test_trained_model_sorts_through_the_static_kv_graph(trained):
    """Block diffusion through ExecuTorch's LLM ops (eager): bidirectional within the block,
    denoising forwards that write scratch slots, commits that only advance."""
    c = trained.config
    layout = StaticCacheLayout.for_model(c, 64, 4)
    run = run_sort_task(
        EagerStaticKV(trained, layout),
        sort_prompts(8, seed=99),
        GenerationConfig(max_new_tokens=12, remasking="low_confidence_dynamic"),
        c.mask_token_id,
        c.eos_token_id,
    )
    assert run.exact_match >= 0.9 and run.tokens_per_forward >= 2


def test_8da4w_keeps_the_task(trained):
    c = trained.config
    quantized = quantize_8da4w(copy.deepcopy(trained))
    ids, pos = torch.tensor([encode("31415926")]), torch.arange(9)[None]
    with torch.no_grad():
        drift = (quantized(ids, pos) - trained(ids, pos)).abs().max()
    assert 0 < drift < 1.0  # int4 weights changed the numbers, not the answers
    run = run_sort_task(
        EagerDynamic(quantized, 4),
        sort_prompts(6, seed=7),
        GenerationConfig(max_new_tokens=12),
        c.mask_token_id,
        c.eos_token_id,
    )
    assert run.exact_match >= 0.9


def test_cli_generate_eager_and_pte(capsys, pte_paths):
    assert main(["generate", "--prompt", "97531864"]) == 0
    assert capsys.readouterr().out.strip() == "13456789"
    assert main(["generate", "--tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "5"]) == 0
    eager = capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                "--pte",
                str(pte_paths["block_kv"]),
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "5",
                "--remasking",
                "sequential",
            ]
        )
        == 0
    )
    pte = capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                "--tiny",
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "5",
                "--remasking",
                "sequential",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == pte
    assert eager.startswith("[")


def test_cli_reports_bad_input(capsys, tmp_path):
    assert main(["generate", "--prompt", "12", "--max-new-tokens", "100"]) == 2
    assert "max_seq 64" in capsys.readouterr().err
    assert main(["generate", "--pte", str(tmp_path / "none.pte"), "--prompt", "1"]) == 2
    assert "no .pte" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--tiny"])  # -o is required
    out = tmp_path / "tiny.pte"
    args = ["export", "--tiny", "-o", str(out), "--variant", "cache_io", "--prefill-size", "16"]
    assert main(args) == 2  # an explicit prefill is refused, not silently dropped
    assert "prefill_size needs variant 'block_kv'" in capsys.readouterr().err
    assert not out.exists()


def test_encode_rejects_non_digits():
    with pytest.raises(ValueError, match="digits"):
        encode("12a")


def test_task_layout():
    task = SortTask()
    seq = task.sample(3, torch.Generator().manual_seed(0))
    assert seq.shape == (3, 20)
    for s in seq.tolist():
        assert s[9:17] == sorted(s[:8]) and s[17:] == [11, 11, 11]
    prompt = encode("31415926")
    r = generate(
        EagerDynamic(load_checkpoint(trained_checkpoint()), 4),
        prompt,
        GenerationConfig(max_new_tokens=12),
        12,
        11,
    )
    assert r.tokens == task.expected(prompt)
