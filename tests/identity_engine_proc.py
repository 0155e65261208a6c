"""One engine in its own process, for the model-identity tests.

``python identity_engine_proc.py '<json>'`` builds ``Engine(spec["model"], **spec["engine"])``,
generates greedily for ``spec["prompts"]``, closes the engine (which drains its stores to every
tier) and prints one JSON line: the output token ids per prompt, the engine's stats and the
layout fingerprint (hex) of each secondary tier.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvoffload.engine import Engine, SamplingParams


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*byte-level.*")  # checkpoints without tokenizer
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    engine = Engine(spec["model"], **spec["engine"])
    try:
        outputs = [out.output_token_ids for out in engine.generate(spec["prompts"], params)]
        tiers = engine.tiering.tiers if engine.tiering is not None else []
        fingerprints = [tier.layout.fingerprint().hex() for tier in tiers]
    finally:
        engine.close()
    return {"outputs": outputs, "stats": engine.stats(), "fingerprints": fingerprints}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
