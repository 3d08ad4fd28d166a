"""Codec benchmark: ratio and decode GB/s of plain zstd, the byte-plane layouts and zipnn.

Tensor sets: all-MiniLM-L6-v2's trained Linear weights (fp32, and cast to bf16 and
fp16) and SmolLM2-135M's Linear weights (fp32; they went through 4-bit GGUF
quantisation, so their ratio is not representative of trained weights). Methods are
measured interleaved (A B C A B C ...) and the medians reported, next to memcpy of
the same bytes (the physical limit of any decoder writing them).
"""

from __future__ import annotations

import statistics
import time

import torch

from zstd_linear import CodecConfig, Decoder, encode_weight

THREADS = (1, 2)


def minilm_weights() -> list[torch.Tensor]:
    from safetensors.torch import load_file

    from membound_testing import minilm_path

    tensors = load_file(str(minilm_path() / "model.safetensors"))
    return [t for k, t in sorted(tensors.items()) if t.dim() == 2 and "embeddings" not in k]


def smollm2_weights() -> list[torch.Tensor]:
    from membound_testing import load_smollm2

    model, _ = load_smollm2()
    return [
        m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]


class Ours:
    def __init__(self, layout: str):
        self.name = "zstd (plain)" if layout == "zstd" else f"zstd-linear {layout}"
        self.layout = layout

    def prepare(self, weights):
        self.encoded = [encode_weight(w, CodecConfig(layout=self.layout)) for w in weights]
        self.buffers = [torch.empty(e.original_bytes, dtype=torch.uint8) for e in self.encoded]
        return sum(e.compressed_bytes for e in self.encoded)

    def decode_all(self, threads: int) -> None:
        decoder = self.decoders[threads]
        for encoded, buf in zip(self.encoded, self.buffers, strict=True):
            decoder.decode_into(encoded, buf)

    def __enter__(self):
        self.decoders = {t: Decoder(t) for t in THREADS}
        return self

    def __exit__(self, *exc):
        for d in self.decoders.values():
            d.close()


class ZipNN:
    name = "zipnn"

    def prepare(self, weights):
        from zipnn import ZipNN as _ZipNN

        dtype = str(weights[0].dtype).removeprefix("torch.")
        self.codecs = {
            t: _ZipNN(input_format="torch", bytearray_dtype=dtype, threads=t) for t in THREADS
        }
        self.blobs = [self.codecs[1].compress(w.contiguous()) for w in weights]
        return sum(len(b) for b in self.blobs)

    def decode_all(self, threads: int) -> None:
        for blob in self.blobs:
            self.codecs[threads].decompress(blob)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Memcpy:
    name = "memcpy (limit)"

    def prepare(self, weights):
        self.src = [w.contiguous().view(-1).view(torch.uint8).clone() for w in weights]
        self.dst = [torch.empty_like(s) for s in self.src]
        return sum(s.numel() for s in self.src)

    def decode_all(self, threads: int) -> None:
        for s, d in zip(self.src, self.dst, strict=True):
            d.copy_(s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def zipnn_available() -> bool:
    try:
        import zipnn  # noqa: F401
    except ImportError:
        return False
    return True


def measure(weights, methods, repeats: int) -> list[dict]:
    original = sum(w.numel() * w.element_size() for w in weights)
    sizes = {m.name: m.prepare(weights) for m in methods}
    times = {(m.name, t): [] for m in methods for t in THREADS}
    for _ in range(repeats):
        for t in THREADS:
            for m in methods:  # interleaved
                start = time.perf_counter()
                m.decode_all(t)
                times[m.name, t].append(time.perf_counter() - start)
    out = []
    for m in methods:
        row = {"method": m.name, "ratio": original / sizes[m.name], "bytes": original}
        for t in THREADS:
            row[f"gbps_{t}"] = original / statistics.median(times[m.name, t]) / 1e9
        out.append(row)
    return out


def run(quick: bool = False) -> dict:
    repeats = 3 if quick else 7
    sets = [
        ("MiniLM-L6 fp32", minilm_weights, torch.float32),
        ("MiniLM-L6 bf16", minilm_weights, torch.bfloat16),
        ("MiniLM-L6 fp16", minilm_weights, torch.float16),
    ]
    if not quick:
        sets.append(("SmolLM2-135M fp32 (from Q4 GGUF)", smollm2_weights, torch.float32))
    have_zipnn = zipnn_available()
    rows, by_key = [], {}
    for label, loader, dtype in sets:
        weights = [w.to(dtype).contiguous() for w in loader()]
        methods = [Ours("zstd"), Ours("exponent"), Ours("exponent-mantissa")]
        methods += [ZipNN()] if have_zipnn else []
        methods.append(Memcpy())
        with methods[0], methods[1], methods[2]:
            results = measure(weights, methods, repeats)
        for r in results:
            by_key[label, r["method"]] = r
            rows.append(
                [
                    label,
                    r["method"],
                    round(r["ratio"], 4) if r["method"] != "memcpy (limit)" else "-",
                    round(r["gbps_1"], 2),
                    round(r["gbps_2"], 2),
                ]
            )
    targets = []
    bf = "MiniLM-L6 bf16"
    best = max(
        (by_key[bf, f"zstd-linear {lay}"] for lay in ("exponent", "exponent-mantissa")),
        key=lambda r: r["ratio"],
    )
    if have_zipnn:
        z = by_key[bf, "zipnn"]["ratio"]
        targets.append(
            {
                "target": "bf16 ratio on MiniLM weights >= the zipnn ratio on the same tensors",
                "measured": (
                    f"{best['method']} {best['ratio']:.4f}, default layout (exponent) "
                    f"{by_key[bf, 'zstd-linear exponent']['ratio']:.4f}, zipnn {z:.4f}, "
                    f"plain zstd {by_key[bf, 'zstd (plain)']['ratio']:.4f}"
                ),
                "met": best["ratio"] >= z,
            }
        )
    else:
        targets.append(
            {
                "target": "bf16 ratio on MiniLM weights >= the zipnn ratio on the same tensors",
                "measured": f"{best['method']} {best['ratio']:.4f}; zipnn not installed "
                "(install the bench extra)",
                "met": False,
            }
        )
    slowest = min(by_key[label, "zstd-linear exponent"]["gbps_2"] for label, _, _ in sets)
    targets.append(
        {
            "target": "decode >= 1 GB/s with 2 threads",
            "measured": "default layout (exponent), 2 threads: "
            + ", ".join(
                f"{label} {by_key[label, 'zstd-linear exponent']['gbps_2']:.2f} GB/s"
                for label, _, _ in sets
            ),
            "met": slowest >= 1.0,
        }
    )
    from common import write_result

    return write_result(
        "codec",
        "Codec: compression ratio and decode throughput (GB/s of decoded weights)",
        ["tensors", "method", "ratio", "decode GB/s, 1 thread", "decode GB/s, 2 threads"],
        rows,
        targets,
        "Median of interleaved runs decoding every Linear weight of the set into "
        "preallocated buffers (zipnn allocates its outputs). Compare rows of the same run. SmolLM2's weights come from a Q4_1 GGUF: their ratio is "
        "not representative of trained float weights.",
    )


if __name__ == "__main__":
    import sys

    run(quick="--quick" in sys.argv)
