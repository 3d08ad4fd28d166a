"""The minimum hard memory limit at which each SmolLM2 program still answers the chat
question: diffulex-edge's .pte (static_kv, block_kv, static_kv 8da4w and 8da4w-mixed),
optimum-executorch's .pte and eager transformers, each run as ``optimum_side_by_side.py
--child`` (a 200-token prefill, then 32 greedy tokens after the chat prompt).

The children get the prompts as token ids (``prompt_ids.json`` in DIR) and print their
tokens; this process decodes them. Each try is a fresh process in its own cgroup (the
budget runner of ``membound_testing.budget``: a hard limit with swap off, the page
cache dropped first);
the smallest limit at which the answer still says "Paris" is bisected. The programs come
from the side-by-side benchmark's ``--keep`` directory, plus the quantized exports (or
``smollm2_quality.py --keep DIR``, which writes the static_kv 8da4w programs of 0.14, 0.13,
0.12 and 0.10 under the names below, and ``optimum_int4.py DIR``, which exports optimum-executorch's
int4 recipe):

    hatch run diffulex-edge-optimum:bench --keep DIR
    diffulex-edge export MODEL_DIR -o DIR/diffulex-static_kv-8da4w.pte --variant static_kv --quantize 8da4w
    diffulex-edge export MODEL_DIR -o DIR/diffulex-static_kv-8da4w-mixed.pte --variant static_kv --quantize 8da4w-mixed
    hatch run python packages/diffulex-edge/benchmarks/pte_min_limits.py DIR

Needs root (cgroups). Runs in the default environment, which holds the budget runner; the
children run in the diffulex-edge-optimum environment's interpreter.

Every child runs without ``CAP_IPC_LOCK`` (``setpriv --bounding-set -ipc_lock``), as a
process in a container with Docker's default capabilities, or any ordinary user's, does:
ExecuTorch's runtime locks the segments it maps (``mlock``) wherever the process may, and
root on a host may lock them all, which no user on a device or in a container gets.
``--keep-ipc-lock`` runs the children with root's capabilities as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from optimum_side_by_side import KINDS  # noqa: E402

PROGRAMS = {  # row -> (child kind, file or directory under DIR; None = the model itself)
    "diffulex-edge .pte static_kv": (KINDS[0], "diffulex-static_kv.pte"),
    "diffulex-edge .pte block_kv": (KINDS[1], "diffulex-block_kv.pte"),
    "diffulex-edge .pte static_kv 8da4w": (KINDS[0], "diffulex-static_kv-8da4w.pte"),
    "diffulex-edge .pte static_kv 8da4w-mixed": (KINDS[0], "diffulex-static_kv-8da4w-mixed.pte"),
    # 0.13's, 0.12's and 0.10's quantizations beside 0.14's: smollm2_quality.py --keep
    "diffulex-edge .pte static_kv 8da4w (0.13)": (KINDS[0], "diffulex-static_kv-8da4w-0.13.pte"),
    "diffulex-edge .pte static_kv 8da4w (0.12)": (KINDS[0], "diffulex-static_kv-8da4w-0.12.pte"),
    "diffulex-edge .pte static_kv 8da4w (0.10)": (KINDS[0], "diffulex-static_kv-8da4w-0.10.pte"),
    "diffulex-edge .pte static_kv 8da4w-mixed (0.10)": (
        KINDS[0],
        "diffulex-static_kv-8da4w-mixed-0.10.pte",
    ),
    "optimum-executorch .pte": (KINDS[2], "optimum"),
    # its int4 recipe (qlinear 8da4w, qembedding 8w): optimum_int4.py DIR
    "optimum-executorch .pte 8da4w": (KINDS[2], "optimum-8da4w"),
    "eager transformers": (KINDS[3], None),
}
ANSWER = "Paris"


def optimum_python() -> str:
    found = subprocess.run(
        ["hatch", "env", "find", "diffulex-edge-optimum"], capture_output=True, text=True
    )
    python = Path(found.stdout.strip()) / "bin" / "python"
    if found.returncode or not python.is_file():
        raise SystemExit(
            f"no diffulex-edge-optimum environment at {python}: "
            "run `hatch env create diffulex-edge-optimum`"
        )
    return str(python)


def _answer(stdout: str, tokenizer) -> str:
    """The child's greedy tokens, decoded here (the child imports no tokenizer)."""
    try:
        tokens = json.loads(stdout.strip().splitlines()[-1])["tokens"]
    except (IndexError, KeyError, ValueError):
        return ""
    return tokenizer.decode(tokens, skip_special_tokens=True)


def measure(command: list[str], resolution_mib: int, tokenizer) -> dict:
    from membound_testing.budget.profiles import MiB
    from membound_testing.budget.runner import bisect_min_limit, run_limited

    first = run_limited(command, 4096 * MiB)
    text = _answer(first.stdout, tokenizer) if first.completed else ""
    if ANSWER not in text:
        return {"unlimited": first.status, "stderr": first.stderr.strip()[-400:]}
    timeout = max(120.0, 4 * first.wall_s)

    def passes(limit: int) -> tuple[bool, str]:
        result = run_limited(command, limit, timeout=timeout)
        if not result.completed:
            return False, result.status
        ok = ANSWER in _answer(result.stdout, tokenizer)
        return ok, "ok" if ok else "wrong answer"

    hi = (first.peak_usage // MiB + 32) * MiB
    found = bisect_min_limit(passes, 64 * MiB, hi, resolution_mib * MiB)
    return {
        "min_limit_mib": None if found.min_bytes is None else found.min_bytes // MiB,
        "peak_anon_mib": round(first.peak_anon / MiB, 1),
        "peak_usage_mib": round(first.peak_usage / MiB, 1),
        "answer": text.split("\n")[0][:40],
        "tries": [[limit // MiB, ok, status] for limit, ok, status in found.tries],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("programs", type=Path, help="the side-by-side benchmark's --keep DIR")
    parser.add_argument("--rows", nargs="+", choices=list(PROGRAMS), default=list(PROGRAMS))
    parser.add_argument("--resolution", type=int, default=16, help="MiB")
    parser.add_argument(
        "--python",
        help="the children's interpreter (default: the diffulex-edge-optimum environment's; "
        "the diffulex-edge environment's runs every row but optimum-executorch's)",
    )
    parser.add_argument("--result", default="pte_min_limits", help="results/<RESULT>.json to write")
    parser.add_argument(
        "--keep-ipc-lock",
        action="store_true",
        help="run the children with root's CAP_IPC_LOCK (default: dropped, as in a container)",
    )
    args = parser.parse_args(argv)
    prefix = []
    if not args.keep_ipc_lock:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SystemExit("setpriv (util-linux) is needed to drop CAP_IPC_LOCK: install it")
        prefix = [setpriv, "--bounding-set", "-ipc_lock"]
    from optimum_side_by_side import write_prompts
    from transformers import PreTrainedTokenizerFast

    from membound_testing.models import smollm2_float_dir
    from membound_testing.results import write_result

    model_dir = smollm2_float_dir()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    prompt_ids = write_prompts(model_dir, args.programs / "prompt_ids.json")
    python = args.python or optimum_python()
    load_start = os.getloadavg()[0]
    rows, raw = [], {}
    plain = None
    for row in args.rows:
        kind, name = PROGRAMS[row]
        path = model_dir if name is None else args.programs / name
        if not path.exists():
            raise SystemExit(f"{path} is missing: see this script's docstring")
        command = [
            *prefix,
            python,
            str(HERE / "optimum_side_by_side.py"),
            "--child",
            kind,
            str(path),
            str(prompt_ids),
        ]
        entry = measure(command, args.resolution, tokenizer)
        raw[row] = entry
        print(row, json.dumps(entry), flush=True)
        size = "-" if name is None else round(_bytes(path) / 2**20, 1)
        limit = entry.get("min_limit_mib", f"unlimited run: {entry.get('unlimited')}")
        if row == "eager transformers":
            plain = entry.get("min_limit_mib")
        rows.append(
            [
                row,
                size,
                limit,
                entry.get("peak_anon_mib", "-"),
                entry.get("peak_usage_mib", "-"),
                entry.get("answer", ""),
            ]
        )
    targets = []
    if plain is not None:
        for row, entry in raw.items():
            if row.startswith("diffulex-edge") and entry.get("min_limit_mib") is not None:
                targets.append(
                    {
                        "target": f"{row}: minimum hard limit below eager transformers'",
                        "measured": f"{entry['min_limit_mib']} vs {plain} MiB",
                        "met": entry["min_limit_mib"] < plain,
                    }
                )
    write_result(
        HERE / "results",
        package="diffulex-edge",
        name=args.result,
        title="SmolLM2-135M-Instruct: minimum hard memory limit per program",
        command="hatch run python packages/diffulex-edge/benchmarks/pte_min_limits.py DIR",
        columns=[
            "program",
            ".pte MiB",
            "min limit MiB",
            "peak anon MiB (no limit)",
            "peak usage MiB (no limit)",
            "answer",
        ],
        rows=rows,
        targets=targets,
        notes=f"The side-by-side child (200-token prefill, then 32 greedy tokens after the "
        f"chat prompt), one fresh process per try in its own cgroup (hard limit, swap off, "
        f"page cache dropped first); bisected at {args.resolution} MiB between 64 MiB and "
        "the unlimited run's peak usage + 32 MiB; a try passes when its text says "
        f"{ANSWER!r} within max(120 s, 4x the unlimited wall time). Every child gets the "
        "prompts as token ids and prints its greedy tokens, which this process decodes: no "
        "child imports a tokenizer (transformers' costs 118 MiB of anonymous memory). Eager "
        "transformers maps the float32 safetensors. "
        + (
            "Children kept root's CAP_IPC_LOCK (ExecuTorch's runtime locks what it maps). "
            if args.keep_ipc_lock
            else "Children ran without CAP_IPC_LOCK (setpriv --bounding-set -ipc_lock; "
            f"soft RLIMIT_MEMLOCK {_memlock_limit()}), as in a container. "
        )
        + "Every try: "
        + json.dumps({row: e.get("tries") for row, e in raw.items()})
        + f". 1-minute load average {load_start:.1f} at the start (2 cores).",
    )


def _memlock_limit() -> str:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:g} MiB"


def _bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.pte"))
    return path.stat().st_size


if __name__ == "__main__":
    main()
