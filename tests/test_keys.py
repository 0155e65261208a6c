"""Offload keys and prefix-chained block hashing (``kvoffload.keys``).

The hash formats are pinned here by references written independently of the implementation
(hand-encoded CBOR, ``struct``), because stored blocks outlive processes and versions: a silent
format change would turn every stored block into a miss, or worse, into someone else's block.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import (
    BlockHasher,
    ConfigError,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
)
from kvoffload.keys import HASH_SCHEMES

SCHEMES = sorted(HASH_SCHEMES)
FAST = settings(max_examples=60, deadline=None)

token_ids = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)
extra_keys = (
    st.none() | st.tuples(st.text(max_size=8)) | st.tuples(st.text(max_size=8), st.integers(0, 99))
)


# ---------------------------------------------------------------------------- OffloadKey


@FAST
@given(block_hash=st.binary(max_size=40), group=st.integers(min_value=0, max_value=2**32 - 1))
def test_offload_key_round_trips(block_hash: bytes, group: int) -> None:
    key = make_offload_key(block_hash, group)
    assert isinstance(key, bytes)
    assert offload_key_hash(key) == block_hash
    assert offload_key_group(key) == group


def test_offload_key_defaults_to_group_zero_and_groups_are_distinct_keys() -> None:
    block_hash = bytes(32)
    assert offload_key_group(make_offload_key(block_hash)) == 0
    assert make_offload_key(block_hash, 0) != make_offload_key(block_hash, 1)
    assert make_offload_key(block_hash, 1) == block_hash + b"\x00\x00\x00\x01"


# ---------------------------------------------------------------------------- chaining


@pytest.mark.parametrize("scheme", SCHEMES)
@FAST
@given(data=st.data())
def test_changing_one_token_changes_its_block_and_every_later_one(
    scheme: str, data: st.DataObject
) -> None:
    hasher = BlockHasher(block_size=4, scheme=scheme)
    tokens = data.draw(st.lists(st.integers(0, 50_000), min_size=16, max_size=16))
    position = data.draw(st.integers(0, 15))
    changed = list(tokens)
    changed[position] += 1
    before, after = hasher.hash_blocks(tokens), hasher.hash_blocks(changed)
    block = position // 4
    assert before[:block] == after[:block]
    assert all(b != a for b, a in zip(before[block:], after[block:], strict=True))


@pytest.mark.parametrize("scheme", SCHEMES)
@FAST
@given(tokens=token_ids, extra=extra_keys, data=st.data())
def test_hashing_from_start_block_with_parent_equals_hashing_everything(
    scheme: str, tokens: list[int], extra: Any, data: st.DataObject
) -> None:
    hasher = BlockHasher(block_size=3, scheme=scheme)
    whole = hasher.hash_blocks(tokens, extra)
    start = data.draw(st.integers(0, len(whole)))
    parent = whole[start - 1] if start else None
    assert hasher.hash_blocks(tokens, extra, parent=parent, start_block=start) == whole[start:]
    # One block at a time through hash_block gives the same chain.
    prev = None
    for i, expected in enumerate(whole):
        prev = hasher.hash_block(prev, tokens[i * 3 : i * 3 + 3], extra)
        assert prev == expected


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partial_trailing_block_is_not_hashed(scheme: str) -> None:
    hasher = BlockHasher(block_size=4, scheme=scheme)
    full = list(range(8))
    assert len(hasher.hash_blocks(full)) == 2
    assert hasher.hash_blocks([*full, 8, 9, 10]) == hasher.hash_blocks(full)
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks(full, parent=hasher.hash_blocks(full)[1], start_block=2) == []


@pytest.mark.parametrize("scheme", SCHEMES)
def test_extra_keys_and_seed_change_every_hash(scheme: str) -> None:
    tokens = list(range(12))
    plain = BlockHasher(4, scheme).hash_blocks(tokens)
    variants = [
        BlockHasher(4, scheme).hash_blocks(tokens, ("lora-a",)),
        BlockHasher(4, scheme).hash_blocks(tokens, ("lora-b",)),
        BlockHasher(4, scheme).hash_blocks(tokens, ()),
        BlockHasher(4, scheme, seed="1").hash_blocks(tokens),
    ]
    for variant in variants:
        assert all(p != v for p, v in zip(plain, variant, strict=True))
    assert BlockHasher(4, scheme).hash_blocks(tokens, ("lora-a",)) == variants[0]
    assert BlockHasher(4, scheme, seed="1").root_hash != BlockHasher(4, scheme).root_hash


def test_schemes_give_different_hashes_of_their_own_sizes() -> None:
    tokens = list(range(8))
    sha = BlockHasher(4, "sha256_cbor").hash_blocks(tokens)
    xxh = BlockHasher(4, "xxh3_128").hash_blocks(tokens)
    assert {len(h) for h in sha} == {32}
    assert {len(h) for h in xxh} == {16}
    assert not set(sha) & set(xxh)


# ---------------------------------------------------------------------------- pinned formats


def _vllm_sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _vllm_block_hashes(tokens: list[int], block_size: int, seed: str, extra: Any) -> list[bytes]:
    """vLLM's ``hash_block_tokens`` chain with ``NONE_HASH = sha256_cbor(PYTHONHASHSEED)``."""
    parent = _vllm_sha256_cbor(seed)
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _vllm_sha256_cbor((parent, tuple(tokens[start : start + block_size]), extra))
        hashes.append(parent)
    return hashes


@FAST
@given(tokens=token_ids, extra=extra_keys, seed=st.sampled_from(["0", "42", "hello"]))
def test_sha256_cbor_equals_vllm_block_hashes(tokens: list[int], extra: Any, seed: str) -> None:
    hasher = BlockHasher(block_size=4, scheme="sha256_cbor", seed=seed)
    assert hasher.root_hash == _vllm_sha256_cbor(seed)
    assert hasher.hash_blocks(tokens, extra) == _vllm_block_hashes(tokens, 4, seed, extra)


def test_sha256_cbor_bytes_are_hand_checkable() -> None:
    # Canonical CBOR without cbor2: text "0" = 61 30; array(3) = 83; bytes(32) = 58 20 <32 bytes>;
    # array(4) = 84; small ints encode as themselves; null = f6.
    root = hashlib.sha256(b"\x61\x30").digest()
    first = hashlib.sha256(b"\x83\x58\x20" + root + b"\x84\x01\x02\x03\x04\xf6").digest()
    hasher = BlockHasher(
        block_size=4
    )  # defaults: sha256_cbor, seed "0" (vLLM with PYTHONHASHSEED=0)
    assert hasher.root_hash == root
    assert hasher.hash_blocks([1, 2, 3, 4]) == [first]


@FAST
@given(tokens=token_ids, extra=extra_keys)
def test_xxh3_128_format(tokens: list[int], extra: Any) -> None:
    """``xxh3_128(parent || token ids as uint32 little-endian || cbor(extra_keys))``."""
    parent = xxhash.xxh3_128_digest(b"0")
    expected = []
    for start in range(0, len(tokens) - 3, 4):
        block = struct.pack("<4I", *tokens[start : start + 4])
        tail = b"" if extra is None else cbor2.dumps(extra, canonical=True)
        parent = xxhash.xxh3_128_digest(parent + block + tail)
        expected.append(parent)
    hasher = BlockHasher(block_size=4, scheme="xxh3_128")
    assert hasher.root_hash == xxhash.xxh3_128_digest(b"0")
    assert hasher.hash_blocks(tokens, extra) == expected


_CHILD = """
import json, sys
from kvoffload import BlockHasher
tokens = list(range(1000, 1040))
print(json.dumps({s: [h.hex() for h in BlockHasher(8, s, seed="7").hash_blocks(tokens, ("salt", 3))]
                  for s in sys.argv[1:]}))
"""


def test_hashes_are_identical_across_processes_with_different_hash_seeds() -> None:
    tokens = list(range(1000, 1040))
    here = {
        s: [h.hex() for h in BlockHasher(8, s, seed="7").hash_blocks(tokens, ("salt", 3))]
        for s in SCHEMES
    }
    for hash_seed in ("1", "31337"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, *SCHEMES],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert json.loads(out.stdout) == here


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("scheme", ["sha256", "", "XXH3_128"])
def test_unknown_scheme_is_a_config_error_naming_the_field(scheme: str) -> None:
    with pytest.raises(ConfigError, match="hash_scheme") as info:
        BlockHasher(16, scheme)
    assert info.value.field == "hash_scheme"


@pytest.mark.parametrize("block_size", [0, -1, 2.5, "16", None])
def test_bad_block_size_is_a_config_error_naming_the_field(block_size: Any) -> None:
    with pytest.raises(ConfigError, match="block_size") as info:
        BlockHasher(block_size)
    assert info.value.field == "block_size"


@pytest.mark.parametrize("seed", [0, None, b"0"], ids=["int", "none", "bytes"])
def test_non_string_seed_is_a_config_error(seed: Any) -> None:
    # An int seed would silently give a root hash different from vLLM's (which hashes the string).
    with pytest.raises(ConfigError) as info:
        BlockHasher(16, seed=seed)
    assert info.value.field == "hash_seed"
