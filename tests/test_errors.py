"""Errors cross process boundaries intact (a benchmark's engine process reports them to its
parent through pickle)."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

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


def _package_modules() -> list[str]:
    import kvoffload

    root = Path(kvoffload.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_every_exception_kvoffload_defines_derives_from_kvoffload_error() -> None:
    """errors.py's promise: ``KVOffloadError`` is the base of every error kvoffload raises on
    purpose, so ``except KVOffloadError`` catches them all. Every module is imported (those that
    need vLLM only where it is installed) and every exception class it defines is checked."""
    outside, unimported = [], []
    for name in _package_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("vllm"):
                raise
            unimported.append(name)
            continue
        for value in list(vars(module).values()):
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == name
                and not issubclass(value, KVOffloadError)
            ):
                outside.append(f"{name}.{value.__qualname__}")
    assert not outside, f"exceptions outside KVOffloadError: {outside}"
    assert all(name.startswith("kvoffload.integrations.vllm") for name in unimported), unimported

