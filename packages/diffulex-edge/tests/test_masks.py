"""The mask builder never exposes an empty cache slot or a padded block column.

Each test here targets one defect of the published original: its denoising mask opened
``[cache_len, cache_len + valid_len)`` (cache slots that held no data yet) and left padded
block columns visible.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.masks import block_attention_mask, block_positions, cache_io_masks

BS, MAX = 4, 32


def _layout(config, max_seq=MAX, bs=BS):
    return StaticCacheLayout.for_model(config, max_seq, bs)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(0, MAX // BS - 1), valid=st.integers(1, BS), commit=st.booleans())
def test_visible_columns_are_exactly_filled_slots_and_real_block_columns(
    config, blocks, valid, commit
):
    layout = _layout(config)
    cache_len = blocks * BS
    m = cache_io_masks(layout, cache_len, commit, valid)
    visible = m.attention_mask == 0
    assert torch.isinf(m.attention_mask[~visible]).all()
    expected = torch.zeros(MAX + BS, dtype=torch.bool)
    expected[:cache_len] = True
    expected[MAX : MAX + valid] = True
    assert torch.equal(visible, expected.expand_as(visible))
    inserted = m.insert_matrix[0, 0, 0]
    if commit:
        assert inserted.nonzero().tolist() == [[cache_len + i, i] for i in range(valid)]
        assert m.keep_mask[0, 0, 0, :, 0].tolist() == [
            0.0 if cache_len <= j < cache_len + valid else 1.0 for j in range(MAX)
        ]
    else:
        assert inserted.abs().sum() == 0 and bool((m.keep_mask == 1).all())


@torch.no_grad()
@pytest.mark.parametrize("commit", [False, True])
def test_garbage_in_empty_cache_slots_changes_nothing(model, config, commit):
    layout = _layout(config)
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(layout.shape, generator=gen)
    garbage = kv.clone()
    garbage[..., 8:, :] = 1e3 * torch.randn(garbage[..., 8:, :].shape, generator=gen)
    ids, pos = torch.tensor([[7, 63, 63, 63]]), block_positions(layout, 8)
    m = cache_io_masks(layout, 8, commit)
    a, kv_a = model.forward_export(ids, pos, kv, m.attention_mask, m.insert_matrix, m.keep_mask)
    b, kv_b = model.forward_export(
        ids, pos, garbage, m.attention_mask, m.insert_matrix, m.keep_mask
    )
    assert torch.equal(a, b)
    end = 12 if commit else 8  # iteration mode writes nothing, so only [:8] holds data
    assert torch.equal(kv_a[..., :end, :], kv_b[..., :end, :])


@torch.no_grad()
def test_padded_block_columns_are_invisible_and_never_committed(model, config):
    layout = _layout(config)
    kv = layout.allocate()
    pos = block_positions(layout, 0)
    m = cache_io_masks(layout, 0, commit=True, valid_len=2)
    real = torch.tensor([[5, 9, 1, 1]])
    other = torch.tensor([[5, 9, 40, 22]])  # different padding tokens
    a, kv_a = model.forward_export(real, pos, kv, m.attention_mask, m.insert_matrix, m.keep_mask)
    b, kv_b = model.forward_export(other, pos, kv, m.attention_mask, m.insert_matrix, m.keep_mask)
    torch.testing.assert_close(a[:, :2], b[:, :2], rtol=0, atol=1e-6)
    assert torch.equal(kv_a, kv_b)
    assert kv_a[..., 2:, :].abs().max() == 0
    # Same two tokens alone, as an unpadded prefix, give the same logits.
    alone = model(real[:, :2], pos[:, :2])
    torch.testing.assert_close(a[:, :2], alone, rtol=0, atol=1e-5)


def test_block_mask_is_shared_by_layers_and_matches_cache_io(config):
    layout = _layout(config)
    shared = block_attention_mask(layout, 12)
    per_layer = cache_io_masks(layout, 12, commit=False).attention_mask
    assert torch.equal(per_layer, shared.expand_as(per_layer))


@pytest.mark.parametrize(
    "cache_len, valid, word",
    [
        (-1, None, "cache_len"),
        (MAX - 2, None, "does not fit"),
        (0, 0, "valid_len"),
        (0, 5, "valid_len"),
    ],
)
def test_bad_mask_requests(config, cache_len, valid, word):
    with pytest.raises(ValueError, match=word):
        cache_io_masks(_layout(config), cache_len, True, valid)


def test_positions_follow_the_cache(config):
    assert block_positions(_layout(config), 8).tolist() == [[8, 9, 10, 11]]
