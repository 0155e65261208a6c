"""The lossy codec, opt-in only: fp8 (e4m3) values with one bf16 scale per head vector.

The block is read as elements of its KV dtype (bf16, fp16 or fp32) in groups of ``head_dim``
(one token's vector of one head in one layer's K or V: the innermost dimension of every KV
layout here). Each group is divided by its scale, ``amax / 448`` rounded to bf16 (448 is the
largest e4m3 value), and rounded to e4m3; decoding multiplies back. Body after the frame header:
the scales (bf16, one per group), then the fp8 values (one byte per element).

Error: e4m3 keeps 3 mantissa bits, so each element is off by at most 1/16 of its magnitude
(relative, round to nearest), plus the absolute floor of e4m3's subnormals (2^-9 x the scale)
for elements far below their group's largest; ``benchmarks/compression.py`` measures what that
does to the next-token distribution. bf16 KV stores in ``(head_dim + 2) / (2 * head_dim)`` of
its size (1.94x at head_dim 64), fp32 KV in about a quarter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.codec.frame import FP8_ID, FRAME, pack_frame_header

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_DTYPES", "decode_fp8", "encode_fp8"]

#: The KV dtypes fp8 encodes, by ``str(torch dtype)``, and their ids in the frame.
FP8_DTYPES = {"torch.bfloat16": 1, "torch.float16": 2, "torch.float32": 3}
_E4M3_MAX = 448.0


def _torch_dtype(dtype_id: int) -> torch.dtype | None:
    """The torch dtype of a frame's dtype id (torch is imported here, on first use: importing
    the tiers must not import it)."""
    import torch

    return {1: torch.bfloat16, 2: torch.float16, 3: torch.float32}.get(dtype_id)


def encode_fp8(raw: memoryview | bytes, dtype: str, head_dim: int) -> bytes:
    """The frame of ``raw``, elements of ``dtype`` (a key of :data:`FP8_DTYPES`) in groups of
    ``head_dim``."""
    import torch

    dtype_id = FP8_DTYPES.get(dtype)
    source = None if dtype_id is None else _torch_dtype(dtype_id)
    if dtype_id is None or source is None:
        raise ValueError(f"fp8 encodes {sorted(FP8_DTYPES)} KV, not {dtype}")
    values = torch.frombuffer(bytearray(raw), dtype=source).float()
    groups = values.view(-1, head_dim)
    scales = (groups.abs().amax(dim=1, keepdim=True) / _E4M3_MAX).to(torch.bfloat16)
    scales[scales == 0] = 1.0
    quant = (groups / scales.float()).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return b"".join(
        [
            pack_frame_header(FP8_ID, dtype_id, len(raw)),
            scales.view(torch.uint8).numpy().tobytes(),
            quant.view(torch.uint8).numpy().tobytes(),
        ]
    )


def decode_fp8(stored: memoryview, dtype_id: int, head_dim: int, out: memoryview) -> None:
    """Decode the frame ``stored`` into ``out`` (``len(out)`` bytes of the frame's dtype)."""
    import torch

    dtype = _torch_dtype(dtype_id)
    if dtype is None:
        raise CorruptBlockError("corrupt", f"fp8 frame of unknown dtype id {dtype_id}")
    width = dtype.itemsize
    count = len(out) // width
    groups = count // head_dim if head_dim > 0 else 0
    if groups * head_dim * width != len(out) or len(stored) != FRAME.size + 2 * groups + count:
        raise CorruptBlockError("corrupt", f"an fp8 frame of {len(stored)} bytes")
    body = bytearray(stored[FRAME.size :])
    scales = torch.frombuffer(body, dtype=torch.bfloat16, count=groups).float()
    quant = torch.frombuffer(body, dtype=torch.float8_e4m3fn, offset=2 * groups)
    values = quant.float().view(groups, head_dim) * scales.view(groups, 1)
    target = torch.frombuffer(out, dtype=torch.uint8)
    target.copy_(values.to(dtype).view(-1).view(torch.uint8))
