"""Per-plane measurement behind the codec's defaults: the raw-frame threshold and the layout.

For every chunk and plane of every Linear weight of MiniLM (fp32, bf16) and SmolLM2 (fp32),
under the "exponent" and "exponent-mantissa" layouts, it records the plane's bytes, its
zstd frame's bytes and the frame's decode time (best of 3, one thread) next to the
plane's fast form: its bit-packing where some bits are constant (and that is smaller),
timed unpacking, else the raw plane, timed as a memcpy. From these it derives, per tensor
set, layout and threshold t (zstd is kept where it saves at least t of the plane over the
fast form, as the codec does): the compression ratio and the decode seconds of the frames.

Ratios and byte counts are deterministic; the times are for choosing the threshold and
are only comparable within one run. Writes results/planes.json.

    hatch run zstd-linear:bench planes
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from zstd_linear._core import unpack_bits
from zstd_linear.codec import CodecConfig, _compressor, bitpack
from zstd_linear.layout import LAYOUTS, SUPPORTED_DTYPES, dtype_name

sys.path.insert(0, str(Path(__file__).parent))
from codec import minilm_weights, smollm2_weights

THRESHOLDS = (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.10, 0.125, 0.15, 0.20, 0.30)
BANDS = (0.0, 0.05, 0.10, 0.15, 0.25, 0.5, 1.0)
LAYOUT_NAMES = ("exponent", "exponent-mantissa")


def _best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def frames_of(weights: list[torch.Tensor], layout: str, timed: bool) -> list[dict]:
    """One record per (chunk, plane): plane index, raw bytes, zstd bytes, the fast form's
    bytes and kind, zstd decode and fast-form seconds."""
    config = CodecConfig(layout=layout)
    compressor = _compressor(config, layout)
    reader = zstandard.ZstdDecompressor().stream_reader
    records = []
    for w in weights:
        name = dtype_name(w.dtype)
        int_dtype = SUPPORTED_DTYPES[name][1]
        values = w.contiguous().view(-1).view(torch.uint8).numpy().view(int_dtype)
        chunk_elems = config.chunk_bytes // int_dtype.itemsize
        for start in range(0, values.size, chunk_elems):
            planes = LAYOUTS[layout].split(values[start : start + chunk_elems], name)
            for p, plane in enumerate(planes):
                raw = plane.tobytes()
                packed = compressor.compress(raw)
                bits = bitpack(plane)
                bitpacked = bits is not None and len(bits) < len(raw)
                record = {
                    "plane": p,
                    "raw": len(raw),
                    "packed": len(packed),
                    "fast": len(bits) if bitpacked else len(raw),
                    "bitpack": bitpacked,
                }
                if timed:
                    out = np.empty(len(raw), np.uint8)
                    src = np.frombuffer(raw, np.uint8)
                    record["decode_s"] = _best_of(
                        lambda f=packed, o=out: reader(f).readinto(memoryview(o))
                    )
                    record["copy_s"] = _best_of(
                        (lambda b=bits, o=out: unpack_bits(b, o))
                        if bitpacked
                        else (lambda o=out, s=src: np.copyto(o, s))
                    )
                records.append(record)
    return records


def summarise(records: list[dict], original: int) -> list[dict]:
    rows = []
    for t in THRESHOLDS:
        stored = seconds = 0.0
        raw_frames = bitpacked = 0
        for r in records:
            saved = r["fast"] - r["packed"]
            if saved <= 0 or saved < t * r["raw"]:
                stored += r["fast"]
                seconds += r.get("copy_s", 0.0)
                bitpacked += r["bitpack"]
                raw_frames += not r["bitpack"]
            else:
                stored += r["packed"]
                seconds += r.get("decode_s", 0.0)
        rows.append(
            {
                "threshold": t,
                "ratio": original / stored,
                "raw_frames": raw_frames,
                "bitpacked_frames": bitpacked,
                "frames": len(records),
                "frame_seconds": seconds,
                "decoded_gbps": original / seconds / 1e9 if seconds else None,
            }
        )
    return rows


def cost_bands(records: list[dict]) -> list[dict]:
    """Frames zstd shrinks below their fast form, by saving (of the plane): how many, and
    the extra decode time (zstd minus the fast form) per byte they save, in ns (median
    of the band's frames)."""
    rows = []
    for lo, hi in itertools.pairwise(BANDS):
        costs = sorted(
            (r["decode_s"] - r["copy_s"]) / (r["fast"] - r["packed"]) * 1e9
            for r in records
            if r["packed"] < r["fast"]
            and lo < (r["fast"] - r["packed"]) / r["raw"] <= hi
            and "decode_s" in r
        )
        rows.append(
            {
                "saving": f"({lo}, {hi}]",
                "frames": len(costs),
                "ns_per_saved_byte": costs[len(costs) // 2] if costs else None,
            }
        )
    return rows


def main() -> None:
    from common import write_result

    from zstd_linear.codec import AUTO_LAYOUTS, DEFAULT_RAW_BELOW

    timed = "--no-time" not in sys.argv
    minilm = minilm_weights()
    sets = [
        ("MiniLM-L6 fp32", [w.float().contiguous() for w in minilm]),
        ("MiniLM-L6 bf16", [w.to(torch.bfloat16).contiguous() for w in minilm]),
        ("MiniLM-L6 fp16", [w.to(torch.float16).contiguous() for w in minilm]),
        ("SmolLM2-135M fp32", smollm2_weights()),
    ]
    shown = (0.0, DEFAULT_RAW_BELOW, 0.125, 0.15)
    rows, targets = [], []
    for label, weights in sets:
        original = sum(w.numel() * w.element_size() for w in weights)
        default_layout = AUTO_LAYOUTS[dtype_name(weights[0].dtype)]
        for layout in LAYOUT_NAMES:
            records = frames_of(weights, layout, timed)
            by_t = {row["threshold"]: row for row in summarise(records, original)}
            savings = sorted(
                (r["fast"] - r["packed"]) / r["raw"] for r in records if r["packed"] < r["fast"]
            )
            cheapest_band = next(
                (b for b in cost_bands(records) if b["frames"] and b["ns_per_saved_byte"]), None
            )
            gbps = [by_t[t]["decoded_gbps"] for t in (0.0, 0.15)]
            rows.append(
                [
                    label,
                    layout + (" (default)" if layout == default_layout else ""),
                    *(round(by_t[t]["ratio"], 4) for t in shown),
                    f"{by_t[DEFAULT_RAW_BELOW]['raw_frames']} / "
                    f"{by_t[DEFAULT_RAW_BELOW]['bitpacked_frames']} of {len(records)}",
                    f"{savings[0]:.4f}" if savings else "-",
                    f"{cheapest_band['ns_per_saved_byte']:.1f} ({cheapest_band['saving']})"
                    if cheapest_band
                    else "-",
                    " / ".join(f"{g:.2f}" if g else "-" for g in gbps),
                ]
            )
            if layout == default_layout:
                # Frames zstd shrinks by a few bytes below their bit-packing (SmolLM2)
                # cost thousands of ns per saved byte: the threshold gives those up.
                kept = by_t[DEFAULT_RAW_BELOW]["ratio"] >= by_t[0.0]["ratio"] * (1 - 1e-4)
                targets.append(
                    {
                        "target": f"{label}: raw_below={DEFAULT_RAW_BELOW} keeps the default "
                        "layout's ratio within 0.01% (zstd wherever it is smaller: 0)",
                        "measured": f"{by_t[DEFAULT_RAW_BELOW]['ratio']:.6f} vs "
                        f"{by_t[0.0]['ratio']:.6f}",
                        "met": kept,
                    }
                )
            print(rows[-1], flush=True)
    write_result(
        "planes",
        "Per-plane raw threshold and layout choice (ratio by raw_below)",
        [
            "tensors",
            "layout",
            *(f"ratio, raw_below {t}" for t in shown),
            f"raw / bit-packed frames at {DEFAULT_RAW_BELOW}",
            "smallest saving of a zstd frame over its fast form",
            "ns extra decode per saved byte, lowest band (saving)",
            "frame decode GB/s, raw_below 0 / 0.15 (1 thread)",
        ],
        rows,
        targets,
        f"Every chunk ({CodecConfig().chunk_bytes // 1024} KiB) and plane of every Linear "
        "weight; a frame is stored in its fast "
        "form (bit-packed where some bits are constant, else raw) when zstd saves less than "
        "raw_below of its plane over that form. Ratios and frame counts are exact; times are "
        "best of 3 per frame, one thread: zstd decode of the frame, or the C unpack of a "
        "bit-packed one, or memcpy of a raw one (no plane join), summed; they compare "
        "thresholds within one run only.",
    )


if __name__ == "__main__":
    main()
