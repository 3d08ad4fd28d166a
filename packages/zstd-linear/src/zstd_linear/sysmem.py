"""What the process may hold and holds: its cgroup's hard memory limit, the machine's
memory, and its resident pages (the budget policy's ``memory_limit`` sizing)."""

from __future__ import annotations

import os
from pathlib import Path

UNLIMITED = 1 << 62  # a cgroup v1 limit at or above this means none (the kernel writes ~2**63)


def _mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(cgroup v1 memory mounts, cgroup v2 mounts), each as (root in the hierarchy, mount
    point), from the text of /proc/self/mountinfo."""
    v1, v2 = [], []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if not after:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if after[0] == "cgroup2":
            v2.append((root, point))
        elif after[0] == "cgroup" and "memory" in (after[-1].split(",") if len(after) > 2 else []):
            v1.append((root, point))
    return v1, v2


def _walk_limits(point: str, root: str, path: str, file: str) -> list[int]:
    """The limits written in ``file`` of the group at hierarchy ``path`` and of every
    group above it that the mount (of hierarchy ``root`` at ``point``) shows."""
    rel = path
    if root != "/" and (path == root or path.startswith(root.rstrip("/") + "/")):
        rel = path[len(root) :]
    elif root != "/":
        rel = "/"  # a namespaced mount shows our group as its root
    parts = [p for p in rel.split("/") if p]
    limits = []
    for depth in range(len(parts), -1, -1):
        target = Path(point, *parts[:depth], file)
        try:
            text = target.read_text().strip()
        except OSError:
            continue
        if text != "max":
            try:
                value = int(text)
            except ValueError:
                continue
            if value < UNLIMITED:
                limits.append(value)
    return limits


def cgroup_memory_limit(proc: str | os.PathLike = "/proc/self") -> int | None:
    """The hard memory limit of the cgroups this process is in, in bytes: the smallest
    ``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) of its group and the groups
    above it; None where no group sets one (or cgroups are not mounted)."""
    proc = Path(proc)
    try:
        groups = (proc / "cgroup").read_text()
        v1_mounts, v2_mounts = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return None
    limits: list[int] = []
    for line in groups.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            for root, point in v2_mounts:
                limits += _walk_limits(point, root, path, "memory.max")
        elif "memory" in controllers.split(","):
            for root, point in v1_mounts:
                limits += _walk_limits(point, root, path, "memory.limit_in_bytes")
    return min(limits) if limits else None


def physical_memory() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def process_memory_limit() -> int:
    """What ``memory_limit="auto"`` stands for: the cgroup's hard limit
    (``cgroup_memory_limit``), or the machine's memory where there is none."""
    limit = cgroup_memory_limit()
    return min(limit, physical_memory()) if limit is not None else physical_memory()


def resident_bytes(skip: list[int] = ()) -> int:
    """What the process holds resident now and needs to go on: its anonymous pages and
    the pages of the files it maps (shared libraries' code and data above all, which a
    limit too tight for them makes the kernel read again and again), except the mappings
    that hold an address in ``skip`` (the compressed frames, counted apart). From the Rss
    of each mapping in /proc/self/smaps."""
    total = 0
    counted = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if not head:
                continue
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                file_backed = head[4] != "0"
                counted = not (file_backed and any(lo <= a < hi for a in skip))
            elif counted and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total
