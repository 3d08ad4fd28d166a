"""Run block-diffusion generation on an exported ``.pte`` through ``executorch.runtime``.

The engine reads the program's constant methods (what it was exported for), checks them
and the forward method's input shapes before the first step, owns the static KV cache, and
builds every mask on the CPU with :mod:`diffulex_edge.masks`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffulex_edge.backends import StaticCacheBackend
from diffulex_edge.config import SDARConfig
from diffulex_edge.export import EXPORT_VARIANTS, PTE_FORMAT_VERSION, config_digest
from diffulex_edge.generate import GenerationConfig, GenerationResult, generate
from diffulex_edge.kv_cache import StaticCacheLayout
from diffulex_edge.masks import block_attention_mask, block_positions, cache_io_masks

_VARIANT_BY_ID = {cls.variant_id: name for name, cls in EXPORT_VARIANTS.items()}
_META_KEYS = (
    "diffulex_format_version",
    "variant_id",
    "num_layers",
    "kv_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "max_seq",
    "mask_token_id",
    "eos_token_id",
    "config_digest",
)


class PteBackend(StaticCacheBackend):
    """A :class:`Backend` over a loaded ExecuTorch ``forward`` method."""

    def __init__(self, method, variant: str, layout: StaticCacheLayout) -> None:
        self.method = method
        self.variant = variant
        super().__init__(layout)

    def _run(self, block_ids: torch.Tensor, commit: bool) -> torch.Tensor:
        positions = block_positions(self.layout, self.cache_len)
        if self.variant == "cache_io":
            m = cache_io_masks(self.layout, self.cache_len, commit)
            logits, self.kv_cache = self.method.execute(
                [
                    block_ids,
                    positions,
                    self.kv_cache,
                    m.attention_mask,
                    m.insert_matrix,
                    m.keep_mask,
                ]
            )
            return logits
        mask = block_attention_mask(self.layout, self.cache_len)
        logits, block_kv = self.method.execute([block_ids, positions, self.kv_cache, mask])
        if commit:
            end = self.cache_len + self.block_size
            self.kv_cache[..., self.cache_len : end, :] = block_kv
        return logits

    def denoise(self, block_ids):
        return self._run(block_ids, commit=False)

    def commit(self, block_ids):
        self._run(block_ids, commit=True)
        self.cache_len += self.block_size


class PteEngine:
    """Load a diffulex ``.pte`` and generate with it.

    ``expected_config``: when given, the program must have been exported from a model with
    exactly this config (compared by digest), else ``ValueError``.
    """

    def __init__(self, path: str | Path, expected_config: SDARConfig | None = None) -> None:
        from executorch.runtime import Runtime

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no .pte at {path}")
        self.path = path
        self.program = Runtime.get().load_program(path)
        names = self.program.method_names
        missing = [k for k in _META_KEYS if k not in names]
        if missing or "forward" not in names:
            raise ValueError(f"{path} is not a diffulex-edge program (missing methods {missing})")
        self.meta = {k: int(self.program.load_method(k).execute([])[0]) for k in _META_KEYS}
        if self.meta["diffulex_format_version"] != PTE_FORMAT_VERSION:
            raise ValueError(
                f"{path} has format version {self.meta['diffulex_format_version']}, "
                f"this engine reads {PTE_FORMAT_VERSION}"
            )
        if expected_config is not None:
            self.check_config(expected_config)
        self.variant = _VARIANT_BY_ID[self.meta["variant_id"]]
        self.layout = StaticCacheLayout(
            num_layers=self.meta["num_layers"],
            batch=1,
            kv_heads=self.meta["kv_heads"],
            max_seq=self.meta["max_seq"],
            head_dim=self.meta["head_dim"],
            block_size=self.meta["block_size"],
        )
        method = self.program.load_method("forward")
        cache_meta = method.metadata.input_tensor_meta(2)
        if tuple(cache_meta.sizes()) != self.layout.shape:
            raise ValueError(
                f"{path}: forward's kv_cache input is {tuple(cache_meta.sizes())}, its metadata "
                f"says {self.layout.shape}"
            )
        self.backend = PteBackend(method, self.variant, self.layout)

    def check_config(self, config: SDARConfig) -> None:
        got = {
            "num_layers": config.num_hidden_layers,
            "kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "vocab_size": config.vocab_size,
        }
        diffs = {k: (self.meta[k], v) for k, v in got.items() if self.meta[k] != v}
        if diffs or self.meta["config_digest"] != config_digest(config):
            raise ValueError(
                f"{self.path} was exported for another model config "
                f"(pte vs given: {diffs or 'same shapes, different config digest'})"
            )

    @property
    def mask_token_id(self) -> int:
        return self.meta["mask_token_id"]

    @property
    def eos_token_id(self) -> int | None:
        return None if self.meta["eos_token_id"] < 0 else self.meta["eos_token_id"]

    @property
    def pte_bytes(self) -> int:
        return self.path.stat().st_size

    def generate(self, prompt_ids, config: GenerationConfig) -> GenerationResult:
        if self.mask_token_id < 0:
            raise ValueError(f"{self.path} was exported from a config without mask_token_id")
        return generate(self.backend, prompt_ids, config, self.mask_token_id, self.eos_token_id)
