"""The names an engine setting may take, torch-free: ``EngineConfig`` checks against them and
the CLI offers them as choices, so building a command's parser imports no torch."""

from __future__ import annotations

__all__ = ["DTYPES", "DTYPE_SPELLINGS", "SCHEDULING_POLICIES"]

#: ``scheduling_policy``'s values (:mod:`kvoffload.engine.admission` builds their queues).
SCHEDULING_POLICIES = ("fcfs", "cache_aware")

#: Every dtype name ``dtype`` accepts -> its canonical name (a ``torch`` attribute).
DTYPE_SPELLINGS: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
#: The dtype names ``load_model`` accepts.
DTYPES = frozenset(DTYPE_SPELLINGS)
