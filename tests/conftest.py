"""Shared fixtures: a handful of keys and a request context. Tests marked ``cuda`` skip without one."""

from __future__ import annotations

import os
import signal

import pytest

# Before torch starts its OpenMP pool: spinning worker threads on a shared 2-core machine turn a
# millisecond forward pass into a second (tests of the model pin torch to one thread as well).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvoffload import OffloadKey, ReqContext, make_offload_key

# A runner started in the background (`make test &`, nohup, a CI script's `&`) inherits SIGINT
# ignored, and so would every process a test starts: the Ctrl-C tests' CLIs would never see their
# SIGINT (hang, or exit 0). A handled signal is reset to its default on exec, an ignored one is
# not: handling it here gives the children the default disposition a terminal gives them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Repeat, as a red banner, why the vLLM plug-in tests were skipped (if they were)."""
    from vllm_cases import SKIP_MARK

    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if SKIP_MARK in reason:
            terminalreporter.write_sep("!", reason.removeprefix("Skipped: "), red=True, bold=True)
            return


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if not cuda_items:
        return
    import torch  # only when a CUDA test was collected: the scheduler-side tests stay torch-free

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in cuda_items:
        item.add_marker(skip)


@pytest.fixture
def keys() -> list[OffloadKey]:
    """Ten distinct offload keys: ``keys[i]`` plays vLLM's test block ``i``."""
    return [make_offload_key(i.to_bytes(32, "big")) for i in range(10)]


@pytest.fixture
def ctx() -> ReqContext:
    """A fresh request context."""
    return ReqContext("req-0")


@pytest.fixture(scope="session")
def redis_server():
    """A standalone ``redis-server`` for the whole session (fails, never skips, when missing)."""
    from redis_servers import RedisUnavailableError, standalone_server

    try:
        with standalone_server() as server:
            yield server
    except RedisUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def tls_redis():
    """A TLS-only ``redis-server`` (``--port 0 --tls-port``) whose certificates are made for the
    session with ``openssl``; its ``url`` is ``rediss://`` with ``ssl_ca_certs`` naming its CA.
    Fails, never skips, when redis-server or openssl is missing."""
    from redis_servers import RedisUnavailableError, tls_server

    try:
        with tls_server() as server:
            yield server
    except RedisUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_cluster():
    """A Cluster of 3 masters + 3 replicas for the whole session; tests must not break it."""
    from redis_servers import RedisUnavailableError, cluster_servers

    try:
        with cluster_servers(masters=3) as cluster:
            yield cluster
    except RedisUnavailableError as exc:
        pytest.fail(str(exc), pytrace=False)
