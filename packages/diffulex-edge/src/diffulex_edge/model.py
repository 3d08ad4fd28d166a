"""The SDAR transformer: Qwen3 geometry (RMSNorm, RoPE, GQA, q/k norm, SwiGLU).

q/k norm and q/k/v biases are config switches, so the same module is a Llama, Qwen2 or
Qwen3 model too (:mod:`diffulex_edge.hf_config`).

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
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SDARAttention(nn.Module):
    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.scaling = hd**-0.5
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=False)
        # Llama and Qwen2 have no q/k norm: identity keeps one code path and no empty weights.
        norm = (lambda: RMSNorm(hd, config.rms_norm_eps)) if config.qk_norm else nn.Identity
        self.q_norm = norm()
        self.k_norm = norm()

    def heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: (B, T, hidden); cos/sin: (B, T, 1, hd) -> q (B, T, H, hd), k and v
        (B, T, KV, hd), rotary embedding applied (the layout of ExecuTorch's LLM ops)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: (B, T, hidden); cos/sin: (B, 1, T, hd) -> q (B, H, T, hd), k and v (B, KV, T, hd)."""
        q, k, v = self.heads(x, cos.transpose(1, 2), sin.transpose(1, 2))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, mask_add: torch.Tensor) -> torch.Tensor:
        """q: (B, H, T, hd); k, v: (B, KV, S, hd); mask_add: additive, broadcast to (B, H, T, S).

        Returns (B, T, hidden). GQA repeats each KV head for its group of query heads.
        """
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling + mask_add
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # (B, H, T, hd)
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class SDARDecoderLayer(nn.Module):
    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.self_attn = SDARAttention(config)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, past_k, past_v, mask_add):
        """One layer over a block whose keys/values are appended after ``past_k``/``past_v``.

        h: (B, T, hidden); past_k/past_v: (B, KV, S, hd) (S may be 0);
        mask_add: additive over (S + T) key columns. Returns (h, k_block, v_block).
        """
        q, k, v = self.self_attn.project(self.input_layernorm(h), cos, sin)
        full_k = torch.cat([past_k, k], dim=-2)
        full_v = torch.cat([past_v, v], dim=-2)
        h = h + self.self_attn.attend(q, full_k, full_v, mask_add)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


class SDARModel(nn.Module):
    """SDAR for block-diffusion decoding; parameter names follow the Hugging Face layout."""

    def __init__(self, config: SDARConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            SDARDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        hd = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(
            torch.arange(config.max_position_embeddings, dtype=torch.float64), inv_freq
        )
        angles = torch.cat([angles, angles], dim=-1)  # (max_pos, hd)
        self.register_buffer("cos_cached", angles.cos().float(), persistent=False)
        self.register_buffer("sin_cached", angles.sin().float(), persistent=False)

    def _rope(self, positions: torch.Tensor):
        """positions: (B, T) int64 -> cos, sin: (B, 1, T, hd)."""
        return self.cos_cached[positions].unsqueeze(1), self.sin_cached[positions].unsqueeze(1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

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
        cos, sin = self._rope(positions)
        h = self.embed_tokens(input_ids)
        empty = h.new_zeros(B, self.config.num_key_value_heads, 0, self.config.head_dim)
        new_kv = []
        for i, layer in enumerate(self.layers):
            past_k, past_v = (empty, empty) if past_len == 0 else cache.layer(i)
            h, k, v = layer(h, cos, sin, past_k, past_v, mask_add)
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
        cos, sin = self._rope(positions)
        h = self.embed_tokens(input_ids)
        updated = []
        for i, layer in enumerate(self.layers):
            old_k, old_v = kv_cache[i, 0], kv_cache[i, 1]
            h, k, v = layer(h, cos, sin, old_k, old_v, attention_mask[i])
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
        cos, sin = self._rope(positions)
        h = self.embed_tokens(input_ids)
        block = []
        for i, layer in enumerate(self.layers):
            h, k, v = layer(h, cos, sin, kv_cache[i, 0], kv_cache[i, 1], attention_mask)
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


def random_model(config: SDARConfig, seed: int = 0) -> SDARModel:
    """An SDARModel with seeded random weights (norm gains perturbed too, so q/k norm and
    RMSNorm weights are exercised), in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    model = SDARModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()
