"""Running a run matrix: every run ``repeats`` times, interleaved (ABC ABC, so that drift on a
shared machine hits every configuration alike), each on a fresh engine; a run's disk tier in a
fresh directory and its remote tier in a fresh namespace of the server when asked (so that no run
starts warm from another's blocks, whatever the server held before); and one run in a process of
its own (engine A of two instances, which shares nothing with the others but their
Redis server). A fresh namespace is removed from the server after its run."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.benchmark.matrix import Run, actual_label
from kvoffload.benchmark.throughput import ThroughputResult, run_throughput
from kvoffload.errors import KVOffloadError
from kvoffload.tiers.redis.admin import drop_namespace
from kvoffload.tiers.redis.connection import RespErrorRaised
from kvoffload.tiers.redis.url import redacted_url

__all__ = [
    "Progress",
    "fresh_disk_directory",
    "fresh_remote_namespace",
    "run_in_own_process",
    "run_interleaved",
    "steady_threads",
]

log = logging.getLogger(__name__)


def steady_threads() -> None:
    """What the tests do for steady runs, unless the user chose: OpenMP threads that sleep when
    idle (spinning ones slow everything down on a shared machine) and one torch thread per core
    this process may use."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


@dataclass
class Progress:
    """What a caller hears while runs run: ``bar(total, name)`` returns a tqdm-like bar
    (``update``, ``close``) or ``None``; ``phase(text)`` hears "loading model" and "warming up";
    ``result(name, result)`` hears each run as it ends."""

    bar: Callable[[int, str], Any] | None = None
    phase: Callable[[str], Any] | None = None
    result: Callable[[str, ThroughputResult], Any] | None = None


@contextlib.contextmanager
def fresh_disk_directory(kwargs: dict[str, Any], fresh: bool) -> Iterator[dict[str, Any]]:
    """``kwargs`` for one run: with ``fresh``, its disk tier gets an empty subdirectory of
    ``kv_disk_path`` (removed afterwards, also when the run fails or is interrupted)."""
    path = kwargs.get("kv_disk_path")
    if path is None or not fresh:
        yield kwargs
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="run-", dir=path)
    try:
        yield {**kwargs, "kv_disk_path": run_dir}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def fresh_remote_namespace(kwargs: dict[str, Any], fresh: bool) -> Iterator[dict[str, Any]]:
    """``kwargs`` for one run: with ``fresh``, its remote tier (if any) stores and finds blocks
    only in a namespace no run used before (the URL's ``namespace`` option, replaced), removed
    from the server afterwards (also when the run fails or is interrupted; a removal that fails
    is a warning, not the run's error). The server's other keys are never touched."""
    url = kwargs.get("kv_remote_url")
    if url is None or not fresh:
        yield kwargs
        return
    base, _, query = url.partition("?")
    options = [o for o in query.split("&") if o and not o.startswith("namespace=")]
    options.append(f"namespace=bench-{uuid.uuid4().hex[:16]}")
    own = base + "?" + "&".join(options)
    try:
        yield {**kwargs, "kv_remote_url": own}
    finally:
        try:
            drop_namespace(own)
        except (OSError, KVOffloadError, RespErrorRaised) as exc:
            log.warning("could not remove the run's namespace from %s: %s", redacted_url(own), exc)


def run_interleaved(
    runs: Sequence[Run],
    requests_of: Callable[[int], Sequence[BenchRequest]],
    repeats: int,
    *,
    fresh_disk: bool = False,
    arrivals: Sequence[float] | None = None,
    progress: Progress | None = None,
    fresh_remote: bool = False,
) -> list[ThroughputResult]:
    """Every run ``repeats`` times, interleaved, on ``requests_of(repeat)`` (repeat from 1); the
    results in order, each labelled as it ran (:func:`actual_label`). ``fresh_disk`` /
    ``fresh_remote``: every run starts from an empty disk directory / remote namespace."""
    progress = progress or Progress()
    results: list[ThroughputResult] = []
    for repeat in range(1, repeats + 1):
        requests = requests_of(repeat)
        for run in runs:
            with (
                fresh_remote_namespace(run.engine_kwargs, fresh_remote) as own,
                fresh_disk_directory(own, fresh_disk) as kwargs,
            ):
                result = run_throughput(
                    requests,
                    run.label,
                    kwargs,
                    _bar_for(progress, repeat, repeats),
                    repeat,
                    arrivals,
                    progress.phase,
                )
            result.label = actual_label(run, result.stats)
            results.append(result)
            if progress.result is not None:
                progress.result(_repeat_name(result.label, repeat, repeats), result)
    return results


def _repeat_name(label: str, repeat: int, repeats: int) -> str:
    return f"{label} (repeat {repeat}/{repeats})" if repeats > 1 else label


def _bar_for(progress: Progress, repeat: int, repeats: int) -> Callable[[int, str], Any] | None:
    bar = progress.bar
    if bar is None:
        return None
    return lambda total, label: bar(total, _repeat_name(label, repeat, repeats))


def run_in_own_process(
    requests: Sequence[BenchRequest], label: str, kwargs: dict[str, Any]
) -> ThroughputResult:
    """:func:`run_throughput` in a spawned process: its result, or its :class:`KVOffloadError`
    raised here. The process ignores Ctrl-C; an interrupt here (or any exception) stops it."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_own_process, args=(send, requests, label, kwargs))
    process.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        raise RuntimeError(f"{label}: its process ended without a result") from None
    finally:
        if process.is_alive():
            process.terminate()
        process.join()
        receive.close()
    if not ok:
        raise value
    return value


def _own_process(
    send: Connection, requests: Sequence[BenchRequest], label: str, kwargs: dict[str, Any]
) -> None:
    """A run in a process of its own: ``(True, result)`` or ``(False, error)`` sent back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C, and stops us
    steady_threads()
    try:
        outcome: tuple[bool, Any] = (True, run_throughput(requests, label, kwargs))
    except KVOffloadError as exc:
        outcome = (False, exc)
    except Exception as exc:  # a bug: its traceback here, its name there
        traceback.print_exc()
        outcome = (False, RuntimeError(f"{label} failed in its own process: {exc!r}"))
    send.send(outcome)
    send.close()

