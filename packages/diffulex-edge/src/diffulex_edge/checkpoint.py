"""SDAR checkpoints in Hugging Face layout: ``config.json`` + ``model.safetensors``
(or shards listed in ``model.safetensors.index.json``), tensor names as in
``SDARForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``).

:func:`save_checkpoint` also writes ``diffulex_integrity.json``: the size and SHA-256 of
every file it wrote. :func:`load_checkpoint` verifies it when present, then validates the
config, every safetensors header, and that the tensors present are exactly the ones the
config implies (names, shapes, dtype) before it builds the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diffulex_edge.config import SDARConfig
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.files import umask_mode
from diffulex_edge.model import SDARModel
from diffulex_edge.safetensors_header import read_header

INTEGRITY_FILE = "diffulex_integrity.json"
INTEGRITY_FORMAT = "diffulex-edge-checkpoint-integrity"
INTEGRITY_VERSION = 1
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 2**20
# config.json's Hugging Face "torch_dtype" -> the safetensors dtype every weight must have.
FLOAT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_TOP_LEVEL = ("lm_head.",)


def _hf_name(name: str) -> str:
    return name if name.startswith(_TOP_LEVEL) else f"model.{name}"


def expected_shapes(config: SDARConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (Hugging Face layout) and shape that ``config`` implies, computed
    without building a model (a damaged config must not get to allocate anything).
    ``lm_head.weight`` is listed even when tied."""
    c, hd = config, config.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (c.num_attention_heads * hd, c.hidden_size),
                p + "self_attn.k_proj.weight": (c.num_key_value_heads * hd, c.hidden_size),
                p + "self_attn.v_proj.weight": (c.num_key_value_heads * hd, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, c.num_attention_heads * hd),
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
            }
        )
        if c.norm_layout != "post":
            shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        if c.norm_layout == "sandwich":
            shapes[p + "pre_feedforward_layernorm.weight"] = (c.hidden_size,)
        if c.norm_layout != "pre":
            shapes[p + "post_feedforward_layernorm.weight"] = (c.hidden_size,)
        if c.qk_norm:
            per_head = c.qk_norm_per_head
            shapes[p + "self_attn.q_norm.weight"] = (
                hd if per_head else c.num_attention_heads * hd,
            )
            shapes[p + "self_attn.k_norm.weight"] = (
                hd if per_head else c.num_key_value_heads * hd,
            )
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.num_attention_heads * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (c.num_key_value_heads * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (c.num_key_value_heads * hd,)
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _read_json(path: Path):
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise DiffulexEdgeError(
            f"{path} is {size} bytes; a JSON file here is at most {MAX_JSON_BYTES}"
        )
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:
        raise DiffulexEdgeError(f"{path} is not valid JSON: {err}") from err


def _plain_name(directory: Path, name, what: str) -> Path:
    """``directory / name`` for a bare file name (no separators, no '..'), which must exist."""
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
        raise DiffulexEdgeError(f"{what} names {name!r}, expected a file name inside {directory}")
    path = directory / name
    if not path.is_file():
        raise DiffulexEdgeError(f"{what} names {name!r}, which is not a file in {directory}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _verify_integrity(directory: Path) -> set[str] | None:
    """The names of the files the integrity record verified, or None if there is none."""
    record_path = directory / INTEGRITY_FILE
    if not record_path.exists():
        return None
    record = _read_json(record_path)
    if not isinstance(record, dict) or record.get("format") != INTEGRITY_FORMAT:
        raise DiffulexEdgeError(f"{record_path}: format must be {INTEGRITY_FORMAT!r}")
    if record.get("version") != INTEGRITY_VERSION or isinstance(record.get("version"), bool):
        raise DiffulexEdgeError(
            f"{record_path}: version {record.get('version')!r}, this loader reads "
            f"{INTEGRITY_VERSION}"
        )
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        raise DiffulexEdgeError(f"{record_path}: files must be a non-empty object")
    for name, entry in files.items():
        path = _plain_name(directory, name, str(record_path))
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry.get("bytes"), bool)
            and isinstance(entry.get("sha256"), str)
        ):
            raise DiffulexEdgeError(
                f"{record_path}: entry for {name} must have an int 'bytes' and a 'sha256' string"
            )
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DiffulexEdgeError(
                f"{path} is {size} bytes, its integrity record says {entry['bytes']}: "
                "the file was changed after it was written"
            )
        if _sha256(path) != entry["sha256"]:
            raise DiffulexEdgeError(
                f"{path} does not match the SHA-256 in {record_path}: the file was changed "
                "after it was written"
            )
    return set(files)


def _shard_names(directory: Path) -> tuple[list[str], dict[str, str] | None]:
    """The shard file names, and the index's tensor -> shard map (None without an index)."""
    index = directory / INDEX_FILE
    if not index.exists():
        if not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(f"{directory} has neither model.safetensors nor its index")
        return ["model.safetensors"], None
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DiffulexEdgeError(f"{index}: weight_map must be a non-empty object")
    for shard in set(weight_map.values()):
        _plain_name(directory, shard, f"{index} weight_map")
    return sorted(set(weight_map.values())), weight_map


def _checkpoint_dtype(config_path: Path, data: dict) -> str | None:
    name = data.get("torch_dtype")
    if name is None:
        return None
    if not isinstance(name, str) or name not in FLOAT_DTYPES:
        raise DiffulexEdgeError(
            f"{config_path}: torch_dtype is {name!r}, expected one of {sorted(FLOAT_DTYPES)}"
        )
    return FLOAT_DTYPES[name]


def load_checkpoint(directory: str | Path, dtype: torch.dtype = torch.float32) -> SDARModel:
    """Build an :class:`SDARModel` from a Hugging Face-layout directory.

    All of the checks below run before the model is built.

    Args:
        directory: ``config.json`` and ``model.safetensors`` (or its shards and
            ``model.safetensors.index.json``), as ``save_pretrained`` or
            :func:`save_checkpoint` write them.
        dtype: the floating dtype of the model's weights.

    Returns:
        :class:`SDARModel`: the model, in eval mode.

    Raises:
        FileNotFoundError: no ``config.json``, or neither ``model.safetensors`` nor its
            index.
        DiffulexEdgeError: (naming the file and what was expected) a file that does not
            match ``diffulex_integrity.json`` (when the directory has one), an invalid
            config, an invalid safetensors header, a missing, unexpected or misshapen
            tensor, a dtype other than config.json's ``torch_dtype`` (or, without one,
            tensors of mixed or non-float dtypes), with tied embeddings a saved
            ``lm_head.weight`` that differs from ``embed_tokens``, or a ``dtype`` that is
            not a floating torch dtype.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DiffulexEdgeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{directory} has no config.json")
    verified = _verify_integrity(directory)
    data = _read_json(config_path)
    try:
        config = SDARConfig.from_dict(data)
    except DiffulexEdgeError as err:
        raise DiffulexEdgeError(f"{config_path}: {err}") from err
    want_dtype = _checkpoint_dtype(config_path, data)
    shards, weight_map = _shard_names(directory)
    read = {"config.json", *shards} | ({INDEX_FILE} if weight_map is not None else set())
    if verified is not None and verified != read:
        raise DiffulexEdgeError(
            f"{directory / INTEGRITY_FILE} covers {sorted(verified)}, the checkpoint reads "
            f"{sorted(read)}"
        )
    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for name in shards:
        shard = directory / name
        for key, entry in read_header(shard).items():
            if key in found:
                raise DiffulexEdgeError(f"tensor {key!r} is in both {found[key][0]} and {shard}")
            if weight_map is not None and weight_map.get(key) != name:
                raise DiffulexEdgeError(
                    f"{shard} holds {key!r}, the index maps it to {weight_map.get(key)!r}"
                )
            found[key] = (shard, entry.dtype, entry.shape)
    if weight_map is not None and set(weight_map) != set(found):
        absent = sorted(set(weight_map) - set(found))[:5]
        raise DiffulexEdgeError(f"{directory / INDEX_FILE} lists tensors no shard holds: {absent}")
    _check_tensors(directory, config, want_dtype, found)
    return _build(config, found).to(dtype).eval()


def _check_tensors(directory: Path, config: SDARConfig, want_dtype, found) -> None:
    expected = expected_shapes(config)
    if config.tie_word_embeddings:
        # A tied pair may be saved once under either name (safetensors' save_model keeps
        # whichever it meets last; transformers' save_pretrained keeps embed_tokens).
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if (
                name not in found
                and len({"lm_head.weight", "model.embed_tokens.weight"} & set(found)) == 1
            ):
                expected.pop(name)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise DiffulexEdgeError(
            f"checkpoint {directory} does not match its config "
            f"({config.num_hidden_layers} layers) with qk_norm={config.qk_norm}, "
            f"qkv_bias={config.qkv_bias}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for key, shape in expected.items():
        if found[key][2] != shape:
            raise DiffulexEdgeError(
                f"{key} has shape {found[key][2]} in {found[key][0]}, config implies {shape}"
            )
    dtypes = {key: entry[1] for key, entry in found.items()}
    if want_dtype is None:
        first = (
            "model.embed_tokens.weight"
            if "model.embed_tokens.weight" in found
            else "lm_head.weight"
        )
        want_dtype = dtypes[first]
        if want_dtype not in _TORCH_DTYPES:
            raise DiffulexEdgeError(
                f"{first} in {found[first][0]} is "
                f"{want_dtype}, expected one of {sorted(_TORCH_DTYPES)}"
            )
    for key, got in dtypes.items():
        if got != want_dtype:
            raise DiffulexEdgeError(
                f"{key} in {found[key][0]} is {got}, the checkpoint's weights are {want_dtype}"
            )


def _build(config: SDARConfig, found) -> SDARModel:
    state = {}
    try:
        for key, (shard, _, _) in found.items():
            with safe_open(shard, framework="pt") as f:
                state[key] = f.get_tensor(key)
    except SafetensorError as err:
        raise DiffulexEdgeError(f"safetensors refused {shard}: {err}") from err
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in state:
        state["model.embed_tokens.weight"] = state.pop("lm_head.weight")
    if config.tie_word_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        if not torch.equal(head, state["model.embed_tokens.weight"]):
            raise DiffulexEdgeError(
                f"lm_head.weight in {found['lm_head.weight'][0]} differs from "
                "model.embed_tokens.weight, but config.json ties them"
            )
    model = SDARModel(config)
    params = dict(model.named_parameters())  # tied lm_head is listed once, as embed_tokens
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[_hf_name(name)])
    return model


def save_checkpoint(model: SDARModel, directory: str | Path) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``diffulex_integrity.json`` (size and
    SHA-256 of the other two), each to a temp name then renamed, the record last.

    Args:
        model: the model to save (a float model: float32, float16 or bfloat16 throughout).
        directory: created if missing; the three files in it are replaced.

    Raises:
        DiffulexEdgeError: parameters of mixed dtypes or of a dtype other than float32,
            float16 and bfloat16, before any file is written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {_hf_name(n): p.detach().contiguous().clone() for n, p in model.named_parameters()}
    names = {v: k for k, v in FLOAT_DTYPES.items()}
    st_dtypes = {
        next((s for s, t in _TORCH_DTYPES.items() if t == x.dtype), None) for x in tensors.values()
    }
    if len(st_dtypes) != 1 or None in st_dtypes:
        raise DiffulexEdgeError(
            f"save_checkpoint needs every parameter in one of float32, float16, bfloat16; "
            f"got {sorted({str(x.dtype) for x in tensors.values()})}"
        )
    _atomic(directory / "model.safetensors", lambda p: save_file(tensors, p, {"format": "pt"}))
    config = {**model.config.to_dict(), "torch_dtype": names[st_dtypes.pop()]}
    text = json.dumps(config, indent=2) + "\n"
    _atomic(directory / "config.json", lambda p: Path(p).write_text(text))
    write_integrity_record(directory, ["config.json", "model.safetensors"])


def write_integrity_record(directory: str | Path, names: list[str]) -> None:
    """Record the size and SHA-256 of ``names`` (files in ``directory``) in
    ``diffulex_integrity.json``; :func:`load_checkpoint` then verifies them."""
    directory = Path(directory)
    files = {}
    for name in names:
        path = _plain_name(directory, name, "write_integrity_record")
        files[name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    record = {"format": INTEGRITY_FORMAT, "version": INTEGRITY_VERSION, "files": files}
    text = json.dumps(record, indent=2) + "\n"
    _atomic(directory / INTEGRITY_FILE, lambda p: Path(p).write_text(text))


def _atomic(target: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
