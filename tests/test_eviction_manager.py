"""Every eviction policy behind a real CPUOffloadingManager, and out-of-tree policies.

Requests here are prefix chains (as a scheduler sends them): a request continues one of a few
shared prefixes and adds blocks of its own, so that the policies' chain bookkeeping (parents,
leaves, orphans after failed stores) is exercised, not only flat keys.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import ConfigError, CPUOffloadingManager, LookupResult, ReqContext
from kvoffload.eviction import available_eviction_policies, create_eviction_policy
from kvoffload.eviction import base as eviction_base
from kvoffload.keys import OffloadKey, make_offload_key

HIT = LookupResult.HIT


def chain(prefix: int, length: int, own: int) -> list[OffloadKey]:
    """``length`` blocks: the first ``length - 2`` shared by every request of ``prefix``, then two
    blocks of request ``own``."""
    shared = [make_offload_key(f"p{prefix}-{i}".encode()) for i in range(max(0, length - 2))]
    return shared + [make_offload_key(f"r{own}-{i}".encode()) for i in range(min(2, length))]


request_steps = st.lists(
    st.tuples(
        st.integers(0, 2),  # which shared prefix
        st.integers(1, 7),  # chain length
        st.sampled_from(["complete", "fail", "leave pending"]),
        st.booleans(),  # keep the hits pinned until the next request
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.parametrize("policy", available_eviction_policies())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=request_steps)
def test_manager_invariants_hold_under_random_requests(
    policy: str, steps: list[tuple[int, int, str, bool]]
) -> None:
    """lookup -> load hits -> touch -> store the rest, with failed and unfinished stores and pins
    held across requests; the manager's and the policy's invariants hold after every call."""
    manager = CPUOffloadingManager(6, policy, enable_events=True)
    pinned: list[tuple[list[OffloadKey], ReqContext]] = []
    pending: list[tuple[list[OffloadKey], ReqContext]] = []
    for i, (prefix, length, outcome, keep_pins) in enumerate(steps):
        ctx = ReqContext(f"req-{i}")
        keys = chain(prefix, length, i)
        hits = 0
        for key in keys:
            if manager.lookup(key, ctx) is not HIT:
                break
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], ctx)
            if keep_pins:
                pinned.append((keys[:hits], ctx))
            else:
                manager.complete_load(keys[:hits], ctx)
        manager.touch(keys, ctx)
        manager.check_invariants()
        out = manager.prepare_store(keys[hits:], ctx)
        manager.check_invariants()
        if out is not None:
            assert not set(out.evicted_keys) & set(keys[hits:]), (
                "evicted a block it was asked to store"
            )
            if outcome == "leave pending":
                pending.append((out.keys_to_store, ctx))
            else:
                manager.complete_store(out.keys_to_store, ctx, success=outcome == "complete")
        manager.take_events()
        manager.check_invariants()
        if len(pinned) > 1:
            loaded, owner = pinned.pop(0)
            manager.complete_load(loaded, owner)
        if len(pending) > 1:
            stored, owner = pending.pop(0)
            manager.complete_store(stored, owner)
        manager.request_finished(ctx)
        manager.check_invariants()
    for loaded, owner in pinned:
        manager.complete_load(loaded, owner)
    for stored, owner in pending:
        manager.complete_store(stored, owner)
    manager.check_invariants()
    assert len(manager.policy) == manager.stats()["used_blocks"] <= 6


@pytest.mark.parametrize("policy", available_eviction_policies())
def test_a_reused_prefix_survives_a_stream_of_one_off_requests(policy: str) -> None:
    """Sanity of every policy through the manager: a prefix used by every other request keeps
    hitting while unrelated one-off requests flow through a tier smaller than their total."""
    manager = CPUOffloadingManager(16, policy)
    hot = chain(0, 6, -1)[:4]
    hits = 0
    for i in range(200):
        ctx = ReqContext(f"req-{i}")
        keys = hot + chain(1, 2, i) if i % 2 == 0 else chain(i + 10, 6, i)
        n = 0
        for key in keys:
            if manager.lookup(key, ctx) is not HIT:
                break
            n += 1
        hits += n if i % 2 == 0 else 0
        manager.touch(keys, ctx)
        out = manager.prepare_store(keys[n:], ctx)
        if out is not None:
            manager.complete_store(out.keys_to_store, ctx)
        manager.check_invariants()
    assert hits >= 0.5 * 4 * 100  # the 4 hot blocks hit in most of the 100 reusing requests


# ----------------------------------------------------------------------- out-of-tree policies

OUT_OF_TREE = '''
    from kvoffload.eviction.lru import LRUPolicy


    class MyPolicy(LRUPolicy):
        """An out-of-tree policy: LRU under another name."""

        name = "my_out_of_tree_lru"


    NOT_A_POLICY = object()
'''


def install_dist(tmp_path: Path, entry_points: str) -> None:
    """A real installed distribution: a module and a dist-info directory on ``sys.path`` whose
    ``entry_points.txt`` declares ``kvoffload.eviction_policies`` entries."""
    (tmp_path / "my_kv_policies.py").write_text(textwrap.dedent(OUT_OF_TREE))
    dist = tmp_path / "my_kv_policies-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kv-policies\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[kvoffload.eviction_policies]\n{entry_points}\n")
    sys.path.insert(0, str(tmp_path))


@pytest.fixture
def site(tmp_path: Path):
    """Where a test installs its distribution; everything is undone afterwards."""
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_kv_policies", None)
    for name in ("my_out_of_tree_lru", "not_a_policy"):
        eviction_base._REGISTRY.pop(name, None)


def test_an_entry_point_policy_is_found_by_name(site: Path) -> None:
    install_dist(site, "my_out_of_tree_lru = my_kv_policies:MyPolicy")
    assert "my_out_of_tree_lru" in available_eviction_policies()
    policy = create_eviction_policy("my_out_of_tree_lru", 4)
    assert type(policy).__name__ == "MyPolicy" and policy.capacity == 4
    manager = CPUOffloadingManager(4, "my_out_of_tree_lru")
    out = manager.prepare_store(chain(0, 3, 0), ReqContext("r"))
    assert out is not None and len(out.keys_to_store) == 3


def test_an_entry_point_that_is_not_a_policy_is_a_config_error(site: Path) -> None:
    install_dist(site, "not_a_policy = my_kv_policies:NOT_A_POLICY")
    assert "not_a_policy" in available_eviction_policies()  # listed without being loaded
    with pytest.raises(ConfigError) as info:
        create_eviction_policy("not_a_policy", 4)
    assert info.value.field == "eviction_policy" and "my_kv_policies:NOT_A_POLICY" in str(
        info.value
    )


def test_a_broken_entry_point_does_not_hide_the_others(site: Path) -> None:
    install_dist(
        site,
        "not_a_policy = my_kv_policies:NOT_A_POLICY\n"
        "missing_module = no_such_module_anywhere:Policy\n"
        "my_out_of_tree_lru = my_kv_policies:MyPolicy",
    )
    assert type(create_eviction_policy("my_out_of_tree_lru", 4)).__name__ == "MyPolicy"
    with pytest.raises(ConfigError, match="missing_module"):
        create_eviction_policy("missing_module", 4)


def test_an_unknown_policy_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown policy 'nope'.*'lru'"):
        create_eviction_policy("nope", 4)
