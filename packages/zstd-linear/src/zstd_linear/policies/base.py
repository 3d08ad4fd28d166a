"""The caching-policy interface: when is a layer's weight decoded, and when dropped.

A policy sees the model through a ``BackingStore`` only (buffers, a decode call, each
weight's stored form, a wait recorder) and names layers by their fully qualified
names: it never holds the model's runtime or its modules, so the dependencies point
one way (runtime -> policy -> store).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from zstd_linear.buffers import BufferPool
from zstd_linear.codec import EncodedWeight


@dataclass(frozen=True)
class BackingStore:
    """What a policy may use, and all it may use.

    Args:
        pool: the decode buffers (slabs and dedicated buffers; it counts their bytes).
        decode: ``decode(name, buf) -> weight``: decodes layer ``name`` into the front
            of ``buf`` ((>= nbytes(name),) uint8, from ``pool``) and returns the weight
            view, (out_features, in_features), the layer's dtype; counted in the
            model's stats.
        encoded: name -> the layer's EncodedWeight (sizes, frames), in the model's
            order.
        record_wait: ``record_wait(seconds)``: time a forward call waited for a weight.
        stream_bytes: the buffer the runtime streams a layer tied to an embedding
            through, where it has one (see ``CachePolicy.keeps``); 0 otherwise.
        will_need: ``will_need(name)``: have the kernel start reading layer ``name``'s
            compressed frames from their file now (``Decoder.will_need``); nothing for
            frames in anonymous memory. The default does nothing.
    """

    pool: BufferPool
    decode: Callable[[str, torch.Tensor], torch.Tensor]
    encoded: Mapping[str, EncodedWeight]
    record_wait: Callable[[float], None]
    stream_bytes: int = 0
    will_need: Callable[[str], None] = lambda name: None

    def nbytes(self, name: str) -> int:
        """The decoded size of a layer.

        Args:
            name: the layer's fully qualified name, a key of ``encoded``.

        Returns:
            Its decoded bytes.
        """
        return self.encoded[name].original_bytes


class CachePolicy(ABC):
    """One model's decoded-weight cache.

    The runtime brackets every layer's F.linear with ``acquire(name)`` (returns the
    decoded weight, (out, in), the layer's dtype) and ``release(name)``, and calls
    ``on_pass_start`` when the root module's forward begins.

    Args:
        store: all the policy may use (buffers, a decode call, the stored weights).
    """

    name: ClassVar[str]

    def __init__(self, store: BackingStore):
        self.store = store

    def on_pass_start(self, index: int) -> None:  # noqa: B027 - most policies ignore passes
        """A new forward pass of the root module begins.

        Args:
            index: the pass's number: 1 for the first, never going back.
        """

    @abstractmethod
    def acquire(self, name: str) -> torch.Tensor:
        """The decoded weight of a layer, for one F.linear.

        Args:
            name: the layer's fully qualified name.

        Returns:
            (out_features, in_features), the layer's dtype; valid until
            ``release(name)``.
        """

    def release(self, name: str) -> None:  # noqa: B027 - most keep the weight
        """The F.linear that used ``acquire(name)``'s weight has returned.

        Args:
            name: the layer's fully qualified name.
        """

    def keeps(self, name: str) -> bool:
        """Whether this policy keeps layer ``name`` decoded from one pass to the next.

        The runtime streams a layer tied to an embedding (a group of chunks at a time,
        never the whole table) unless its policy keeps it: then ``acquire`` serves it.

        Args:
            name: the layer's fully qualified name.

        Returns:
            True when the policy keeps it decoded.
        """
        return False

    #: compressed bytes of the layers' frames asked from storage ahead of their decode
    #: (``PerPassPrefetch``; the runtime reads a streamed layer's next groups as far
    #: ahead, where ``pages_out`` says its frames are not kept cached); 0: none
    read_ahead_bytes: int = 0

    def pages_out(self, name: str) -> bool:
        """Whether layer ``name``'s compressed frames leave the page cache once decoded
        (the runtime then drops them: ``Decoder.page_out``). A policy that knows the
        process's memory limit says True for the frames it does not keep cached.

        Args:
            name: the layer's fully qualified name.

        Returns:
            True to drop them after each decode.
        """
        return False

    @abstractmethod
    def close(self) -> None:
        """Give every buffer back; the policy is not used afterwards."""
