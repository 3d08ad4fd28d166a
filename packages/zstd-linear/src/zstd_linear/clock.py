"""The pass clock: which forward pass of the root module is running."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


class PassClock:
    """Counts forward passes of one root module.

    ``compress_model`` attaches one to the root module; a forward pre-hook advances
    it, and every CompressedLinear of that model reads the same clock, so "a new
    pass began" needs no module-level global and no patched ``forward``.
    """

    def __init__(self):
        self.index = 0
        self._listeners: list[Callable[[int], None]] = []
        self._handle = None

    def subscribe(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(new_index)`` at the start of every pass."""
        self._listeners.append(listener)

    def advance(self) -> int:
        self.index += 1
        for listener in self._listeners:
            listener(self.index)
        return self.index

    def attach(self, root: nn.Module) -> None:
        if self._handle is not None:
            raise RuntimeError("this PassClock is already attached to a module")
        self._handle = root.register_forward_pre_hook(self._pre_hook)

    def _pre_hook(self, module: nn.Module, args) -> None:
        # Returns None: a pre-hook's return value would replace the forward's arguments.
        self.advance()

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
