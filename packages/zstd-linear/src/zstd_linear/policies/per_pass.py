"""Policy ``per_pass``: the seed design, decode once per forward pass."""

from __future__ import annotations

import torch

from zstd_linear.policies.base import BackingStore, CachePolicy


class PerPass(CachePolicy):
    """Each layer decodes on its first call in a pass and reuses the weight within it.

    As in the seed, every layer keeps its own buffer between passes (refilled, never
    reallocated), so the peak is all decoded weights: use ``per_pass_prefetch`` to
    bound it.
    """

    name = "per_pass"

    def __init__(self, store: BackingStore):
        super().__init__(store)
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, torch.Tensor] = {}
        self._decoded_in: dict[str, int] = {}
        # Calls before the next pass starts (a layer called on its own, a policy set
        # between passes) share one pass, whatever the root module's count is.
        self._pass = 0

    def on_pass_start(self, index: int) -> None:
        self._pass = index

    def acquire(self, name: str) -> torch.Tensor:
        if self._decoded_in.get(name) != self._pass:
            buf = self._buffers.get(name)
            if buf is None:
                buf = self._buffers[name] = self.store.pool.dedicated(self.store.nbytes(name))
            self._weights[name] = self.store.decode(name, buf)
            self._decoded_in[name] = self._pass
        return self._weights[name]

    def keeps(self, name: str) -> bool:
        return True  # every layer keeps its own buffer between passes

    def close(self) -> None:
        for buf in self._buffers.values():
            self.store.pool.drop_dedicated(buf)
        self._buffers.clear()
        self._weights.clear()
        self._decoded_in.clear()
