"""A memory cgroup (and an I/O-throttled block cgroup) for one child process.

The kernel enforces a container's memory limit through the memory controller: under it,
clean file-backed pages (mmap'd weights, the page cache) are reclaimed and read again
when touched, and anonymous memory that does not fit gets the process OOM-killed. This
module makes such a group the way a container runtime does:

- cgroup v2 where the unified hierarchy has the memory controller and is writable:
  ``memory.max``, ``memory.swap.max = 0``, ``io.max rbps=``;
- otherwise cgroup v1: ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` to
  the same value, so the group cannot swap), ``blkio.throttle.read_bps_device``.

It reads the group's own counters: anonymous and file-backed bytes, bytes read from
storage, and OOM kills. Where no memory cgroup is writable it raises
:class:`CgroupUnavailable`, whose message says why, and measures nothing else instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup")
V2_CANDIDATES = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
# The exit status of the wrapper when the child could not join its group: the command
# never ran, so nothing it would have measured is reported.
JOIN_FAILED = 125


class CgroupUnavailable(RuntimeError):
    """No writable memory cgroup on this machine (the message says what was tried)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """The group's memory and I/O counters at one instant (bytes)."""

    anon: int  # anonymous + shmem: what cannot be reclaimed without swap
    file_mapped: int  # file pages mapped into the group's processes (mmap'd weights)
    cache: int  # all page cache charged to the group (mapped or not)
    read: int  # bytes read from the block device


def block_device_of(path: str | os.PathLike) -> str:
    """``"MAJ:MIN"`` of the whole block device holding ``path`` (throttles take whole
    disks, not partitions)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysdev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sysdev.exists():
        raise CgroupUnavailable(
            f"{path} is on device {major}:{minor}, which is not a block device "
            "(an overlay or network filesystem): its reads cannot be throttled or counted"
        )
    if (sysdev / "partition").exists():
        parent = (sysdev.resolve().parent / "dev").read_text().strip()
        return parent
    return f"{major}:{minor}"


def _own_cgroup(controller: str) -> str:
    """This process's cgroup path (relative) in the v1 hierarchy of ``controller``, or in
    the unified one for ``controller=""``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") if controller else controllers == "":
            return path.lstrip("/")
    return ""


def _v2_root() -> Path | None:
    for root in V2_CANDIDATES:
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return root
    return None


def _mkgroup(parents: list[Path], name: str) -> Path:
    """Make ``name`` under the first parent that lets us; the error lists every try."""
    errors = []
    for parent in parents:
        group = parent / name
        try:
            group.mkdir()
            return group
        except OSError as exc:
            errors.append(f"{group}: {exc.strerror}")
    raise CgroupUnavailable("cannot create a cgroup: " + "; ".join(errors))


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot write {value!r} to {path}: {exc.strerror}") from None


def _count_reads_v1(blkio: Path) -> None:
    """Make cgroup v1 count the group's reads on every disk.

    v1's read counter (``blkio.throttle.io_service_bytes``) is kept by the throttle, which
    recent kernels (6.x) set up for a disk only when a throttle rule is first written for
    it since boot. Until then the counter stays at 0. Seen once: on a freshly booted machine,
    before any throttled run, an unthrottled run reported ``read_bytes`` 0 for a 320 MiB
    file it mapped under a 128 MiB limit; once a throttled run had happened, no rerun did.
    A rule of 0 (no limit) sets the throttle up without limiting anything. Disks that refuse
    a rule are left alone (their reads are then not counted).
    """
    for dev in sorted(Path("/sys/block").glob("*/dev")):
        with contextlib.suppress(OSError):
            (blkio / "blkio.throttle.read_bps_device").write_text(f"{dev.read_text().strip()} 0")


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


class Cgroup:
    """A fresh memory group (and block group) with a hard limit; remove with close().

    ``memory_bytes``: the hard limit. ``read_bps``: a read-bandwidth limit on ``device``
    (``"MAJ:MIN"``), or None for none. Counters are read from the group itself.
    """

    def __init__(self, memory_bytes: int, read_bps: int | None = None, device: str | None = None):
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0, got {memory_bytes}")
        if read_bps is not None and (read_bps <= 0 or device is None):
            raise ValueError("read_bps needs a positive rate and a device")
        self.memory_bytes = memory_bytes
        self.read_bps = read_bps
        self.device = device
        self.groups: list[Path] = []
        name = f"membound-budget-{os.getpid()}-{time.monotonic_ns()}"
        try:
            v2 = _v2_root()
            if v2 is not None:
                self.version = 2
                self._setup_v2(v2, name)
            else:
                self.version = 1
                self._setup_v1(name)
        except BaseException:
            self.close()
            raise

    # --- setup -------------------------------------------------------------------------

    def _setup_v2(self, root: Path, name: str) -> None:
        own = root / _own_cgroup("")
        group = _mkgroup([own, root] if own != root else [root], name)
        self.groups.append(group)
        parent = group.parent
        enabled = (parent / "cgroup.subtree_control").read_text().split()
        for controller in ("memory", "io"):
            if controller not in enabled:
                with contextlib.suppress(CgroupUnavailable):
                    _write(parent / "cgroup.subtree_control", f"+{controller}")
        if not (group / "memory.max").exists():
            raise CgroupUnavailable(f"{group}: the memory controller is not enabled")
        _write(group / "memory.max", str(self.memory_bytes))
        if (group / "memory.swap.max").exists():
            _write(group / "memory.swap.max", "0")
        if self.read_bps is not None:
            _write(group / "io.max", f"{self.device} rbps={self.read_bps}")
        self.memory_dir = self.io_dir = group

    def _setup_v1(self, name: str) -> None:
        if not (V1 / "memory" / "memory.limit_in_bytes").exists():
            raise CgroupUnavailable(
                "no cgroup v2 memory controller and no cgroup v1 memory hierarchy at "
                f"{V1 / 'memory'}"
            )
        mem_parents = [V1 / "memory" / _own_cgroup("memory"), V1 / "memory"]
        memory = _mkgroup(list(dict.fromkeys(mem_parents)), name)
        self.groups.append(memory)
        _write(memory / "memory.limit_in_bytes", str(self.memory_bytes))
        # No swap for the group: the limit is on memory + swap too.
        if (memory / "memory.memsw.limit_in_bytes").exists():
            _write(memory / "memory.memsw.limit_in_bytes", str(self.memory_bytes))
        _write(memory / "memory.swappiness", "0")
        self.memory_dir = memory
        self.io_dir = None
        if (V1 / "blkio").is_dir():
            blk_parents = [V1 / "blkio" / _own_cgroup("blkio"), V1 / "blkio"]
            blkio = _mkgroup(list(dict.fromkeys(blk_parents)), name)
            self.groups.append(blkio)
            _count_reads_v1(blkio)
            if self.read_bps is not None:
                _write(blkio / "blkio.throttle.read_bps_device", f"{self.device} {self.read_bps}")
            self.io_dir = blkio
        elif self.read_bps is not None:
            raise CgroupUnavailable(f"no blkio hierarchy at {V1 / 'blkio'} to throttle reads")

    # --- use -----------------------------------------------------------------------------

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` prefixed so that it joins the group(s) before it execs: nothing it
        runs, not even the interpreter's start, is outside the limit."""
        joins = " ".join(
            f'echo $$ > "{g}/cgroup.procs" || exit {JOIN_FAILED};' for g in self.groups
        )
        return ["/bin/sh", "-c", f'{joins} exec "$@"', "membound-budget", *command]

    def sample(self) -> Sample:
        if self.version == 2:
            s = _stat(self.memory_dir / "memory.stat")
            anon, mapped, cache = (
                s.get("anon", 0) + s.get("shmem", 0),
                s.get("file_mapped", 0),
                s.get("file", 0),
            )
        else:
            s = _stat(self.memory_dir / "memory.stat")
            anon = s.get("total_rss", 0) + s.get("total_shmem", 0)
            mapped, cache = s.get("total_mapped_file", 0), s.get("total_cache", 0)
        return Sample(anon=anon, file_mapped=mapped, cache=cache, read=self.read_bytes())

    def read_bytes(self) -> int:
        """Bytes the group has read from block devices (the throttled disk included)."""
        return read_bytes_of(self.io_counter_path())

    def io_counter_path(self) -> str | None:
        if self.version == 2:
            return str(self.io_dir / "io.stat")
        if self.io_dir is None:
            return None
        return str(self.io_dir / "blkio.throttle.io_service_bytes")

    def oom_kills(self) -> int:
        if self.version == 2:
            return _stat_kv(self.memory_dir / "memory.events").get("oom_kill", 0)
        return _stat_kv(self.memory_dir / "memory.oom_control").get("oom_kill", 0)

    def peak_usage(self) -> int | None:
        """The kernel's own peak of charged memory (anon + page cache), where it keeps one."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        path = self.memory_dir / name
        return int(path.read_text()) if path.exists() else None

    def close(self) -> None:
        """Kill whatever is left in the groups and remove them."""
        for group in reversed(self.groups):
            procs = group / "cgroup.procs"
            for _ in range(50):
                try:
                    pids = [int(p) for p in procs.read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                time.sleep(0.02)
            with contextlib.suppress(OSError):
                group.rmdir()
        self.groups = []

    def __enter__(self) -> Cgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stat_kv(path: Path) -> dict[str, int]:
    return _stat(path) if path.exists() else {}


def read_bytes_of(counter: str | None) -> int:
    """Bytes read, summed over devices, from a v1 ``blkio.throttle.io_service_bytes`` or a
    v2 ``io.stat`` file; 0 where there is no counter."""
    if not counter:
        return 0
    total = 0
    for line in Path(counter).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":  # v1: "MAJ:MIN Read N"
            total += int(parts[2])
        elif parts and ":" in parts[0]:  # v2: "MAJ:MIN rbytes=N wbytes=N ..."
            for field in parts[1:]:
                if field.startswith("rbytes="):
                    total += int(field[7:])
    return total


def mapped_by_processes(root: Path) -> list[str]:
    """Every process's mappings of files under ``root`` (this process's too), one line per
    process: ``"pid 123 (python suite.py ...) maps /root/.cache/membound/x.safetensors"``.

    A page that a process maps cannot be dropped from the page cache, and stays charged to
    that process's group: a run in a new group then reads it for free, and a hard limit
    does not bind on it (a benchmark left running that maps the same safetensors made the
    plain model run at 22 tokens/s under the tight profile's 480 MiB)."""
    prefix = str(Path(root).resolve()) + os.sep
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "maps").read_text().splitlines()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        paths = sorted({f[5] for f in (line.split(maxsplit=5) for line in lines) if len(f) == 6})
        hits = [p for p in paths if p.startswith(prefix)]
        if hits:
            more = f" and {len(hits) - 1} more" if len(hits) > 1 else ""
            found.append(f"pid {entry.name} ({cmd.strip()[:80]}) maps {hits[0]}{more}")
    return found


def drop_page_cache() -> str | None:
    """Write back dirty pages and drop the clean page cache, so a run reads its weights
    from storage. Returns None, or why it could not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"could not drop the page cache (/proc/sys/vm/drop_caches: {exc.strerror})"
    return None
