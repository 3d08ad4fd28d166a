"""The SDAR model configuration (a Qwen3-style transformer decoded by block diffusion)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from diffulex_edge.errors import DiffulexEdgeError

# Upper bounds far above any released model, low enough that a damaged config cannot ask
# for an absurd allocation (the RoPE tables are max_position_embeddings x head_dim).
_INT_RANGES = {
    "vocab_size": 2**24,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 2**10,
    "num_attention_heads": 2**10,
    "num_key_value_heads": 2**10,
    "head_dim": 2**12,
    "max_position_embeddings": 2**20,
}


# The gate activations of the gated MLP: SwiGLU (silu) and Gemma's GeGLU (tanh-approximated gelu).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# Where a layer's RMSNorms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma
# 2/3: before and after each), "post" (OLMo 2: after each, on the branch's output).
NORM_LAYOUTS = ("pre", "sandwich", "post")
LAYER_TYPES = ("full_attention", "sliding_attention")
_FAMILY_SWITCHES = frozenset(
    {
        "hidden_act",
        "norm_layout",
        "norm_unit_offset",
        "qk_norm_per_head",
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
        "attention_scale",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "sliding_window",
        "layer_types",
        "rope_local_theta",
        "rope_layers",
    }
)


def _int_in_range(name: str, value, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise DiffulexEdgeError(f"{name} must be an int in [1, {high}], got {value!r}")
    if not 1 <= value <= high:
        raise DiffulexEdgeError(f"{name} must be in [1, {high}], got {value}")


def _finite_positive(name: str, value, high: float) -> None:
    # JSON configs often write floats as ints ("rope_theta": 1000000): ints are accepted.
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise DiffulexEdgeError(f"{name} must be a number in (0, {high}], got {value!r}")
    if not (math.isfinite(value) and 0 < value <= high):
        raise DiffulexEdgeError(f"{name} must be finite and in (0, {high}], got {value!r}")


@dataclass
class SDARConfig:
    """Hyper-parameters of an SDAR checkpoint, named as in its Hugging Face ``config.json``.

    ``mask_token_id`` is the id block diffusion writes into positions still to be decoded;
    SDAR checkpoints carry it in ``config.json`` (the tokenizer's ``<|MASK|>``).
    ``head_dim`` defaults to ``hidden_size // num_attention_heads`` as in Qwen3.

    The same transformer covers the Llama family: ``qk_norm`` (RMSNorm on each query and key
    head, Qwen3 and SDAR) and ``qkv_bias`` (biases on the q/k/v projections, Qwen2) are
    switches, and so are the traits of the other families :mod:`diffulex_edge.hf_config`
    maps (Mistral, Phi-3, OLMo 2, Gemma 2/3, Granite, SmolLM3):

    - ``hidden_act``: the MLP's gate, ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
    - ``norm_layout``: :data:`NORM_LAYOUTS`; ``norm_unit_offset``: RMSNorm scales by
      ``1 + weight`` (Gemma); ``qk_norm_per_head`` False normalises the whole q and k
      projections instead of each head (OLMo 2).
    - ``embedding_multiplier`` (Gemma: sqrt(hidden_size); Granite), ``residual_multiplier``
      (each branch's output, Granite), ``logits_scaling`` (logits are divided by it,
      Granite), ``attention_scale`` (replaces ``head_dim ** -0.5``).
    - ``attn_logit_softcapping`` / ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on
      the attention scores / the logits (Gemma 2).
    - ``layer_types``: one of :data:`LAYER_TYPES` a layer (None: all full attention); a
      ``"sliding_attention"`` layer sees the last ``sliding_window`` positions, itself
      included. ``rope_local_theta``: the RoPE base of sliding layers (Gemma 3).
    - ``rope_layers``: 1 where a layer applies RoPE, 0 where it has none (SmolLM3's NoPE).

    :meth:`from_dict` reads those families' Hugging Face configs as well as SDAR's own.
    A model without ``mask_token_id`` decodes autoregressively (block diffusion with block
    size 1).
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
    qk_norm: bool = True
    qkv_bias: bool = False
    # The switches below keep SDAR's (and Llama's) behaviour at their defaults, and
    # to_dict() leaves them out there, so configs and program digests written before they
    # existed stay the same. hf_config sets them for the other families.
    hidden_act: str = "silu"
    norm_layout: str = "pre"
    norm_unit_offset: bool = False
    qk_norm_per_head: bool = True
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    rope_layers: list[int] | None = None

    def __post_init__(self) -> None:
        for name, high in _INT_RANGES.items():
            if name != "head_dim":
                _int_in_range(name, getattr(self, name), high)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise DiffulexEdgeError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _int_in_range("head_dim", self.head_dim, _INT_RANGES["head_dim"])
        if self.head_dim % 2:
            raise DiffulexEdgeError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DiffulexEdgeError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads} (grouped-query attention)"
            )
        _finite_positive("rms_norm_eps", self.rms_norm_eps, 1.0)
        _finite_positive("rope_theta", self.rope_theta, 1e12)
        for name in ("tie_word_embeddings", "qk_norm", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise DiffulexEdgeError(
                    f"{name} must be true or false, got {getattr(self, name)!r}"
                )
        self._check_family_switches()
        for name in ("mask_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise DiffulexEdgeError(f"{name} must be an int or null, got {value!r}")
            if not 0 <= value < self.vocab_size:
                raise DiffulexEdgeError(f"{name} must be in [0, {self.vocab_size}), got {value}")

    def _check_family_switches(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise DiffulexEdgeError(
                f"hidden_act must be one of {list(HIDDEN_ACTS)}, got {self.hidden_act!r}"
            )
        if self.norm_layout not in NORM_LAYOUTS:
            raise DiffulexEdgeError(
                f"norm_layout must be one of {list(NORM_LAYOUTS)}, got {self.norm_layout!r}"
            )
        for name in ("norm_unit_offset", "qk_norm_per_head"):
            if not isinstance(getattr(self, name), bool):
                raise DiffulexEdgeError(
                    f"{name} must be true or false, got {getattr(self, name)!r}"
                )
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            _finite_positive(name, getattr(self, name), 1e6)
        for name in (
            "attention_scale",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_theta",
        ):
            if getattr(self, name) is not None:
                _finite_positive(name, getattr(self, name), 1e12)
        L = self.num_hidden_layers
        if self.layer_types is not None:
            if not isinstance(self.layer_types, list) or len(self.layer_types) != L:
                raise DiffulexEdgeError(
                    f"layer_types must be a list of {L} entries (one a layer), got "
                    f"{self.layer_types!r}"
                )
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
            if bad:
                raise DiffulexEdgeError(
                    f"layer_types holds {bad}, expected entries of {list(LAYER_TYPES)}"
                )
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        if sliding:
            _int_in_range(
                "sliding_window", self.sliding_window, _INT_RANGES["max_position_embeddings"]
            )
        elif self.sliding_window is not None:
            raise DiffulexEdgeError(
                f"sliding_window {self.sliding_window!r} is set but no layer_types entry is "
                "'sliding_attention'"
            )
        if self.rope_layers is not None and (
            not isinstance(self.rope_layers, list)
            or len(self.rope_layers) != L
            or any(v not in (0, 1) or isinstance(v, bool) for v in self.rope_layers)
        ):
            raise DiffulexEdgeError(
                f"rope_layers must be a list of {L} entries, 1 (RoPE) or 0 (none), got "
                f"{self.rope_layers!r}"
            )

    def layer_type(self, i: int) -> str:
        """``"full_attention"`` or ``"sliding_attention"`` (``sliding_window`` keys back)."""
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    def layer_rope(self, i: int) -> str:
        """Which RoPE table layer ``i`` rotates with: ``"global"`` (``rope_theta``),
        ``"local"`` (``rope_local_theta``, sliding-window layers that have one) or
        ``"none"`` (a NoPE layer)."""
        if self.rope_layers is not None and not self.rope_layers[i]:
            return "none"
        if self.rope_local_theta is not None and self.layer_type(i) == "sliding_attention":
            return "local"
        return "global"

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, data: dict) -> SDARConfig:
        """Build from a ``config.json`` dict, ignoring keys this model does not use.

        A list-valued ``eos_token_id`` (as some Qwen3 configs have) keeps its first id.
        Any other ``model_type`` (``llama``, ``qwen2``, ``gemma2``, ...) is mapped by
        :func:`diffulex_edge.hf_config.sdar_dict_from_hf` first.
        """
        if not isinstance(data, dict):
            raise DiffulexEdgeError(f"a config must be a JSON object, got {type(data).__name__}")
        if data.get("model_type", "sdar") != "sdar":
            from diffulex_edge.hf_config import sdar_dict_from_hf

            data = sdar_dict_from_hf(data)
        fields = dataclasses.fields(cls)
        required = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise DiffulexEdgeError(f"config is missing {missing}")
        kwargs = {f.name: data[f.name] for f in fields if f.name in data}
        eos = kwargs.get("eos_token_id")
        if isinstance(eos, list):
            if not eos:
                raise DiffulexEdgeError("eos_token_id is an empty list; expected an int or ids")
            kwargs["eos_token_id"] = eos[0]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> SDARConfig:
        """Read ``path`` (a ``config.json``); any problem is a :class:`DiffulexEdgeError`
        naming the file."""
        path = Path(path)
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as err:
            raise DiffulexEdgeError(f"{path} is not valid JSON: {err}") from err
        try:
            return cls.from_dict(data)
        except DiffulexEdgeError as err:
            raise DiffulexEdgeError(f"{path}: {err}") from err

    def to_dict(self) -> dict:
        """The config.json form; the family switches appear only where they differ from
        their defaults (so SDAR and Llama configs read as they did before they existed)."""
        data = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in _FAMILY_SWITCHES and data[f.name] == f.default:
                del data[f.name]
        return {"model_type": "sdar", **data}


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
