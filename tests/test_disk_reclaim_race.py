"""A disk tier that starts while a tier of the other ``kv_disk_compression`` reclaims its
namespace (the raw one under a compressed tier, and the reverse) still starts, and its namespace
is its own from then on. Real tiers on one directory, real files; the race is made deterministic
by running the reclaiming tier's start at a chosen point of the starting tier's (a profile hook
in this thread: no sleeps, no second process to schedule)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from test_disk_compression import kv_pool, run, tier
from tier_cases import key

from kvoffload.tiers.disk.ledger import SpaceLedger
from kvoffload.tiers.disk.tier import DiskTier


@contextlib.contextmanager
def once_at(function: Callable[..., Any], event: str, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` once, in this thread, when ``function`` is entered (``event`` "call") or
    returns ("return"), in the middle of whatever called it."""
    code = function.__code__

    def profile(frame: FrameType, what: str, arg: object) -> None:
        if what == event and frame.f_code is code:
            sys.setprofile(None)
            action()

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("event", ["call", "return"])
@pytest.mark.parametrize("starting", ["none", "lossless"])
def test_a_tier_starting_while_the_other_setting_reclaims_its_namespace_starts(
    tmp_path: Path, starting: str, event: str
) -> None:
    """The starting tier's namespace is made, then the other tier starts and reclaims it (no
    process holds it yet) just before (``call``) or just after (``return``) the starting tier
    opens its ledger there. The starting tier starts all the same, in a namespace of its own that
    the other tier's later reclaims leave alone while it runs; both store and load intact."""
    other = "lossless" if starting == "none" else "none"
    pool, view = kv_pool(8)
    earlier = tier(tmp_path, view, compression=starting)  # an earlier run's namespace and files
    assert run(earlier, 1, True, [key(0)], [0]) == {}
    earlier.close()
    reclaimer: list[DiskTier] = []
    with once_at(
        SpaceLedger.__init__,
        event,
        lambda: reclaimer.append(tier(tmp_path, view, compression=other)),
    ):
        started = tier(tmp_path, view, compression=starting)
    try:
        (late,) = reclaimer
        try:
            assert late._old_namespaces.removed_files >= 1  # it did reclaim, mid-start
            late._old_namespaces.reclaim()  # the rescan's reclaim, while the started tier runs
            assert late._old_namespaces.in_use == 1
            assert started.namespace.is_dir()
            assert run(started, 2, True, [key(1), key(2)], [1, 2]) == {}
            assert run(started, 3, False, [key(2)], [3]) == {}
            assert torch.equal(pool[3], pool[2])
            assert run(late, 4, True, [key(3)], [4]) == {}
            assert run(late, 5, False, [key(3)], [5]) == {}
            assert torch.equal(pool[5], pool[4])
        finally:
            late.close()
    finally:
        started.close()
