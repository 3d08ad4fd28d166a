"""Strict JSON for files from disk, and the checksummed JSON files this package writes.

A checksummed file is JSON that starts with the fixed bytes ``{"sha256": "`` followed by
64 hex digits: the SHA-256 of the whole file with those 64 digits left out. The digest so
covers every other byte (format, version and body) and is verified before anything is
parsed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from moe_expert_cache.errors import ExpertCacheError

_PREFIX = b'{"sha256": "'
_DIGEST = slice(len(_PREFIX), len(_PREFIX) + 64)


def is_int(value) -> bool:
    """A JSON integer (``bool`` is a Python ``int`` but not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def loads_strict(raw: bytes, what: str):
    """``raw`` parsed as UTF-8 JSON; duplicate keys, NaN and Infinity are refused.

    ``what`` names the file (and part) in the error message."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExpertCacheError(f"{what}: not UTF-8 ({e.reason} at byte {e.start})") from None

    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise ExpertCacheError(f"{what}: duplicate JSON key {key!r}")
            out[key] = value
        return out

    def no_constant(name):
        raise ExpertCacheError(f"{what}: {name} is not a JSON number")

    try:
        return json.loads(text, object_pairs_hook=unique, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise ExpertCacheError(f"{what}: not valid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise ExpertCacheError(f"{what}: JSON nested too deeply") from None


def dumps_checksummed(doc: dict) -> bytes:
    """``doc`` (a non-empty dict without a ``sha256`` key) as a checksummed file."""
    body = json.dumps(doc, sort_keys=True).encode()
    rest = b'", ' + body[1:]
    return _PREFIX + hashlib.sha256(_PREFIX + rest).hexdigest().encode() + rest


def loads_checksummed(data: bytes, what: str) -> dict:
    """The dict of a checksummed file (without ``sha256``), its digest verified first."""
    if not data.startswith(_PREFIX) or len(data) < _DIGEST.stop + 4:
        raise ExpertCacheError(
            f"{what}: not a checksummed moe-expert-cache file (expected it to start with "
            f"{_PREFIX.decode()!r} and 64 hex digits)"
        )
    digest, rest = data[_DIGEST], data[_DIGEST.stop :]
    if hashlib.sha256(_PREFIX + rest).hexdigest().encode() != digest:
        raise ExpertCacheError(
            f"{what}: SHA-256 checksum mismatch (the file was changed or damaged)"
        )
    doc = loads_strict(data, what)
    if not isinstance(doc, dict):  # unreachable for a matching digest of our own output
        raise ExpertCacheError(f"{what}: expected a JSON object")
    doc.pop("sha256")
    return doc


def umask_mode(directory: bool = False) -> int:
    """The mode ``open`` / ``mkdir`` give a new file (0o666) or directory (0o777) under the
    process's umask (``tempfile`` makes them 0o600 / 0o700 instead)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary name and a rename, with the
    mode a plain ``open`` would give it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, umask_mode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
