"""Run every zstd-linear benchmark, write results/*.json and refresh the README table.

hatch run zstd-linear:bench            # full
hatch run zstd-linear:bench --quick    # smoke run (fewer repeats, smaller workloads)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import codec  # noqa: E402
import end_to_end  # noqa: E402
from common import RESULTS, markdown  # noqa: E402

README = HERE.parent / "README.md"
START, END = "<!-- measured:start -->", "<!-- measured:end -->"


def refresh_readme() -> None:
    parts = []
    for name in ("codec", "end_to_end"):
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        m = r["machine"]
        parts.append(f"**{r['title']}** ({m['cpu']}, {m['cores']} cores, {m['date']})\n")
        parts.append(markdown(r["columns"], r["rows"]))
        parts += [""] + [
            f"- {t['target']}: {t['measured']} — **{'met' if t['met'] else 'not met'}**"
            for t in r["targets"]
        ]
        parts += ["", f"_{r['notes']}_", ""]
    text = README.read_text()
    if START in text and END in text:
        head, rest = text.split(START, 1)
        _, tail = rest.split(END, 1)
        README.write_text(f"{head}{START}\n" + "\n".join(parts) + f"\n{END}{tail}")


def main() -> None:
    quick = "--quick" in sys.argv
    repeats = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--repeats=")), None)
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not only or "codec" in only:
        codec.run(quick=quick)
    if not only or "end_to_end" in only:
        end_to_end.run(quick=quick, repeats=repeats)
    refresh_readme()


if __name__ == "__main__":
    main()
