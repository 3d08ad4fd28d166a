"""``ExpertCacheConfig(map_embeddings=True)``: the input embedding table stays in the shard's
memory map, the output stays the stock model's, and what cannot be mapped is refused."""

from __future__ import annotations

import gc
import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import decode_logits
from mlx.utils import tree_flatten

from membound_testing.random_moe import ARCHITECTURES, random_moe_config, write_random_moe
from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, load_cached_model, seal_model
from moe_expert_cache.cli import main
from moe_expert_cache.mapped_embedding import EMBEDDING_KEY, MappedEmbedding


def _embedding_param_names(model) -> list[str]:
    return [n for n, _ in tree_flatten(model.parameters()) if "embed_tokens" in n]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mapped_embedding_gives_stock_logits_and_is_never_materialised(
    model_dir, stock_run, arch, monkeypatch
):
    tokens, stock_logits, _ = stock_run(arch)
    path = model_dir(arch)
    reads = []
    from moe_expert_cache.safetensors_io import SafetensorsShard

    real_read = SafetensorsShard.read

    def spy(self, info, row=None, crc32=None):
        reads.append(info.name)
        return real_read(self, info, row, crc32)

    monkeypatch.setattr(SafetensorsShard, "read", spy)
    cached = load_cached_model(path, ExpertCacheConfig(capacity_share=0.5, map_embeddings=True))
    assert EMBEDDING_KEY not in reads  # the table is never copied out whole
    assert isinstance(cached.model.model.embed_tokens, MappedEmbedding)
    assert _embedding_param_names(cached.model) == []
    logits = decode_logits(cached.model, tokens, cached.manager)
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, stock_logits, strict=True)) == 0.0


def test_mlx_holds_the_table_less(model_dir):
    """MLX's own buffers (anonymous memory) shrink by the table's bytes."""
    path = model_dir("qwen2_moe")
    held = {}
    for mapped in (False, True):
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        cached = load_cached_model(
            path, ExpertCacheConfig(capacity_share=0.5, map_embeddings=mapped)
        )
        held[mapped] = mx.get_active_memory() - before
        del cached
    config = random_moe_config("qwen2_moe")
    table = config["vocab_size"] * config["hidden_size"] * 4
    assert held[False] - held[True] == table


def test_rows_are_the_stored_rows_in_their_dtype(tmp_path):
    config = random_moe_config("mixtral")
    path = write_random_moe(tmp_path / "bf16", config, dtype=mx.bfloat16, seal=seal_model)
    plain = load_cached_model(path, ExpertCacheConfig(capacity_share=1.0))
    mapped = load_cached_model(path, ExpertCacheConfig(capacity_share=1.0, map_embeddings=True))
    ids = mx.array([[0, 5, 255, 5]])
    want = plain.model.model.embed_tokens(ids)
    got = mapped.model.model.embed_tokens(ids)
    assert got.dtype == mx.bfloat16 and got.shape == (1, 4, config["hidden_size"])
    assert mx.array_equal(got, want).item()


def test_ids_outside_the_table_are_refused(model_dir):
    cached = load_cached_model(model_dir("mixtral"), ExpertCacheConfig(map_embeddings=True))
    embed = cached.model.model.embed_tokens
    with pytest.raises(ExpertCacheError, match=r"outside the embedding table \[0, 256\)"):
        embed(mx.array([[1, 256]]))
    with pytest.raises(ExpertCacheError, match="outside the embedding table"):
        embed(mx.array([[-1]]))
    with pytest.raises(ExpertCacheError, match="must be integers"):
        embed(mx.array([[1.0]]))


def test_a_quantized_table_is_refused_before_anything_is_read(model_dir):
    with pytest.raises(ExpertCacheError, match="quantized embedding tables are not mapped"):
        load_cached_model(model_dir("mixtral", 4), ExpertCacheConfig(map_embeddings=True))


def test_a_tied_embedding_is_refused(tmp_path):
    config = {**random_moe_config("mixtral"), "tie_word_embeddings": True}
    path = write_random_moe(tmp_path / "tied", config, seal=seal_model)
    with pytest.raises(ExpertCacheError, match="needs an untied lm_head"):
        load_cached_model(path, ExpertCacheConfig(map_embeddings=True))
    # Without the option the tied model loads as before.
    assert load_cached_model(path, ExpertCacheConfig()).model.model.embed_tokens.weight.shape == (
        256,
        64,
    )


def test_a_damaged_table_fails_its_crc(tmp_path):
    path = write_random_moe(
        tmp_path / "damaged", random_moe_config("qwen2_moe"), shards=1, seal=seal_model
    )
    shard = next(path.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8 : 8 + header_len])[EMBEDDING_KEY]["data_offsets"][0]
    data[8 + header_len + begin + 100] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ExpertCacheError, match=f"{EMBEDDING_KEY}.*CRC-32"):
        load_cached_model(path, ExpertCacheConfig(map_embeddings=True))


def test_map_embeddings_must_be_a_bool():
    with pytest.raises(ExpertCacheError, match="map_embeddings must be True or False"):
        ExpertCacheConfig(map_embeddings="yes")


def test_cli_map_embeddings(model_dir, capsys):
    args = ["generate", "--model", str(model_dir("olmoe")), "--prompt-ids", "1,2,3"]
    assert main([*args, "--max-tokens", "6"]) == 0
    plain = capsys.readouterr().out.split("tokens:")[1].splitlines()[0]
    assert main([*args, "--max-tokens", "6", "--map-embeddings"]) == 0
    assert capsys.readouterr().out.split("tokens:")[1].splitlines()[0] == plain
