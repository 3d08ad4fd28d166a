"""The lazy expert store: non-expert weights are materialised, experts read one at a time.

A model directory may carry an integrity record, ``moe-expert-cache.integrity.json``
(written by :func:`seal_model`, which membound's developer helpers
``membound_testing.moefy`` and ``membound_testing.random_moe`` are given to seal what they
write): the SHA-256 of ``config.json``, of the index and of every shard's header, and a
CRC-32 of every non-expert tensor and of every expert row. When it is there, every header
is checked at open and every tensor or expert row when it is read, so a changed weight
byte is refused.
Without it (a checkpoint from elsewhere), only the structure can be checked.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np

from moe_expert_cache.checked_json import (
    dumps_checksummed,
    is_int,
    loads_checksummed,
    write_atomic,
)
from moe_expert_cache.errors import ExpertCacheError
from moe_expert_cache.safetensors_io import SafetensorsShard, TensorInfo, open_shards

# mlx-lm stores each MoE layer's experts stacked: <block>.<switch>.<proj>.<param>, (E, ...),
# where the switch module is ``switch_mlp`` (``experts`` in GPT-OSS).
_EXPERT_KEY = re.compile(
    r"^(?P<block>.+\.(?:mlp|block_sparse_moe))\.(?P<switch>switch_mlp|experts)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<param>weight|scales|biases|bias)$"
)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INTEGRITY_FILE = "moe-expert-cache.integrity.json"
# A new version refuses older records: bump membound_testing.moefy's BUILD_FORMAT with it,
# so that its cached builds are made again.
INTEGRITY_FORMAT, INTEGRITY_VERSION = "moe-expert-cache-integrity", 1
# Small files whose bytes the integrity record covers, when the directory has them.
_SEALED_FILES = ("config.json", "model.safetensors.index.json")


class ExpertStore:
    """Reads a model directory's shards; experts by byte range, everything else whole.

    ``blocks`` maps a MoE block's module path (``model.layers.3.mlp``) to
    ``{proj: {param: TensorInfo}}`` where each tensor is stacked ``(E, ...)``;
    ``switch_names[block]`` names the block's expert module (``switch_mlp`` or ``experts``).
    ``bytes_read[block]`` counts the expert bytes copied out of the shards.
    ``integrity``: the directory's verified integrity record, or ``None``.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._shards: dict[Path, SafetensorsShard] = {}
        self._infos: dict[str, TensorInfo] = {}
        shards = open_shards(self.model_dir)
        for shard in shards.values():
            self._shards[shard.path] = shard
            self._infos.update(shard.tensors)
        try:
            self.integrity = _read_integrity(self.model_dir, shards)
            self.blocks, self.switch_names = _expert_blocks(self._infos, self.model_dir)
        except BaseException:
            self.close()
            raise
        self.bytes_read: dict[str, int] = dict.fromkeys(self.blocks, 0)

    def _crc(self, info: TensorInfo):
        if self.integrity is None:
            return None
        return self.integrity["shards"][info.shard.name]["crc32"][info.name]

    def check_file(self, name: str, data: bytes) -> None:
        """Refuse ``data`` (the bytes of ``name``, e.g. ``config.json``) if the integrity
        record has a different SHA-256 for it."""
        want = (self.integrity or {}).get("files", {}).get(name)
        if want is not None and hashlib.sha256(data).hexdigest() != want:
            raise ExpertCacheError(
                f"{self.model_dir / name}: SHA-256 differs from {INTEGRITY_FILE} "
                "(the file was changed or damaged)"
            )

    def num_experts(self, block: str) -> int:
        return next(iter(self._block(block)["up_proj"].values())).shape[0]

    def expert_nbytes(self, block: str) -> int:
        """Bytes of one expert of ``block`` (all projections and their scales/biases)."""
        return sum(i.row_bytes for p in self._block(block).values() for i in p.values())

    def _block(self, block: str) -> dict[str, dict[str, TensorInfo]]:
        if block not in self.blocks:
            raise ExpertCacheError(
                f"{self.model_dir}: no MoE block {block!r}; the shards hold {sorted(self.blocks)}"
            )
        return self.blocks[block]

    def non_expert_weights(self, skip: tuple[str, ...] = ()) -> dict[str, mx.array]:
        """Every tensor that is not an expert tensor (nor named in ``skip``), read whole
        (materialised)."""
        return {
            name: self._shards[info.shard].read(info, crc32=self._crc(info))
            for name, info in self._infos.items()
            if not _EXPERT_KEY.match(name) and name not in skip
        }

    def tensor(self, name: str) -> tuple[TensorInfo, SafetensorsShard, int | None] | None:
        """``(info, shard, crc32 or None)`` of tensor ``name``, or ``None`` if no shard has it."""
        info = self._infos.get(name)
        return None if info is None else (info, self._shards[info.shard], self._crc(info))

    def read_expert(self, block: str, expert: int) -> dict[str, dict[str, mx.array]]:
        """Expert ``expert`` of ``block``: ``{proj: {param: array of shape info.shape[1:]}}``.

        Reads only that expert's byte range of each stacked tensor.
        """
        projs = self._block(block)
        num = self.num_experts(block)
        if not (is_int(expert) or isinstance(expert, np.integer)) or not 0 <= expert < num:
            raise ExpertCacheError(f"{block}: expert {expert!r} outside [0, {num})")
        out: dict[str, dict[str, mx.array]] = {}
        for proj, params in projs.items():
            out[proj] = {}
            for param, info in params.items():
                crc = self._crc(info)
                out[proj][param] = self._shards[info.shard].read(
                    info, row=int(expert), crc32=None if crc is None else crc[expert]
                )
                self.bytes_read[block] += info.row_bytes
        return out

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()


def _expert_blocks(infos: dict[str, TensorInfo], model_dir: Path):
    blocks: dict[str, dict[str, dict[str, TensorInfo]]] = defaultdict(lambda: defaultdict(dict))
    switch_names: dict[str, str] = {}
    for name, info in infos.items():
        m = _EXPERT_KEY.match(name)
        if m:
            if len(info.shape) < 2 or info.shape[0] < 1:
                raise ExpertCacheError(
                    f"{info.shard}: expert tensor {name!r} has shape {list(info.shape)}, "
                    "expected (num_experts >= 1, ...)"
                )
            if switch_names.setdefault(m["block"], m["switch"]) != m["switch"]:
                raise ExpertCacheError(
                    f"{model_dir}: {m['block']}: expert tensors under both "
                    f"{m['block']}.switch_mlp and {m['block']}.experts; expected one of them"
                )
            blocks[m["block"]][m["proj"]][m["param"]] = info
    out = {b: {p: dict(v) for p, v in projs.items()} for b, projs in blocks.items()}
    for block, projs in out.items():
        if set(projs) != set(PROJECTIONS):
            raise ExpertCacheError(
                f"{model_dir}: {block}: expert projections {sorted(projs)}, "
                f"expected {list(PROJECTIONS)}"
            )
        counts = {i.shape[0] for p in projs.values() for i in p.values()}
        if len(counts) != 1:
            raise ExpertCacheError(
                f"{model_dir}: {block}: expert tensors disagree on the expert count {counts}"
            )
        for param in ("weight", "scales", "biases", "bias"):
            dtypes = {p[param].dtype for p in projs.values() if param in p}
            if len(dtypes) > 1:
                raise ExpertCacheError(
                    f"{model_dir}: {block}: the projections' {param} tensors disagree on "
                    f"the dtype {sorted(dtypes)}"
                )
    return out, switch_names


def _crc_record(shard: SafetensorsShard) -> dict:
    """CRC-32 per tensor: one per row for expert tensors, one for the whole otherwise."""
    out = {}
    for name, info in shard.tensors.items():
        if _EXPERT_KEY.match(name) and info.shape and info.shape[0] > 0:
            rb = info.row_bytes
            out[name] = [
                zlib.crc32(shard._map[info.begin + e * rb : info.begin + (e + 1) * rb])
                for e in range(info.shape[0])
            ]
        else:
            out[name] = zlib.crc32(shard._map[info.begin : info.end])
    return out


def seal_model(model_dir: str | Path) -> Path:
    """Write ``model_dir``'s integrity record (see the module docstring).

    Reads every shard once; run it on a checkpoint you trust.

    Args:
        model_dir: An mlx-lm checkpoint directory.

    Returns:
        The record's path, ``model_dir / "moe-expert-cache.integrity.json"``.

    Raises:
        ExpertCacheError: A shard or index that cannot be read as safetensors.
    """
    model_dir = Path(model_dir)
    shards = open_shards(model_dir)
    try:
        doc = {
            "format": INTEGRITY_FORMAT,
            "version": INTEGRITY_VERSION,
            "files": {
                name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
                for name in _SEALED_FILES
                if (model_dir / name).is_file()
            },
            "shards": {
                name: {"header_sha256": s.header_sha256, "crc32": _crc_record(s)}
                for name, s in shards.items()
            },
        }
    finally:
        for shard in shards.values():
            shard.close()
    path = model_dir / INTEGRITY_FILE
    write_atomic(path, dumps_checksummed(doc))
    return path


def _read_integrity(model_dir: Path, shards: dict[str, SafetensorsShard]) -> dict | None:
    """The verified integrity record of ``model_dir``, or ``None`` when it has none."""
    path = model_dir / INTEGRITY_FILE
    if not path.is_file():
        return None
    doc = loads_checksummed(path.read_bytes(), str(path))
    if doc.get("format") != INTEGRITY_FORMAT or doc.get("version") != INTEGRITY_VERSION:
        raise ExpertCacheError(
            f"{path}: format {doc.get('format')!r} version {doc.get('version')!r}, "
            f"expected {INTEGRITY_FORMAT!r} version {INTEGRITY_VERSION}"
        )
    files, recorded = doc.get("files"), doc.get("shards")
    if not isinstance(files, dict) or not isinstance(recorded, dict):
        raise ExpertCacheError(f"{path}: expected 'files' and 'shards' objects")
    if sorted(recorded) != sorted(shards):
        raise ExpertCacheError(
            f"{path}: records shards {sorted(recorded)}, the directory has {sorted(shards)}"
        )
    for name in _SEALED_FILES:
        if (name in files) != (model_dir / name).is_file():
            raise ExpertCacheError(f"{path}: {name} is recorded or present, but not both")
    if "model.safetensors.index.json" in files:
        index = model_dir / "model.safetensors.index.json"
        if hashlib.sha256(index.read_bytes()).hexdigest() != files[index.name]:
            raise ExpertCacheError(f"{index}: SHA-256 differs from {INTEGRITY_FILE}")
    for name, shard in shards.items():
        rec = recorded[name]
        if not isinstance(rec, dict) or rec.get("header_sha256") != shard.header_sha256:
            raise ExpertCacheError(
                f"{shard.path}: header SHA-256 differs from {INTEGRITY_FILE} "
                "(the header was changed or damaged)"
            )
        crcs = rec.get("crc32")
        if not isinstance(crcs, dict) or sorted(crcs) != sorted(shard.tensors):
            raise ExpertCacheError(f"{path}: CRC-32 list of {name} does not match its tensors")
        for tensor, crc in crcs.items():
            info = shard.tensors[tensor]
            rowwise = _EXPERT_KEY.match(tensor) and info.shape and info.shape[0] > 0
            ok = (
                isinstance(crc, list) and len(crc) == info.shape[0] and all(map(is_int, crc))
                if rowwise
                else is_int(crc)
            )
            if not ok:
                raise ExpertCacheError(f"{path}: CRC-32 of {name}:{tensor} is malformed")
    return doc
