"""ModelRuntime: the runtime that compress_model attaches to the root module: it owns the
compressed modules and serves their weights through the caching policy."""

from __future__ import annotations

import threading
import time
from itertools import accumulate

import torch
import torch.nn as nn
import torch.nn.functional as F

from zstd_linear.buffers import BufferPool
from zstd_linear.codec import view_weight
from zstd_linear.decoder import Decoder, check_threads
from zstd_linear.embedding import CompressedEmbedding
from zstd_linear.errors import ZstdLinearError
from zstd_linear.layer import CompressedLinear
from zstd_linear.policies import BackingStore, CachePolicy, make_policy
from zstd_linear.stats import DecodeStats

# A streamed layer is decoded this many bytes at a time (whole chunks, at least one): its
# buffer is what a streamed lm_head holds in anonymous memory. SmolLM2's tied lm_head took
# 111-121 ms a token in groups of 4 MiB (a 4.1 MiB buffer), 121-134 in groups of 1 MiB
# (1.1 MiB); under a hard limit the 3 MiB are page cache for the weights' file instead.
STREAM_GROUP_BYTES = 1 << 20
# ... and its output computed in blocks of a multiple of this many rows, counted from row
# 0, the last block ending where the weight ends. The BLAS computes the rows of a block
# past a multiple of its own blocking on another path, with other rounding (MKL on this
# CPU: 4 rows for one token, 16 for several): blocks cut anywhere else gave logits that
# differ in the last bits from the plain model's single F.linear.
STREAM_ROW_BLOCK = 64


def _span_file_bytes(encoded, span: range) -> int:
    """Bytes of the frames of ``encoded``'s chunks ``span`` that live in a mapped file."""
    return sum(len(f.data) for c in span for f in encoded.frames[c] if f.file_backed)


class ModelRuntime:
    """Owns one model's compressed layers and serves their weights through its policy.

    layers: fully qualified module name -> CompressedLinear (names, never short names,
    identify layers everywhere: the caches, the prefetch order and the file format).
    Each layer is bound to this runtime until ``close``; its forward asks ``acquire`` /
    ``release`` for its weight, which the runtime passes on to the policy by name.
    embeddings: name -> CompressedEmbedding; a layer whose EncodedWeight is an
    embedding's (a tied lm_head) shares its frames.

    A layer tied to an embedding is *streamed* unless the policy keeps it decoded
    (``CachePolicy.keeps``: resident, per_pass, a budget's pinned set): its output is
    computed a group of chunks (``STREAM_GROUP_BYTES``) at a time from one small reused
    buffer, so its table (SmolLM2's is 113 MiB, ~25x a Linear) is never decoded whole.

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
            raise ZstdLinearError("layers must name at least one CompressedLinear, got none")
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
        # SmolLM2), which is streamed (or, where the policy keeps it, gets a buffer of its
        # own size) instead of inflating every slab.
        tied = {id(e.encoded) for e in self.embeddings.values()}
        self.streamed = frozenset(n for n, lyr in layers.items() if id(lyr.encoded) in tied)
        own = [lyr for lyr in layers.values() if id(lyr.encoded) not in tied] or layers.values()
        self.pool = BufferPool(max(lyr.encoded.original_bytes for lyr in own), self.stats)
        self._stream_buffer: torch.Tensor | None = None  # uint8, reused by streamed layers
        # name -> ends[k], the file bytes of a streamed layer's groups 0..k-1 (its read-ahead)
        self._stream_ends: dict[str, list[int]] = {}
        self._stats_lock = threading.Lock()
        self._store = BackingStore(
            pool=self.pool,
            decode=self._decode,
            encoded={name: lyr.encoded for name, lyr in self.layers.items()},
            record_wait=self._record_wait,
            stream_bytes=max((self._stream_need(n) for n in self.streamed), default=0),
            will_need=self._will_need,
        )
        # Built before anything else starts threads, so bad options leave nothing behind.
        self.policy: CachePolicy = make_policy(policy, self._store, **policy_options)
        self.decoder = Decoder(threads)
        for layer in self.layers.values():
            layer._runtime = self

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

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Layer ``name``'s ``F.linear(x, W, bias)``, W served by the policy or streamed."""
        if name in self.streamed and not self.policy.keeps(name):
            if x.numel() == x.shape[-1]:
                return self._streamed_linear(name, x, bias)
            return self._whole_linear(name, x, bias)
        weight = self.acquire(name)
        try:
            return F.linear(x, weight, bias)
        finally:
            self.release(name)

    def _whole_linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A streamed layer called on several rows of x: decoded whole into a buffer
        freed when the call returns. Blocks of a matrix product over several rows are
        not bit-identical to the whole product here (MKL splits the rows of W between
        its threads by their number), so only a single row of x is streamed; generation
        asks the lm_head for the last position only, one row per sequence."""
        encoded = self.layers[name].encoded
        buf = self.pool.dedicated(encoded.original_bytes)
        try:
            return F.linear(x, self._decode(name, buf), bias)
        finally:
            self.pool.drop_dedicated(buf)

    def _stream_need(self, name: str) -> int:
        """Bytes of the buffer that streams layer ``name``: a group of chunks, and the
        rows carried over from the group before (less than a block and a row), never
        more than the whole weight."""
        encoded = self.layers[name].encoded
        elems = (
            len(encoded.chunk_groups(STREAM_GROUP_BYTES)[0]) * encoded.chunk_elems
        )  # the largest
        need = (elems + (STREAM_ROW_BLOCK + 1) * encoded.shape[1]) * encoded.itemsize
        return min(need, encoded.original_bytes)

    def _streamed_linear(
        self, name: str, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear`` over a weight decoded a group of chunks at a time: x (..., in)
        -> (..., out). Rows cut by a group's end are carried to the front of the buffer
        and finished by the next group."""
        encoded = self.layers[name].encoded
        out_features, in_features = encoded.shape
        width, dtype = encoded.itemsize, encoded.torch_dtype
        need = self._stream_need(name)
        buf = self._stream_buffer
        if buf is None or buf.numel() < need:
            if buf is not None:
                self.pool.drop_dedicated(buf)
            buf = self._stream_buffer = self.pool.dedicated(need)
        out = x.new_empty(*x.shape[:-1], out_features)
        start = time.perf_counter()
        carry = row = 0  # elements from row ``row`` on, already at the buffer's front
        chunks = len(encoded.frames)
        page_out = self.policy.pages_out(name)
        spans = encoded.chunk_groups(STREAM_GROUP_BYTES)
        # Frames not kept cached: the groups after the one decoding are asked from
        # storage, up to the policy's read_ahead_bytes of compressed bytes ahead.
        ahead = self.policy.read_ahead_bytes if page_out else 0
        ends = self._stream_ends.get(name) if ahead else None
        if ahead and ends is None:  # once per layer: the frames do not change
            sizes = (_span_file_bytes(encoded, s) for s in spans)
            ends = self._stream_ends[name] = [0, *accumulate(sizes)]
        asked = 1  # groups asked for: the first is asked by its own decode
        for j, span in enumerate(spans):
            if ahead:
                asked = max(asked, j + 1)
                while asked < len(spans) and ends[asked + 1] - ends[j + 1] <= ahead:
                    self.decoder.will_need(encoded, spans[asked])
                    asked += 1
            lo, hi = encoded.span_range(span)
            total = carry + hi - lo
            self.decoder.decode_chunks_into(
                encoded, span, buf[carry * width : total * width], page_out=page_out
            )
            rows = total // in_features
            if span.stop < chunks:
                rows -= rows % STREAM_ROW_BLOCK
            if rows:
                weight = buf[: rows * in_features * width].view(dtype).view(rows, in_features)
                part = None if bias is None else bias[row : row + rows]
                out[..., row : row + rows] = F.linear(x, weight, part)
                row += rows
            # What is left (rows short of a block, a row cut by the group's end) moves to
            # the buffer's front, where the weight's rows stay 64-byte aligned.
            done, carry = rows * in_features * width, total - rows * in_features
            if rows and carry:
                rest = buf[done : done + carry * width]
                buf[: carry * width].copy_(rest.clone() if done < carry * width else rest)
        seconds = time.perf_counter() - start
        with self._stats_lock:
            self.stats.decompressions += 1
            self.stats.bytes_decoded += encoded.original_bytes
            self.stats.seconds_decoding += seconds
        return out

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
        self.decoder.decode_into(encoded, target, page_out=self.policy.pages_out(name))
        seconds = time.perf_counter() - start
        with self._stats_lock:
            self.stats.decompressions += 1
            self.stats.bytes_decoded += encoded.original_bytes
            self.stats.seconds_decoding += seconds
        return view_weight(target, encoded)

    def _will_need(self, name: str) -> None:
        self.decoder.will_need(self.layers[name].encoded)

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
        if self._stream_buffer is not None:
            self.pool.drop_dedicated(self._stream_buffer)
            self._stream_buffer = None
        self.decoder.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for layer in self.layers.values():
            layer._runtime = None
