"""Issue #15's reproducers: each damaged or crafted input is refused with
ExpertCacheError naming the file and what was expected."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import mlx.core as mx
import pytest

from moe_expert_cache import ExpertCacheConfig, ExpertCacheError, load_cached_model, read_state
from moe_expert_cache.checked_json import dumps_checksummed
from moe_expert_cache.cli import main
from moe_expert_cache.expert_store import INTEGRITY_FILE, ExpertStore
from moe_expert_cache.safetensors_io import SafetensorsShard
from moe_expert_cache.simulator import synthetic_trace
from moe_expert_cache.slots import ExpertSlots
from moe_expert_cache.trace import RouterTrace

SHARD = "model-00002-of-00002.safetensors"


def foreign_copy(src, dst):
    """``src`` without its integrity record: a checkpoint as another tool writes it."""
    shutil.copytree(src, dst)
    (dst / INTEGRITY_FILE).unlink()
    return dst


def rewrite_header(path, change):
    """Apply ``change(header dict)`` to a safetensors file, keeping its data bytes."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + data[8 + n :])


def test_quantization_group_size_zero_is_refused_not_sigfpe(model_dir, tmp_path):
    path = foreign_copy(model_dir("mixtral", 4), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertCacheError, match=r"config\.json.*group_size and bits"):
        load_cached_model(path)
    config["quantization"] = {"group_size": 0, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertCacheError, match=r"config\.json: quantization group_size = 0"):
        load_cached_model(path)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"group_size": 64, "bits": 7}, r"\['model.layers.0.mlp.gate'\] bits = 7"),
        ({"group_size": 64}, r"\['model.layers.0.mlp.gate'\] = .*group_size, bits"),
        ({"group_size": 64, "bits": 8, "scale": 2}, r"\['model.layers.0.mlp.gate'\] = "),
        (8, r"\['model.layers.0.mlp.gate'\] = 8, expected a layer's"),
    ],
)
def test_bad_per_layer_quantization_is_refused(model_dir, tmp_path, entry, match):
    """Per-layer settings, as mlx_lm.convert writes them for a router, are checked like
    the default ones (the support matrix loads valid ones)."""
    path = foreign_copy(model_dir("qwen3_moe", 4), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["quantization"]["model.layers.0.mlp.gate"] = entry
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExpertCacheError, match=r"config\.json: quantization" + match):
        load_cached_model(path)


def _two_tensors(tmp_path):
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((4, 8)), "b": mx.ones((4, 8))})
    return path


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ({"a": [0, 128], "b": [64, 192]}, "overlaps"),  # overlapping tensors
        ({"a": [0, 128], "b": [120, 248]}, "overlaps"),  # shifted into its neighbour
        ({"a": [0, 128], "b": [132, 260]}, "starts at data offset 132, expected 128"),  # gap
        ({"a": [0, 128], "b": [-128, 0]}, "0 <= begin"),  # negative offset
        ({"a": [0, 128], "b": [0, 128]}, "overlaps"),  # two names, one byte range
    ],
)
def test_safetensors_offsets_are_checked_like_the_reference(tmp_path, offsets, match):
    path = _two_tensors(tmp_path)

    def change(header):
        for name, o in offsets.items():
            header[name]["data_offsets"] = o

    rewrite_header(path, change)
    with pytest.raises(ExpertCacheError, match=match):
        SafetensorsShard(path)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "F64", "dtype 'F64' is not one of"),
        ("dtype", "I16", "span 128 bytes, expected"),
        ("shape", [4, -8], "integers >= 0"),
        ("shape", [4, 8.0], "integers >= 0"),
        ("data_offsets", [0, True], r"\[begin, end\]"),
    ],
)
def test_safetensors_fields_are_checked(tmp_path, field, value, match):
    path = _two_tensors(tmp_path)
    rewrite_header(path, lambda h: h["a"].__setitem__(field, value))
    with pytest.raises(ExpertCacheError, match=match):
        SafetensorsShard(path)


def test_header_length_and_trailing_bytes(tmp_path):
    path = _two_tensors(tmp_path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    with pytest.raises(ExpertCacheError, match="header length"):
        SafetensorsShard(path)
    path.write_bytes(data + b"junk")
    with pytest.raises(ExpertCacheError, match="trailing bytes"):
        SafetensorsShard(path)


def test_flipped_weight_byte_refused_with_integrity_record(model_dir, tmp_path):
    """A package-written checkpoint carries CRC-32s: a flipped expert byte is refused when
    the expert is read. Without the record (a foreign checkpoint) it cannot be seen."""
    sealed = tmp_path / "sealed"
    shutil.copytree(model_dir("qwen3_moe"), sealed)
    store = ExpertStore(sealed)
    info = store.blocks["model.layers.1.mlp"]["down_proj"]["weight"]
    store.close()
    data = bytearray((sealed / info.shard.name).read_bytes())
    data[info.begin + 3 * info.row_bytes + 5] ^= 0x40  # expert 3
    (sealed / info.shard.name).write_bytes(bytes(data))
    store = ExpertStore(sealed)
    store.read_expert("model.layers.1.mlp", 2)
    with pytest.raises(ExpertCacheError, match=r"down_proj\.weight' row 3 fails its CRC-32"):
        store.read_expert("model.layers.1.mlp", 3)
    foreign = foreign_copy(sealed, tmp_path / "foreign")
    ExpertStore(foreign).read_expert("model.layers.1.mlp", 3)  # the documented limit


def test_header_change_refused_with_integrity_record(model_dir, tmp_path):
    sealed = tmp_path / "sealed"
    shutil.copytree(model_dir("qwen3_moe"), sealed)
    rewrite_header(sealed / SHARD, lambda h: h["__metadata__"].update(format="x"))
    with pytest.raises(ExpertCacheError, match="header SHA-256 differs"):
        ExpertStore(sealed)


def test_same_size_dtype_swap_in_foreign_shard_is_refused(model_dir, tmp_path):
    """F32 -> I32 keeps every size right; the model's parameter kinds give it away."""
    path = foreign_copy(model_dir("olmoe"), tmp_path / "m")
    for shard in path.glob("*.safetensors"):
        header_names = SafetensorsShard(shard).tensors
        if "model.norm.weight" in header_names:
            rewrite_header(shard, lambda h: h["model.norm.weight"].update(dtype="I32"))
    with pytest.raises(ExpertCacheError, match=r"model\.norm\.weight.*expected a float"):
        load_cached_model(path)


def test_transposed_expert_shape_in_foreign_shard_is_refused(model_dir, tmp_path):
    path = foreign_copy(model_dir("mixtral"), tmp_path / "m")
    name = "model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight"
    for shard in path.glob("*.safetensors"):
        if name in SafetensorsShard(shard).tensors:
            rewrite_header(shard, lambda h: h[name].update(shape=[8, 64, 128]))
    with pytest.raises(ExpertCacheError, match=r"up_proj\.weight.*expected .* shape"):
        load_cached_model(path)


def test_index_must_match_the_shards(model_dir, tmp_path):
    path = foreign_copy(model_dir("mixtral"), tmp_path / "m")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../etc/passwd"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ExpertCacheError, match="expected a file name"):
        ExpertStore(path)


def _forged_state(path, change):
    doc = json.loads(path.read_bytes())
    del doc["sha256"]
    change(doc["state"])
    path.write_bytes(dumps_checksummed(doc))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: s["resident"][0].__setitem__(1, s["resident"][0][0]), "repeats a resident"),
        (lambda s: s["pinned"].__setitem__(0, [s["resident"][0] and 7]), "must be resident"),
        (lambda s: s["resident"][1].__setitem__(0, 1.0), "integer expert ids"),
        (lambda s: s["resident"][1].__setitem__(0, 99), r"in \[0, 8\)"),
        (lambda s: s.__setitem__("top_k", 9), "top_k"),
    ],
)
def test_forged_state_is_refused(model_dir, tmp_path, change, match):
    """A state whose SHA-256 was recomputed after the edit still has to make sense."""
    cached = load_cached_model(model_dir("qwen2_moe"), ExpertCacheConfig(capacity=4))
    cached.manager.save_state(tmp_path / "state.json")
    state = read_state(tmp_path / "state.json")
    assert 7 not in state["resident"][0]  # so that pinning 7 pins a non-resident expert
    _forged_state(tmp_path / "state.json", change)
    with pytest.raises(ExpertCacheError, match=match):
        read_state(tmp_path / "state.json")


def test_state_header_is_under_the_checksum(model_dir, tmp_path):
    cached = load_cached_model(model_dir("qwen2_moe"), ExpertCacheConfig(capacity=4))
    cached.manager.save_state(tmp_path / "state.json")
    text = (tmp_path / "state.json").read_text().replace('"version": 2', '"version": 3')
    (tmp_path / "state.json").write_text(text)
    with pytest.raises(ExpertCacheError, match="checksum"):
        read_state(tmp_path / "state.json")


def test_state_for_another_model_is_refused(model_dir, tmp_path):
    from moe_expert_cache import config_from_state

    cached = load_cached_model(model_dir("qwen2_moe"), ExpertCacheConfig(capacity=4))
    cached.manager.save_state(tmp_path / "state.json")
    _forged_state(tmp_path / "state.json", lambda s: s.__setitem__("num_experts", [9, 9]))
    config = config_from_state(ExpertCacheConfig(), read_state(tmp_path / "state.json"))
    with pytest.raises(ExpertCacheError, match=r"saved state is for \[9, 9\] experts"):
        load_cached_model(model_dir("qwen2_moe"), config)


@pytest.mark.parametrize("ids", [[1, 1, 2, 3], [1.5, 2, 3, 4]])
def test_slots_refuse_repeated_or_float_ids(ids):
    with pytest.raises(ExpertCacheError, match="initial experts"):
        ExpertSlots(8, 4, 2, initial=ids)
    with pytest.raises(ExpertCacheError, match="pinned experts"):
        ExpertSlots(8, 6, 2, pinned=ids)


def _resealed_trace(data: bytes, header=None, cell=None) -> bytes:
    (n,) = struct.unpack("<I", data[8:12])
    head, rows = data[12 : 12 + n], bytearray(data[12 + n : -32])
    if header is not None:
        h = json.loads(head)
        h.update(header)
        head = json.dumps(h).encode()
    if cell is not None:
        rows[4 * cell[0] : 4 * cell[0] + 4] = struct.pack("<i", cell[1])
    body = data[:8] + struct.pack("<I", len(head)) + head + bytes(rows)
    return body + hashlib.sha256(body).digest()


def test_trace_header_is_under_the_checksum(tmp_path):
    synthetic_trace(2, 8, 2, 10).save(tmp_path / "t")
    data = (tmp_path / "t").read_bytes()
    (n,) = struct.unpack("<I", data[8:12])
    head = data[12 : 12 + n].replace(b'"num_experts": 8', b'"num_experts": 9')
    (tmp_path / "t").write_bytes(data[:12] + head + data[12 + n :])
    with pytest.raises(ExpertCacheError, match="checksum"):
        RouterTrace.load(tmp_path / "t")


@pytest.mark.parametrize("expert", [99, -1, 8])
def test_trace_rows_with_bad_expert_ids_are_refused(tmp_path, expert):
    synthetic_trace(2, 8, 2, 10).save(tmp_path / "t")
    data = (tmp_path / "t").read_bytes()
    (tmp_path / "t").write_bytes(_resealed_trace(data, cell=(2, expert)))  # row 0, expert 1
    with pytest.raises(ExpertCacheError, match=r"record 0 .* distinct experts in"):
        RouterTrace.load(tmp_path / "t")


@pytest.mark.parametrize(
    "header", [{"top_k": 2.0}, {"num_layers": 2**40}, {"records": -1}, {"version": 1}]
)
def test_trace_header_values_are_checked(tmp_path, header):
    synthetic_trace(2, 8, 2, 10).save(tmp_path / "t")
    data = (tmp_path / "t").read_bytes()
    (tmp_path / "t").write_bytes(_resealed_trace(data, header=header))
    with pytest.raises(ExpertCacheError, match="t: "):
        RouterTrace.load(tmp_path / "t")


def test_cli_refuses_token_ids_outside_the_vocabulary(model_dir, capsys):
    """--prompt-ids 1000000 used to segfault inside MLX's embedding lookup."""
    for ids in ("1000000", "-1", "256"):
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", "--model", str(model_dir("olmoe")), "--prompt-ids", ids])
        assert exit_info.value.code == 2
        assert "vocab_size=256" in capsys.readouterr().err
