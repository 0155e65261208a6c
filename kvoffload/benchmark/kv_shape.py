"""A model's KV-cache shape, to turn a tier size in GiB into trace blocks (``bench trace
--capacities-gib``).

One token's KV takes ``layers * 2 (K and V) * kv_heads * head_dim * dtype bytes``; a trace block
(a hash id) holds ``block_size`` tokens, so a tier of ``G`` GiB holds
``floor(G * 2**30 / (bytes_per_token * block_size))`` blocks. Only standard (GQA / MHA) attention
is modelled: no MLA, sliding windows or quantisation scales.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvoffload.errors import ConfigError

__all__ = ["DTYPE_BYTES", "GIB", "KNOWN_SHAPES", "KVShape", "blocks_for_gib"]

GIB = 1 << 30

#: Bytes per element of each KV dtype.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class KVShape:
    """The KV-cache shape of a model: decoder layers, KV heads per layer, head dimension and the
    cache's dtype (a key of :data:`DTYPE_BYTES`). ``name`` labels it in output."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for field in ("layers", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("kv_shape", f"{field} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                "kv_dtype", f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPE_BYTES)}"
            )

    @property
    def bytes_per_token(self) -> float:
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def as_json(self, block_size: int) -> dict[str, Any]:
        """The shape with its bytes per token and per block of ``block_size`` tokens."""
        return dict(
            asdict(self),
            bytes_per_token=self.bytes_per_token,
            bytes_per_block=self.bytes_per_token * block_size,
        )


#: Well-known shapes (from each model's Hugging Face ``config.json``), bf16 KV.
KNOWN_SHAPES: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape("llama-3-8b", 32, 8, 128),
        KVShape("llama-3.1-8b", 32, 8, 128),
        KVShape("llama-3-70b", 80, 8, 128),
        KVShape("llama-3.1-70b", 80, 8, 128),
        KVShape("mistral-7b", 32, 8, 128),
        KVShape("qwen-7b", 32, 32, 128),
        KVShape("qwen2.5-7b", 28, 4, 128),
        KVShape("qwen2.5-72b", 80, 8, 128),
        KVShape("qwen3-8b", 36, 8, 128),
        KVShape("qwen3-32b", 64, 8, 128),
    )
}


def blocks_for_gib(gib: float, shape: KVShape, block_size: int) -> int:
    """How many whole blocks of ``block_size`` tokens a tier of ``gib`` GiB holds."""
    return math.floor(gib * GIB / (shape.bytes_per_token * block_size))
