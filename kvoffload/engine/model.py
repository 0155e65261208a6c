"""The decoder-only transformer of the reference engine (Llama / Qwen2 / Qwen3 families).

Pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query attention over the
paged KV cache (:mod:`kvoffload.engine.attention`) and a SwiGLU MLP. Weights are kept fused for
speed: ``qkv_proj`` stacks the q, k and v projections row-wise, ``gate_up_proj`` the gate and up
projections, and ``qk_norm`` (Qwen3) stacks the q-norm weight once per query head and the k-norm
weight once per KV head. :mod:`kvoffload.engine.loader` maps Hugging Face names onto these.

All work is batched over the step's ``T`` tokens; the only Python loops are over layers and,
inside attention, over sequences.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvoffload.engine.attention import (
    AttentionMetadata,
    AttentionPlan,
    paged_attention,
    plan_attention,
)
from kvoffload.engine.model_config import ModelConfig, RopeScaling
from kvoffload.errors import ContractError

__all__ = ["DecoderModel", "RotaryEmbedding"]


class RotaryEmbedding:
    """Cached cos/sin tables for RoPE in the half-split ("rotate half") convention.

    Tables are float32, computed exactly as Hugging Face does (``position * inv_freq`` in float32),
    and grow on demand to the next power of two above the longest sequence seen, so a model with
    ``max_position_embeddings=131072`` does not allocate a 128k-row table up front.
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = _inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(
            device
        )
        self.cos = torch.empty(0, config.head_dim, device=device)
        self.sin = torch.empty(0, config.head_dim, device=device)

    def tables(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` rows for ``positions``, shaped ``(T, 1, D)`` in ``dtype``.

        ``sin`` carries the rotation's sign (``-sin`` in the first half), so that
        ``rope(x) = x * cos + swap_halves(x) * sin``. ``max_len`` bounds ``positions`` (it is the
        longest sequence of the step, known on the host without a device sync).
        """
        if max_len > self.cos.shape[0]:
            n = 1 << max(max_len - 1, 1).bit_length()
            freqs = torch.outer(
                torch.arange(n, device=self.inv_freq.device, dtype=torch.float32), self.inv_freq
            )
            self.cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
            self.sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` is ``(T, N, D)`` (may be strided); returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block with fused projections."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        c, h = config, config.hidden_size
        self.config = config
        param = functools.partial(_param, dtype=dtype, device=device)
        self.input_norm = param(h)
        self.qkv_proj = param(c.q_size + 2 * c.kv_size, h)
        self.qkv_bias = param(c.q_size + 2 * c.kv_size) if c.attention_bias else None
        self.qk_norm = param(c.num_heads + c.num_kv_heads, c.head_dim) if c.qk_norm else None
        self.o_proj = param(h, c.q_size)
        self.o_bias = param(h) if c.o_proj_bias else None
        self.post_attention_norm = param(h)
        self.gate_up_proj = param(2 * c.intermediate_size, h)
        self.down_proj = param(h, c.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        c = self.config
        eps, d, heads = c.rms_norm_eps, c.head_dim, c.num_heads
        num_tokens = x.shape[0]

        h = F.rms_norm(x, (c.hidden_size,), self.input_norm, eps)
        qkv = F.linear(h, self.qkv_proj, self.qkv_bias)
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, heads + c.num_kv_heads, d)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), None, eps) * self.qk_norm
        qk = _apply_rope(qk, cos, sin)
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, d)
        attn_out = paged_attention(qk[:, :heads], qk[:, heads:], v, kv_cache, layer, plan)
        x = x + F.linear(attn_out, self.o_proj, self.o_bias)

        h = F.rms_norm(x, (c.hidden_size,), self.post_attention_norm, eps)
        gate_up = F.linear(h, self.gate_up_proj)
        inter = c.intermediate_size
        return x + F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.down_proj)


class DecoderModel(nn.Module):
    """A causal LM whose attention reads and writes the engine's paged KV cache.

    Parameters are created uninitialised; :func:`kvoffload.engine.loader.load_model` fills them
    from a checkpoint or with seeded random values. Call under ``torch.inference_mode()``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        param = functools.partial(_param, dtype=dtype, device=device)
        self.embed_tokens = param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = param(config.hidden_size)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else param(config.vocab_size, config.hidden_size)
        )
        self.rope = RotaryEmbedding(config, device)

    def kv_cache_shape(
        self, num_blocks: int, block_size: int
    ) -> tuple[int, int, int, int, int, int]:
        """``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``; K is 0, V is 1."""
        c = self.config
        return (num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token, all layers (``kv_cache.element_size()`` included)."""
        return self.config.kv_bytes_per_token(torch.empty(0, dtype=self.dtype).element_size())

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """A zeroed KV cache on the model's device in the model's dtype."""
        return torch.zeros(
            self.kv_cache_shape(num_blocks, block_size), dtype=self.dtype, device=self.device
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the step's ``T`` new tokens; returns final-normed hidden states ``(T, hidden)``.

        Writes every new token's K/V into ``kv_cache`` at ``attn.slot_mapping`` and nowhere
        else. ``positions[t]`` is token ``t``'s position in its sequence (used for RoPE; must
        match ``attn``). Raises :class:`ContractError` before writing anything if the inputs are
        inconsistent.
        """
        num_tokens = input_ids.shape[0]
        if input_ids.shape != (num_tokens,) or positions.shape != (num_tokens,):
            raise ContractError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                "must both be (T,)"
            )
        num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[3] if kv_cache.dim() == 6 else -1
        if (
            kv_cache.shape != self.kv_cache_shape(num_blocks, block_size)
            or kv_cache.dtype != self.dtype
        ):
            raise ContractError(
                f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                f"{self.kv_cache_shape(num_blocks, block_size)} {self.dtype}"
            )
        plan = plan_attention(attn, num_tokens, kv_cache, self.config.max_position_embeddings)
        cos, sin = self.rope.tables(positions, max(attn.seq_lens, default=1), self.dtype)
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, i, plan)
        return F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``(N, vocab_size)`` for rows of :meth:`forward`'s output."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
