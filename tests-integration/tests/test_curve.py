"""The budget curve's SVG: one line per row through its good points, a cross on the axis for
each limit where the row did not run (no measurement is made here)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from membound_integration.budget.curve import svg

NS = "{http://www.w3.org/2000/svg}"


def _point(tps=None, status="ok", correct=True):
    done = tps is not None
    return {"completed": done, "correct": correct, "status": status, "tokens_per_s": tps}


def test_lines_through_good_points_and_crosses_where_a_row_failed():
    curve = {
        "read_bps": 200_000_000,
        "rows": {
            "plain": {"480": _point(0.3), "900": _point(2.0), "2048": _point(20.0)},
            "combined": {
                "384": _point(status="OOM-killed"),
                "480": _point(1.0),
                "900": _point(1.5, correct=False),
                "2048": _point(18.0),
            },
        },
    }
    root = ET.fromstring(svg(curve))
    lines = root.findall(f"{NS}polyline")
    assert len(lines) == 2
    # plain: three points; combined: the two right answers only
    assert [len(p.get("points").split()) for p in lines] == [3, 2]
    assert len(root.findall(f"{NS}circle")) == 5
    crosses = [p for p in root.findall(f"{NS}path")]
    assert len(crosses) == 2  # combined at 384 (OOM) and 900 (wrong answer)
    labels = [t.text for t in root.findall(f"{NS}text")]
    assert {"plain", "combined", "384", "2048"} <= set(labels)
    # The highest point is drawn highest: y grows downwards.
    ys = {float(c.get("cy")) for c in root.findall(f"{NS}circle")}
    top = min(ys)
    assert top == min(float(p.split(",")[1]) for p in lines[0].get("points").split())


def test_no_points_is_an_error():
    with pytest.raises(ValueError, match="no curve points"):
        svg({"read_bps": 1, "rows": {"plain": {}}})
