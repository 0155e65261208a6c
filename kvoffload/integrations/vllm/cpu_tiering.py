"""vLLM's own ``TieringOffloadingSpec`` on vLLM's CPU platform: :class:`CPUTieringOffloadingSpec`.

vLLM's tiering spec (its CPU tier, with vLLM's or our cache policies, and its secondary tiers,
vLLM's or ours) refuses to start on the CPU platform only for its worker side (GPU <-> CPU copies
with CUDA streams). This spec is vLLM's, unchanged, with our worker there
(:class:`~kvoffload.integrations.vllm.worker.CPUPlatformWorker`); on CUDA-alike and XPU platforms
it is exactly vLLM's. Everything else, settings included, is ``TieringOffloadingSpec``'s::

    {"spec_name": "CPUTieringOffloadingSpec",
     "spec_module_path": "kvoffload.integrations.vllm.cpu_tiering",
     "cpu_bytes_to_use": 8000000000,
     "eviction_policy": "KVOffloadAdaptive",
     "cache_policy_module_path": "kvoffload.integrations.vllm.policies",
     "secondary_tiers": [{"type": "KVOffloadDiskTier",
                          "module_path": "kvoffload.integrations.vllm.tiers",
                          "path": "kv-disk", "size_gib": 200}]}
"""

from __future__ import annotations

from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvoffload.integrations.vllm.worker import CPUPlatformWorker

__all__ = ["CPUTieringOffloadingSpec"]


class CPUTieringOffloadingSpec(CPUPlatformWorker, TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with our worker side on vLLM's CPU platform."""
