"""KV caches: the growing one of Python inference and the static layout of the export."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DynamicKVCache:
    """Per-layer K/V that grow by concatenation (the reference's ``DynamicCache``).

    Each layer holds k, v: (B, KV, S, hd). Only committed blocks are appended.
    """

    def __init__(self, num_layers: int) -> None:
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.num_layers = num_layers

    @property
    def seq_len(self) -> int:
        return 0 if self._layers is None else self._layers[0][0].shape[-2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def append(self, new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """new_kv: per layer (k, v), each (B, KV, T, hd)."""
        if len(new_kv) != self.num_layers:
            raise ValueError(f"expected K/V for {self.num_layers} layers, got {len(new_kv)}")
        if self._layers is None:
            self._layers = [(k, v) for k, v in new_kv]
        else:
            self._layers = [
                (torch.cat([k0, k], dim=-2), torch.cat([v0, v], dim=-2))
                for (k0, v0), (k, v) in zip(self._layers, new_kv, strict=True)
            ]

    @property
    def nbytes(self) -> int:
        if self._layers is None:
            return 0
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self._layers
        )


@dataclass(frozen=True)
class StaticCacheLayout:
    """The pre-allocated cache ``(num_layers, 2, batch, kv_heads, max_seq, head_dim)``.

    ``max_seq`` must be a whole number of blocks: blocks are committed at multiples of
    ``block_size`` and a block that straddles the end could not be written.
    """

    num_layers: int
    batch: int
    kv_heads: int
    max_seq: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "batch", "kv_heads", "max_seq", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_seq % self.block_size:
            raise ValueError(
                f"max_seq {self.max_seq} is not a multiple of block_size {self.block_size}: "
                "the cache must hold a whole number of blocks"
            )

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, self.batch, self.kv_heads, self.max_seq, self.head_dim)

    @property
    def nbytes(self) -> int:
        """layers * 2 * batch * kv_heads * max_seq * head_dim * dtype_bytes."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.num_layers * 2 * self.batch * self.kv_heads * self.max_seq * self.head_dim
        ) * itemsize

    def allocate(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype)

    @classmethod
    def for_model(cls, config, max_seq: int, block_size: int, batch: int = 1) -> StaticCacheLayout:
        return cls(
            num_layers=config.num_hidden_layers,
            batch=batch,
            kv_heads=config.num_key_value_heads,
            max_seq=max_seq,
            head_dim=config.head_dim,
            block_size=block_size,
        )
