"""Real ExecuTorch programs: numerics against eager, and the engine's input checks."""

import pytest
import torch

from diffulex_edge.backends import EagerDynamic
from diffulex_edge.config import tiny_config
from diffulex_edge.generate import GenerationConfig, generate
from diffulex_edge.runtime import PteEngine

from .test_generate import Lockstep

BS = 4


@pytest.mark.parametrize("variant", ["cache_io", "block_kv"])
def test_pte_matches_eager_over_a_32_token_greedy_generation(model, config, pte_paths, variant):
    engine = PteEngine(pte_paths[variant], expected_config=config)
    assert engine.variant == variant
    lock = Lockstep(EagerDynamic(model, BS), engine.backend)
    cfg = GenerationConfig(max_new_tokens=32, remasking="low_confidence_static", stop_on_eos=False)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    through_lock = generate(lock, prompt, cfg, config.mask_token_id, config.eos_token_id)
    assert max(lock.diffs) <= 1e-4
    eager = generate(EagerDynamic(model, BS), prompt, cfg, config.mask_token_id, None)
    pte = engine.generate(prompt, cfg)
    assert len(eager.tokens) == 32
    assert pte.tokens == eager.tokens == through_lock.tokens


def test_engine_rejects_a_pte_exported_for_another_config(pte_paths):
    other = tiny_config(rope_theta=500.0)
    with pytest.raises(ValueError, match="exported for another model config"):
        PteEngine(pte_paths["block_kv"], expected_config=other)
    with pytest.raises(ValueError, match=r"exported for another model config.*num_layers"):
        PteEngine(pte_paths["block_kv"], expected_config=tiny_config(num_hidden_layers=3))


def test_engine_rejects_prompts_past_its_cache(config, pte_paths):
    engine = PteEngine(pte_paths["block_kv"])
    with pytest.raises(ValueError, match="more than max_seq 64"):
        engine.generate(list(range(70)), GenerationConfig(max_new_tokens=4))
    assert engine.backend.cache_len == 0


def test_engine_rejects_files_that_are_not_diffulex_programs(tmp_path):
    with pytest.raises(FileNotFoundError):
        PteEngine(tmp_path / "missing.pte")


def test_pte_cache_matches_eager_after_commits(model, pte_paths):
    engine = PteEngine(pte_paths["cache_io"])
    eager = EagerDynamic(model, BS)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    engine.backend.reset(), eager.reset()
    engine.backend.prefill(ids), eager.prefill(ids)
    for i in range(model.config.num_hidden_layers):
        torch.testing.assert_close(
            engine.backend.kv_cache[i, 0, ..., :8, :], eager.cache.layer(i)[0], rtol=0, atol=1e-4
        )
