"""What :func:`diffulex_edge.export.export_pte` is asked to export, validated against the
model's config before anything runs (the exporter only orchestrates)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffulex_edge.config import SDARConfig
from diffulex_edge.errors import DiffulexEdgeError
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.program_meta import QUANTIZATIONS, VARIANT_IDS, program_metadata


@dataclass(frozen=True)
class ExportConfig:
    """One export's arguments (those of :func:`~diffulex_edge.export.export_pte`) for a
    model with ``config``; ``__post_init__`` checks them and derives the cache layouts.

    Attributes:
        layout: the program's static cache, ``max_seq`` slots in blocks of ``block_size``.
        prefill_layout: the causal prompt chunks' cache view (blocks of ``prefill_size``),
            or None without a prefill.

    Raises:
        DiffulexEdgeError: an unknown ``variant`` or ``quantize``, a ``prefill_size`` the
            variant cannot take, or ``max_seq`` above the model's
            ``max_position_embeddings``.
        ValueError: ``max_seq`` or ``block_size`` not a positive int, or ``max_seq`` not a
            whole number of blocks.
    """

    config: SDARConfig
    max_seq: int
    block_size: int = 4
    variant: str = "block_kv"
    quantize: str | None = None
    prefill_size: int | None = None
    layout: StaticCacheLayout = field(init=False)
    prefill_layout: StaticCacheLayout | None = field(init=False)

    def __post_init__(self) -> None:
        # The checks run in this order; a test may name the first one that fails.
        if self.variant not in VARIANT_IDS:
            raise DiffulexEdgeError(
                f"variant must be one of {sorted(VARIANT_IDS)}, got {self.variant!r}"
            )
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise DiffulexEdgeError(
                f"quantize must be None or one of {QUANTIZATIONS}, got {self.quantize!r}"
            )
        layout = StaticCacheLayout.for_model(
            self.config, max_seq=self.max_seq, block_size=self.block_size
        )
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "prefill_layout", self._prefill_layout())
        limit = self.config.max_position_embeddings
        if self.max_seq > limit:
            raise DiffulexEdgeError(
                f"max_seq {self.max_seq} exceeds the model's max_position_embeddings {limit} "
                f"(the longest sequence it was built for): export with max_seq <= {limit} "
                f"(the CLI's --max-seq {limit})"
            )

    def _prefill_layout(self) -> StaticCacheLayout | None:
        if self.prefill_size is None:
            return None
        if self.variant == "cache_io":
            raise DiffulexEdgeError(
                f"prefill_size needs variant 'block_kv' or 'static_kv', got {self.variant!r}"
            )
        if self.variant == "static_kv" and self.layout.block_size != 1:
            raise DiffulexEdgeError(
                f"prefill_size with variant 'static_kv' needs block_size 1 (its prompt chunks "
                f"attend causally), got block_size {self.layout.block_size}"
            )
        try:
            return StaticCacheLayout.for_model(self.config, self.max_seq, self.prefill_size)
        except ValueError as err:
            raise DiffulexEdgeError(f"prefill_size {self.prefill_size!r}: {err}") from err

    def metadata(self) -> dict[str, int]:
        """The constant methods the program carries (``program_meta.META_KEYS``).

        Returns:
            Each constant method's name and its int value.
        """
        return program_metadata(
            self.config,
            self.layout.block_size,
            self.layout.max_seq,
            self.variant,
            self.prefill_size or 0,
        )
