"""Run every paired-cache benchmark, write results/*.json and refresh the README table.

hatch run paired-cache:bench [--quick]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import quality  # noqa: E402
import update_bench  # noqa: E402
from common import RESULTS  # noqa: E402

from paired_cache.microbench import markdown  # noqa: E402

README = HERE.parent / "README.md"
START, END = "<!-- measured:start -->", "<!-- measured:end -->"


def refresh_readme() -> None:
    """Rewrite the README's measured section from the JSON results."""
    parts = []
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        m = r["machine"]
        parts.append(f"**{r['title']}** ({m['cpu']}, {m['cores']} cores, {m['date']})\n")
        parts.append(markdown(r["columns"], r["rows"]) + "\n")
        for t in r["targets"]:
            parts.append(f"- {t['target']}: {t['measured']} — {'met' if t['met'] else 'NOT met'}")
        parts.append(f"\n{r['notes']}\n")
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{README} lacks the {START} / {END} markers")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    README.write_text(head + START + "\n" + "\n".join(parts) + "\n" + END + tail)


def main() -> None:
    quick = "--quick" in sys.argv
    update_bench.main(quick)
    quality.main(quick)
    if not quick:
        refresh_readme()


if __name__ == "__main__":
    main()
