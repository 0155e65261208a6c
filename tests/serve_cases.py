"""Real ``kvoffload serve`` / ``kvoffload route`` processes for the serving tests: started on free
loopback ports, waited for, and stopped (SIGTERM, then SIGKILL) whatever the test did."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SERVE_FLAGS = ["--num-device-blocks", "64", "--max-num-seqs", "4"]
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def events_config() -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv",
        }
    )


def http_json(
    url: str, body: dict[str, Any] | None = None, timeout: float = 30.0, key: str | None = None
) -> Any:
    """GET (or POST ``body``) and decode the JSON answer; raises HTTPError for 4xx/5xx. ``key``:
    sent as the API key."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                                 **auth(key)})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read()
    return json.loads(text) if text else None


def auth(key: str | None) -> dict[str, str]:
    """The header that carries API key ``key`` (none for ``None``)."""
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def post_raw(
    url: str, data: bytes, timeout: float = 30.0, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """POST raw bytes; returns (status, decoded JSON body)."""
    request = urllib.request.Request(url, data, {"Content-Type": "application/json",
                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:  # an unclosed error response leaks its socket (a ResourceWarning at GC)
            return exc.code, json.loads(exc.read())


def metric(url: str, name: str) -> float:
    """The value of an unlabelled series (or the sum of a labelled one) on ``url/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


class Process:
    """A ``kvoffload`` subcommand listening on ``url``; a context manager that always stops it."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.args = args
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvoffload.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=full_env,
            text=True,
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> Process:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited {self.proc.returncode}: {self.output()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                f"{self.url}/health", timeout=2
            ) as response:
                if response.status == 200:
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.args[0]} not ready after {timeout_s} s")

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        assert self.proc.stdout is not None
        return self.proc.stdout.read()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM; returns the exit status (SIGKILL after ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def close_output(self) -> None:
        if self.proc.stdout is not None and self.proc.poll() is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.terminate(30)
        self.close_output()


@contextlib.contextmanager
def serve(
    *extra: str, events: bool = True, env: dict[str, str] | None = None, model: str = "tiny"
) -> Iterator[Process]:
    """``kvoffload serve`` with :data:`SERVE_FLAGS`, ``model`` (a preset or a checkpoint
    directory) and ``extra``."""
    port = free_port()
    args = ["serve", "--port", str(port), *SERVE_FLAGS, "--model", model, *extra]
    if events:
        args += ["--kv-events-config", events_config()]
    with Process(args, port, env) as process:
        yield process.wait_ready()


class HasURL(Protocol):
    @property
    def url(self) -> str: ...


@dataclass
class Endpoint:
    url: str


@contextlib.contextmanager
def stale_keepalive(backend: HasURL) -> Iterator[Endpoint]:
    """``backend`` behind ``stale_keepalive_proxy.py`` (a process of its own): every request on
    a reused connection finds it closed by the server, as a keep-alive timeout would."""
    with _front("stale_keepalive_proxy.py", backend) as endpoint:
        yield endpoint


@contextlib.contextmanager
def unavailable(backend: HasURL) -> Iterator[Endpoint]:
    """``backend`` behind ``unavailable_front.py`` (a process of its own): it answers health
    checks and model lists as ``backend`` does, and every request with 503."""
    with _front("unavailable_front.py", backend) as endpoint:
        yield endpoint


@contextlib.contextmanager
def faulty(mode: str, backend: HasURL) -> Iterator[Endpoint]:
    """``backend`` behind ``faulty_front.py MODE`` (a process of its own): a stream that stalls
    after its first chunk (``hold``), a malformed answer, unparsable ``/metrics``."""
    with _front("faulty_front.py", backend, mode) as endpoint:
        yield endpoint


@contextlib.contextmanager
def _front(name: str, backend: HasURL, *args: str) -> Iterator[Endpoint]:
    """The script ``name`` (with ``args``) in front of ``backend``: it prints its port on its
    first line."""
    script = Path(__file__).with_name(name)
    port = backend.url.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, str(script), *args, port], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        yield Endpoint(f"http://127.0.0.1:{int(proc.stdout.readline())}")
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def route(
    backends: Sequence[HasURL], *extra: str, model: str = "tiny", key: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Process]:
    """``kvoffload route`` over ``backends``, once all are in rotation (``key``: its API key,
    for its /router/stats)."""
    port = free_port()
    args = ["route", "--port", str(port), "--model", model, "--health-interval", "0.2",
            "--metrics-interval", "0.5", *extra]
    for b in backends:
        args += ["--backend", b.url]
    with Process(args, port, env) as process:
        process.wait_ready()
        deadline = time.monotonic() + START_TIMEOUT_S
        while sum(
            b["healthy"] for b in http_json(f"{process.url}/router/stats", key=key)["backends"]
        ) < len(backends):
            assert time.monotonic() < deadline, "backends not in rotation"
            time.sleep(0.1)
        yield process
