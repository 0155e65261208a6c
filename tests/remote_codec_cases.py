"""Helpers of the compressed-tier tests: KV-like host pools (bf16 values that compress as a
model's KV does) and layouts that name their dtype as the engine does."""

from __future__ import annotations

import uuid

import torch

from kvoffload.tiers.contract import KVLayout


def kv_layout(block_bytes: int, dtype: str = "torch.bfloat16") -> KVLayout:
    """A fresh layout (a fingerprint no other test uses) of ``dtype`` KV, head_dim 64."""
    return KVLayout(f"test-{uuid.uuid4().hex}", dtype, 16, 2, 2, 64, block_bytes)


def fill_kv(tensor: torch.Tensor, seed: int = 0) -> None:
    """Fill a uint8 pool tensor with bf16 values: normal, a few channels 8x larger."""
    g = torch.Generator().manual_seed(seed)
    count = tensor.numel() // 2
    values = torch.randn(count, generator=g) * (1 + 7 * (torch.arange(count) % 64 == 5))
    tensor.view(-1).copy_(values.to(torch.bfloat16).view(torch.uint8))
