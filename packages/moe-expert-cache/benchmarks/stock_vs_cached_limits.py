"""Stock mlx-lm against the expert cache under hard memory limits, on the real MoE: the
MoEfied SmolLM2-135M with a shared expert (Qwen2-MoE, shared 256 + 16 experts x 80,
top-6; ``MoefyConfig(shared_size=256, top_k=6)``, the demo's MoE row).

Each variant answers the demo's chat question ("What is the capital of France?") with 24
greedy tokens, as a fresh process (``--child``): stock ``mlx_lm.load`` of the whole
checkpoint, and ``load_cached_model`` in exact mode at 50% and 37.5% of the routed experts
resident (6 of 16, the fewest top-6 routing allows; 25% would be 4). Both run the
package's greedy loop (``generate``; without a manager it is a plain greedy loop over the
stock model), so the two time the same work. A run passes when it completes with stock's
own greedy tokens, the ones the first unlimited stock run gives.

Per variant, under membound's budget runner (a cgroup with swap off, the page cache
dropped before every run): unlimited runs in interleaved rounds (tokens/s side by side),
the smallest hard limit at which it still passes (bisected), and one run under each fixed
profile (hard limit + 200 MB/s reads: the budget runner's tight profile sized to this
model, the tight profile itself, and the cached 50% model's measured minimum limit):
completed or killed, decode tokens/s, peak anonymous and file-backed memory apart.

    hatch run python packages/moe-expert-cache/benchmarks/stock_vs_cached_limits.py

Every variant also runs with the embedding table left in the mmap'd shard
(``ExpertCacheConfig(map_embeddings=True)``).

Needs root (cgroups). Runs in the default environment, which holds the budget runner and
this package. The children run, by default, in a fresh venv that holds what an MLX user
installs, this package and mlx-lm (with the default environment's mlx, mlx-lm and
transformers versions) and no torch: in membound's environments ``import mlx_lm`` imports
transformers, which imports torch because it is installed, and torch's 127 MiB of
anonymous memory would count against every limit. ``--runtime dev`` runs the children in
the default environment's interpreter instead.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

QUESTION = "What is the capital of France?"  # the demo's question (membound_integration.row)
NEW_TOKENS = 24  # as the demo's MoE row
STOCK = "stock mlx-lm (mlx_lm.load, every expert resident)"
MAPPED = ", embedding mapped"
VARIANTS = {  # row -> child argument: "stock", or the cached model's capacity (+ "m": mapped)
    STOCK: "stock",
    "cached, exact, 50% of experts resident": "0.5",
    # 6 of 16: the smallest capacity top-6 routing allows (25% would be 4 experts).
    "cached, exact, 37.5% of experts resident": "0.375",
    f"cached, exact, 50% of experts resident{MAPPED}": "0.5m",
    f"cached, exact, 37.5% of experts resident{MAPPED}": "0.375m",
}
MiB, MB = 2**20, 10**6
# The budget runner's tight profile is 480 MiB with 200 MB/s reads for the plain SmolLM2
# (its float32 checkpoint). Sized to this model, it keeps the same ratio of limit to the
# checkpoint that loading reads, and the same bandwidth.
TIGHT_MIB, TIGHT_READ_BPS = 480, 200 * MB
PROFILE_TIMEOUT = 300.0  # s, as the budget runner's profile runs
# Every run's counters and answer, kept after each run, in a folder tools/bench.py does not
# render; the table is written from it.
RAW = HERE / "results" / "raw" / "stock_vs_cached_limits.json"
COMMAND = "hatch run python packages/moe-expert-cache/benchmarks/stock_vs_cached_limits.py"


def moe_checkpoint() -> Path:
    """The demo's MoE checkpoint (built on first use: minutes on 2 cores)."""
    from smollm2_moe import smollm2_moe

    from membound_testing.moefy import MoefyConfig

    return smollm2_moe(MoefyConfig(shared_size=256, top_k=6))


def child(kind: str, model_dir: Path) -> None:
    """Load one variant, answer the question, print one JSON line."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.utils import load_tokenizer

    # The budget runner's read counter (membound_testing, which every dev env installs).
    from membound_testing.budget.runner import storage_read_bytes
    from moe_expert_cache import ExpertCacheConfig, generate, load_cached_model

    # Both variants import the same modules first: what the runtime holds before any weight.
    import_anon = _rss_anon()
    start = time.perf_counter()
    if kind == "stock":
        model, tokenizer = mlx_lm.load(str(model_dir))
        manager = None
    else:
        config = ExpertCacheConfig(
            capacity_share=float(kind.removesuffix("m")),
            mode="exact",
            map_embeddings=kind.endswith("m"),
        )
        cached = load_cached_model(model_dir, config)
        model, manager = cached.model, cached.manager
        tokenizer = load_tokenizer(model_dir)
    load_s = time.perf_counter() - start
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    read = storage_read_bytes()
    result = generate(model, prompt, NEW_TOKENS, manager)
    read = storage_read_bytes() - read
    out = {
        "tokens": result.tokens,
        "text": tokenizer.decode(result.tokens, skip_special_tokens=True).strip(),
        "tokens_per_s": result.tokens_per_s,
        "prompt_s": result.prompt_seconds,
        "load_s": load_s,
        "decode_read_bytes": read,
        "import_anon_bytes": import_anon,
        "mlx_active_bytes": mx.get_active_memory(),  # MLX's own buffers: the weights, the KV
        "mlx_peak_bytes": mx.get_peak_memory(),
        "torch_imported": "torch" in sys.modules,
    }
    if manager is not None:
        total = manager.total_metrics()
        out |= {
            "hit_rate": total.hit_rate,
            "swaps": total.swaps,
            "resident_expert_bytes": manager.resident_expert_bytes(),
            "all_expert_bytes": manager.all_expert_bytes(),
        }
    print(json.dumps(out), flush=True)


def mlx_user_venv(root: Path) -> Path:
    """A venv under ``root`` holding this package and mlx-lm, at the default environment's
    mlx, mlx-lm and transformers versions, and no torch. Returns its python."""
    import subprocess
    import venv
    from importlib.metadata import version

    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    pins = [f"{name}=={version(name)}" for name in ("mlx", "mlx-lm", "transformers")]
    package = HERE.parent  # packages/moe-expert-cache, built and installed as a wheel
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-compile", str(package), *pins], check=True
    )
    probe = "import importlib.util as u; assert u.find_spec('torch') is None, 'torch installed'"
    subprocess.run([python, "-c", probe], check=True)
    return python


def _rss_anon() -> int:
    """RssAnon + RssShmem of this process, bytes."""
    total = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssShmem:")):
                total += int(line.split()[1]) * 1024
    return total


def _parse(stdout: str) -> dict | None:
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def _run(command, limit, read_bps=None, device=None, timeout=None) -> dict:
    """One run under the budget runner, as a JSON-ready dict."""
    from membound_testing.budget.runner import run_limited

    result = run_limited(command, limit, read_bps, device, timeout=timeout)
    answer = _parse(result.stdout) if result.completed else None
    entry = {
        "limit_mib": limit // MiB,
        "read_mbps": None if read_bps is None else read_bps // MB,
        "status": result.status,
        "completed": result.completed,
        "wall_s": round(result.wall_s, 1),
        "peak_anon_mib": round(result.peak_anon / MiB, 1),
        "peak_file_mapped_mib": round(result.peak_file_mapped / MiB, 1),
        "peak_cache_mib": round(result.peak_cache / MiB, 1),
        "peak_usage_mib": None if result.peak_usage is None else round(result.peak_usage / MiB, 1),
        "peak_rss_anon_mib": round(result.peak_rss_anon / MiB, 1),
        "peak_rss_file_mib": round(result.peak_rss_file / MiB, 1),
        "read_mib": round(result.read_bytes / MiB, 1),
        "cache_note": result.cache_note,
        "load": round(os.getloadavg()[0], 2),
    }
    if answer is not None:
        entry["answer"] = answer
    if not result.completed:
        entry["stderr_tail"] = result.stderr.strip()[-400:]
    return entry


def _passes(entry: dict, expected: list[int]) -> tuple[bool, str]:
    if not entry["completed"]:
        return False, entry["status"]
    ok = entry.get("answer", {}).get("tokens") == expected
    return ok, "ok" if ok else "wrong tokens"


def measure_min_limit(command, expected, unlimited: dict, resolution_mib: int) -> dict:
    """The smallest hard limit (reads unthrottled) at which ``command`` still passes."""
    from membound_testing.budget.runner import bisect_min_limit

    timeout = max(120.0, 4 * unlimited["wall_s"])
    tries_full = []

    def passes(limit: int) -> tuple[bool, str]:
        entry = _run(command, limit, timeout=timeout)
        tries_full.append(entry)
        ok, status = _passes(entry, expected)
        print(f"    {limit // MiB} MiB: {status} ({entry['wall_s']} s)", flush=True)
        return ok, status

    # Anonymous memory cannot be reclaimed without swap, file pages can: the unlimited run's
    # anonymous peak + 128 MiB is tried first, then, if it fails, up to its whole peak.
    hi = (int(unlimited["peak_anon_mib"]) + 128) * MiB
    top = (int(unlimited["peak_usage_mib"] or 4096) + 32) * MiB
    found = bisect_min_limit(passes, 64 * MiB, hi, resolution_mib * MiB, fallback_hi=top)
    return {
        "min_limit_mib": None if found.min_bytes is None else found.min_bytes // MiB,
        "describe": found.describe(),
        "timeout_s": round(timeout),
        "tries": [[limit // MiB, ok, status] for limit, ok, status in found.tries],
        "loads": [e["load"] for e in tries_full],
    }


def _checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _fmt_cell(entry: dict, expected: list[int]) -> str:
    """Tokens/s (or how the run ended), then its peak anonymous / file-mapped MiB."""
    return (
        f"{_fmt_run(entry, expected)} "
        f"({entry['peak_anon_mib']:.0f} / {entry['peak_file_mapped_mib']:.0f})"
    )


def _fmt_rounds(entries: list[dict], expected: list[int]) -> str:
    """Median tokens/s (min-max) over the rounds, then the first run's peaks."""
    speeds = [e["answer"]["tokens_per_s"] for e in entries if _passes(e, expected)[0]]
    if len(speeds) < len(entries):
        return f"{len(entries) - len(speeds)} of {len(entries)} runs failed " + _fmt_cell(
            entries[0], expected
        )
    peaks = f"({entries[0]['peak_anon_mib']:.0f} / {entries[0]['peak_file_mapped_mib']:.0f})"
    return f"{statistics.median(speeds):.2f} ({min(speeds):.2f}-{max(speeds):.2f}) {peaks}"


def _fmt_run(entry: dict, expected: list[int]) -> str:
    ok, status = _passes(entry, expected)
    if not ok:
        return status
    return f"{entry['answer']['tokens_per_s']:.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", nargs=2, metavar=("KIND", "MODEL_DIR"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=list(VARIANTS.values()),
        default=list(VARIANTS.values()),
        help="variants: stock, or a cached capacity (stock always runs: its tokens are expected)",
    )
    parser.add_argument(
        "--runtime",
        choices=("mlx-user", "dev"),
        default="mlx-user",
        help="where the children run: a venv with only this package and mlx-lm (no torch), "
        "or this interpreter",
    )
    parser.add_argument("--resolution", type=int, default=16, help="bisection step, MiB")
    parser.add_argument("--no-bisect", action="store_true", help="profile runs only")
    parser.add_argument("--rounds", type=int, default=3, help="unlimited runs per variant")
    parser.add_argument(
        "--render-only", action="store_true", help=f"write the table from {RAW.name} only"
    )
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return

    if args.render_only:
        _write(json.loads(RAW.read_text()))
        return
    from membound_testing.budget.cgroup import block_device_of
    from membound_testing.machine import machine_info
    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_json_atomic

    model_dir = moe_checkpoint()
    dense = _checkpoint_bytes(smollm2_float_dir())
    moe = _checkpoint_bytes(model_dir)
    sized_mib = TIGHT_MIB * moe // dense
    profiles = {
        f"tight, sized to this model ({sized_mib} MiB)": sized_mib * MiB,
        f"tight ({TIGHT_MIB} MiB)": TIGHT_MIB * MiB,
    }
    device = block_device_of(model_dir)
    rows = [STOCK] + [r for r, kind in VARIANTS.items() if kind in args.rows and r != STOCK]
    script = str(Path(__file__).resolve())
    python = sys.executable
    if args.runtime == "mlx-user":
        import tempfile

        python = str(mlx_user_venv(Path(tempfile.mkdtemp(prefix="moe-mlx-user-")) / "venv"))
    commands = {row: [python, script, "--child", VARIANTS[row], str(model_dir)] for row in rows}
    raw = {
        "setup": {
            "model": model_dir.name,
            "checkpoint_bytes": moe,
            "dense_checkpoint_bytes": dense,
            "sized_mib": sized_mib,
            "resolution_mib": args.resolution,
            "rounds": args.rounds,
            "runtime": args.runtime,
            "load_start": os.getloadavg()[0],
            "mlx": _mlx_version(),
            "machine": machine_info(),  # the table's stamp: when measured, not rendered
        },
        "rows": {row: {"profiles": {}} for row in rows},
    }
    runs = raw["rows"]

    # Unlimited first (4 GiB, reads unthrottled), A B C rounds: the expected tokens (stock's
    # first run), each upper bound for the bisection, and tokens/s side by side.
    expected = None
    for r in range(args.rounds):
        for row in rows:
            entry = _run(commands[row], 4096 * MiB, timeout=600)
            runs[row].setdefault("unlimited_rounds", []).append(entry)
            runs[row].setdefault("unlimited", entry)
            write_json_atomic(RAW, raw)
            shown = {k: v for k, v in entry.items() if k != "answer"}
            print(f"{row} unlimited, round {r + 1}:", json.dumps(shown))
            print("   ", json.dumps(entry.get("answer", {}).get("text")), flush=True)
            if row == STOCK and expected is None:
                if "answer" not in entry:
                    raise SystemExit(f"stock mlx-lm did not complete without a limit: {entry}")
                expected = entry["answer"]["tokens"]
    if not args.no_bisect:
        for row in rows:
            if runs[row]["unlimited"].get("answer") is None:
                continue
            print(row, "bisecting:", flush=True)
            runs[row]["min_limit"] = measure_min_limit(
                commands[row], expected, runs[row]["unlimited"], args.resolution
            )
            write_json_atomic(RAW, raw)
            print(f"  {row} minimum hard limit: {runs[row]['min_limit']['describe']}", flush=True)
    # Read from this run's bisection, not a device: the first cached variant's minimum limit,
    # where stock is tried under the same read bandwidth.
    first = rows[1] if len(rows) > 1 else None
    found = runs[first].get("min_limit", {}).get("min_limit_mib") if first else None
    if found is not None:
        share = f"{float(VARIANTS[first]):.1%}".replace(".0%", "%")
        profiles[f"cached {share}'s minimum limit ({found} MiB)"] = found * MiB
    raw["setup"]["profiles"] = {p: limit // MiB for p, limit in profiles.items()}
    # Each fixed profile, the variants interleaved (A B C, then the next profile).
    for profile, limit in profiles.items():
        for row in rows:
            entry = _run(commands[row], limit, TIGHT_READ_BPS, device, timeout=PROFILE_TIMEOUT)
            runs[row]["profiles"][profile] = entry
            write_json_atomic(RAW, raw)
            print(
                f"{row} under {profile}: {_fmt_run(entry, expected)}; "
                f"anon {entry['peak_anon_mib']} MiB, file mapped "
                f"{entry['peak_file_mapped_mib']} MiB, wall {entry['wall_s']} s",
                flush=True,
            )
    raw["setup"]["load_end"] = os.getloadavg()[0]
    write_json_atomic(RAW, raw)
    _write(raw)


def _write(raw: dict) -> None:
    """results/stock_vs_cached_limits.json (the README table) from the raw runs."""
    from membound_testing.results import render_result, write_json_atomic, write_result

    setup, runs = raw["setup"], raw["rows"]
    expected = runs[STOCK]["unlimited"]["answer"]["tokens"]
    names = list(setup["profiles"])
    rows = []
    for row, entry in runs.items():
        unlimited = entry["unlimited"]
        answer = unlimited.get("answer", {})
        rows.append(
            [
                row,
                entry.get("min_limit", {}).get("describe", "not run"),
                *[_fmt_cell(entry["profiles"][p], expected) for p in names],
                _fmt_rounds(entry.get("unlimited_rounds", [unlimited]), expected),
                "yes" if answer.get("tokens") == expected else "no",
            ]
        )
    # The writer's own printout would carry the render time: the table is printed below.
    with contextlib.redirect_stdout(io.StringIO()):
        result = write_result(
            HERE / "results",
            save=False,
            package="moe-expert-cache",
            name="stock_vs_cached_limits",
            command=COMMAND,
            title="the real MoE (MoEfied SmolLM2, shared expert) under hard memory limits: stock "
            "mlx-lm vs the expert cache",
            columns=[
                "variant",
                "min hard limit (MiB)",
                *[f"{p}, 200 MB/s" for p in names],
                "no limit (4 GiB, reads unthrottled)",
                "stock's tokens",
            ],
            rows=rows,
            targets=_targets(runs, names[0], expected),
            notes=_notes(setup, runs),
        )
    result["machine"] = setup["machine"]
    write_json_atomic(HERE / "results" / "stock_vs_cached_limits.json", result)
    print(f"\nas written, stamped when measured:\n{render_result(result)}", flush=True)


def _targets(runs: dict, sized: str, expected: list[int]) -> list[dict]:
    """The issue's target under the sized tight profile, and the minimum limits."""
    stock = runs[STOCK]
    targets = []
    for row, entry in runs.items():
        if row == STOCK:
            continue
        s_ok, s_status = _passes(stock["profiles"][sized], expected)
        c_ok, c_status = _passes(entry["profiles"][sized], expected)
        if c_ok and not s_ok:
            tps = _fmt_run(entry["profiles"][sized], expected)
            measured, met = f"cached completes ({tps} tokens/s); stock: {s_status}", True
        elif c_ok and s_ok:
            a = entry["profiles"][sized]["answer"]["tokens_per_s"]
            b = stock["profiles"][sized]["answer"]["tokens_per_s"]
            measured, met = f"both complete: {a:.2f} vs {b:.2f} tokens/s ({a / b:.2f}x)", a > b
        else:
            measured, met = f"cached: {c_status}; stock: {'ok' if s_ok else s_status}", False
        targets.append(
            {
                "target": f"{sized}: {row} completes where stock is killed, or runs faster",
                "measured": measured,
                "met": met,
            }
        )
        a, b = entry.get("min_limit", {}), stock.get("min_limit", {})
        if a.get("min_limit_mib") is not None and b.get("min_limit_mib") is not None:
            targets.append(
                {
                    "target": f"{row}: minimum hard limit below stock's",
                    "measured": f"{a['min_limit_mib']} vs {b['min_limit_mib']} MiB",
                    "met": a["min_limit_mib"] < b["min_limit_mib"],
                }
            )
    return targets


def _notes(setup: dict, runs: dict) -> str:
    parts = []
    for row, entry in runs.items():
        answer = entry["unlimited"].get("answer")
        if answer:
            parts.append(
                f"{row}: {answer['import_anon_bytes'] / MiB:.0f} MiB anonymous after the imports, "
                f"MLX's buffers {answer['mlx_active_bytes'] / MiB:.0f} MiB after generating "
                f"(peak {answer['mlx_peak_bytes'] / MiB:.0f})"
            )
    loads = [
        e["load"]
        for r in runs.values()
        for e in [*r.get("unlimited_rounds", [r["unlimited"]]), *r["profiles"].values()]
    ]
    loads += [x for r in runs.values() for x in r.get("min_limit", {}).get("loads", [])]
    tries = {r: e.get("min_limit", {}).get("tries") for r, e in runs.items()}
    moe, dense = setup["checkpoint_bytes"], setup["dense_checkpoint_bytes"]
    return (
        "Each run's cell: decode tokens/s, or how the run ended, then (peak anonymous / peak "
        "file-mapped MiB) from the cgroup's counters; the profiles read at 200 MB/s. "
        f"Model: {setup['model']} ({moe / MiB:.0f} MiB of float32 shards), mlx[cpu] "
        f"{setup['mlx']}. Each run is a fresh process in its own cgroup (hard limit, swap off, "
        f"page cache dropped first): load, then {NEW_TOKENS} greedy tokens after the chat "
        "prompt; tokens/s is decode after the first token: one run per profile; without a "
        f"limit the median (min-max) of {setup.get('rounds', 1)} rounds, variants "
        "interleaved, peaks from the first round. The sized tight profile keeps the budget runner's tight ratio of limit to "
        f"checkpoint: {TIGHT_MIB} MiB x {moe} / {dense} bytes (the plain SmolLM2's float32 "
        f"checkpoint) = {setup['sized_mib']} MiB, chosen before any run; the last profile's "
        "limit is read from this run's bisection, not a device. A run passes only with "
        "stock's own greedy tokens (exact mode must give them). The minimum limit is "
        f"bisected at {setup['resolution_mib']} MiB between 64 MiB and the unlimited run's "
        "anonymous peak + 128 MiB (above it, up to its whole peak + 32 MiB, if that fails), reads unthrottled, timeout max(120 s, 4x the unlimited wall time); "
        f"profile runs time out at {PROFILE_TIMEOUT:.0f} s. Without a limit: "
        + "; ".join(parts)
        + f". Every try: {json.dumps(tries)}. 1-minute load average "
        f"{min(loads):.2f}-{max(loads):.2f} during the runs. " + _runtime_note(setup, runs)
    )


def _runtime_note(setup: dict, runs: dict) -> str:
    torch = sorted(
        {r for r, e in runs.items() if e["unlimited"].get("answer", {}).get("torch_imported")}
    )
    if setup.get("runtime", "dev") == "dev":
        where = "The children ran in membound's default environment (torch installed)."
    else:
        where = (
            "The children ran in a fresh venv holding only moe-expert-cache and mlx-lm (at the "
            "default environment's mlx, mlx-lm and transformers versions), no torch, as an "
            "MLX user installs them."
        )
    return where + (f" torch was imported by: {', '.join(torch)}." if torch else "")


def _mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__


if __name__ == "__main__":
    main()
