"""Fuzz benchmark: thousands of seeded mutants of a .zlin file of real MiniLM layers,
each loaded by load_compressed in a fresh process (membound_testing.fuzz), classed as
clean / unclear / crash / hang / silent / benign.

python benchmarks/fuzz.py [--mutants 2000] [--seed 0]

The file holds four Linear layers of all-MiniLM-L6-v2's first encoder layer in every
dtype and layout (1.5 MB of weights, chunks of 256 KiB). Half the mutants are byte
mutations, half rewrite one header field (to an odd or a plausible value) with the
header's CRC recomputed. Also measured: what checking a decoded weight's CRC-32 costs
next to decoding it (load_compressed does both once per layer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import zlin_fuzz  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from membound_testing import fuzz, minilm_path  # noqa: E402
from membound_testing.results import write_result  # noqa: E402
from zstd_linear.codec import CodecConfig, encode_weight  # noqa: E402
from zstd_linear.decoder import Decoder  # noqa: E402

LOADER = "load_compressed (.zlin, 4 MiniLM layers)"


def minilm_layers() -> dict:
    t = load_file(str(minilm_path() / "model.safetensors"))
    p = "encoder.layer.0.attention."
    chunks = 256 << 10

    def get(name, dtype, bias=True):
        return t[f"{p}{name}.weight"].to(dtype), t[f"{p}{name}.bias"].to(dtype) if bias else None

    return {
        f"{p}self.query": (*get("self.query", torch.float32), CodecConfig(chunk_bytes=chunks)),
        f"{p}self.key": (
            *get("self.key", torch.bfloat16),
            CodecConfig(layout="exponent-mantissa", chunk_bytes=chunks),
        ),
        f"{p}self.value": (
            *get("self.value", torch.float16, bias=False),
            CodecConfig(layout="zstd", chunk_bytes=chunks),
        ),
        f"{p}output.dense": (*get("output.dense", torch.bfloat16), CodecConfig()),
    }


def checksum_cost(repeats: int = 21) -> list[dict]:
    """Median seconds to decode MiniLM's largest Linear (1 thread) and to CRC-32 the
    decoded bytes, interleaved."""
    weight = load_file(str(minilm_path() / "model.safetensors"))[
        "encoder.layer.0.intermediate.dense.weight"
    ]
    rows = []
    decoder = Decoder(threads=1)
    for dtype in (torch.float32, torch.bfloat16):
        encoded = encode_weight(weight.to(dtype))
        out = torch.empty(encoded.original_bytes, dtype=torch.uint8)
        decode, crc = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decoder.decode_into(encoded, out)
            t1 = time.perf_counter()
            zlib.crc32(out.numpy())
            t2 = time.perf_counter()
            decode.append(t1 - t0)
            crc.append(t2 - t1)
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": encoded.original_bytes,
                "decode_ms": statistics.median(decode) * 1e3,
                "crc_ms": statistics.median(crc) * 1e3,
            }
        )
    decoder.close()
    return rows


def run(mutants: int = 2000, seed: int = 0, save: bool = True) -> dict:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="zlin-fuzz-") as tmp:
        target = zlin_fuzz.write_target(Path(tmp) / "minilm", minilm_layers())
        size = (target.root / zlin_fuzz.ZLIN).stat().st_size
        t0 = time.perf_counter()
        report = fuzz.run([target], zlin_fuzz.CHECKER, zlin_fuzz.CLEAN_ERRORS, mutants, seed)
        seconds = time.perf_counter() - t0
    print(report.summary())
    counts = [report.counts[c] for c in fuzz.CLASSES]
    bad = {c: report.counts[c] for c in ("crash", "hang", "unclear", "silent")}
    costs = checksum_cost()
    cost_text = "; ".join(
        f"{r['dtype']} {r['bytes'] / 2**20:.2f} MiB: decode {r['decode_ms']:.2f} ms, "
        f"CRC-32 {r['crc_ms']:.2f} ms (+{100 * r['crc_ms'] / r['decode_ms']:.0f} %)"
        for r in costs
    )
    return write_result(
        HERE / "results",
        package="zstd-linear",
        name="fuzz",
        title=f"{mutants} seeded mutants of a .zlin file (seed {seed})",
        command=f"python benchmarks/fuzz.py --mutants {mutants} --seed {seed}",
        columns=["loader", "mutants", *fuzz.CLASSES],
        rows=[[LOADER, mutants, *counts]],
        targets=[
            {
                "target": f"{LOADER}: 0 crash, 0 hang, 0 unclear, 0 silent (the package "
                "wrote the file)",
                "measured": ", ".join(f"{v} {k}" for k, v in bad.items()),
                "met": not any(bad.values()),
            }
        ],
        notes=(
            f"The file: {size} bytes, 4 Linear layers of MiniLM-L6's first encoder layer "
            "(float32, bfloat16, float16; layouts exponent, exponent-mantissa, zstd; one with "
            "3 chunks; 3 with bias). About half the mutants are byte mutations (truncation, "
            "flips, zeroed ranges, junk, duplicated ranges), half rewrite one header field to "
            "an odd value (fuzz.mutate_json) or a plausible one (another layout or dtype, a "
            "moved name, frame, bias or checksum, a flipped raw flag, a shifted offset) with "
            "the header CRC recomputed. Each batch of 50 loads in a fresh process; "
            f"{seconds:.0f} s in all. Cost of the decoded-weight check (load_compressed "
            "decodes and checks every layer once, at load; a forward pass does not), "
            f"MiniLM intermediate.dense, 1 thread, medians of 21 interleaved runs: {cost_text}."
        ),
        save=save,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="print only (smoke run)")
    args = parser.parse_args()
    run(args.mutants, args.seed, save=not args.no_save)


if __name__ == "__main__":
    main()
