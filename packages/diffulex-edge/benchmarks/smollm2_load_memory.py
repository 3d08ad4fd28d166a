"""SmolLM2-135M-Instruct's fp32 .pte (forward + 32-token prefill): anonymous memory after
each load step, with the methods sharing one packed copy of the weights (XNNPACK's weight
cache, as PteEngine loads them) and without (each delegate packing its own).

    python packages/diffulex-edge/benchmarks/smollm2_load_memory.py [--quick]

Each mode runs in a fresh process and reads RssAnon from /proc/self/status after: the
imports (torch, diffulex_edge, ExecuTorch's runtime), the program mapped from its file,
``forward`` loaded, ``prefill`` loaded. No timing. The program is the test suite's, exported
once per diffulex-edge version under the membound cache (several minutes on 2 cores).
``--quick`` prints the table without saving the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
COMMAND = "python packages/diffulex-edge/benchmarks/smollm2_load_memory.py"
STEPS = ("imports", "program", "forward", "prefill")

_CHILD = """
import json, re, sys
from contextlib import nullcontext
from pathlib import Path

def rss_anon():
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"RssAnon:\\s+(\\d+) kB", status).group(1)) * 1024

import torch, diffulex_edge
from diffulex_edge.executorch_import import runtime
from diffulex_edge.xnnpack_weight_cache import shared_packed_weights

loader = runtime()
readings = {"imports": rss_anon()}
program = loader.load_program(sys.argv[1])
readings["program"] = rss_anon()
with shared_packed_weights() if sys.argv[2] == "shared" else nullcontext():
    methods = []
    for name in ("forward", "prefill"):
        methods.append(program.load_method(name))
        readings[name] = rss_anon()
print(json.dumps(readings))
"""


def measure(path: Path, mode: str) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), mode], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"the {mode} load failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="print only, save no JSON")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from smollm2_quality import ensure_pte

    from membound_testing.results import write_result

    path = ensure_pte(None)
    mib = 2**20
    rows, readings = [], {}
    for mode in ("shared", "unshared"):
        r = readings[mode] = measure(path, mode)
        label = "one packed copy (weight cache)" if mode == "shared" else "a copy per method"
        rows.append(
            [
                label,
                round(r["imports"] / mib),
                round((r["program"] - r["imports"]) / mib),
                round((r["forward"] - r["program"]) / mib),
                round((r["prefill"] - r["forward"]) / mib),
                round(r["prefill"] / mib),
            ]
        )
    shared, unshared = readings["shared"], readings["unshared"]
    prefill_share = (shared["prefill"] - shared["forward"]) / (
        shared["forward"] - shared["program"]
    )
    write_result(
        RESULTS,
        package="diffulex-edge",
        name="smollm2_load_memory",
        title="SmolLM2-135M-Instruct fp32 .pte: anonymous memory after each load step",
        command=COMMAND,
        columns=[
            "methods",
            "imports MiB",
            "+ program mapped",
            "+ forward",
            "+ prefill",
            "total RssAnon MiB",
        ],
        rows=rows,
        targets=[
            {
                "target": "prefill reuses forward's packed weights: loading it adds < 0.1x "
                "what forward's load added",
                "measured": f"{prefill_share:.3f}x",
                "met": prefill_share < 0.1,
            },
            {
                "target": "total anonymous memory below the per-method copies'",
                "measured": f"{shared['prefill'] / mib:.0f} vs {unshared['prefill'] / mib:.0f} MiB",
                "met": shared["prefill"] < unshared["prefill"],
            },
        ],
        notes=(
            f"{path.stat().st_size / mib:.1f} MiB program (block_kv, block size 1, static "
            "cache of 256, 32-token prefill method); each mode in a fresh process, RssAnon "
            "from /proc/self/status. The shared mode is how PteEngine loads a program: "
            "XNNPACK's weight cache on while the methods load. The file still holds the "
            "tied 49152 x 576 embedding twice (the gather's constant and the lm_head's "
            "named data); those pages are file-backed."
        ),
        save=not args.quick,
    )


if __name__ == "__main__":
    main()
