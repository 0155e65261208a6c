"""The processes a comparison starts: ``kvoffload serve`` or ``route`` on a free loopback port,
ready once ``/health`` answers, stopped with SIGTERM (then SIGKILL after 60 s) on exit."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from kvoffload.cli.front_door_flags import API_KEY_ENV, BACKEND_API_KEY_ENV

__all__ = ["free_port", "running"]

#: Keys ``serve`` and ``route`` read from the environment: never inherited by the comparison's own
#: servers, or each would refuse the benchmark's requests (401).
_SERVER_KEY_ENVS = frozenset((API_KEY_ENV, BACKEND_API_KEY_ENV))


def free_port() -> int:
    """A loopback port free now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(args: list[str], port: int) -> Iterator[str]:
    """``kvoffload ARGS`` (serving on ``port``) while the block runs; yields its URL once
    ``/health`` answers (300 s at most; a process that exits first raises)."""
    # The servers the comparison starts take no key (the benchmark sends $OPENAI_API_KEY only).
    env = {k: v for k, v in os.environ.items() if k not in _SERVER_KEY_ENVS}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.cli.main", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(args)} exited {proc.returncode}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args[0]} did not start")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
