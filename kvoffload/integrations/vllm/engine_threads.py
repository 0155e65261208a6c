"""The engine's OpenMP threads on vLLM's CPU platform when our worker side is loaded (no vLLM import).

vLLM's CPU binding (``VLLM_CPU_OMP_THREADS_BIND=auto``, the default) leaves one core per worker
to the scheduler process, and one more per worker as soon as any KV connector is configured (for
NIXL's transfers). Where the machine has no core to spare for that (2 cores, one worker), it
reserves none: each worker's OpenMP team then spans every core the engine may use, and its
threads spin-wait after every parallel region against the scheduler process, the API server and
our copy threads. Measured with vllm-cpu 0.32 and ``KVOffloadSpec`` on 2 cores: 62.7 s of server
CPU against 16.6 s without offloading, throughput 0.13x (``OMP_WAIT_POLICY=PASSIVE`` would fix
it, but that variable is read once, when the OpenMP runtime starts, before vLLM loads a spec).

Our copies need no core of their own (``memmove`` threads that never enter OpenMP), so in that
case the worker side gives one core back: :func:`give_back_core` lowers the calling thread's
intra-op thread count by one, to the team vLLM builds without a connector. It is called on the
worker's main thread (the one that runs the forward pass), once, when the worker side is built.
Explicit binding settings (``VLLM_CPU_OMP_THREADS_BIND`` other than ``auto``,
``VLLM_CPU_NUM_OF_RESERVED_CPU``) are the user's choice and left alone.

The binding (and its reservation) happens only where vLLM's multiprocessing executor spawned the
worker: it sets the team's OpenMP affinity variable in the worker's environment
(``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY`` or ``OMP_PLACES``). Under the ``uni`` executor
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vLLM binds nothing and reserves nothing: the team is
torch's default with or without a connector, so nothing is given back (giving one back there
halved the compute threads against a run without offloading: ``vllm_bench.py`` runs so).
"""

from __future__ import annotations

import os

import torch

__all__ = ["give_back_core", "threads_to_keep"]

#: The variables vLLM's executor sets in a worker's environment when it binds the worker's
#: OpenMP team (one per OpenMP runtime: GNU, Intel, other).
AFFINITY_VARIABLES = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES")


def threads_to_keep(threads: int, workers: int, usable_cpus: int) -> int:
    """The intra-op threads a worker keeps: one less than ``threads`` when the ``workers``' teams
    together cover all ``usable_cpus`` (no core left outside them), else ``threads``; at least 1."""
    if threads > 1 and threads * max(1, workers) >= usable_cpus:
        return threads - 1
    return threads


def _usable_cpus() -> int | None:
    """CPUs the engine's processes may use: the parent's (vLLM's engine process; the worker's
    own affinity is already narrowed to its team's cores), ``None`` where unknown."""
    try:
        return len(os.sched_getaffinity(os.getppid()))
    except (AttributeError, OSError):
        return None


def give_back_core(workers: int, usable_cpus: int | None = None) -> int | None:
    """Lower the calling thread's intra-op threads as :func:`threads_to_keep` says, under vLLM's
    automatic binding only (it bound this worker's team: :data:`AFFINITY_VARIABLES`); return the
    new count, ``None`` where nothing changed.

    ``usable_cpus``: default the CPUs of the parent process (vLLM's engine process).
    """
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None
    if os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") is not None:
        return None
    if not any(os.environ.get(name) for name in AFFINITY_VARIABLES):
        return None  # vLLM bound no team (the uni executor): none was reserved either
    cpus = _usable_cpus() if usable_cpus is None else usable_cpus
    if cpus is None:
        return None
    threads = torch.get_num_threads()
    keep = threads_to_keep(threads, workers, cpus)
    if keep == threads:
        return None
    # vLLM's CPU worker replaces torch.set_num_threads with a stub after it binds its threads
    # (raising the count would add unbound threads); lowering it keeps the bound ones.
    torch._C.set_num_threads(keep)
    return keep
