"""Run a command under a hard memory limit (and a read-bandwidth limit), and bisect the
smallest limit under which it still gives the right answer."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from membound_testing.budget.cgroup import (
    JOIN_FAILED,
    Cgroup,
    CgroupUnavailable,
    Sample,
    drop_page_cache,
    mapped_by_processes,
    read_bytes_of,
)

MiB = 2**20
# The environment variable through which a child learns its group's I/O counter, so that
# it can count the bytes it reads from storage while it decodes (row.py).
IO_COUNTER_ENV = "MEMBOUND_IO_COUNTER"


@dataclasses.dataclass
class RunResult:
    """One command's run under a limit. Peaks are sampled from the group's counters."""

    returncode: int
    oom_killed: bool
    timed_out: bool
    wall_s: float
    peak_anon: int
    peak_file_mapped: int
    peak_cache: int
    peak_usage: int | None  # the kernel's own peak of charged memory, where it keeps one
    peak_rss_anon: int  # the process's own view (/proc/PID/status RssAnon + RssShmem)
    peak_rss_file: int  # file pages mapped by the process, wherever they are charged
    read_bytes: int  # from storage, over the whole run
    stdout: str
    stderr: str
    cache_note: str | None  # why the page cache could not be dropped, if it could not
    cgroup_version: int = 1

    @property
    def completed(self) -> bool:
        return self.returncode == 0 and not self.oom_killed and not self.timed_out

    @property
    def status(self) -> str:
        if self.oom_killed:
            return "OOM-killed"
        if self.timed_out:
            return "timed out"
        if self.returncode < 0:
            return f"killed by {signal.Signals(-self.returncode).name}"
        return "ok" if self.returncode == 0 else f"exit {self.returncode}"


class MappedElsewhere(RuntimeError):
    """A process maps model files that a limited run would read: no measurement is made."""


def run_limited(
    command: list[str],
    memory_bytes: int,
    read_bps: int | None = None,
    device: str | None = None,
    drop_cache: bool = True,
    timeout: float | None = None,
    interval: float = 0.005,
    env: dict | None = None,
) -> RunResult:
    """Run ``command`` in a fresh process inside a new cgroup limited to ``memory_bytes``
    (no swap), with reads from ``device`` throttled to ``read_bps`` bytes/s if given.

    The page cache is dropped first (``cache_note`` says if that failed). The group's
    memory counters are sampled every ``interval`` seconds for the anonymous and
    file-backed peaks (a spike shorter than that can be missed; ``peak_usage``, the
    kernel's own peak of both together, misses nothing). A run past
    ``timeout`` seconds is killed and reported as timed out. Raises CgroupUnavailable
    where no cgroup can be made, and MappedElsewhere, before the run, where a process
    (this one too) maps a file under membound's model cache (``$MEMBOUND_CACHE``): those
    pages cannot be dropped and the limit would not bind on them.
    """
    note = drop_page_cache() if drop_cache else None
    if drop_cache:
        from membound_testing.models import cache_dir

        holders = mapped_by_processes(cache_dir())
        if holders:
            raise MappedElsewhere(
                f"{holders[0]}{f' (and {len(holders) - 1} other processes)' if len(holders) > 1 else ''}"
                ": pages a process maps stay in the page cache, charged to its group, so a "
                "run would read them for free and the limit would not bind on them; stop "
                "it (or let it exit) and run again"
            )
    with Cgroup(memory_bytes, read_bps, device) as group:
        child_env = dict(os.environ if env is None else env)
        counter = group.io_counter_path()
        if counter:
            child_env[IO_COUNTER_ENV] = counter
        peaks = {"anon": 0, "file_mapped": 0, "cache": 0, "rss_anon": 0, "rss_file": 0}
        stop = threading.Event()

        def sampler() -> None:
            while True:
                s: Sample = group.sample()
                for key in ("anon", "file_mapped", "cache"):
                    peaks[key] = max(peaks[key], getattr(s, key))
                anon, file = _proc_rss(proc.pid)
                peaks["rss_anon"] = max(peaks["rss_anon"], anon)
                peaks["rss_file"] = max(peaks["rss_file"], file)
                if stop.wait(interval):
                    return

        start = time.perf_counter()
        proc = subprocess.Popen(
            group.wrap(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env=child_env,
        )
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            stdout, stderr = proc.communicate()
        wall = time.perf_counter() - start
        stop.set()
        thread.join()
        if proc.returncode == JOIN_FAILED and "cgroup.procs" in stderr:
            raise CgroupUnavailable(f"the child could not join its cgroup: {stderr.strip()}")
        final = group.sample()
        oom = group.oom_kills() > 0
        return RunResult(
            returncode=proc.returncode,
            oom_killed=oom,
            timed_out=timed_out,
            wall_s=wall,
            peak_anon=max(peaks["anon"], final.anon),
            peak_file_mapped=max(peaks["file_mapped"], final.file_mapped),
            peak_cache=max(peaks["cache"], final.cache),
            peak_usage=group.peak_usage(),
            peak_rss_anon=peaks["rss_anon"],
            peak_rss_file=peaks["rss_file"],
            read_bytes=final.read,
            stdout=stdout,
            stderr=stderr,
            cache_note=note,
            cgroup_version=group.version,
        )


def _proc_rss(pid: int) -> tuple[int, int]:
    """(RssAnon + RssShmem, RssFile) of a live process, in bytes; zeros once it is gone.

    The group's counters only see pages charged to the group: a file page that another
    process had already read (the same weights mapped by a test session, say) stays
    charged there and is not dropped with the page cache. RssFile counts every file page
    the process maps, wherever it is charged."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    anon += int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return anon, file


@dataclasses.dataclass
class Bisection:
    """The smallest limit found (None if even ``hi`` failed) and every try, in order."""

    min_bytes: int | None
    resolution: int
    tries: list[tuple[int, bool, str]]  # (limit, passed, status)

    def describe(self) -> str:
        if self.min_bytes is None:
            limit, _, status = self.tries[-1]
            return f"fails even at {limit // MiB} MiB ({status})"
        return f"{self.min_bytes // MiB} MiB (±{self.resolution // MiB})"


def bisect_min_limit(
    passes: Callable[[int], tuple[bool, str]],
    lo: int,
    hi: int,
    resolution: int = 16 * MiB,
    *,
    fallback_hi: int | None = None,
) -> Bisection:
    """The smallest limit in (lo, hi], to ``resolution``, at which ``passes(limit)`` holds.

    ``passes(limit) -> (ok, status)`` runs the job once under ``limit``. ``hi`` is tried
    first (if it fails, there is no answer, unless ``fallback_hi`` > ``hi`` is given: then
    the search goes on in (hi, fallback_hi], every try kept); ``lo`` is taken to fail
    without a try unless the search comes down to it. Passing is assumed monotone in the
    limit.
    """
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    if resolution <= 0:
        raise ValueError(f"resolution must be > 0, got {resolution}")
    tries = []
    ok, status = passes(hi)
    tries.append((hi, ok, status))
    if not ok:
        if fallback_hi is not None and fallback_hi > hi:
            more = bisect_min_limit(passes, hi, fallback_hi, resolution)
            return Bisection(more.min_bytes, more.resolution, tries + more.tries)
        return Bisection(None, resolution, tries)
    good, bad = hi, lo
    while good - bad > resolution:
        mid = (good + bad) // 2
        mid -= mid % MiB  # whole MiB, as a container's limit is written
        if mid <= bad:
            break
        ok, status = passes(mid)
        tries.append((mid, ok, status))
        if ok:
            good = mid
        else:
            bad = mid
    return Bisection(good, resolution, tries)


def storage_read_bytes() -> int:
    """Bytes this process has read from storage so far: its cgroup's own counter when the
    budget runner runs it (``MEMBOUND_IO_COUNTER``), else ``read_bytes`` of /proc/self/io."""
    counter = os.environ.get(IO_COUNTER_ENV)
    if counter:
        return read_bytes_of(counter)
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
