"""The public surface of ``kvoffload``: pinned, resolvable, and torch-free on the scheduler side."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

import kvoffload

# Changing the public API is deliberate: update this list in the same change.
EXPORTED = [
    "BlockHash",
    "BlockHasher",
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "ConfigError",
    "ContractError",
    "DiskTier",
    "Engine",
    "EngineConfig",
    "EvictionPolicy",
    "FilterReusedOffloadingManager",
    "GPULoadStoreSpec",
    "HostAllocationError",
    "KVEventsConfig",
    "KVLayout",
    "KVOffloadError",
    "LoadStoreSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingConnectorScheduler",
    "OffloadingConnectorWorker",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RedisTier",
    "RemoteTierConfig",
    "ReqContext",
    "RequestKVState",
    "SamplingParams",
    "SchedulerOffloadConfig",
    "SecondaryTier",
    "StoreOnComputePolicy",
    "TieringOffloadingManager",
    "TransferError",
    "__version__",
    "available_eviction_policies",
    "create_eviction_policy",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
]

# The scheduler-side core and the KV-event layer: never torch. Every one must exist: a module
# renamed or removed fails here until this list names its successor.
SCHEDULER_SIDE = [
    "kvoffload",
    "kvoffload.manager_contract",
    "kvoffload.errors",
    "kvoffload.events",
    "kvoffload.eviction",
    "kvoffload.identity",
    "kvoffload.keys",
    "kvoffload.managers",
    "kvoffload.load_store_specs",
    "kvoffload.scheduler",
]


def test_all_is_sorted_and_pinned() -> None:
    assert kvoffload.__all__ == sorted(kvoffload.__all__)
    assert kvoffload.__all__ == EXPORTED


@pytest.mark.parametrize("module", SCHEDULER_SIDE)
def test_every_listed_module_exists(module: str) -> None:
    assert importlib.util.find_spec(module) is not None, (
        f"{module} is listed in SCHEDULER_SIDE but does not exist (renamed? update the list)"
    )


@pytest.mark.parametrize("module", SCHEDULER_SIDE)
def test_every_exported_name_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", [])
    assert len(names) == len(set(names)), f"{module}.__all__ lists a name twice"
    missing = [name for name in names if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names {missing}, which it does not define"


def test_package_exports_the_same_objects_as_their_modules() -> None:
    from kvoffload import errors, keys, load_store_specs, manager_contract, managers

    for module in (manager_contract, errors, keys, managers, load_store_specs):
        for name in module.__all__:
            if name in kvoffload.__all__:
                assert getattr(kvoffload, name) is getattr(module, name)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (nothing imported yet); its output as text."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )


def test_scheduler_side_imports_no_torch() -> None:
    modules = SCHEDULER_SIDE
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = run_python(code)
    assert out.stdout.strip() == "[]", f"importing {modules} pulled in torch"


# Headline classes: exported from ``kvoffload`` and from the package that holds them.
HEADLINE = {
    "kvoffload.engine": ["Engine", "EngineConfig", "SamplingParams"],
    "kvoffload.events": ["KVEventsConfig"],
    "kvoffload.managers": [
        "CPUOffloadingManager",
        "FilterReusedOffloadingManager",
        "TieringOffloadingManager",
    ],
    "kvoffload.scheduler": [
        "OffloadPolicy",
        "OffloadingConnectorScheduler",
        "RequestKVState",
        "SchedulerOffloadConfig",
        "StoreOnComputePolicy",
    ],
    "kvoffload.tiers": ["DiskTier", "KVLayout", "RedisTier", "RemoteTierConfig", "SecondaryTier"],
    "kvoffload.worker": ["OffloadingConnectorWorker"],
}


@pytest.mark.parametrize("package", sorted(HEADLINE))
def test_headline_classes_are_exported_from_kvoffload_and_their_package(package: str) -> None:
    mod = importlib.import_module(package)
    for name in HEADLINE[package]:
        assert name in mod.__all__ and name in kvoffload.__all__, name
        assert getattr(kvoffload, name) is getattr(mod, name), name
        assert name in dir(kvoffload) and name in dir(mod), name


def test_import_kvoffload_loads_neither_torch_nor_redis_until_asked() -> None:
    code = (
        "import sys, kvoffload, kvoffload.tiers\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'redis', 'zmq'}))\n"
        "kvoffload.RedisTier\n"
        "print('kvoffload.tiers.redis.tier' in sys.modules, 'torch' in sys.modules)\n"
    )
    out = run_python(code)
    assert out.stdout.split("\n")[:2] == ["[]", "True False"]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        kvoffload.NoSuchThing  # noqa: B018


def test_version_is_a_string() -> None:
    assert isinstance(kvoffload.__version__, str) and kvoffload.__version__


def test_scheduler_core_imports_no_network_layer() -> None:
    """The connector needs the event *types* only; pyzmq loads when a publisher is made."""
    code = (
        "import sys\n"
        "import kvoffload, kvoffload.managers, kvoffload.eviction, kvoffload.scheduler\n"
        "print('zmq' in sys.modules)\n"
        "from kvoffload.events import create_event_publisher, KVEventSubscriber\n"
        "print('zmq' in sys.modules)\n"
    )
    out = run_python(code)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("kvoffload.base", "kvoffload.manager_contract", "OffloadingManager"),
        ("kvoffload.mediums", "kvoffload.load_store_specs", "CPULoadStoreSpec"),
        ("kvoffload.tiers.base", "kvoffload.tiers.contract", "SecondaryTier"),
        ("kvoffload.tiers.remote", "kvoffload.tiers.redis.tier", "RedisTier"),
    ],
)
def test_a_moved_module_path_still_works_with_a_warning(old: str, new: str, name: str) -> None:
    """Paths users may have typed before the house moved (issue 33) forward to the new module,
    naming it in a DeprecationWarning."""
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError):
        module.__wrapped__  # noqa: B018  (dunder names are not forwarded)
