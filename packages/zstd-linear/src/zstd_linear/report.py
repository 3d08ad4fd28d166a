"""What compress_model / load_compressed did: per-layer and total sizes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LayerReport:
    """One stored weight's sizes.

    Args:
        name: the layer's fully qualified name.
        dtype: a SUPPORTED_DTYPES name.
        shape: (out_features, in_features), or (num_embeddings, embedding_dim).
        layout: the LAYOUTS name it was encoded with.
        original_bytes: its decoded size.
        compressed_bytes: its frames' size.
        file_backed_bytes: of ``compressed_bytes``, pages of the mapped .zlin file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    original_bytes: int
    compressed_bytes: int
    file_backed_bytes: int = 0  # of compressed_bytes: pages of the mapped .zlin file

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.compressed_bytes)


@dataclass
class CompressionReport:
    """What a model stores compressed, and what stayed plain.

    Args:
        layers: one LayerReport per stored weight.
        skipped: name -> why a Linear or embedding stayed plain.
    """

    layers: list[LayerReport]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def original_bytes(self) -> int:
        return sum(layer.original_bytes for layer in self.layers)

    @property
    def compressed_bytes(self) -> int:
        return sum(layer.compressed_bytes for layer in self.layers)

    @property
    def file_backed_bytes(self) -> int:
        """Compressed bytes that are pages of the mapped .zlin file (load_compressed):
        the kernel can drop them under a memory limit and read them again."""
        return sum(layer.file_backed_bytes for layer in self.layers)

    @property
    def anonymous_bytes(self) -> int:
        """Compressed bytes held in anonymous memory (compress_model's frames)."""
        return self.compressed_bytes - self.file_backed_bytes

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.compressed_bytes)

    def table(self) -> str:
        """The report as markdown.

        Returns:
            A markdown table, one row per layer plus the total.
        """
        lines = [
            "| layer | dtype | shape | layout | original | compressed | ratio |",
            "|---|---|---|---|---:|---:|---:|",
        ]
        for r in self.layers:
            shape = "x".join(map(str, r.shape))
            lines.append(
                f"| {r.name} | {r.dtype} | {shape} | {r.layout} | {r.original_bytes} "
                f"| {r.compressed_bytes} | {r.ratio:.3f} |"
            )
        lines.append(
            f"| total ({len(self.layers)} layers) | | | | {self.original_bytes} "
            f"| {self.compressed_bytes} | {self.ratio:.3f} |"
        )
        for name, why in self.skipped.items():
            lines.append(f"| {name} (skipped: {why}) | | | | | | |")
        return "\n".join(lines)
