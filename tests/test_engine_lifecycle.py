"""What an engine owns (copy threads, the host pool, the event publisher's thread and bound socket)
is released on close(), when the engine is garbage-collected without close(), and when its
construction fails half way: nothing leaks, and the same endpoint can be bound again at once."""

from __future__ import annotations

import gc
import socket
import threading
import weakref

import pytest
from engine_cases import greedy, host_gib, one_thread, tiny_engine  # noqa: F401 - autouse

from kvoffload.errors import ConfigError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(port: int) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": None,
    }


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_engines_dropped_without_close_release_threads_pool_and_socket() -> None:
    before = _threads()
    port = _free_port()
    pools = []
    for _ in range(3):
        engine = tiny_engine(
            num_device_blocks=64, kv_offloading_size=host_gib(64), kv_events_config=_events(port)
        )
        assert engine.worker is not None
        pools.append(weakref.ref(engine.worker.host_pool))
        engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], greedy(2))
        assert _threads() - before  # copy threads and the publisher's thread
        del engine  # never closed; the next one binds the same endpoint
        gc.collect()
    assert not _threads() - before
    assert all(pool() is None for pool in pools)


def test_a_failed_construction_releases_the_publisher_and_its_endpoint() -> None:
    before = _threads()
    port = _free_port()
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        tiny_engine(kv_offloading_size=1e-12, kv_events_config=_events(port))
    assert not _threads() - before
    with tiny_engine(kv_offloading_size=host_gib(8), kv_events_config=_events(port)) as engine:
        engine.generate([[1, 2, 3, 4, 5]], greedy(1))
    assert not _threads() - before


def test_close_is_idempotent_and_releases_everything() -> None:
    before = _threads()
    engine = tiny_engine(kv_offloading_size=host_gib(8), kv_events_config=_events(_free_port()))
    engine.close()
    engine.close()
    assert not _threads() - before
