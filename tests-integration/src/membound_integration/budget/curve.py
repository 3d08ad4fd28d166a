"""The budget curve: tokens/s against the hard memory limit, one line per weight row, at one
storage read bandwidth (the ``tight`` profile's), drawn as an SVG for the root README.

`hatch run budget curve` runs each row in a fresh cgroup at each limit (page cache dropped
first, as every budget run), keeps the points in ``results/budget-curve.json`` and draws
``results/budget-curve.svg`` from them. A point that was OOM-killed, timed out
or answered wrong is drawn as a cross on the axis: the row does not run there.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

from membound_testing.budget.profiles import PROFILES, MiB

ROWS = ("plain", "zstd_linear", "paired_cache_in_place", "combined")
LIMITS_MIB = (384, 480, 640, 900, 1400, 2048)
READ_BPS = PROFILES["tight"].read_bps
COLOURS = ("#555555", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e")


def curve_json() -> Path:
    from membound_integration.budget.suite import RESULTS

    return RESULTS / "budget-curve.json"


def load() -> dict:
    import json

    path = curve_json()
    return json.loads(path.read_text()) if path.is_file() else {"read_bps": READ_BPS, "rows": {}}


def measure(rows, limits_mib, timeout: float) -> dict:
    """Run every (row, limit) once at READ_BPS; merge the points into budget-curve.json."""
    from tqdm import tqdm

    from membound_integration.budget.suite import _stamp, measure_profile
    from membound_integration.demo import _row_functions, run_prepare
    from membound_testing.budget.cgroup import block_device_of
    from membound_testing.budget.profiles import Profile
    from membound_testing.models import cache_dir
    from membound_testing.results import write_json_atomic

    modules = {r: m for m, r in _row_functions()}
    unknown = set(rows) - set(modules)
    if unknown:
        raise ValueError(f"unknown rows {sorted(unknown)}; rows are {sorted(modules)}")
    run_prepare(sorted({modules[r] for r in rows}))
    device = block_device_of(cache_dir())
    curve = load()
    run_id = _stamp()["date"]
    steps = [(r, lim) for r in rows for lim in limits_mib]
    for row_id, limit in tqdm(steps, desc="curve", unit="run"):
        profile = Profile(f"{limit} MiB", limit * MiB, READ_BPS, "budget curve point")
        got = measure_profile(modules[row_id], row_id, profile, device, timeout)
        got["run"] = run_id
        curve["rows"].setdefault(row_id, {})[str(limit)] = got
        tqdm.write(f"{row_id} @ {limit} MiB: {got['status']}, {got.get('tokens_per_s')} tok/s")
        write_json_atomic(curve_json(), curve)
    return curve


def svg(curve: dict, width: int = 640, height: int = 360) -> str:
    """The SVG line chart of a "curve" entry: x the hard limit (MiB), y tokens/s (log)."""
    rows = {r: pts for r, pts in curve["rows"].items() if pts}
    limits = sorted({int(k) for pts in rows.values() for k in pts})
    good = [
        p["tokens_per_s"]
        for pts in rows.values()
        for p in pts.values()
        if p.get("completed") and p.get("correct")
    ]
    if not limits:
        raise ValueError("no curve points to draw")
    # A log scale: the rows differ by multiples (0.2 against 0.7 tokens/s under a tight
    # limit, 12 against 14 with room), which a linear one squashes onto the axis.
    low = 10 ** math.floor(math.log10(min(good, default=1.0)))
    top = max(max(good, default=1.0) * 1.2, low * 10)
    left, right, bottom, upper = 56, width - 190, height - 44, 16

    def x(limit):
        lo, hi = limits[0], limits[-1]
        return left + (right - left) * (limit - lo) / max(hi - lo, 1)

    def y(tps):
        return bottom - (bottom - upper) * math.log(tps / low) / math.log(top / low)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{upper}" x2="{left}" y2="{bottom}" stroke="black"/>',
        f'<text x="{(left + right) / 2}" y="{height - 8}" text-anchor="middle">hard memory '
        f"limit (MiB), reads at {curve['read_bps'] / 1e6:.0f} MB/s</text>",
        f'<text x="14" y="{(upper + bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(upper + bottom) / 2})">tokens/s (log)</text>',
    ]
    for limit in limits:
        out.append(
            f'<text x="{x(limit):.1f}" y="{bottom + 14}" text-anchor="middle">{limit}</text>'
        )
    ticks = [d * m for d in (low * 10**i for i in range(8)) for m in (1, 2, 5)]
    for tps in [t for t in ticks if t <= top]:
        out.append(f'<text x="{left - 6}" y="{y(tps) + 4:.1f}" text-anchor="end">{tps:g}</text>')
    for n, (row_id, pts) in enumerate(rows.items()):
        colour = COLOURS[n % len(COLOURS)]
        ok = sorted(
            (int(k), p["tokens_per_s"])
            for k, p in pts.items()
            if p.get("completed") and p.get("correct")
        )
        failed = sorted(
            int(k) for k, p in pts.items() if not (p.get("completed") and p.get("correct"))
        )
        if len(ok) > 1:
            path = " ".join(f"{x(lim):.1f},{y(t):.1f}" for lim, t in ok)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        for lim, t in ok:
            out.append(f'<circle cx="{x(lim):.1f}" cy="{y(t):.1f}" r="3" fill="{colour}"/>')
        for lim in failed:
            cx, cy = x(lim), bottom - 4 - 4 * n
            out.append(f'<path d="M{cx - 3:.1f},{cy - 3:.1f} l6,6 m0,-6 l-6,6" stroke="{colour}"/>')
        ly = upper + 14 + 18 * n
        out.append(
            f'<line x1="{right + 12}" y1="{ly - 4}" x2="{right + 30}" y2="{ly - 4}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{right + 36}" y="{ly}">{escape(row_id)}</text>')
    out.append(
        f'<text x="{right + 12}" y="{upper + 14 + 18 * len(rows) + 8}">x: OOM-killed, timed '
        "out or wrong</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_svg(curve: dict) -> Path | None:
    """Write results/budget-curve.svg from ``curve`` (None when it has no point)."""
    if not curve.get("rows"):
        return None
    path = curve_json().with_suffix(".svg")
    tmp = path.with_suffix(".svg.tmp")
    tmp.write_text(svg(curve))
    tmp.replace(path)
    return path
