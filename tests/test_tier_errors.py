"""The tiers' exceptions are in kvoffload's one tree (issue 33): each derives from
``KVOffloadError`` and keeps the builtin base existing ``except`` clauses catch; they pickle
intact (a benchmark's engine process reports errors to its parent)."""

from __future__ import annotations

import errno
import importlib
import inspect
import pickle
import pkgutil

import pytest

import kvoffload.tiers
from kvoffload.benchmark.redis_server import RedisUnavailableError
from kvoffload.errors import KVOffloadError
from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.disk.files import TemporaryRemovedError
from kvoffload.tiers.redis.connection import ProtocolError, RespError, RespErrorRaised


def _modules() -> list[str]:
    names = [f"kvoffload.tiers.{m.name}" for m in pkgutil.iter_modules(kvoffload.tiers.__path__)]
    return [*names, "kvoffload.benchmark.redis_server"]


@pytest.mark.parametrize("module", _modules())
def test_every_exception_a_tier_module_defines_is_a_kvoffload_error(module: str) -> None:
    mod = importlib.import_module(module)
    for name, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ == module and issubclass(cls, BaseException):
            assert issubclass(cls, KVOffloadError), f"{module}.{name}"


def test_builtin_bases_are_kept() -> None:
    assert issubclass(ProtocolError, ConnectionError)
    assert issubclass(TemporaryRemovedError, FileNotFoundError)
    assert issubclass(RedisUnavailableError, RuntimeError)
    assert not issubclass(RespError, BaseException)  # a reply value, returned, never raised
    removed = TemporaryRemovedError(errno.ENOENT, "x.tmp was removed while written")
    assert removed.errno == errno.ENOENT


@pytest.mark.parametrize(
    "error",
    [
        CorruptBlockError("checksum", "payload xxh3 differs"),
        TemporaryRemovedError(errno.ENOENT, "x.tmp was removed while written"),
        ProtocolError("the server closed the connection"),
        RespErrorRaised(RespError("WRONGPASS invalid username-password pair")),
        RedisUnavailableError("redis-server is not installed"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_they_survive_pickle(error: KVOffloadError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    if isinstance(error, CorruptBlockError):
        assert (copy.cause, copy.detail) == (error.cause, error.detail)  # type: ignore[attr-defined]
    if isinstance(error, RespErrorRaised):
        assert copy.error.kind == "WRONGPASS"  # type: ignore[attr-defined]
