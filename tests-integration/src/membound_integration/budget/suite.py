"""`hatch run budget`: every demo row under every device profile, and the smallest hard
memory limit under which each row still gives the right answer.

Each measurement runs the row in a fresh process inside its own cgroup, after the page
cache is dropped (runner.py). Measurements accumulate in ``results/budget-raw.json``
(one entry per row and profile, and per row for the bisection, each stamped with its
date and the machine's load), so a partial run (``--rows``, ``--profiles``,
``--no-bisect``) updates only what it measured; ``results/budget.json`` is then rendered
from all of them: the README's headline table.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

from membound_testing.budget.cgroup import block_device_of
from membound_testing.budget.profiles import PROFILES, MiB, Profile
from membound_testing.budget.runner import RunResult, bisect_min_limit, run_limited

RESULTS = Path(__file__).resolve().parents[3] / "results"
BISECT_LO = 64 * MiB  # below what Python and torch need to start: taken to fail
BISECT_HI = PROFILES["ample"].memory_bytes

# Which row each row is compared with ("x plain"): the same model and prompt without the
# package. The MoE and diffulex-edge rows run other models, and compare inside the row.
BASELINE = {
    "zstd_linear": "plain",
    "paired_cache": "plain",
    "paired_cache_in_place": "plain",
    "combined": "plain",
    "bmrt_kv": "plain_passkey",
}
# The rows that bound weights: their minimum hard limit must be below the plain model's.
WEIGHT_ROWS = ("zstd_linear", "paired_cache", "paired_cache_in_place", "combined")


def _stamp() -> dict:
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load": round(os.getloadavg()[0], 2),
    }


def _run_entry(result: RunResult, profile: Profile | None, row: dict | None) -> dict:
    entry = {
        **_stamp(),
        "status": result.status,
        "completed": result.completed,
        "correct": bool(row and row.get("correct")),
        "wall_s": round(result.wall_s, 1),
        "peak_anon_mib": round(result.peak_anon / MiB, 1),
        "peak_file_mapped_mib": round(result.peak_file_mapped / MiB, 1),
        "peak_cache_mib": round(result.peak_cache / MiB, 1),
        "peak_rss_anon_mib": round(result.peak_rss_anon / MiB, 1),
        "peak_rss_file_mib": round(result.peak_rss_file / MiB, 1),
        "read_mib": round(result.read_bytes / MiB, 1),
        "cache_note": result.cache_note,
        "cgroup": f"v{result.cgroup_version}",
    }
    if row:
        entry["tokens_per_s"] = round(row["tokens_per_s"], 3)
        entry["output"] = row["output"]
        entry["name"] = row["name"]
        if row.get("new_tokens") and row.get("decode_read_bytes") is not None:
            per_token = row["decode_read_bytes"] / row["new_tokens"]
            entry["read_mib_per_token"] = round(per_token / MiB, 2)
            if profile is not None and profile.read_bps and per_token > 0:
                # The physical limit of this profile: storage bandwidth / bytes per token.
                entry["storage_bound_tokens_per_s"] = round(profile.read_bps / per_token, 2)
    if not result.completed:
        entry["stderr_tail"] = result.stderr[-600:]
    return entry


def measure_profile(module: str, row_id: str, profile: Profile, device: str, timeout: float):
    from membound_integration.demo import parse_row, row_command

    result = run_limited(
        row_command(module, row_id),
        profile.memory_bytes,
        profile.read_bps,
        device if profile.read_bps else None,
        timeout=timeout,
    )
    return _run_entry(result, profile, parse_row(result.stdout) if result.completed else None)


def measure_min_limit(module: str, row_id: str, hi: int, timeout: float) -> dict:
    """Bisect the smallest limit (16 MiB resolution, reads unthrottled) at which the row
    completes within ``timeout`` with the right answer."""
    from membound_integration.demo import parse_row, row_command

    def passes(limit: int) -> tuple[bool, str]:
        result = run_limited(row_command(module, row_id), limit, timeout=timeout)
        row = parse_row(result.stdout) if result.completed else None
        if row is None:
            return False, result.status
        return bool(row["correct"]), "ok" if row["correct"] else "wrong answer"

    # If the row's own ample peak is not enough here, the search goes on above it.
    found = bisect_min_limit(passes, BISECT_LO, hi, fallback_hi=BISECT_HI)
    return {
        **_stamp(),
        "min_limit_mib": None if found.min_bytes is None else found.min_bytes // MiB,
        "describe": found.describe(),
        "timeout_s": round(timeout),
        "tries": [[limit // MiB, ok, status] for limit, ok, status in found.tries],
    }


def load_raw() -> dict:
    path = RESULTS / "budget-raw.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def run(rows: list[tuple[str, str]], profiles: list[str], bisect: bool, timeout: float) -> dict:
    """Measure ``rows`` ((module, row id)) under ``profiles`` and bisect their minimum
    limits; merge into budget-raw.json and return the merged data."""
    from tqdm import tqdm

    from membound_integration.demo import run_prepare
    from membound_testing.models import cache_dir
    from membound_testing.results import write_json_atomic

    run_prepare(sorted({m for m, _ in rows}))
    device = block_device_of(cache_dir())
    raw = load_raw()
    # Every measurement of this invocation carries its start: a row is compared with its
    # baseline only where both come from the same run (see same_run).
    run_id = _stamp()["date"]
    steps = [(m, r, p) for m, r in rows for p in profiles] + (
        [(m, r, None) for m, r in rows] if bisect else []
    )
    with tqdm(steps, desc="budget", unit="run") as bar:
        for module, row_id, profile in bar:
            entry = raw.setdefault(row_id, {"profiles": {}})
            bar.set_postfix_str(f"{row_id} {profile or 'min limit'}")
            if profile is not None:
                got = measure_profile(module, row_id, PROFILES[profile], device, timeout)
                got["run"] = run_id
                entry["profiles"][profile] = got
                tqdm.write(f"{row_id} {profile}: {got['status']}, {got.get('tokens_per_s')} tok/s")
            else:
                ample = entry["profiles"].get("ample", {})
                hi = BISECT_HI
                if ample.get("completed"):
                    # The row's own peak under ample room is an upper bound worth trying
                    # first (fewer bisection steps); the whole ample limit otherwise.
                    peak = ample["peak_anon_mib"] + ample["peak_cache_mib"] + 64
                    hi = min(BISECT_HI, int(peak) * MiB)
                wall = ample.get("wall_s", 60)
                entry["min_limit"] = measure_min_limit(
                    module, row_id, hi, timeout=min(timeout, max(90.0, 4 * wall))
                )
                entry["min_limit"]["run"] = run_id
                tqdm.write(f"{row_id} min limit: {entry['min_limit']['describe']}")
            write_json_atomic(RESULTS / "budget-raw.json", raw)
    return raw


def same_run(a: dict | None, b: dict | None) -> bool:
    """Whether two measurements come from one invocation of ``run`` (entries written
    before runs were stamped carry none, and compare with each other only)."""
    return bool(a) and bool(b) and a.get("run") == b.get("run")


OTHER_RUN = "not the same run"


def _fmt_tps(run: dict | None) -> str:
    if not run:
        return "not run"
    if not run["completed"]:
        return run["status"]
    tps = f"{run['tokens_per_s']:.2f}"
    return tps if run["correct"] else f"{tps} (wrong answer)"


def render(raw: dict, order: list[str]) -> dict:
    """The headline result (results/budget.json) from the accumulated measurements."""
    from membound_testing.results import write_result

    names = {
        r: next((p.get("name") for p in e["profiles"].values() if p.get("name")), r)
        for r, e in raw.items()
    }
    rows, targets = [], []
    for row_id in order:
        entry = raw.get(row_id)
        if entry is None:
            continue
        prof = entry["profiles"]
        base = raw.get(BASELINE.get(row_id, ""), {}).get("profiles", {})
        tight, ample = prof.get("tight"), prof.get("ample")

        def ratio(run, ref):
            if not (run and ref and run.get("correct") and ref.get("correct")):
                return ""
            if not same_run(run, ref):
                return OTHER_RUN
            return f"{run['tokens_per_s'] / ref['tokens_per_s']:.2f}x"

        limit = entry.get("min_limit", {})
        rows.append(
            [
                names[row_id],
                limit.get("describe", "not run"),
                *[_fmt_tps(prof.get(p)) for p in PROFILES],
                ratio(tight, base.get("tight")),
                ratio(ample, base.get("ample")),
                (tight or {}).get("read_mib_per_token", ""),
                (tight or {}).get("storage_bound_tokens_per_s", ""),
                f"{ample['peak_anon_mib']:.0f} / {ample['peak_file_mapped_mib']:.0f}"
                if ample
                else "",
            ]
        )
    targets += _targets(raw)
    stamps = sorted(
        {p["date"][:10] for e in raw.values() for p in e["profiles"].values()}
        | {e["min_limit"]["date"][:10] for e in raw.values() if "min_limit" in e}
    )
    loads = [p["load"] for e in raw.values() for p in e["profiles"].values()]
    versions = sorted({p.get("cgroup", "v1") for e in raw.values() for p in e["profiles"].values()})
    profiles = "; ".join(f"{p.describe()}: {p.stands_for}" for p in PROFILES.values())
    return write_result(
        RESULTS,
        package="membound",
        name="budget",
        title="Under a hard memory limit: minimum limit and tokens/s per device profile",
        command="hatch run budget",
        columns=[
            "row",
            "min hard limit (MiB)",
            *[f"{name} tok/s" for name in PROFILES],
            "x baseline, tight",
            "x baseline, ample",
            "MiB read/token, tight",
            "storage bound tok/s, tight",
            "peak anon / file MiB, ample",
        ],
        rows=rows,
        targets=targets,
        notes=(
            f"Profiles: {profiles}. Each run is a fresh process in its own cgroup "
            f"({'/'.join(versions) or 'v1'}: a hard memory limit with swap off, a read "
            "throttle on the weights' disk), after the page cache was dropped. The minimum "
            "limit is bisected at 16 MiB resolution with reads unthrottled; a run past its "
            "timeout (max(90 s, 4x the row's ample wall time), so a row that thrashes for "
            "minutes does not count as fitting) or with a wrong answer counts as not "
            "fitting: every try is in results/budget-raw.json. Profile runs time out at "
            "300 s. tokens/s is the steady state after a two-token warm-up (the bmrt-kv "
            "rows: prompt + answer tokens over the whole stream). Baselines: the "
            "plain model for the weight rows, the full-cache pass key for bmrt-kv; a row "
            "is compared with its baseline only when one invocation measured both "
            f"('{OTHER_RUN}' otherwise: plain's own minimum limit moved 12 MiB between two "
            "runs on 2026-11-26). Storage "
            "bound = the profile's read bandwidth / bytes read per generated token. "
            f"Measured on {', '.join(stamps)}; 1-minute load average during the runs "
            f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f} (2 cores)."
        ),
    )


def _targets(raw: dict) -> list[dict]:
    """The hard-limits issue's targets, each as measured (or 'not measured')."""

    def run_of(row, profile):
        return raw.get(row, {}).get("profiles", {}).get(profile)

    def tps(run):
        return run["tokens_per_s"] if run and run["completed"] and run["correct"] else None

    def limit(row):
        return raw.get(row, {}).get("min_limit", {}).get("min_limit_mib")

    def mib(value):
        return "not measured" if value is None else f"{value} MiB"

    def judged(measured: str, met: bool, a: dict | None, b: dict | None) -> tuple[str, bool]:
        # A row and its baseline measured in different runs are not compared: the
        # machine's state between runs moved plain's own minimum limit by 12 MiB here.
        if measured != "not measured" and not same_run(a, b):
            return f"{measured} ({OTHER_RUN})", False
        return measured, met

    def highest_failure(row):
        """The highest limit ``row``'s bisection failed at, below its minimum (None
        without the tries)."""
        entry = raw.get(row, {}).get("min_limit", {})
        failed = [t[0] for t in entry.get("tries", []) if not t[1] and t[0] < limit(row)]
        return max(failed, default=None)

    out = []
    plain_limit, plain_failed = limit("plain"), highest_failure("plain")
    for row in WEIGHT_ROWS:
        got = limit(row)
        # "Below" means the row answered under a limit at which plain failed: a minimum
        # a few MiB lower is within the bisection's resolution (16 MiB) and proves
        # nothing. Without plain's tries, the two minima are compared.
        below = got is not None and plain_limit is not None and got < plain_limit
        text = f"{mib(got)} vs plain {mib(plain_limit)}"
        if below and plain_failed is not None:
            below = got <= plain_failed
            text += f"; plain failed at {plain_failed} MiB" + (
                "" if below else ": within the bisection's resolution"
            )
        measured, met = judged(
            text,
            below,
            raw.get(row, {}).get("min_limit"),
            raw.get("plain", {}).get("min_limit"),
        )
        if got is None or plain_limit is None:
            measured, met = f"{mib(got)} vs plain {mib(plain_limit)}", False
        out.append(
            {"target": f"{row}: minimum hard limit below plain's", "measured": measured, "met": met}
        )
    for row, factor in (
        ("zstd_linear", 2.0),
        ("paired_cache", 1.5),
        ("paired_cache_in_place", 1.5),
        ("combined", 3.0),
    ):
        ra, rb = run_of(row, "tight"), run_of("plain", "tight")
        a, b = tps(ra), tps(rb)
        measured, met = judged(
            "not measured"
            if a is None or b is None
            else f"{a:.2f} vs {b:.2f} tok/s ({a / b:.2f}x)",
            a is not None and b is not None and a >= factor * b,
            ra,
            rb,
        )
        out.append(
            {
                "target": f"tight: {row} >= {factor}x plain tokens/s, same answer",
                "measured": measured,
                "met": met,
            }
        )
    for row, base in BASELINE.items():
        ra, rb = run_of(row, "ample"), run_of(base, "ample")
        a, b = tps(ra), tps(rb)
        measured, met = judged(
            "not measured" if a is None or b is None else f"{a / b:.2f}x",
            a is not None and b is not None and a >= 0.9 * b,
            ra,
            rb,
        )
        out.append(
            {"target": f"ample: {row} >= 0.9x {base} tokens/s", "measured": measured, "met": met}
        )
    a, b = limit("bmrt_kv"), limit("plain_passkey")
    measured, met = judged(
        f"{mib(a)} vs full cache {mib(b)}",
        a is not None and b is not None and b - a >= 150,
        raw.get("bmrt_kv", {}).get("min_limit"),
        raw.get("plain_passkey", {}).get("min_limit"),
    )
    out.append(
        {
            "target": "bmrt-kv 6k pass key: minimum limit >= 150 MiB below the full cache's, "
            "right key",
            "measured": measured,
            "met": met,
        }
    )
    return out
