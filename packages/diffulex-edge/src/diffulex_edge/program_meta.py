"""What a .pte program says about itself, shared by the exporter (export.py) and the
record beside the program (pte_record.py): the format version, the quantizations, the
variants' ids and the constant methods (META_KEYS) a program carries."""

from __future__ import annotations

import hashlib
import json

PTE_FORMAT_VERSION = 2
QUANTIZATIONS = ("8da4w", "8da4w-mixed")
# The graph each variant name exports (export.EXPORT_VARIANTS), by the id its program reports.
VARIANT_IDS = {"cache_io": 0, "block_kv": 1, "static_kv": 2}


def config_digest(config) -> int:
    """A 31-bit digest of the model config (so a .pte cannot be paired with another model)."""
    text = json.dumps(config.to_dict(), sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1


META_KEYS = (
    "diffulex_format_version",
    "variant_id",
    "num_layers",
    "kv_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "max_seq",
    "mask_token_id",
    "eos_token_id",
    "config_digest",
    "prefill_size",
)


def program_metadata(
    config, block_size: int, max_seq: int, variant: str, prefill_size: int = 0
) -> dict[str, int]:
    """The constant methods a program exported from ``config`` carries (keys: META_KEYS).
    ``prefill_size`` 0 means the program has no prefill method."""
    c = config
    return {
        "diffulex_format_version": PTE_FORMAT_VERSION,
        "variant_id": VARIANT_IDS[variant],
        "num_layers": c.num_hidden_layers,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "block_size": block_size,
        "max_seq": max_seq,
        "mask_token_id": -1 if c.mask_token_id is None else c.mask_token_id,
        "eos_token_id": -1 if c.eos_token_id is None else c.eos_token_id,
        "config_digest": config_digest(c),
        "prefill_size": prefill_size,
    }
