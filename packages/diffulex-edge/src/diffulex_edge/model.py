"""The SDAR transformer: Qwen3 geometry (RMSNorm, RoPE, GQA, q/k norm, SwiGLU).

q/k norm, q/k/v biases and the other families' traits (GeGLU, Gemma's and OLMo 2's norm
placements, soft-capping, sliding-window layers, NoPE layers, constant multipliers) are
config switches, so the same module is a Llama, Mistral, Qwen2/3, Phi-3, OLMo 2, Gemma 2/3,
Granite or SmolLM3 model too (:mod:`diffulex_edge.hf_config`). Cache slot j always holds
position j, which is what a sliding-window mask compares against.

Three entry points share one set of weights and one attention routine:

- :meth:`SDARModel.forward` — Python inference with a :class:`DynamicKVCache` that grows.
- :meth:`SDARModel.forward_export` — the cache-as-I/O static graph of the design: the whole
  cache goes in, the whole updated cache comes out, and three CPU-built masks steer it.
- :meth:`SDARModel.forward_block_kv` — the StaticAttention-style graph: the cache goes in
  read-only and only the block's K/V come out; the runtime writes them in place.

None of the static paths has data-dependent control flow, dynamic slicing or ``item()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffulex_edge.config import SDARConfig
from diffulex_edge.kv_cache import DynamicKVCache


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``unit_offset`` (Gemma) ``(1 + weight) * x / rms(x)``,
    the weight then starting at zeros as Gemma stores it."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.eps)
        return normed * (1.0 + self.weight) if self.unit_offset else self.weight * normed


def _norm(config: SDARConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, config.norm_unit_offset)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's soft-capping), or ``x`` when ``cap`` is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive sliding-window mask: a query at position p sees keys at p - window + 1 and
    later (itself included), as transformers' ``sliding_window`` does.

    q_pos: (B, T) int64; k_pos: (B, S) or (S,) int64. Returns (B, 1, T, S) float, 0 or -inf.
    """
    k = k_pos if k_pos.dim() == 2 else k_pos[None]
    far = (q_pos[:, :, None] - k[:, None, :]) >= window  # (B, T, S)
    return torch.zeros(far.shape).masked_fill(far, -torch.inf).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU with ``act="silu"``, Gemma's GeGLU with
    ``"gelu_pytorch_tanh"``."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


SwiGLU = GatedMLP  # the name before the gate activation became a switch


class SDARAttention(nn.Module):
    def __init__(self, config: SDARConfig, layer_idx: int = 0) -> None:
        super().__init__()
        hd = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.scaling = hd**-0.5 if config.attention_scale is None else config.attention_scale
        self.softcap = config.attn_logit_softcapping
        sliding = config.layer_type(layer_idx) == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=False)
        # Llama and Qwen2 have no q/k norm: identity keeps one code path and no empty weights.
        # OLMo 2 normalises the whole projection (all heads together), Qwen3 each head.
        self.qk_norm_per_head = config.qk_norm_per_head
        q_dim, k_dim = (
            (hd, hd) if config.qk_norm_per_head else (self.num_heads * hd, self.num_kv_heads * hd)
        )
        self.q_norm = _norm(config, q_dim) if config.qk_norm else nn.Identity()
        self.k_norm = _norm(config, k_dim) if config.qk_norm else nn.Identity()

    @property
    def needs_explicit_scores(self) -> bool:
        """Whether the scores need more than ExecuTorch's causal ``custom_sdpa`` computes
        (a sliding window, soft-capping)."""
        return self.sliding_window is not None or self.softcap is not None

    def heads(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """x: (B, T, hidden); cos/sin: (B, T, 1, hd), or None for a layer without RoPE ->
        q (B, T, H, hd), k and v (B, T, KV, hd), rotary embedding applied (the layout of
        ExecuTorch's LLM ops)."""
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm_per_head:
            q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim))
        else:
            q = self.q_norm(q).view(B, T, self.num_heads, self.head_dim)
            k = self.k_norm(k).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if cos is None:
            return q, k, v
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def project(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """x: (B, T, hidden); cos/sin: (B, 1, T, hd) or None -> q (B, H, T, hd), k and v
        (B, KV, T, hd)."""
        if cos is not None:
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        q, k, v = self.heads(x, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, mask_add: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, hd); k, v: (B, KV, S, hd); mask_add: additive, broadcast to (B, H, T, S).

        Returns (B, T, hidden). GQA repeats each KV head for its group of query heads.
        """
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = softcap(torch.matmul(q, k.transpose(-1, -2)) * self.scaling, self.softcap)
        scores = scores + mask_add
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, H, T, hd)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class SDARDecoderLayer(nn.Module):
    """Attention then MLP, each a residual branch; where the RMSNorms sit follows
    ``config.norm_layout`` under Hugging Face's names (Llama's ``post_attention_layernorm``
    is the MLP's input norm, Gemma's and OLMo 2's normalises the attention output)."""

    def __init__(self, config: SDARConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.norm_layout = config.norm_layout
        self.residual_multiplier = config.residual_multiplier
        self.rope = config.layer_rope(layer_idx)
        d = config.hidden_size
        if config.norm_layout != "post":
            self.input_layernorm = _norm(config, d)
        self.post_attention_layernorm = _norm(config, d)
        if config.norm_layout == "sandwich":
            self.pre_feedforward_layernorm = _norm(config, d)
        if config.norm_layout != "pre":
            self.post_feedforward_layernorm = _norm(config, d)

    def attention_input(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.norm_layout == "post" else self.input_layernorm(h)

    def _residual(self, h: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        if self.residual_multiplier != 1.0:
            branch = branch * self.residual_multiplier
        return h + branch

    def add_attention(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """h + the attention branch's output (normalised first outside the pre layout)."""
        if self.norm_layout != "pre":
            attn_out = self.post_attention_layernorm(attn_out)
        return self._residual(h, attn_out)

    def add_mlp(self, h: torch.Tensor) -> torch.Tensor:
        """h + the MLP branch."""
        if self.norm_layout == "pre":
            x = self.post_attention_layernorm(h)
        elif self.norm_layout == "sandwich":
            x = self.pre_feedforward_layernorm(h)
        else:
            x = h
        out = self.mlp(x)
        if self.norm_layout != "pre":
            out = self.post_feedforward_layernorm(out)
        return self._residual(h, out)

    def forward(self, h, cos, sin, past_k, past_v, mask_add):
        """One layer over a block whose keys/values are appended after ``past_k``/``past_v``.

        h: (B, T, hidden); past_k/past_v: (B, KV, S, hd) (S may be 0); cos/sin: this
        layer's RoPE (None without); mask_add: additive over (S + T) key columns, this
        layer's (sliding window included). Returns (h, k_block, v_block).
        """
        q, k, v = self.self_attn.project(self.attention_input(h), cos, sin)
        full_k = torch.cat([past_k, k], dim=-2)
        full_v = torch.cat([past_v, v], dim=-2)
        h = self.add_attention(h, self.self_attn.attend(q, full_k, full_v, mask_add))
        return self.add_mlp(h), k, v


class SDARModel(nn.Module):
    """SDAR for block-diffusion decoding; parameter names follow the Hugging Face layout."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = _rope_table(config.rope_theta, config.head_dim, config.max_position_embeddings)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)
        if config.rope_local_theta is not None:
            cos, sin = _rope_table(
                config.rope_local_theta, config.head_dim, config.max_position_embeddings
            )
            self.register_buffer("cos_local", cos, persistent=False)
            self.register_buffer("sin_local", sin, persistent=False)

    def rope_tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each RoPE kind a layer may use (:meth:`SDARConfig.layer_rope`) -> its (cos, sin)
        tables, each (max_pos, hd), or None for a layer without RoPE."""
        tables = {"global": (self.cos_cached, self.sin_cached), "none": None}
        if self.config.rope_local_theta is not None:
            tables["local"] = (self.cos_local, self.sin_local)
        return tables

    def _rope(self, positions: torch.Tensor) -> dict:
        """positions: (B, T) int64 -> per RoPE kind, cos and sin: (B, 1, T, hd) (None for
        a layer without RoPE)."""
        return {
            kind: None
            if t is None
            else (t[0][positions].unsqueeze(1), t[1][positions].unsqueeze(1))
            for kind, t in self.rope_tables().items()
        }

    def _layer_input(self, layer, rope: dict, mask_add, q_pos, k_pos):
        """(cos, sin, mask_add) of ``layer``: its RoPE (None, None without) and, for a
        sliding-window layer, ``mask_add`` plus the window.

        rope: :meth:`_rope`'s; mask_add: additive, broadcast to (B, 1, T, S); q_pos: (B, T)
        int64; k_pos: (B, S) int64, the position of each key column.
        """
        cos, sin = rope[layer.rope] or (None, None)
        window = layer.self_attn.sliding_window
        if window is not None:
            mask_add = mask_add + window_mask(q_pos, k_pos, window)
        return cos, sin, mask_add

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (B, T) int64 -> (B, T, hidden), times ``embedding_multiplier``."""
        h = self.embed_tokens(input_ids)
        m = self.config.embedding_multiplier
        return h if m == 1.0 else h * m

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(h))
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return softcap(logits, self.config.final_logit_softcapping)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicKVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        store_kv: bool = False,
    ) -> torch.Tensor:
        """Dynamic-cache forward (the SDAR reference's ``model(..., store_kv=...)``).

        input_ids, positions: (B, T) int64. ``cache`` holds S earlier tokens (or is None).
        attention_mask: bool (B or 1, T, S + T), True = visible; None means every cached
        token and the whole input block are visible (one block of block diffusion).
        ``store_kv`` appends this input's K/V to ``cache``. Returns logits (B, T, vocab).
        """
        B, T = input_ids.shape
        if store_kv and cache is None:
            raise ValueError("store_kv=True needs a cache to store into")
        past_len = 0 if cache is None else cache.seq_len
        if attention_mask is None:
            mask_add = torch.zeros(1, 1, T, past_len + T)
        else:
            if attention_mask.shape[-2:] != (T, past_len + T):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                    f"(B, {T}, {past_len + T}) for {T} inputs after {past_len} cached tokens"
                )
            mask_add = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, -torch.inf)
            mask_add = mask_add.unsqueeze(1)
        k_pos = torch.cat([torch.arange(past_len)[None].expand(B, -1), positions], dim=1)
        rope = self._rope(positions)
        h = self.embed(input_ids)
        empty = h.new_zeros(B, self.config.num_key_value_heads, 0, self.config.head_dim)
        new_kv = []
        for i, layer in enumerate(self.layers):
            cos, sin, mask = self._layer_input(layer, rope, mask_add, positions, k_pos)
            past_k, past_v = (empty, empty) if past_len == 0 else cache.layer(i)
            h, k, v = layer(h, cos, sin, past_k, past_v, mask)
            new_kv.append((k, v))
        if store_kv:
            cache.append(new_kv)
        return self._logits(h)

    def forward_export(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attention_mask: torch.Tensor,
        insert_matrix: torch.Tensor,
        keep_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache-as-I/O static graph.

        input_ids, positions: (B, bs) int64
        kv_cache: (L, 2, B, KV, max_len, hd) float
        attention_mask: (L, B, 1, bs, max_len + bs) float, 0 = visible, -inf = hidden
        insert_matrix: (L, B, 1, max_len, bs) float, 1 where block[i] goes to cache[start + i]
        keep_mask: (L, B, 1, max_len, 1) float, 0 on the slots being overwritten
        Returns (logits (B, bs, vocab), updated kv_cache of kv_cache's shape).
        """
        self._check_static_shapes(
            input_ids, positions, kv_cache, attention_mask, self.config.num_hidden_layers
        )
        L, _, B, _, max_len, _ = kv_cache.shape
        bs = input_ids.shape[1]
        expected = {
            "insert_matrix": (insert_matrix, (L, B, 1, max_len, bs)),
            "keep_mask": (keep_mask, (L, B, 1, max_len, 1)),
        }
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        # Cache slot j holds position j; the block's keys follow at their positions.
        k_pos = torch.cat([torch.arange(max_len)[None].expand(B, -1), positions], dim=1)
        rope = self._rope(positions)
        h = self.embed(input_ids)
        updated = []
        for i, layer in enumerate(self.layers):
            old_k, old_v = kv_cache[i, 0], kv_cache[i, 1]
            cos, sin, mask = self._layer_input(layer, rope, attention_mask[i], positions, k_pos)
            h, k, v = layer(h, cos, sin, old_k, old_v, mask)
            new_k = old_k * keep_mask[i] + torch.matmul(insert_matrix[i], k)
            new_v = old_v * keep_mask[i] + torch.matmul(insert_matrix[i], v)
            updated.append(torch.stack([new_k, new_v]))
        return self._logits(h), torch.stack(updated)

    def forward_block_kv(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The StaticAttention-style graph: the cache is read, never rewritten.

        input_ids, positions: (B, bs) int64; kv_cache: (L, 2, B, KV, max_len, hd) float;
        attention_mask: (B, 1, bs, max_len + bs) float, shared by all layers.
        Returns (logits (B, bs, vocab), block_kv (L, 2, B, KV, bs, hd)); committing a block
        is the caller's in-place copy of block_kv into the cache's slots.
        """
        self._check_static_shapes(input_ids, positions, kv_cache, attention_mask[None], 1)
        B, max_len = input_ids.shape[0], kv_cache.shape[4]
        # Cache slot j holds position j; the block's keys follow at their positions.
        k_pos = torch.cat([torch.arange(max_len)[None].expand(B, -1), positions], dim=1)
        rope = self._rope(positions)
        h = self.embed(input_ids)
        block = []
        for i, layer in enumerate(self.layers):
            cos, sin, mask = self._layer_input(layer, rope, attention_mask, positions, k_pos)
            h, k, v = layer(h, cos, sin, kv_cache[i, 0], kv_cache[i, 1], mask)
            block.append(torch.stack([k, v]))
        return self._logits(h), torch.stack(block)

    def _check_static_shapes(self, input_ids, positions, kv_cache, attention_mask, mask_layers):
        """Shape checks only: they run once while tracing and cost nothing in the graph."""
        c = self.config
        if input_ids.dim() != 2 or tuple(positions.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                "must both be (batch, block_size)"
            )
        B, bs = input_ids.shape
        kv_ok = kv_cache.dim() == 6 and (
            kv_cache.shape[0],
            kv_cache.shape[1],
            kv_cache.shape[2],
            kv_cache.shape[3],
            kv_cache.shape[5],
        ) == (c.num_hidden_layers, 2, B, c.num_key_value_heads, c.head_dim)
        if not kv_ok:
            raise ValueError(
                f"kv_cache has shape {tuple(kv_cache.shape)}, expected "
                f"({c.num_hidden_layers}, 2, {B}, {c.num_key_value_heads}, max_len, {c.head_dim})"
            )
        want = (mask_layers, B, 1, bs, kv_cache.shape[4] + bs)
        if tuple(attention_mask.shape) != want:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected {want}"
            )


def _rope_table(theta: float, hd: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (max_pos, hd) float32 of RoPE with base ``theta`` (computed in float64)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (max_pos, hd)
    return angles.cos().float(), angles.sin().float()
