"""The tiers' block codecs: lossless round trips exactly, fp8 within its stated error, and a
frame a tier must not serve (damaged, of the other kind, of another length) is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.codec.frame import unpack_frame_header
from kvoffload.tiers.codec.lossless import encode_lossless
from kvoffload.tiers.contract import KVLayout

_DTYPES = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def _layout(dtype: str = "torch.bfloat16", block_bytes: int = 4096, head_dim: int = 16) -> KVLayout:
    return KVLayout("m", dtype, 16, 1, 1, head_dim, block_bytes)


def _kv(nbytes: int, dtype: torch.dtype, seed: int = 0) -> bytearray:
    """KV-like values: normal, with a few large channels."""
    g = torch.Generator().manual_seed(seed)
    count = nbytes // dtype.itemsize
    values = torch.randn(count, generator=g) * (1 + 8 * (torch.arange(count) % 16 == 3))
    return bytearray(values.to(dtype).view(torch.uint8).numpy().tobytes())


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=4096),
    width=st.sampled_from([1, 2, 4, 8]),
)
def test_lossless_round_trips_any_bytes(data: bytes, width: int) -> None:
    data = data[: len(data) // width * width]
    dtype = {1: "int8", 2: "torch.bfloat16", 4: "torch.float32", 8: "torch.float64"}[width]
    codec = BlockCodec("lossless", _layout(dtype, max(len(data), 1)))
    stored = codec.encode(memoryview(data))
    if stored is None:  # not smaller: the tier stores the bytes as they are
        return
    assert len(stored) < len(data)
    out = bytearray(len(data))
    codec.decode(memoryview(stored), memoryview(out))
    assert bytes(out) == data


@pytest.mark.parametrize("dtype", sorted(_DTYPES))
def test_lossless_compresses_kv(dtype: str) -> None:
    raw = _kv(1 << 16, _DTYPES[dtype])
    codec = BlockCodec("lossless", _layout(dtype, len(raw)))
    stored = codec.encode(memoryview(raw))
    assert stored is not None and len(stored) < len(raw)
    out = bytearray(len(raw))
    codec.decode(memoryview(stored), memoryview(out))
    assert out == raw
    stats = codec.stats.as_stats()
    assert stats["codec_raw_bytes"] == len(raw) and stats["codec_stored_bytes"] == len(stored)
    assert codec.stats.ratio > 1.0


def test_none_never_encodes() -> None:
    codec = BlockCodec("none", _layout())
    assert codec.encode(memoryview(bytes(4096))) is None
    assert codec.stored_layout(codec.layout) == codec.layout


@pytest.mark.parametrize("dtype", [*sorted(_DTYPES), "torch.float32"])
def test_fp8_error_is_bounded(dtype: str) -> None:
    tdt = {**_DTYPES, "torch.float32": torch.float32}[dtype]
    raw = _kv(1 << 14, tdt, seed=1)
    codec = BlockCodec("fp8", _layout(dtype, len(raw)))
    stored = codec.encode(memoryview(raw))
    assert stored is not None
    assert len(stored) == 8 + len(raw) // tdt.itemsize * (1 + 2 / 16)  # a byte + a scale / 16
    out = bytearray(len(raw))
    codec.decode(memoryview(stored), memoryview(out))
    want = torch.frombuffer(raw, dtype=tdt).float().view(-1, 16)
    got = torch.frombuffer(out, dtype=tdt).float().view(-1, 16)
    amax = want.abs().amax(dim=1, keepdim=True)
    # e4m3: 1/16 relative (round to nearest), and at most 2^-9 of the group's scale below that;
    # the result's own rounding to the KV dtype adds its half-ulp.
    ulp = {2: 2**-8 if tdt == torch.bfloat16 else 2**-11, 4: 2**-24}[tdt.itemsize]
    bound = want.abs() * (1 / 16 + ulp) + amax / 448 * 2**-9 + 1e-30
    assert bool(((got - want).abs() <= bound * 1.001).all())


def test_lossy_blocks_live_under_another_layout() -> None:
    layout = _layout()
    lossy = BlockCodec("fp8", layout)
    assert lossy.stored_layout(layout).fingerprint() != layout.fingerprint()
    assert BlockCodec("lossless", layout).stored_layout(layout) == layout
    assert BlockCodec("auto", layout).stored_layout(layout) == layout


def test_a_lossy_frame_is_never_decoded_by_an_exact_codec_nor_the_reverse() -> None:
    layout = _layout()
    raw = _kv(layout.block_bytes, torch.bfloat16)
    out = bytearray(len(raw))
    lossy_frame = BlockCodec("fp8", layout).encode(memoryview(raw))
    exact_frame = BlockCodec("lossless", layout).encode(memoryview(raw))
    assert lossy_frame is not None and exact_frame is not None
    with pytest.raises(CorruptBlockError):
        BlockCodec("lossless", layout).decode(memoryview(lossy_frame), memoryview(out))
    with pytest.raises(CorruptBlockError):
        BlockCodec("fp8", layout).decode(memoryview(exact_frame), memoryview(out))


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(min_value=0, max_value=400), flip=st.integers(min_value=0, max_value=10**6))
def test_damaged_lossless_frames_are_refused_or_decode_to_the_right_length(
    cut: int, flip: int
) -> None:
    """Without the block checksum (which catches every change first), a damaged frame still
    never writes outside its slot: the codec refuses it or fills exactly the slot."""
    layout = _layout()
    raw = _kv(layout.block_bytes, torch.bfloat16)
    frame = bytearray(encode_lossless(memoryview(raw), 2))
    frame = frame[: len(frame) - cut] if cut else frame
    frame[flip % len(frame)] ^= 0x5A
    out = bytearray(len(raw))
    try:
        BlockCodec("lossless", layout).decode(memoryview(frame), memoryview(out))
    except CorruptBlockError:
        return
    assert len(out) == len(raw)


def test_fp8_needs_a_float_kv_dtype() -> None:
    with pytest.raises(ConfigError, match="fp8"):
        BlockCodec("fp8", dataclasses.replace(_layout(), dtype="torch.int8"))
    with pytest.raises(ConfigError, match="compression"):
        BlockCodec("zip", _layout())


@pytest.mark.parametrize("dtype", ["bfloat16", "torch.bfloat16", "float16", "torch.float16"])
def test_lossless_splits_planes_whatever_the_dtype_spelling(dtype: str) -> None:
    # vLLM's layouts name the dtype without "torch." ("bfloat16"): its blocks were compressed
    # as bytes of width 1 (no byte planes: a ratio of about 1.3 instead of 1.5).
    layout = _layout(dtype=dtype, block_bytes=1 << 14)
    raw = memoryview(_kv(layout.block_bytes, torch.bfloat16))
    frame = BlockCodec("lossless", layout).encode(raw)
    assert frame is not None and unpack_frame_header(frame)[1] == 2  # the element width
    out = bytearray(layout.block_bytes)
    BlockCodec("lossless", layout).decode(memoryview(frame), memoryview(out))
    assert out == raw

def test_fp8_needs_whole_head_vectors() -> None:
    # vLLM's layouts carry no head size (head_dim 0): fp8 cannot group a block into head
    # vectors, so it is refused at start rather than failing (and logging) on every store.
    for layout in (_layout(head_dim=0), _layout(block_bytes=4096 + 2, head_dim=16)):
        with pytest.raises(ConfigError, match="head"):
            BlockCodec("fp8", layout, "kv_disk_compression")
    assert BlockCodec("lossless", _layout(head_dim=0)).encodes  # exact codecs need no head size


def test_auto_encodes_a_sample_then_follows_the_measured_figures() -> None:
    layout = _layout(block_bytes=1 << 16)
    raw = memoryview(_kv(layout.block_bytes, torch.bfloat16))
    fast = BlockCodec("auto", layout)
    assert fast.encode(raw) is not None  # the first block is a sample
    fast.note_io(1 << 30, 0.01)  # a tier at 100 GB/s: the codec never pays
    assert all(fast.encode(raw) is None for _ in range(10))
    slow = BlockCodec("auto", layout)
    slow.encode(raw)
    slow.note_io(1 << 20, 1.0)  # 1 MB/s: it does
    assert all(slow.encode(raw) is not None for _ in range(10))
    full = BlockCodec("auto", layout)
    full.encode(raw)
    full.note_io(1 << 30, 0.01)
    full.note_capacity_bound()
    assert full.encode(raw) is not None
