"""Model preparation: every one-time conversion the demo rows need, done once, before any
row is timed or measured.

That is the SmolLM2 GGUF fetched and dequantised to a float32 safetensors copy, the
zstd-linear .zlin files, the random MoE checkpoint and the diffulex-edge .pte. Each step
is cached under ``$MEMBOUND_CACHE`` (default ``~/.cache/membound``) and is a no-op when
its file exists, so no row's figures ever include a conversion.

    python -m membound_integration.prepare        # `hatch run prepare`; the demo runs it first
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from membound_integration.rows import ORDER


def steps(only: list[str] | None = None) -> list[tuple[str, object]]:
    """(name, function) of every rows module's PREPARE steps, in row order, each once."""
    found, seen = [], set()
    for module in ORDER:
        if only and module not in only:
            continue
        mod = importlib.import_module(f"membound_integration.rows.{module}")
        for fn in getattr(mod, "PREPARE", []):
            key = (fn.__module__, fn.__qualname__)
            if key not in seen:
                seen.add(key)
                found.append((f"{module}: {fn.__name__.strip('_')}", fn))
    return found


def prepare(only: list[str] | None = None) -> None:
    from tqdm import tqdm

    todo = steps(only)
    with tqdm(todo, desc="prepare", unit="step") as bar:
        for name, fn in bar:
            bar.set_postfix_str(name)
            start = time.perf_counter()
            result = fn()
            tqdm.write(f"prepare {name}: {result} ({time.perf_counter() - start:.1f} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=ORDER, help="rows modules to prepare")
    args = parser.parse_args(argv)
    prepare(args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
