"""The sliding window on SmolLM2-135M from its pool file: bytes read from the pool per token
and resident active bytes, per window length and mask source, at 50% active rows.
Counts bytes, not time: the cache's own statistics (rows copied x pool row bytes)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from common import write_result
from texts import HELD_OUT

from paired_cache.model_io import convert, load_sparse
from paired_cache.pool_file import PoolFile

WINDOWS = (1, 2, 4, 8)
SOURCES = ("cats", "oracle")
FRACTION = 0.5


def main(quick: bool) -> None:
    from transformers import PreTrainedTokenizerFast

    from membound_testing import smollm2_float_dir

    torch.set_num_threads(1)
    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ids = tokenizer(HELD_OUT, return_tensors="pt").input_ids[:, : 16 if quick else 128]
    with tempfile.TemporaryDirectory() as tmp:
        pool_path = Path(tmp) / "smollm2.pcpool"
        convert(model_dir, pool_path, progress=False)
        mlp_bytes = PoolFile(pool_path).pool_bytes
        rows = []
        for source in SOURCES:
            for window in WINDOWS[:2] if quick else WINDOWS:
                model = load_sparse(
                    model_dir,
                    pool_path,
                    source,
                    FRACTION,
                    window=window,
                    rows="copy",
                    prefill="sparse",
                )
                mlps = [layer.mlp for layer in model.model.layers]
                with torch.no_grad():
                    model(ids)
                tokens = mlps[0].tokens
                read = sum(m.pool_bytes_read for m in mlps)
                resident = sum(m.cache.active_bytes for m in mlps)
                capacity = sum(m.cache.capacity * m.cache.active_row_bytes for m in mlps)
                rows.append(
                    [
                        source,
                        window,
                        round(read / tokens / 2**20, 2),
                        round(read / tokens / mlp_bytes, 3),
                        round(resident / 2**20, 1),
                        round(capacity / 2**20, 1),
                    ]
                )
                print(rows[-1], file=sys.stderr)
                del model, mlps
    half = [r for r in rows if r[0] == "cats"]
    write_result(
        "window",
        f"Sliding window, SmolLM2-135M float32 at {round(FRACTION * 100)}% active rows, "
        f"{ids.shape[1]} tokens of the held-out text, pool mapped from storage",
        [
            "mask source",
            "window (tokens)",
            "MiB read from the pool per token",
            "share of the MLP bytes per token",
            "resident active MiB (end)",
            "active buffers MiB (capacity)",
        ],
        rows,
        [
            {
                "target": "bytes read from the pool per token at 50% with the window below half "
                "the MLP bytes",
                "measured": ", ".join(f"w={r[1]}: {r[3]}" for r in half) + " (cats)",
                "met": all(r[3] < 0.5 for r in half if r[1] > 1),
            }
        ],
        f"The MLP bytes: {mlp_bytes / 2**20:.1f} MiB (30 pools). Bytes read count every row "
        "copied from the mapped pool into the active buffers (rows copied x the active row's "
        "bytes: up | down_T, 4,608 bytes, for cats, which computes the gate itself; gate | "
        "up | down_T, 6,912 bytes, for the others), the first token's fill included, divided "
        "by the tokens; the prompt runs token by token. cats reads the whole gate for its "
        "scores as well (not counted here: gate_proj read in place from the safetensors, 1/3 "
        "of the MLP bytes). Resident: the union of the last "
        "window tokens' masks; capacity: min(N, window x k) rows per layer.",
        save=not quick,
    )


if __name__ == "__main__":
    main("--quick" in sys.argv)
