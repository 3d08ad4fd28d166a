"""Where a static_kv program's decode time goes, per kind of operator: ExecuTorch's own
profiler (ETDump, with XNNPACK's per-operator events) on SmolLM2's 8da4w programs of 0.14,
0.13, 0.12 and 0.10, side by side.

Each program runs in a fresh process (the programs in turn, ``--rounds`` times; medians),
loaded as :class:`~diffulex_edge.PteEngine` loads it (XNNPACK's shared weight cache on, one
thread), then decodes ``--steps`` single tokens (T = 1) at positions 0, 1, ...; the first
``WARMUP`` are left out. Per token: the method's time, its int4 and int8 products
(XNNPACK's fully connected operators with QB4W and QC8W weights), the rest of the time
inside the XNNPACK delegates (its other operators and the delegate calls' own cost), and
the operators outside them (the attention's custom ops, ``index_select`` of 0.13's split
``lm_head``, ...). The profiler's events cost time of their own, so the totals run above an
unprofiled decode (``smollm2_quality.py`` times that).

    hatch run diffulex-edge:python packages/diffulex-edge/benchmarks/smollm2_quality.py --keep DIR
    hatch run diffulex-edge:python packages/diffulex-edge/benchmarks/pte_op_profile.py DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMAND = "hatch run diffulex-edge:python packages/diffulex-edge/benchmarks/pte_op_profile.py DIR"
PROGRAMS = {  # row -> file under DIR (smollm2_quality.py --keep DIR)
    "8da4w (0.14)": "diffulex-static_kv-8da4w.pte",
    "8da4w (0.13)": "diffulex-static_kv-8da4w-0.13.pte",
    "8da4w (0.12)": "diffulex-static_kv-8da4w-0.12.pte",
    "8da4w (0.10)": "diffulex-static_kv-8da4w-0.10.pte",
}
WARMUP = 8
# Kept whole: the method's and the delegate calls' time. ETDump's OPERATOR_CALL wraps each
# operator outside the delegates, which has its own event, so it is left out.
TOTALS = ("Method::execute", "DELEGATE_CALL")


def _kind(name: str) -> str:
    """An event's kind: a product by weight type, another XNNPACK operator, or an
    operator outside the delegates (ExecuTorch kernels: ``native_call_*``, ``llama::*``)."""
    if "QB4W" in name:
        return "int4"
    if "QC8W" in name:
        return "int8"
    if name.startswith("native_call_") or "::" in name:
        return "outside"
    return "xnnpack"


def child(path: str, steps: int) -> dict:
    """Decode ``steps`` tokens of the program at ``path`` under ETDump; per-token
    milliseconds by kind."""
    import torch

    torch.set_num_threads(1)
    from diffulex_edge.executorch_import import llm_custom_kernels, runtime
    from diffulex_edge.xnnpack_weight_cache import shared_packed_weights

    runtime()
    llm_custom_kernels()
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(1)
    with shared_packed_weights():
        module = portable_lib._load_for_executorch(path, enable_etdump=True, debug_buffer_size=0)
    for position in range(steps):
        module.forward((torch.tensor([[100 + position]]), torch.tensor([position])))
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "run.etdump"
        module.write_etdump_result_to_file(str(etdump))
        inspector = Inspector(etdump_path=str(etdump))
    per_kind: dict[str, float] = {}
    counts: dict[str, int] = {}
    for block in inspector.event_blocks:
        for event in block.events:
            raw = event.perf_data.raw if event.perf_data is not None else []
            name = event.name
            if len(raw) != steps or name == "OPERATOR_CALL":  # load and init run once
                continue
            ms = statistics.median(raw[WARMUP:])
            key = name if name in TOTALS else _kind(name)
            per_kind[key] = per_kind.get(key, 0.0) + ms
            counts[key] = counts.get(key, 0) + 1
            if "index_select" in name:
                per_kind["index_select"] = per_kind.get("index_select", 0.0) + ms
    return {"ms": per_kind, "count": counts}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("programs", type=Path, nargs="?", help="smollm2_quality.py's --keep DIR")
    parser.add_argument("--rows", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=72, help="tokens decoded per process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps must be above the {WARMUP} warm-up tokens")
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    if args.programs is None:
        parser.error("give the directory of the programs (smollm2_quality.py --keep DIR)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    paths = {row: args.programs / PROGRAMS[row] for row in args.rows}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"no program at {', '.join(missing)}: run smollm2_quality.py --keep DIR")
    from membound_testing.results import write_result

    runs: dict[str, list[dict]] = {row: [] for row in paths}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for row, path in paths.items():
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(path), "--steps", str(args.steps)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[row].append(json.loads(out.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])

    def median(row: str, key: str) -> float:
        return statistics.median(run["ms"].get(key, 0.0) for run in runs[row])

    rows = []
    for row in paths:
        total, delegate = median(row, "Method::execute"), median(row, "DELEGATE_CALL")
        int4, int8 = median(row, "int4"), median(row, "int8")
        counts = runs[row][0]["count"]
        rows.append(
            [
                row,
                round(total, 3),
                f"{int4:.3f} ({counts.get('int4', 0)})",
                f"{int8:.3f} ({counts.get('int8', 0)})",
                round(delegate - int4 - int8, 3),
                round(total - delegate, 3),
                round(median(row, "index_select"), 3),
            ]
        )
        print(rows[-1], flush=True)
    write_result(
        HERE / "results",
        package="diffulex-edge",
        name="pte_op_profile",
        title="SmolLM2-135M-Instruct 8da4w programs: decode time per token by kind of operator "
        "(ETDump)",
        command=COMMAND,
        columns=[
            "program",
            "ms/token (profiled)",
            "int4 products ms (count)",
            "int8 products ms (count)",
            "rest of the XNNPACK delegates ms",
            "outside the delegates ms",
            "of which index_select ms",
        ],
        rows=rows,
        notes=f"static_kv programs (max_seq 256, prefill 32) from smollm2_quality.py --keep; "
        f"{args.rounds} fresh processes per program, the programs in turn; in each, "
        f"{args.steps} single-token forwards, the first {WARMUP} left out, the median per "
        "operator; the table holds the medians over the processes. One thread (ExecuTorch's "
        "threadpool too), XNNPACK's weight cache on as PteEngine loads. 'Rest of the XNNPACK "
        "delegates' is the delegate calls' time less their products: the other XNNPACK "
        "operators (adds, multiplies, RMSNorm's, the activations' dynamic quantization) and "
        "the calls' own cost. 1-minute load average during the run: "
        f"{min(loads):.2f}-{max(loads):.2f}.",
    )


if __name__ == "__main__":
    main()
