"""ModelRuntime: the container that compress_model attaches to the root module."""

from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn

from zstd_linear.buffers import BufferPool
from zstd_linear.codec import view_weight
from zstd_linear.decoder import Decoder, check_threads
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.layer import CompressedLinear
from zstd_linear.policies import BackingStore, CachePolicy, make_policy
from zstd_linear.stats import DecodeStats


class ModelRuntime:
    """Owns one model's compressed layers and serves their weights through its policy.

    layers: fully qualified module name -> CompressedLinear (names, never short names,
    identify layers everywhere: the caches, the prefetch order and the file format).
    Each layer is bound to this runtime until ``close``; its forward asks ``acquire`` /
    ``release`` for its weight, which the runtime passes on to the policy by name.
    embeddings: name -> CompressedEmbedding; a layer whose EncodedWeight is an
    embedding's (a tied lm_head) shares its frames.

    ``attach(root)`` counts the root module's forward passes (a forward pre-hook):
    ``pass_index`` never goes back (``stats.forward_passes`` is reset with the
    stats), and the policy hears of each new pass.
    """

    def __init__(
        self,
        layers: dict[str, CompressedLinear],
        policy: str = "per_pass_prefetch",
        threads: int | None = None,
        embeddings: dict[str, CompressedEmbedding] | None = None,
        **policy_options,
    ):
        threads = check_threads(threads)
        if not layers:
            raise ValueError("layers must name at least one CompressedLinear, got none")
        self.layers = dict(layers)
        self.embeddings = dict(embeddings or {})
        self.stats = DecodeStats()
        stored = {id(e.encoded): e.encoded for e in self.stored_weights()}.values()
        file_bytes = sum(e.file_backed_bytes for e in stored)
        self.stats.compressed_file_bytes = file_bytes
        self.stats.compressed_anonymous_bytes = sum(e.compressed_bytes for e in stored) - file_bytes
        self.pass_index = 0
        self._hook = None
        # Slabs fit every Linear but a tied lm_head (the embedding table, ~25x a Linear of
        # SmolLM2), which gets a slab of its own size instead of inflating every slab.
        tied = {id(e.encoded) for e in self.embeddings.values()}
        own = [lyr for lyr in layers.values() if id(lyr.encoded) not in tied] or layers.values()
        self.pool = BufferPool(max(lyr.encoded.original_bytes for lyr in own), self.stats)
        self._stats_lock = threading.Lock()
        self._store = BackingStore(
            pool=self.pool,
            decode=self._decode,
            encoded={name: lyr.encoded for name, lyr in self.layers.items()},
            record_wait=self._record_wait,
        )
        # Built before anything else starts threads, so bad options leave nothing behind.
        self.policy: CachePolicy = make_policy(policy, self._store, **policy_options)
        self.decoder = Decoder(threads)
        for layer in self.layers.values():
            layer._container = self

    def stored_weights(self) -> list:
        """The model's compressed modules (layers and embeddings) as stored: a tied
        lm_head shares its embedding's EncodedWeight and is left out."""
        tied = {id(e.encoded) for e in self.embeddings.values()}
        plain = [lyr for lyr in self.layers.values() if id(lyr.encoded) not in tied]
        return plain + list(self.embeddings.values())

    def acquire(self, name: str) -> torch.Tensor:
        """Layer ``name``'s decoded weight, (out_features, in_features), for one call."""
        return self.policy.acquire(name)

    def release(self, name: str) -> None:
        """The call that used ``acquire(name)``'s weight has returned."""
        self.policy.release(name)

    def attach(self, root: nn.Module) -> None:
        if self._hook is not None:
            raise RuntimeError("this ModelRuntime is already attached to a module")
        self._hook = root.register_forward_pre_hook(self._pass_starts)

    def _pass_starts(self, module: nn.Module, args) -> None:
        # Returns None: a pre-hook's return value would replace the forward's arguments.
        self.pass_index += 1
        self.stats.forward_passes += 1
        self.policy.on_pass_start(self.pass_index)

    def _decode(self, name: str, buf: torch.Tensor) -> torch.Tensor:
        """Decode layer ``name``'s weight into the front of ``buf`` (uint8); returns the
        weight view, shape (out_features, in_features), the layer's dtype."""
        encoded = self.layers[name].encoded
        target = buf[: encoded.original_bytes]
        start = time.perf_counter()
        self.decoder.decode_into(encoded, target)
        seconds = time.perf_counter() - start
        with self._stats_lock:
            self.stats.decompressions += 1
            self.stats.bytes_decoded += encoded.original_bytes
            self.stats.seconds_decoding += seconds
        return view_weight(target, encoded)

    def _record_wait(self, seconds: float) -> None:
        with self._stats_lock:
            self.stats.seconds_waiting += seconds

    def set_policy(self, policy: str, **policy_options) -> None:
        new = make_policy(policy, self._store, **policy_options)  # validates before any change
        self.policy.close()
        self.pool.trim()
        self.policy = new

    def reset_stats(self) -> None:
        """Zero the counters; memory held now becomes the new peak."""
        with self._stats_lock:
            held = self.stats.decoded_bytes
            for field in ("forward_passes", "decompressions", "bytes_decoded"):
                setattr(self.stats, field, 0)
            self.stats.seconds_decoding = self.stats.seconds_waiting = 0.0
            self.stats.peak_decoded_bytes = held

    def close(self) -> None:
        self.policy.close()
        self.pool.trim()
        self.decoder.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for layer in self.layers.values():
            layer._container = None
