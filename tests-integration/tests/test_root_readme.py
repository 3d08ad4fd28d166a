"""The root README's usage column runs as written (#19), each cell on the embedded model
(SmolLM2-135M from its GGUF's float copy) or, for moe-expert-cache, the MoE built from it.

zstd-linear's cell is run by that package's own tests/test_readme.py; diffulex-edge's
export is covered by tests/test_diffulex_pte.py at full size, so its cell runs here on the
shipped trained checkpoint (the same call, a smaller model).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def usage(package: str) -> str:
    (row,) = [line for line in README.read_text().splitlines() if line.startswith(f"| `{package}`")]
    # | `name` | bounds | `code`: prose | link |
    return re.findall(r"`([^`]+)`", row.split("|")[3])[0]


@pytest.fixture(scope="module")
def smollm2():
    from membound_testing import load_smollm2

    return load_smollm2()


def test_every_package_row_has_a_usage_cell():
    for package in ("paired-cache", "moe-expert-cache", "zstd-linear", "bmrt-kv", "diffulex-edge"):
        assert "(" in usage(package), package


def test_paired_cache_cell_runs_and_still_answers(smollm2):
    import paired_cache
    from membound_testing.models import chat_prompt

    model, tokenizer = smollm2
    code = usage("paired-cache")
    assert code.startswith("sparsify_model("), code
    namespace = {**vars(paired_cache), "model": model}
    exec(code, namespace)
    mlps = [m for m in model.modules() if isinstance(m, paired_cache.SparseMLP)]
    assert len(mlps) == model.config.num_hidden_layers
    ids = tokenizer(
        chat_prompt(tokenizer, "What is the capital of France?"),
        return_tensors="pt",
        add_special_tokens=False,
    ).input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_bmrt_kv_cell_runs_and_bounds_the_cache(smollm2):
    import bmrt_kv
    from membound_testing import passkey_prompt
    from membound_testing.models import load_smollm2

    model, tokenizer = load_smollm2()  # a fresh model: the other test sparsified its own
    code = usage("bmrt-kv")
    assert code.startswith("model.generate("), code
    prompt = passkey_prompt(tokenizer, 1500, key=48213, depth=0.5)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    namespace = {**vars(bmrt_kv), "model": model, "ids": ids}
    with torch.inference_mode():
        out = eval(code, namespace)
    assert tokenizer.decode(out[0, ids.shape[1] :]).strip().startswith("48213")
    assert not any(hasattr(m, "_forward_hooks") and m._forward_hooks for m in model.modules())


def test_moe_expert_cache_cell_loads_the_moe_and_bounds_its_experts():
    import moe_expert_cache
    from membound_integration.rows.moe_expert_cache import moe_checkpoint

    code = usage("moe-expert-cache")
    assert code.startswith("load_cached_model("), code
    cached = eval(code, {**vars(moe_expert_cache), "dir": moe_checkpoint()})
    try:
        manager = cached.manager
        assert manager.resident_expert_bytes() * 2 == manager.all_expert_bytes()
    finally:
        cached.store.close()


def test_diffulex_edge_cell_exports_a_program_that_runs(tmp_path, monkeypatch):
    import diffulex_edge

    # The sort model and its task live in diffulex-edge's benchmarks (not in the wheel).
    monkeypatch.syspath_prepend(str(ROOT / "packages" / "diffulex-edge" / "benchmarks"))
    from sort_task import SortTask, sort_prompts, trained_checkpoint

    code = usage("diffulex-edge")
    assert code.startswith("export_pte("), code
    model = diffulex_edge.load_checkpoint(trained_checkpoint())
    monkeypatch.chdir(tmp_path)
    namespace = {
        **vars(diffulex_edge),
        "model": model,
        "max_seq": 64,
        "block_size": 4,
        "variant": "block_kv",
    }
    eval(code, namespace)
    engine = diffulex_edge.PteEngine(tmp_path / "model.pte")
    task = SortTask()
    prompts = sort_prompts(6, seed=7)
    config = diffulex_edge.GenerationConfig(max_new_tokens=12)
    correct = [engine.generate(p, config).tokens == task.expected(p) for p in prompts]
    assert sum(correct) >= 5, correct


def test_stacking_section_runs_and_answers(tmp_path, monkeypatch, capsys):
    """The "Stacking the packages" block, on SmolLM2's float copy, in a fresh directory."""
    from membound_testing.models import smollm2_float_dir
    from membound_testing.readme import blocks
    from paired_cache import SparseMLP
    from zstd_linear import CompressedLinear

    text = README.read_text()
    start = text.index("## Stacking the packages")
    (block,) = [b for b in blocks(README, "python") if start < text.index(b.code) < start + 4000]
    monkeypatch.chdir(tmp_path)
    namespace = {"model_dir": str(smollm2_float_dir())}
    with torch.inference_mode():
        exec(compile(block.code, f"{README}:{block.line}", "exec"), namespace)
    model = namespace["model"]
    assert all(isinstance(layer.mlp, SparseMLP) for layer in model.model.layers)
    assert all(isinstance(layer.self_attn.o_proj, CompressedLinear) for layer in model.model.layers)
    assert isinstance(model.lm_head, CompressedLinear)
    kept = [layer.mlp.kept_rows for layer in model.model.layers]
    assert sum(kept) > 0 and kept[-1] == 0  # 128 MiB holds the first layers' rows only
    assert "Paris" in capsys.readouterr().out
