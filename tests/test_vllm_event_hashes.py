"""Block hashes in KV events: kvoffload's int form is vLLM's.

vLLM publishes a block hash as ``maybe_convert_block_hash(hash bytes)`` (an int by default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); kvoffload as ``external_block_hash(hash bytes,
int_block_hashes)``, whose default follows the same variable. For any hash bytes and either value
of the variable, the two agree, so a router indexes both engines' blocks under one hash.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from vllm_cases import require_vllm

require_vllm()

from vllm import envs  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402

from kvoffload.events import KVEventsConfig, external_block_hash  # noqa: E402
from kvoffload.events.config import INT_BLOCK_HASHES_ENV  # noqa: E402


@pytest.mark.parametrize("value", [None, "1", "0"])
@given(h=st.binary(min_size=8, max_size=64))
@example(h=bytes(32))
@example(h=b"\xff" * 32)
def test_published_hashes_equal_vllms(value: str | None, h: bytes) -> None:
    with pytest.MonkeyPatch.context() as mp:
        if value is None:
            mp.delenv(INT_BLOCK_HASHES_ENV, raising=False)
        else:
            mp.setenv(INT_BLOCK_HASHES_ENV, value)
        envs.disable_envs_cache()  # read the variable afresh (vLLM may cache its variables)
        as_int = KVEventsConfig(enable_kv_cache_events=True).int_block_hashes
        assert as_int is envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        assert external_block_hash(h, as_int) == maybe_convert_block_hash(BlockHash(h))
