"""The remote tier's password never leaves in clear or percent-encoded: every way an engine's
settings or state can be printed, logged, scraped, pickled to a parent process or written to JSON
is grepped for it, against a real password-protected ``redis-server``.

(An ``EngineConfig`` pickled to a *child* process keeps the URL: the child must connect.)
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture
from redis_servers import RedisServer, RedisUnavailableError, standalone_server

from kvoffload.engine import Engine, EngineConfig, SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.serving.ready import ready_line
from kvoffload.tiers.redis.tier import RedisTier, RemoteTierConfig
from kvoffload.tiers.redis.url import parse_redis_url

ROOT = Path(__file__).resolve().parent.parent
#: A password a URL carries as is, and one it must percent-encode.
PASSWORDS = {"plain": "plainSecret4711", "encoded": "s3cr3t/p@ss:w%rd"}


@pytest.fixture(scope="module", params=sorted(PASSWORDS))
def secret(request: pytest.FixtureRequest) -> Iterator[tuple[RedisServer, str, str]]:
    """``(server, password, URL with the password percent-encoded)``."""
    password = PASSWORDS[request.param]
    try:
        with standalone_server(password=password) as server:
            url = f"redis://:{quote(password, safe='')}@127.0.0.1:{server.port}/0"
            yield server, password, url
    except RedisUnavailableError as exc:
        pytest.fail(str(exc))


def assert_hidden(password: str, *texts: object) -> None:
    for text in texts:
        shown = text.decode("latin-1") if isinstance(text, bytes) else str(text)
        for form in {password, quote(password, safe=""), quote(password)}:
            assert form not in shown, f"the password appears in: {shown[:300]!r}"


def remote_engine(url: str, **extra: object) -> Engine:
    return Engine(
        "tiny", block_size=4, num_device_blocks=64, kv_offloading_size=0.01, kv_remote_url=url,
        **extra,
    )  # fmt: skip


def test_settings_objects_never_show_it(secret) -> None:
    _, password, url = secret
    config = EngineConfig(model="tiny", kv_offloading_size=0.01, kv_remote_url=url)
    tier_config = RemoteTierConfig(url=url, ttl_s=5.0)
    assert "***" in repr(config) and "***" in repr(tier_config)
    assert "kv_offloading_size=0.01" in repr(config) and "ttl_s=5.0" in repr(tier_config)
    records = [logging.LogRecord("t", logging.INFO, "f", 1, "%s %r", (config, config), None)]
    assert_hidden(
        password,
        repr(config),
        str(config),
        f"{config}",
        json.dumps({"config": config}, default=str),
        records[0].getMessage(),
        repr(tier_config),
        str(tier_config),
        repr(parse_redis_url(url)),
        parse_redis_url(url).redacted(),
    )


def test_a_running_engine_never_shows_it(secret, caplog: pytest.LogCaptureFixture) -> None:
    """Settings, tier objects, DEBUG logs of every logger, stats lines, /metrics, stats."""
    _, password, url = secret
    with caplog.at_level(logging.DEBUG):
        engine = remote_engine(url, metrics_port=0, log_stats_interval_s=1e-9)
        with engine:
            engine.generate([[5] * 24, [7] * 24], SamplingParams(max_tokens=2))
            engine.drain()
            assert engine.tiering is not None
            tier = engine.tiering.tiers[0]
            assert isinstance(tier, RedisTier)
            assert engine.metrics_server is not None
            with urllib.request.urlopen(engine.metrics_server.url, timeout=30) as response:
                metrics = response.read().decode()
            shown: list[object] = [
                repr(engine.config), str(engine.config), repr(tier), repr(tier.config)]
            shown += [repr(v) for v in vars(tier).values()] if hasattr(tier, "__dict__") else []
            shown += [metrics, engine.stats(), engine.tier_stats()]
            ready = ready_line(engine, "http://127.0.0.1:1", "tiny", {})  # serve's ready line
            shown.append(ready)
    assert f"remote redis://:***@127.0.0.1:{secret[0].port}/0" in ready
    assert engine.stats()["offload_tier_remote_stored_blocks"] > 0  # the tier did work
    assert "kvoffload_" in metrics
    assert any("remote tier usage" in r.getMessage() for r in caplog.records)  # stats lines
    assert_hidden(password, caplog.text, *shown)


@pytest.mark.parametrize("fault", ["wrong password", "server down", "bad port"])
def test_errors_never_show_it(secret, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    """The error, its traceback, and the error as a parent process gets it (pickled)."""
    server, password, url = secret
    bad = {
        "wrong password": url.replace("@", "x@", 1),
        "server down": url.replace(f":{server.port}/", ":1/"),
        "bad port": url.replace(f":{server.port}/", ":99999/"),
    }[fault]
    with caplog.at_level(logging.DEBUG), pytest.raises(ConfigError) as info:
        remote_engine(bad).close()
    exc = info.value
    assert exc.field == "kv_remote_url"
    again = pickle.loads(pickle.dumps(exc))
    assert_hidden(
        password,
        str(exc),
        repr(exc),
        "".join(traceback.format_exception(exc)),
        pickle.dumps(exc),
        str(again),
        caplog.text,
    )
    # Optional: the engine runs without the tier and says why, in a warning.
    with caplog.at_level(logging.DEBUG):
        if fault == "server down":
            remote_engine(bad, kv_remote_optional=True).close()
            assert "running without the remote tier" in caplog.text
    assert_hidden(password, caplog.text)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvoffload.cli.main", "bench", "throughput", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


WORKLOAD = ["--model", "tiny", "--dataset-name", "random", "--num-prompts", "4"]
WORKLOAD += ["--random-input-len", "32", "--random-prefix-len", "16", "--output-len", "2"]
WORKLOAD += ["--num-device-blocks", "64", "--kv-offloading-size", "0.01", "--no-progress"]


def test_the_benchmark_never_shows_it(secret, tmp_path: Path) -> None:
    """Its output, stats lines and --output-json; and an error raised in engine A's process of
    ``--instances 2``, which reaches the parent pickled."""
    _, password, url = secret
    out_json = tmp_path / "out.json"
    flags = ["--kv-remote-url", url, "--log-stats-interval", "0.001", "--metrics-port", "0"]
    done = run_cli(*WORKLOAD, *flags, "--output-json", str(out_json), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "remote tier usage" in done.stderr + done.stdout  # stats lines were written
    assert_hidden(password, done.stdout, done.stderr, out_json.read_text())
    wrong = url.replace("@", "x@", 1)
    failed = run_cli(*WORKLOAD, "--kv-remote-url", wrong, "--instances", "2", cwd=tmp_path)
    assert failed.returncode == 2 and "kv_remote_url" in failed.stderr, failed.stderr[-2000:]
    assert_hidden(password, failed.stdout, failed.stderr)


# -- the API key of serve and route --------------------------------------------------------------

API_KEY = "sk-serve-Secret-8812"
BACKEND_KEY = "sk-backend-Secret-4471"


def test_api_keys_never_show(caplog: pytest.LogCaptureFixture) -> None:
    """``serve`` (key from the environment) and ``route`` (its key and the backends' as flags),
    at DEBUG: their output, /metrics, /router/stats, the error answers, and the objects that
    hold a key (repr, str, pickling refused)."""
    from serve_cases import auth, post_raw, route, serve

    from kvoffload.serving.guard import ApiKey, RequestGuard

    key = ApiKey(API_KEY)
    guard = RequestGuard(lambda *_: None, key, 1024)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pickle.dumps(key)
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("t").info("%s %r %s", key, key, guard)
    shown: list[object] = [repr(key), str(key), repr(guard), f"{key}", caplog.text]
    with serve("--log-level", "debug", env={"KVOFFLOAD_API_KEY": BACKEND_KEY}) as backend:
        with route([backend], "--api-key", API_KEY, "--backend-api-key", BACKEND_KEY,
                   "--log-level", "debug", key=API_KEY) as router:
            statuses = []
            for url, good in ((router.url, API_KEY), (backend.url, BACKEND_KEY)):
                for headers in ({}, auth("wrong"), auth(good)):
                    status, answer = post_raw(f"{url}/v1/completions",
                                              b'{"prompt": "hi", "max_tokens": 2}',
                                              headers=headers)
                    statuses.append(status)
                    shown.append(answer)
                with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
                    shown.append(response.read())
            request = urllib.request.Request(f"{router.url}/router/stats", headers=auth(API_KEY))
            with urllib.request.urlopen(request, timeout=30) as response:
                shown.append(response.read())
            # The router's request with its key went through, carrying the backend's key.
            assert statuses == [401, 401, 200] * 2
            router.terminate(60)
            shown.append(router.output())
        backend.terminate(60)
        shown.append(backend.output())
    for secret in (API_KEY, BACKEND_KEY):
        assert_hidden(secret, *shown)
