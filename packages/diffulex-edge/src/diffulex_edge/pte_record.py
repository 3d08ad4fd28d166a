"""The integrity record of an exported ``.pte``: ``model.pte.json`` next to ``model.pte``.

:func:`diffulex_edge.export.export_pte` writes it; :class:`diffulex_edge.runtime.PteEngine`
reads the program into memory once, checks its size and SHA-256 against the record, and
hands ExecuTorch exactly those verified bytes. The record also carries the config the
program was exported from and the constants the program reports (cache geometry, token
ids), and its own SHA-256 over the canonical JSON of everything else, so an edited record
is refused before any byte reaches ExecuTorch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from diffulex_edge.config import SDARConfig
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.files import umask_mode
from diffulex_edge.program_meta import META_KEYS, QUANTIZATIONS, VARIANT_IDS, program_metadata

RECORD_FORMAT = "diffulex-edge-pte-record"
RECORD_VERSION = 2
MAX_RECORD_BYTES = 2**20
_HEX = set("0123456789abcdef")


@dataclass(frozen=True)
class PteRecord:
    """What a verified record says: the program's size and digest, how it was exported,
    the model config, and the constants the program must report."""

    pte_bytes: int
    pte_sha256: str
    variant: str
    quantize: str | None
    config: SDARConfig
    metadata: dict[str, int]


def record_path(pte_path: str | Path) -> Path:
    pte_path = Path(pte_path)
    return pte_path.with_name(pte_path.name + ".json")


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_record(
    pte_path: Path,
    program: bytes,
    variant: str,
    quantize,
    config,
    block_size,
    max_seq,
    prefill_size: int = 0,
) -> Path:
    """Write ``<pte_path>.json`` (temp name + rename) describing ``program``."""
    body = {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "pte_bytes": len(program),
        "pte_sha256": hashlib.sha256(program).hexdigest(),
        "variant": variant,
        "quantize": quantize,
        "config": config.to_dict(),
        "metadata": program_metadata(config, block_size, max_seq, variant, prefill_size),
    }
    record = {**body, "record_sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    target = record_path(pte_path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, umask_mode())  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_sha256(value) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def read_record(pte_path: Path) -> PteRecord:
    """The validated record of ``pte_path``; any problem is a :class:`DiffulexEdgeError`."""
    path = record_path(pte_path)
    if not path.is_file():
        raise DiffulexEdgeError(
            f"{pte_path} has no integrity record ({path.name}, written by export_pte): it "
            "cannot be verified. Re-export it, or pass allow_unverified=True to load an "
            "unverified program (a damaged one can crash the process inside ExecuTorch)"
        )
    size = path.stat().st_size
    if size > MAX_RECORD_BYTES:
        raise DiffulexEdgeError(f"{path} is {size} bytes; a record is at most {MAX_RECORD_BYTES}")
    try:
        record = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:
        raise DiffulexEdgeError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise DiffulexEdgeError(f"{path}: format must be {RECORD_FORMAT!r}")
    if not _is_int(record.get("version")) or record["version"] != RECORD_VERSION:
        raise DiffulexEdgeError(
            f"{path}: version {record.get('version')!r}, this engine reads {RECORD_VERSION}"
        )
    body = {k: v for k, v in record.items() if k != "record_sha256"}
    try:
        digest = hashlib.sha256(_canonical(body)).hexdigest()
    except ValueError:  # NaN or inf: export_pte never writes them
        digest = None
    if digest != record.get("record_sha256"):
        raise DiffulexEdgeError(
            f"{path}: the record does not match its own record_sha256: it was edited or damaged"
        )
    return _validate(path, body)


def _validate(path: Path, body: dict) -> PteRecord:
    """Field checks on a record whose own checksum matched (so only a deliberately rebuilt
    record gets here with bad fields)."""
    expected = {"format", "version", "pte_bytes", "pte_sha256", "variant", "quantize"}
    expected |= {"config", "metadata"}
    if set(body) != expected:
        raise DiffulexEdgeError(f"{path}: fields {sorted(body)}, expected {sorted(expected)}")
    if not _is_int(body["pte_bytes"]) or body["pte_bytes"] < 8:
        raise DiffulexEdgeError(f"{path}: pte_bytes must be an int >= 8, got {body['pte_bytes']!r}")
    if not _is_sha256(body["pte_sha256"]):
        raise DiffulexEdgeError(f"{path}: pte_sha256 must be 64 lowercase hex digits")
    variant, quantize = body["variant"], body["quantize"]
    if not isinstance(variant, str) or variant not in VARIANT_IDS:
        raise DiffulexEdgeError(
            f"{path}: variant {variant!r}, expected one of {sorted(VARIANT_IDS)}"
        )
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise DiffulexEdgeError(f"{path}: quantize {quantize!r}, expected null or {QUANTIZATIONS}")
    try:
        config = SDARConfig.from_dict(body["config"])
    except DiffulexEdgeError as err:
        raise DiffulexEdgeError(f"{path}: config: {err}") from err
    meta = body["metadata"]
    if not (isinstance(meta, dict) and set(meta) == set(META_KEYS)):
        raise DiffulexEdgeError(f"{path}: metadata must have exactly the keys {list(META_KEYS)}")
    if not all(_is_int(v) for v in meta.values()):
        raise DiffulexEdgeError(f"{path}: metadata values must be ints")
    if not all(_is_int(meta[k]) and meta[k] >= 1 for k in ("block_size", "max_seq")):
        raise DiffulexEdgeError(f"{path}: metadata block_size and max_seq must be ints >= 1")
    want = program_metadata(
        config, meta["block_size"], meta["max_seq"], variant, meta["prefill_size"]
    )
    diffs = {k: (meta[k], want[k]) for k in META_KEYS if meta[k] != want[k]}
    if diffs:
        raise DiffulexEdgeError(
            f"{path}: metadata disagrees with the record's own config (record vs config: {diffs})"
        )
    return PteRecord(body["pte_bytes"], body["pte_sha256"], variant, quantize, config, meta)


def file_identity(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns): what changes when a file is replaced or rewritten."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def verify_program_file(pte_path: Path) -> tuple[PteRecord, tuple[int, int, int, int]]:
    """Check that ``pte_path``'s size and SHA-256 match its record, reading the file in
    1 MiB pieces (page cache only: nothing the size of the program stays in memory).
    Returns the record and the file's identity at the check (:func:`file_identity`), which
    the caller compares again once ExecuTorch has mapped the file."""
    record = read_record(pte_path)
    identity = file_identity(pte_path)
    if identity[2] != record.pte_bytes:
        raise DiffulexEdgeError(
            f"{pte_path} is {identity[2]} bytes, its record {record_path(pte_path).name} says "
            f"{record.pte_bytes}: the program was changed after export"
        )
    digest, size = hashlib.sha256(), 0
    with open(pte_path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    if size != record.pte_bytes or digest.hexdigest() != record.pte_sha256:
        raise DiffulexEdgeError(
            f"{pte_path} does not match the SHA-256 in {record_path(pte_path).name}: the "
            "program was changed after export"
        )
    return record, identity
