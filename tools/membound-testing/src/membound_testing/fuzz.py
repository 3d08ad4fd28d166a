"""A mutation fuzzer for membound's loaders: damaged files must be refused cleanly.

Each mutant is a copy of a good file (or of one file inside a good directory) with one
seeded mutation: a truncation, flipped bytes anywhere or in the header, a zeroed range,
appended junk, a duplicated range, or, for JSON and safetensors headers, one field
rewritten to a huge, negative, fractional, NaN, wrong-typed or missing value (with the
length prefix kept right, so the structure checks are what is tested).

Mutants are loaded in batches, each batch in a fresh Python process with a timeout, by a
*checker*: a function ``check(path: str) -> bool`` named as ``"module:function"`` that
loads ``path`` (the mutated file, or the directory holding it), returns True if what it
loaded equals what was written and False if it differs, and raises if the loader refused.
Each mutant is classed:

- ``clean``: refused with one of the package's error types (``clean_errors``);
- ``unclear``: refused with any other exception (IndexError, struct.error, ...);
- ``crash``: the process died of a signal;
- ``hang``: over the timeout;
- ``silent``: loaded, but the data differs from what was written;
- ``benign``: loaded, and the data is identical.

A batch whose process dies is re-run one mutant per process, so a crash is pinned on the
mutant that caused it. Tests assert ``report.bad == {}`` (no crash, hang, silent or
unclear); benchmarks run thousands and write the counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

CLASSES = ("clean", "unclear", "crash", "hang", "silent", "benign")
BAD = ("unclear", "crash", "hang", "silent")

# Values a JSON field is rewritten to: out of range, of the wrong type, or absurdly large.
ODD_VALUES = [
    0,
    -1,
    1,
    2**31,
    2**40,
    2**64,
    -(2**63),
    1.5,
    -0.5,
    math.nan,
    math.inf,
    "x",
    "",
    "no",
    True,
    False,
    None,
    [],
    {},
    [1, 2],
]


def _leaves(obj, path=()):
    """Every (path, value) in a JSON object, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def mutate_json(obj, rng: random.Random):
    """A deep copy of ``obj`` with one field rewritten, deleted, or one key added."""
    obj = json.loads(json.dumps(obj))
    leaves = [p for p, _ in _leaves(obj) if p]
    if not leaves:
        return ODD_VALUES[rng.randrange(len(ODD_VALUES))]
    path = leaves[rng.randrange(len(leaves))]
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    roll = rng.random()
    if roll < 0.1 and isinstance(parent, dict):
        del parent[key]
    elif roll < 0.15 and isinstance(parent, dict):
        parent[f"unknown_{rng.randrange(100)}"] = 1
    elif roll < 0.3 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] = parent[key] + rng.choice([-2, -1, 1, 2, 7, 4096])
    elif roll < 0.4 and isinstance(parent[key], list) and parent[key]:
        parent[key] = parent[key][::-1] if rng.random() < 0.5 else parent[key][:-1]
    else:
        parent[key] = ODD_VALUES[rng.randrange(len(ODD_VALUES))]
    return obj


def _dumps(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


def mutate_json_bytes(data: bytes, rng: random.Random) -> bytes:
    """A JSON file with one field rewritten (the file's own structure kept)."""
    return _dumps(mutate_json(json.loads(data), rng))


def mutate_safetensors_header(data: bytes, rng: random.Random) -> bytes:
    """A safetensors file whose JSON header has one field rewritten; the 8-byte length
    prefix is recomputed so the header still parses as JSON."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    new = _dumps(mutate_json(header, rng))
    return struct.pack("<Q", len(new)) + new + data[8 + n :]


def mutate_bytes(data: bytes, rng: random.Random, header_bytes: int = 64) -> bytes:
    """One byte-level mutation of ``data``."""
    n = len(data)
    kind = rng.randrange(7)
    if kind == 0 or n < 2:  # truncate
        return data[: rng.randrange(n)] if n else b"\0"
    buf = bytearray(data)
    if kind == 1:  # flip a byte anywhere
        i = rng.randrange(n)
        buf[i] ^= rng.randrange(1, 256)
    elif kind == 2:  # flip a byte in the header
        i = rng.randrange(min(n, header_bytes))
        buf[i] ^= rng.randrange(1, 256)
    elif kind == 3:  # zero a range
        i = rng.randrange(n)
        length = min(rng.randrange(1, 256), n - i)
        buf[i : i + length] = bytes(length)
    elif kind == 4:  # append junk
        buf += rng.randbytes(rng.randrange(1, 512))
    elif kind == 5:  # duplicate a range inside the file
        i, j = rng.randrange(n), rng.randrange(n)
        length = rng.randrange(1, 64)
        buf[j : j + length] = data[i : i + length]
    else:  # several flips
        for _ in range(rng.randrange(2, 9)):
            i = rng.randrange(n)
            buf[i] ^= rng.randrange(1, 256)
    return bytes(buf)


@dataclasses.dataclass
class Target:
    """One file to damage. ``root`` is a file, or a directory whose file ``relpath`` is
    damaged (the checker gets the mutant directory). ``structured`` is a mutation that
    knows the format (``mutate_json_bytes``, ``mutate_safetensors_header``, or one of the
    package's own); it is used for a ``structured_share`` of the mutants (half by default,
    the rest byte-level). A file that only carries a test's arguments (a JSON of config
    fields, say), which the package never parses itself, takes ``structured_share=1.0``:
    a truncated JSON there would test the harness, not the package."""

    root: Path
    relpath: str | None = None
    structured: object = None
    header_bytes: int = 64
    structured_share: float = 0.5

    def data(self) -> bytes:
        path = self.root / self.relpath if self.relpath else self.root
        return path.read_bytes()


@dataclasses.dataclass
class Report:
    counts: Counter
    examples: dict  # class -> list of (mutant description, detail)
    seed: int

    @property
    def bad(self) -> dict:
        return {c: self.counts[c] for c in BAD if self.counts[c]}

    def summary(self) -> str:
        counts = ", ".join(f"{c} {self.counts[c]}" for c in CLASSES)
        lines = [f"seed {self.seed}: {counts}"]
        for c in BAD:
            for desc, detail in self.examples.get(c, [])[:5]:
                lines.append(f"  {c}: {desc}: {detail}")
        return "\n".join(lines)


def _make_mutant(target: Target, data: bytes, out: Path) -> Path:
    """Write a mutant: the file itself, or a copy of the directory with the file replaced
    (the other files hard-linked where possible)."""
    if target.relpath is None:
        out.write_bytes(data)
        return out
    out.mkdir()
    for src in target.root.rglob("*"):
        rel = src.relative_to(target.root)
        dst = out / rel
        if src.is_dir():
            dst.mkdir(exist_ok=True)
        elif str(rel) != target.relpath:
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
    (out / target.relpath).parent.mkdir(parents=True, exist_ok=True)
    (out / target.relpath).write_bytes(data)
    return out


_WORKER = r"""
import importlib, json, sys, traceback
checker, errors, paths = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
mod, fn = checker.split(":")
check = getattr(importlib.import_module(mod), fn)
clean = tuple(
    getattr(importlib.import_module(m), n) for m, n in (e.rsplit(".", 1) for e in errors)
)
for path in paths:
    try:
        same = check(path)
        out = ("benign" if same else "silent", "")
    except clean as exc:
        msg = str(exc)
        out = ("clean", msg[:300]) if msg.strip() else ("unclear", f"empty {type(exc).__name__}")
    except BaseException as exc:
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        out = ("unclear", f"{type(exc).__name__}: {str(exc)[:200]} at {tb.filename}:{tb.lineno}")
    print("FUZZ " + json.dumps([path, *out]), flush=True)
"""


def _run_batch(checker, errors, paths, timeout):
    """{path: (class, detail)} for the paths a worker process got through."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WORKER, checker, json.dumps(errors), *paths],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        return _parse(out or ""), "hang", ""
    died = "crash" if proc.returncode < 0 else ("unclear" if proc.returncode else None)
    return _parse(proc.stdout), died, proc.stderr[-400:]


def _parse(stdout: str) -> dict:
    done = {}
    for line in stdout.splitlines():
        if line.startswith("FUZZ "):
            path, cls, detail = json.loads(line[5:])
            done[path] = (cls, detail)
    return done


def run(
    targets: list[Target],
    checker: str,
    clean_errors: list[str],
    n: int,
    seed: int = 0,
    batch: int = 50,
    timeout: float = 60.0,
    hang_timeout: float = 20.0,
) -> Report:
    """Make ``n`` seeded mutants spread over ``targets``, load them with ``checker`` in
    batches of fresh processes, and class each one.

    ``clean_errors``: dotted names of the exception classes that count as a clean refusal
    (e.g. ``["zstd_linear.ZlinError"]``). ``timeout`` bounds a batch; a batch that runs
    out is re-run one mutant per process with ``hang_timeout``.
    """
    rng = random.Random(seed)
    counts: Counter = Counter()
    examples: dict = {}

    def record(cls, desc, detail):
        counts[cls] += 1
        if cls in BAD:
            examples.setdefault(cls, []).append((desc, detail))

    with tempfile.TemporaryDirectory(prefix="membound-fuzz-") as tmp:
        originals = [t.data() for t in targets]
        # The checker must accept the good files, or every count below means nothing.
        for k, target in enumerate(targets):
            good = _make_mutant(target, originals[k], Path(tmp) / f"good{k}")
            done, _, stderr = _run_batch(checker, clean_errors, [str(good)], timeout)
            if done.get(str(good), ("",))[0] != "benign":
                raise RuntimeError(
                    f"{checker} does not load the unmutated {target.root}: "
                    f"{done.get(str(good)) or stderr}"
                )
        descs: dict[str, str] = {}
        paths: list[str] = []
        for i in range(n):
            k = i % len(targets)
            target, data = targets[k], originals[k]
            if target.structured is not None and rng.random() < target.structured_share:
                mutant = target.structured(data, rng)
                how = f"structured({getattr(target.structured, '__name__', '?')})"
            else:
                mutant = mutate_bytes(data, rng, target.header_bytes)
                how = "bytes"
            if mutant == data:
                mutant = data + b"\0"
            name = Path(target.relpath or target.root.name).name
            path = _make_mutant(target, mutant, Path(tmp) / f"m{i:05d}-{name}")
            paths.append(str(path))
            descs[str(path)] = f"mutant {i} of {name} ({how}, seed {seed})"
        for start in range(0, len(paths), batch):
            chunk = paths[start : start + batch]
            done, _, _ = _run_batch(checker, clean_errors, chunk, timeout)
            for path in chunk:
                if path in done:
                    record(done[path][0], descs[path], done[path][1])
            rest = [p for p in chunk if p not in done]
            for path in rest:
                one, died_one, err = _run_batch(checker, clean_errors, [path], hang_timeout)
                if path in one:
                    record(one[path][0], descs[path], one[path][1])
                else:
                    record(died_one or "crash", descs[path], err.strip()[-200:])
    return Report(counts, examples, seed)


def json_benchmark(
    argv: list[str] | None,
    *,
    doc: str,
    tests_dir: Path,
    write_targets,
    checker: str,
    clean_errors: list[str],
    package: str,
    loader: str,
    title: str,
    notes: str,
    default_seed: int = 15,
) -> int:
    """The fuzz benchmark of a package that reads no file: its arguments or config are a
    JSON written by ``write_targets(dir) -> Path`` (from the package's tests), mutated by
    field only, loaded by ``checker``; writes ``benchmarks/results/fuzz.json`` beside
    ``tests_dir`` and returns 1 if any mutant was bad.

    ``--mutants N`` (default 2000), ``--seed``, ``--quick`` (400 mutants, nothing saved).
    """
    import argparse
    import time

    from membound_testing.results import write_result

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=2000, help="mutants per loader")
    parser.add_argument("--seed", type=int, default=default_seed)
    parser.add_argument(
        "--quick", action="store_true", help="400 mutants, results not saved (run_all --quick)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.mutants = 400
    # The worker processes import the checker from the tests directory.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tests_dir), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        target = Target(
            root=write_targets(Path(tmp)), structured=mutate_json_bytes, structured_share=1.0
        )
        start = time.perf_counter()
        report = run(
            [target], checker, clean_errors, n=args.mutants, seed=args.seed, batch=250, timeout=600
        )
        seconds = time.perf_counter() - start
    print(report.summary())
    bad = ", ".join(f"{report.counts[c]} {c}" for c in ("crash", "hang", "unclear", "silent"))
    script = f"packages/{package}/benchmarks/fuzz.py"
    write_result(
        tests_dir.parent / "benchmarks" / "results",
        package=package,
        name="fuzz",
        title=f"{title}, {args.mutants} seeded mutants, seed {args.seed}",
        command=f"hatch run {package}:python {script} --mutants {args.mutants} --seed {args.seed}",
        columns=["loader", "mutants", *CLASSES, "s"],
        rows=[[loader, args.mutants, *(report.counts[c] for c in CLASSES), round(seconds, 1)]],
        targets=[
            {
                "target": "0 crash, 0 hang, 0 unclear, 0 silent where the package wrote the file",
                "measured": f"{loader}: {bad}",
                "met": not report.bad,
            }
        ],
        save=not args.quick,
        notes=notes,
    )
    return 1 if report.bad else 0
