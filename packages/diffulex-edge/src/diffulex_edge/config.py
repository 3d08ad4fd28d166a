"""The SDAR model configuration (a Qwen3-style transformer decoded by block diffusion)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass
class SDARConfig:
    """Hyper-parameters of an SDAR checkpoint, named as in its Hugging Face ``config.json``.

    ``mask_token_id`` is the id block diffusion writes into positions still to be decoded;
    SDAR checkpoints carry it in ``config.json`` (the tokenizer's ``<|MASK|>``).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` as in Qwen3.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mask_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            _positive(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        for name in ("mask_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be in [0, {self.vocab_size}), got {value}")

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, data: dict) -> SDARConfig:
        """Build from a ``config.json`` dict, ignoring keys this model does not use.

        A list-valued ``eos_token_id`` (as some Qwen3 configs have) keeps its first id.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> SDARConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return {"model_type": "sdar", **dataclasses.asdict(self)}


def tiny_config(**overrides) -> SDARConfig:
    """A few-kilobyte random-weight config for tests and the ``--tiny`` CLI switch."""
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        mask_token_id=63,
        eos_token_id=62,
    )
    base.update(overrides)
    return SDARConfig(**base)


def sdar_1p7b_config(num_hidden_layers: int = 28) -> SDARConfig:
    """The shape of SDAR-1.7B-Chat (Qwen3-1.7B geometry), optionally cut to fewer layers."""
    return SDARConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        mask_token_id=151669,
        eos_token_id=151643,
    )
