"""Device profiles: the (hard memory limit, storage read bandwidth) pairs every row is
measured under. Kept here, in one place; `hatch run budget` runs each of them."""

from __future__ import annotations

import dataclasses

MiB = 2**20
MB = 10**6


@dataclasses.dataclass(frozen=True)
class Profile:
    """A device: ``memory_bytes`` of hard limit and ``read_bps`` bytes/s of storage read
    bandwidth (None: the machine's own disk, unthrottled)."""

    name: str
    memory_bytes: int
    read_bps: int | None
    stands_for: str

    def describe(self) -> str:
        bw = "unthrottled" if self.read_bps is None else f"{self.read_bps // MB} MB/s"
        return f"{self.name} ({self.memory_bytes // MiB} MiB, {bw})"


PROFILES = {
    p.name: p
    for p in (
        Profile("tight", 480 * MiB, 200 * MB, "a small device: little RAM, slow flash"),
        Profile("mid", 900 * MiB, 500 * MB, "a phone-class device: some RAM, faster flash"),
        Profile("ample", 2048 * MiB, None, "a container with room to spare, local disk"),
    )
}
