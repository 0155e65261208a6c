"""How ``serve``, ``route`` and ``bench serve`` start, as a user sees it: a host tier by default
(sized from the machine, said at start), one line when ready, a port in use refused before the
model loads (one line, exit 2), the router's warning about a backend it cannot use, and bench
serve's initial test request (the server's error, exit 3) and progress bar."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from serve_cases import Process, free_port, serve

from kvoffload.cli import host_tier_size
from kvoffload.cli.bench_serve import EXIT_INITIAL_TEST
from kvoffload.cli.engine_flags import engine_config_from_args
from kvoffload.cli.flagspec import resolve_flags
from kvoffload.cli.main import parse_args
from kvoffload.routing.policies import create_policy
from kvoffload.routing.router import BackendSpec, Router
from kvoffload.serving.prompts import PromptTokenizer

GIB = 2**30


@pytest.mark.parametrize(("available_gib", "host_gib"), [
    (0.5, 0.0),     # a quarter is under 1/4 GiB: no host tier
    (1.0, 0.25),
    (19.0, 4.75),
    (21.3, 5.25),   # rounded down to 1/4 GiB
    (64.0, 16.0),
    (1024.0, 16.0),  # at most 16 GiB
])
def test_the_host_tier_default_rule(available_gib: float, host_gib: float) -> None:
    assert host_tier_size.auto_host_tier_gib(int(available_gib * GIB)) == host_gib


def test_serve_has_a_host_tier_by_default_and_0_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(host_tier_size, "available_memory_bytes", lambda: 40 * GIB)
    config = engine_config_from_args(resolve_flags(parse_args(["serve", "--model", "tiny"])))
    assert config.kv_offloading_size == 10.0 and config.offloading
    off = engine_config_from_args(parse_args(["serve", "--kv-offloading-size", "0"]))
    assert off.kv_offloading_size == 0 and not off.offloading
    # bench throughput keeps its own (the main job's 1 GiB); Engine(...) its 0
    assert engine_config_from_args(parse_args(["bench", "throughput"])).kv_offloading_size == 1
    help_text = " ".join(parse_args(["serve"]).parser.format_help().split())
    assert "(default: auto: a quarter of the available memory, at most 16 GiB)" in help_text


def test_available_memory_is_read_from_the_machine() -> None:
    available = host_tier_size.available_memory_bytes()
    assert available is not None and available > 0


@contextlib.contextmanager
def _busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["serve", "--model", "tiny"],
                                     ["route", "--model", "tiny", "--backend", "http://x:1"]])
def test_a_port_in_use_is_one_line_and_exit_2(command: list[str]) -> None:
    with _busy_port() as port:
        done = subprocess.run([sys.executable, "-m", "kvoffload.cli.main", *command,
                               "--port", str(port)],
                              capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"error: port: 127.0.0.1:{port} is already in use"]
    assert done.stdout == ""  # nothing loaded, no host tier announced


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    """``kvoffload serve`` with the default host tier (no --kv-offloading-size)."""
    with serve(events=False) as process:
        yield process


@pytest.mark.timeout(180)
def test_serve_says_its_host_tier_and_one_line_when_ready(server: Process) -> None:
    # its output is read once it has exited: a second server on the same flags, stopped here
    with serve(events=False) as other:
        assert other.terminate() == 0
        lines = other.output().splitlines()
    (sizing,) = [line for line in lines if "host tier" in line and "auto" in line]
    assert re.fullmatch(r"kvoffload serve: host tier [\d.]+ GiB \(auto: a quarter of the "
                        r"available memory, at most 16 GiB; --kv-offloading-size sets it, 0 "
                        r"turns it off\)", sizing), sizing
    (ready,) = [line for line in lines if "ready" in line]
    assert re.fullmatch(rf"kvoffload serve: ready at {other.url}: model tiny; tiers: device 64 "
                        r"blocks of 16 tokens, host [\d.]+ GiB \(\d+ blocks\); KV events off",
                        ready), ready
    assert lines.index(sizing) < lines.index(ready)


#: two short requests of the default workload
WORKLOAD = ("--num-prompts", "2", "--prefix-repetition-prefix-len", "32", "--output-len", "2")
#: one user's two short chat turns (test_bench_sessions' sizes: answers with text)
SESSIONS = ("--dataset-name", "sessions", "--sessions-num-users", "1", "--sessions-num-rounds",
            "2", "--sessions-system-prompt-len", "40", "--sessions-user-context-len", "60",
            "--sessions-question-len", "12", "--sessions-answer-len", "5",
            "--sessions-think-time", "0")


def _bench_serve(url: str, *flags: str, tty: bool = False,
                 workload: tuple[str, ...] = WORKLOAD) -> tuple[int, str, str]:
    """``kvoffload bench serve`` against ``url``: (exit status, stdout, stderr); with ``tty``
    its stderr is a terminal (a pseudo-terminal read here)."""
    argv = [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--base-url", url,
            "--model", "tiny", *workload, *flags]
    if not tty:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        return done.returncode, done.stdout, done.stderr
    controller, terminal = pty.openpty()
    # a terminal of 80 columns (a new one has none: tqdm would draw an empty bar)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=terminal, text=True) as proc:
        os.close(terminal)
        err = b""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(controller, 4096)
                except OSError:  # the terminal closed: the process ended
                    break
                if not chunk:
                    break
                err += chunk
            elif proc.poll() is not None:
                break
        os.close(controller)
        out = proc.stdout.read() if proc.stdout else ""
        return proc.wait(60), out, err.decode(errors="replace")


@pytest.mark.timeout(180)
def test_bench_serve_prints_the_servers_error_and_stops(server: Process) -> None:
    status, out, err = _bench_serve(server.url, "--served-model-name", "not-the-model")
    assert status == EXIT_INITIAL_TEST == 3
    assert err.splitlines() == [
        f"kvoffload bench serve: the initial test request to {server.url} failed: HTTP 400: "
        "The model `not-the-model` does not exist; this server serves `tiny`."]
    assert out == ""  # nothing measured


@pytest.mark.timeout(180)
def test_bench_serve_without_a_server_stops_at_the_test_request() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    status, out, err = _bench_serve(url)
    assert status == 3 and out == ""
    assert err.startswith(f"kvoffload bench serve: the initial test request to {url} failed: ")


@pytest.mark.timeout(180)
def test_bench_serve_shows_a_progress_bar_on_a_terminal_unless_disabled(server: Process) -> None:
    status, out, err = _bench_serve(server.url, tty=True)
    assert status == 0, err
    assert "2/2" in err and "Successful requests:" in out
    status, out, err = _bench_serve(server.url, "--disable-tqdm", tty=True)
    assert status == 0, err
    assert "2/2" not in err and "Successful requests:" in out
    status, _, err = _bench_serve(server.url)  # stderr not a terminal: no bar either
    assert status == 0 and "2/2" not in err
    status, out, err = _bench_serve(server.url, tty=True, workload=SESSIONS)  # a bar of turns
    assert status == 0, err
    assert "2/2" in err and "Successful requests:" in out


def test_route_warns_once_per_backend_it_cannot_use(caplog: pytest.LogCaptureFixture) -> None:
    """One backend answers /health but publishes no KV events (no /kv_event_sources), one does
    not answer: one warning each, not repeated when the first rejoins; round_robin, which reads
    no events, is not warned about them."""

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def run(policy: str) -> list[str]:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        quiet = f"http://127.0.0.1:{runner.addresses[0][1]}"
        down = f"http://127.0.0.1:{free_port()}"
        router = Router([BackendSpec(quiet), BackendSpec(down)], create_policy(policy),
                        PromptTokenizer("tiny"), 4, health_interval_s=3600,
                        metrics_interval_s=3600)
        caplog.clear()
        try:
            await router.start()
            backend = router.backends[0]
            router.mark_dead(backend, "test")
            await router._check(backend)  # rejoins: asks for its events again
            assert backend.healthy
        finally:
            await router.stop()
            await runner.cleanup()
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and ("no KV events" in r.getMessage() or "does not answer" in r.getMessage())]

    with caplog.at_level(logging.WARNING, logger="kvoffload.routing.router"):
        warned = asyncio.run(run("kv_aware"))
        (no_events,) = [w for w in warned if "no KV events" in w]
        (unreachable,) = [w for w in warned if "does not answer" in w]
        assert no_events.startswith("backend http://127.0.0.1:") and "kv_aware cannot see" \
            in no_events
        assert "no request goes to it until it does" in unreachable
        assert [w for w in asyncio.run(run("round_robin")) if "no KV events" in w] == []
