"""CompressedEmbedding: an nn.Embedding whose table lives zstd-compressed, rows decoded
by the chunk that holds them."""

from __future__ import annotations

import torch

from zstd_linear.codec import EncodedWeight
from zstd_linear.compressed import CompressedModule
from zstd_linear.decoder import Decoder
from zstd_linear.errors import ZstdLinearError


class CompressedEmbedding(CompressedModule):
    """Drop-in for a plain nn.Embedding (no max_norm): ``table[ids]``, bit for bit.

    input_ids: (...) int64 in [0, num_embeddings); returns (..., embedding_dim), the
    table's dtype. A lookup decodes only the 256 KiB chunks that hold the rows asked
    for (one chunk per generated token), into one reused chunk-sized buffer. When the
    model ties its lm_head to this table, the lm_head is a CompressedLinear over the
    same EncodedWeight: the bytes are stored once and serve both uses. Made by
    ``compress_model(model, embeddings=True)`` and ``load_compressed``.

    Args:
        encoded: the table, (num_embeddings, embedding_dim), as ``zstd_linear.codec.
            encode_weight`` returns it.
        name: the fully qualified module name.
        padding_idx: kept for ``decompress_model``'s nn.Embedding; the lookup itself
            is plain.

    Raises:
        ZstdLinearError: ``encoded`` is not 2-D.
    """

    def __init__(self, encoded: EncodedWeight, name: str = "", padding_idx: int | None = None):
        super().__init__()
        if len(encoded.shape) != 2:
            raise ZstdLinearError(f"encoded table must be 2-D, got shape {encoded.shape}")
        self.num_embeddings, self.embedding_dim = encoded.shape
        self.encoded = encoded
        self.name = name
        self.padding_idx = padding_idx
        self._decoder = Decoder(threads=1)
        self._chunk: torch.Tensor | None = None  # (chunk bytes,) uint8, reused

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids``, decoded through the runtime's policy.

        Args:
            input_ids: (...) int64.

        Returns:
            (..., embedding_dim), the table's dtype, bit-identical to nn.Embedding's.

        Raises:
            IndexError: an id outside 0..num_embeddings - 1.
        """
        n, d = self.num_embeddings, self.embedding_dim
        flat = input_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(
                f"CompressedEmbedding {self.name!r}: ids must be in 0..{n - 1}, got "
                f"{int(flat.min())}..{int(flat.max())}"
            )
        rows, inverse = torch.unique(flat, return_inverse=True)  # rows: (R,) sorted
        gathered = self._rows(rows.tolist())  # (R, d)
        return gathered[inverse].view(*input_ids.shape, d)

    def _rows(self, rows: list[int]) -> torch.Tensor:
        """The table rows ``rows`` (sorted, unique), decoded: (len(rows), d)."""
        e = self.encoded
        d = self.embedding_dim
        with torch.inference_mode(False):
            out = torch.empty(len(rows), d, dtype=e.torch_dtype)
        flat_out = out.view(-1)
        by_chunk: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            for c in range(r * d // e.chunk_elems, ((r + 1) * d - 1) // e.chunk_elems + 1):
                by_chunk.setdefault(c, []).append(i)
        for c, members in sorted(by_chunk.items()):
            start, stop = e.chunk_range(c)
            values = self._decode_chunk(c, (stop - start) * e.itemsize)  # (stop - start,)
            for i in members:
                lo, hi = max(rows[i] * d, start), min((rows[i] + 1) * d, stop)
                dst = i * d + lo - rows[i] * d
                flat_out[dst : dst + hi - lo] = values[lo - start : hi - start]
        return out

    def _decode_chunk(self, c: int, nbytes: int) -> torch.Tensor:
        if self._chunk is None or self._chunk.numel() < nbytes:
            with torch.inference_mode(False):
                self._chunk = torch.empty(nbytes, dtype=torch.uint8)
        raw = self._chunk[:nbytes]
        self._decoder.decode_chunk_into(self.encoded, c, raw)
        return raw.view(self.encoded.torch_dtype)

    def _shape_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
