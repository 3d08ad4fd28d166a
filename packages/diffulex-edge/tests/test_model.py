"""The three forwards agree, and the attention obeys the properties it claims."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from random_sdar import random_model

from diffulex_edge.config import tiny_config
from diffulex_edge.kv_cache import DynamicKVCache, StaticCacheLayout
from diffulex_edge.masks import block_attention_mask, block_positions, cache_io_masks

BS, MAX = 4, 32


def _prefill_both(model, ids):
    """Commit ``ids`` block by block into a dynamic cache and a static one (forward_export)."""
    layout = StaticCacheLayout.for_model(model.config, MAX, BS)
    dyn = DynamicKVCache(model.config.num_hidden_layers)
    kv = layout.allocate()
    for start in range(0, ids.shape[1], BS):
        block = ids[:, start : start + BS]
        model(block, torch.arange(start, start + BS)[None], dyn, store_kv=True)
        m = cache_io_masks(layout, start, commit=True)
        _, kv = model.forward_export(
            block,
            block_positions(layout, start),
            kv,
            m.attention_mask,
            m.insert_matrix,
            m.keep_mask,
        )
    return layout, dyn, kv


@pytest.mark.parametrize("layers", [1, 3])
@torch.no_grad()
def test_forward_export_matches_forward(layers):
    model = random_model(tiny_config(num_hidden_layers=layers), seed=layers)
    ids = torch.randint(0, 60, (1, 12), generator=torch.Generator().manual_seed(1))
    layout, dyn, kv = _prefill_both(model, ids)
    for i in range(layers):
        torch.testing.assert_close(kv[i, 0, :, :, :12], dyn.layer(i)[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(kv[i, 1, :, :, :12], dyn.layer(i)[1], rtol=0, atol=1e-5)
    assert kv[:, :, :, :, 12:].abs().max() == 0
    block = torch.tensor([[5, 63, 63, 7]])
    ref = model(block, torch.arange(12, 16)[None], dyn)
    m = cache_io_masks(layout, 12, commit=False)
    got, kv_after = model.forward_export(
        block, block_positions(layout, 12), kv, m.attention_mask, m.insert_matrix, m.keep_mask
    )
    assert (got - ref).abs().max() <= 1e-5
    assert torch.equal(kv_after, kv)  # iteration mode: keep everything, insert nothing
    got_kv, _ = model.forward_block_kv(
        block, block_positions(layout, 12), kv, block_attention_mask(layout, 12)
    )
    assert (got_kv - ref).abs().max() <= 1e-5


@torch.no_grad()
def test_block_causal_prefill_equals_block_by_block(model):
    ids = torch.randint(0, 60, (1, 12), generator=torch.Generator().manual_seed(2))
    _, dyn, _ = _prefill_both(model, ids)
    one_shot = DynamicKVCache(model.config.num_hidden_layers)
    blocks = torch.arange(12) // BS
    model(ids, torch.arange(12)[None], one_shot, (blocks[None] <= blocks[:, None])[None], True)
    for i in range(model.config.num_hidden_layers):
        torch.testing.assert_close(one_shot.layer(i)[0], dyn.layer(i)[0], rtol=0, atol=1e-5)


@torch.no_grad()
def test_gqa_equals_full_attention_with_repeated_kv_heads():
    gqa = random_model(tiny_config(num_key_value_heads=2), seed=3)
    mha = random_model(tiny_config(num_key_value_heads=4), seed=4)
    state = dict(gqa.state_dict())
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = state[name].view(2, 8, -1)  # (KV, hd, hidden)
            state[name] = w.repeat_interleave(2, dim=0).reshape(32, -1)
    mha.load_state_dict(state)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    pos = torch.arange(8)[None]
    torch.testing.assert_close(mha(ids, pos), gqa(ids, pos), rtol=0, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(shift=st.integers(1, 150), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_rope_makes_attention_depend_on_relative_position_only(model, shift, seed):
    ids = torch.randint(0, 60, (1, 8), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(8)[None]
    torch.testing.assert_close(model(ids, pos + shift), model(ids, pos), rtol=0, atol=2e-4)


def test_mask_shapes_that_do_not_match_the_model_are_rejected(model):
    layout = StaticCacheLayout.for_model(model.config, MAX, BS)
    ids, pos, kv = (
        torch.zeros(1, BS, dtype=torch.long),
        block_positions(layout, 0),
        layout.allocate(),
    )
    m = cache_io_masks(layout, 0, commit=False)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.forward_export(ids, pos, kv, m.attention_mask[:1], m.insert_matrix, m.keep_mask)
    with pytest.raises(ValueError, match="insert_matrix has shape"):
        model.forward_export(ids, pos, kv, m.attention_mask, m.insert_matrix[..., :2], m.keep_mask)
    with pytest.raises(ValueError, match="kv_cache has shape"):
        model.forward_block_kv(ids, pos, kv[:1], block_attention_mask(layout, 0))
    wrong = StaticCacheLayout.for_model(model.config, 16, BS)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.forward_block_kv(ids, pos, kv, block_attention_mask(wrong, 0))
