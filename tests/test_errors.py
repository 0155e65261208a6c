"""Errors cross process boundaries intact (a benchmark's engine process reports them to its
parent through pickle)."""

from __future__ import annotations

import pickle

import pytest

from kvoffload.errors import (
    ConfigError,
    ContractError,
    HostAllocationError,
    KVOffloadError,
    TransferError,
)

CASES = [
    ConfigError("kv_remote_url", "cannot reach redis://127.0.0.1:1/0"),
    HostAllocationError(3 * 2**30, "mmap failed"),
    ContractError("complete_store of a key never prepared"),
    TransferError("copy failed"),
]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_errors_survive_pickle(error: KVOffloadError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_fields_are_kept() -> None:
    config = pickle.loads(pickle.dumps(CASES[0]))
    assert (config.field, config.message) == ("kv_remote_url", "cannot reach redis://127.0.0.1:1/0")
    host = pickle.loads(pickle.dumps(CASES[1]))
    assert (host.num_bytes, host.detail) == (3 * 2**30, "mmap failed")
    assert "3.00 GiB" in str(host)
