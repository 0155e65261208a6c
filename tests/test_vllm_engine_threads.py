"""The engine's OpenMP threads under our vLLM worker side (kvoffload.integrations.vllm.engine_threads).

vLLM's CPU binding reserves a core per worker for any KV connector and, where the machine cannot
spare it, reserves none: the worker's team then covers every core and spins against the
scheduler. Our worker side gives that core back; these tests check the rule and that the thread
count really changes (a fresh Python per case, as each vLLM worker is one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvoffload.integrations.vllm.engine_threads import AFFINITY_VARIABLES, threads_to_keep

_CHILD = """
import json, sys, torch
from kvoffload.integrations.vllm.engine_threads import give_back_core
before = torch.get_num_threads()
first = give_back_core(1, usable_cpus=int(sys.argv[1]))
second = give_back_core(1, usable_cpus=int(sys.argv[1]))
x = torch.arange(1 << 16, dtype=torch.float32)
print(json.dumps({"before": before, "first": first, "second": second,
                  "after": torch.get_num_threads(), "sum": float((x * 2).sum())}))
"""


@pytest.mark.parametrize(
    ("threads", "workers", "cpus", "kept"),
    [
        (2, 1, 2, 1),  # vLLM reserved nothing: one core back (as without a connector)
        (1, 1, 2, 1),  # no connector reservation to undo, never below one
        (1, 1, 1, 1),
        (6, 1, 8, 6),  # vLLM left cores outside the team: untouched
        (2, 2, 4, 1),  # two workers covering four cores
        (3, 2, 8, 3),
    ],
)
def test_threads_to_keep(threads: int, workers: int, cpus: int, kept: int) -> None:
    assert threads_to_keep(threads, workers, cpus) == kept


def _run(env_extra: dict[str, str], cpus: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_CPU_") and k not in AFFINITY_VARIABLES}
    env.update({"OMP_NUM_THREADS": "2", **env_extra})
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(cpus)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


#: What vLLM's multiprocessing executor sets in a worker it binds (GNU OpenMP, torch's own).
BOUND = {"GOMP_CPU_AFFINITY": "0 1"}


def test_a_team_covering_every_core_loses_one_thread_once() -> None:
    got = _run(BOUND, cpus=2)
    assert got["before"] == 2
    assert (got["first"], got["second"], got["after"]) == (1, None, 1)
    assert got["sum"] == float(2 * sum(range(1 << 16)))


@pytest.mark.parametrize(
    "setting", [{"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}]
)
def test_explicit_binding_is_left_alone(setting: dict[str, str]) -> None:
    got = _run({**BOUND, **setting}, cpus=2)
    assert (got["first"], got["after"]) == (None, 2)


def test_a_team_with_cores_to_spare_is_left_alone() -> None:
    got = _run(BOUND, cpus=3)
    assert (got["first"], got["after"]) == (None, 2)



@pytest.mark.parametrize("variable", ["KMP_AFFINITY", "OMP_PLACES"])
def test_every_openmp_runtime_s_binding_counts(variable: str) -> None:
    got = _run({variable: "{0,1}"}, cpus=2)
    assert (got["first"], got["after"]) == (1, 1)


def test_an_unbound_team_is_left_alone() -> None:
    """The uni executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) binds no team and reserves no
    core for a connector: the team is the same as without one, so it keeps every thread."""
    got = _run({}, cpus=2)
    assert (got["first"], got["after"]) == (None, 2)
