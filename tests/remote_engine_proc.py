"""One engine in its own process, for the two-engine remote-tier tests.

``python remote_engine_proc.py '<json>'`` builds a ``tiny`` engine from the JSON's ``engine``
settings, generates greedily for its ``prompts`` (one round after the other, draining between),
closes the engine (which drains the remote tier's stores) and prints one JSON line: the output
token ids per prompt, ``cached_tokens_offload`` per prompt, and the engine's stats.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvoffload.engine import Engine, SamplingParams


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 4), ignore_eos=True)
    outputs, cached = [], []
    engine = Engine("tiny", **spec["engine"])
    try:
        for prompts in spec["rounds"]:
            for out in engine.generate(prompts, params):
                outputs.append(out.output_token_ids)
                cached.append(out.cached_tokens_offload)
            engine.drain()
    finally:
        engine.close()
    return {"outputs": outputs, "cached_offload": cached, "stats": engine.stats()}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
