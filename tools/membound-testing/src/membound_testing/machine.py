"""A short description of the machine, stamped on every benchmark result."""

from __future__ import annotations

import datetime as _dt
import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _simd() -> str | None:
    """The widest vector extension the CPU reports (/proc/cpuinfo flags): torch's float32
    kernels differ by it, so sums can round differently on two machines that share a CPU
    model name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
            else:
                return None
    except OSError:
        return None
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return None


def _mem_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict:
    """cpu, cores, memory, OS and Python, plus the UTC date of the measurement."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "simd": _simd(),
        "cores": os.cpu_count(),
        "mem_gib": _mem_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
