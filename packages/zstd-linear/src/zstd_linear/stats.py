"""Counters of one compressed model's decoding work."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DecodeStats:
    """What a compressed model's runtime did since compress_model / reset.

    Attributes:
        forward_passes: root-module forward calls (the runtime's forward pre-hook).
        decompressions: weights decoded.
        bytes_decoded: their original bytes.
        seconds_decoding: wall time inside decodes (in the background under prefetch).
        seconds_waiting: time forward calls waited for a prefetched weight.
        decoded_bytes: decoded-weight memory held now, counting reusable buffers
            whether or not they hold a live weight. Decoded weights are always
            anonymous memory.
        peak_decoded_bytes: the most ``decoded_bytes`` has been.
        compressed_anonymous_bytes: the compressed frames in anonymous memory
            (compress_model).
        compressed_file_bytes: the compressed frames that are pages of the mapped
            .zlin file (load_compressed), which a memory limit can evict and the kernel
            read again.
    """

    forward_passes: int = 0
    decompressions: int = 0
    bytes_decoded: int = 0
    seconds_decoding: float = 0.0
    seconds_waiting: float = 0.0
    decoded_bytes: int = 0
    peak_decoded_bytes: int = 0
    compressed_anonymous_bytes: int = 0
    compressed_file_bytes: int = 0

    @property
    def anonymous_bytes(self) -> int:
        """Anonymous bytes the model's compressed layers hold now (decoded + frames)."""
        return self.decoded_bytes + self.compressed_anonymous_bytes

    @property
    def peak_anonymous_bytes(self) -> int:
        return self.peak_decoded_bytes + self.compressed_anonymous_bytes

    @property
    def decompressions_per_pass(self) -> float:
        return self.decompressions / self.forward_passes if self.forward_passes else 0.0

    def to_dict(self) -> dict:
        """The counters as JSON-ready numbers.

        Returns:
            Every field, plus the derived ``decompressions_per_pass``,
            ``anonymous_bytes`` and ``peak_anonymous_bytes``.
        """
        d = asdict(self)
        d["decompressions_per_pass"] = self.decompressions_per_pass
        d["anonymous_bytes"] = self.anonymous_bytes
        d["peak_anonymous_bytes"] = self.peak_anonymous_bytes
        return d
