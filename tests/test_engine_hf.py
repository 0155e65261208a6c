"""A real Hugging Face checkpoint through the engine: a prompt continued from KV that went to the
host tier and came back gives transformers' log-probabilities."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import BLOCK_SIZE, assert_quiescent, one_thread  # noqa: F401 - autouse fixture
from model_cases import VOCAB, hf_logits, make_hf_model, save_hf_model

from kvoffload.engine import Engine, RequestOutput, SamplingParams

pytest.importorskip("transformers")

ATOL = 1e-4
PREFIX_TOKENS = 7 * BLOCK_SIZE
# make_hf_model("qwen3"): 2 layers x (K, V) x 2 KV heads x head_dim 24 x 4 bytes per token.
HF_BLOCK_BYTES = 2 * 2 * 2 * 24 * 4 * BLOCK_SIZE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = make_hf_model("qwen3")
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("qwen3"))


def _check_against_transformers(hf: Any, out: RequestOutput) -> None:
    """Each generated token's full-vocab logprobs equal log_softmax of transformers' logits at the
    position that predicted it; greedy tokens are transformers' argmax."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_token_ids)
    sequence = out.prompt_token_ids + out.output_token_ids[:-1]
    want = torch.log_softmax(hf_logits(hf, sequence).double(), dim=-1)
    first = len(out.prompt_token_ids) - 1
    for i, (token, lp) in enumerate(zip(out.output_token_ids, out.logprobs, strict=True)):
        row = want[first + i]
        got = torch.tensor([lp[t] for t in range(VOCAB)], dtype=torch.float64)
        torch.testing.assert_close(got, row, atol=ATOL, rtol=0)
        assert token == int(row.argmax())


def test_continuation_from_offloaded_kv_matches_transformers(checkpoint: tuple[Any, Path]) -> None:
    hf, path = checkpoint
    rng = random.Random(3)
    tokens = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731 - no EOS (2)
    prefix = tokens(PREFIX_TOKENS)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=-1)
    with pytest.warns(UserWarning, match="byte-level"):
        engine = Engine(
            str(path),
            block_size=BLOCK_SIZE,
            num_device_blocks=12,
            kv_offloading_size=64 * HF_BLOCK_BYTES / 2**30,
            load_policy="always",
        )
    with engine:
        assert (
            engine.worker is not None and engine.worker.bytes_per_offloaded_block == HF_BLOCK_BYTES
        )
        first = engine.generate([prefix + tokens(3)], params)[0]
        engine.drain()
        assert first.cached_tokens_offload == 0
        # Two unrelated prompts take the whole device cache: the prefix leaves it.
        for _ in range(2):
            engine.generate([tokens(PREFIX_TOKENS + 3)], params)
            engine.drain()
        hashes = engine.hasher.hash_blocks(prefix)
        assert engine.pool.find_cached_prefix(hashes, len(hashes)) == []
        again = engine.generate([prefix + tokens(2)], params)[0]
        assert again.cached_tokens_offload == PREFIX_TOKENS
        assert engine.stats()["offload_loaded_blocks"] == PREFIX_TOKENS // BLOCK_SIZE
        assert_quiescent(engine)
    _check_against_transformers(hf, first)
    _check_against_transformers(hf, again)
