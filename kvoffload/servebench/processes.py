"""The processes a comparison starts: ``kvoffload serve`` or ``route`` (or any server, such as
``vllm serve``) on a free loopback port, ready once ``/health`` answers, stopped with SIGTERM
(then SIGKILL after 60 s) on exit."""

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
from dataclasses import dataclass

from kvoffload.cli.front_door_flags import API_KEY_ENV, BACKEND_API_KEY_ENV

__all__ = ["Server", "cpu_seconds", "free_port", "kvoffload_command", "running", "running_command"]

#: Keys ``serve`` and ``route`` read from the environment: never inherited by the comparison's own
#: servers, or each would refuse the benchmark's requests (401).
_SERVER_KEY_ENVS = frozenset((API_KEY_ENV, BACKEND_API_KEY_ENV))


def free_port() -> int:
    """A loopback port free now (the OS's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Server:
    """A server the comparison started: where it answers and its process id."""

    url: str
    pid: int


def kvoffload_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``kvoffload ARGS`` as a comparison starts it: no
    key inherited (the benchmark sends ``$OPENAI_API_KEY`` only), one OpenMP thread unless
    ``OMP_NUM_THREADS`` says otherwise."""
    env = {k: v for k, v in os.environ.items() if k not in _SERVER_KEY_ENVS}
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return [sys.executable, "-m", "kvoffload.cli.main", *args], env


@contextlib.contextmanager
def running(args: list[str], port: int) -> Iterator[str]:
    """``kvoffload ARGS`` (serving on ``port``) while the block runs; yields its URL once
    ``/health`` answers (300 s at most; a process that exits first raises)."""
    with running_command(*kvoffload_command(args), port=port) as server:
        yield server.url


@contextlib.contextmanager
def running_command(cmd: list[str], env: dict[str, str], port: int,
                    log: str | None = None, start_s: float = 300.0) -> Iterator[Server]:
    """The process ``cmd`` (serving on ``port``, environment ``env``) while the block runs;
    yields it once ``/health`` answers (``start_s`` at most; a process that exits first
    raises). Its output goes to the file ``log`` (whose last lines a failed start quotes), else
    nowhere."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "wb")) if log else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        stack.callback(_stop, proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(cmd[:4])} ... exited {proc.returncode}"
                                   + _tail(log))
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shlex.join(cmd[:4])} ... did not start in {start_s:g} s"
                                   + _tail(log))
            time.sleep(0.2)
        yield Server(url, proc.pid)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) the live process ``pid`` and its live descendants have used
    (Linux's ``/proc``; ``None`` elsewhere or when ``pid`` is gone). Unlike wall time, what a
    server did does not grow with what else the machine runs."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU seconds)
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command's ")": state, ppid, ... utime and stime are fields 14 and 15.
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += stats[current][1]
        todo.extend(children.get(current, ()))
    return total


def _tail(log: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of the file ``log``, as a message's continuation."""
    if not log:
        return ""
    with open(log, "rb") as f:
        text = f.read()[-16384:].decode(errors="replace")
    return "; its last output:\n" + "\n".join(text.splitlines()[-lines:])
