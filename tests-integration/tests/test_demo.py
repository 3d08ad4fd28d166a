"""The demo's plain row runs in its own process and reports a real answer."""

import json
import subprocess
import sys


def test_plain_row_answers_and_reports_rss(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "membound_integration.demo", "--only", "plain", "--json", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert "Paris" in row["output"]
    assert row["peak_rss_bytes"] > row["resident_bytes"] > 100 * 2**20
    assert row["tokens_per_s"] > 0
