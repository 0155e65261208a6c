"""Our model against transformers: the same logits from a full prompt, from a prompt continued
after KV cached in random non-contiguous blocks, and inside mixed batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_cases import (
    HF_CASES,
    VOCAB,
    hf_logits,
    make_hf_model,
    one_thread,  # noqa: F401 - autouse fixture
    random_blocks,
    run_chunks,
    save_hf_model,
)

from kvoffload.engine import AttentionMetadata, DecoderModel, load_model

pytest.importorskip("transformers")

ATOL = 1e-4
NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, DecoderModel]:
    """(transformers model, our model loaded from its saved checkpoint)."""
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    with pytest.warns(UserWarning, match="byte-level"):
        ours, config, _ = load_model(str(path))
    assert config.architecture == request.param
    return hf, ours


@pytest.mark.parametrize("length", [1, 7, 16, 45])
@pytest.mark.parametrize("block_size", [4, 16])
def test_full_prompt_matches_transformers(
    pair: tuple[Any, DecoderModel], length: int, block_size: int
) -> None:
    hf, ours = pair
    ids = _prompt(length, seed=length)
    cache = ours.allocate_kv_cache(NUM_BLOCKS, block_size)
    table = random_blocks(NUM_BLOCKS, -(-length // block_size), seed=length)
    got = run_chunks(ours, cache, ids, [length], table, block_size)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("chunks", "block_size"),
    [
        ([20, 25], 4),  # prefix hit ending mid-block, rest in one chunk
        ([16, 16, 13], 16),  # block-aligned chunked prefill
        ([5, 1, 1, 30, 1, 7], 4),  # prefill, decodes, a long chunk, decode, a short chunk
        ([33, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 16),  # decodes crossing a block boundary
    ],
)
def test_continuing_from_cached_kv_matches_transformers(
    pair: tuple[Any, DecoderModel], chunks: list[int], block_size: int
) -> None:
    hf, ours = pair
    ids = _prompt(sum(chunks), seed=len(chunks))
    cache = ours.allocate_kv_cache(NUM_BLOCKS, block_size)
    table = random_blocks(NUM_BLOCKS, -(-len(ids) // block_size), seed=block_size)
    got = run_chunks(ours, cache, ids, chunks, table, block_size)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_mixed_batch_equals_each_sequence_alone(pair: tuple[Any, DecoderModel]) -> None:
    """One step holding a prefill chunk after a prefix hit, a fresh prefill and two decodes gives
    each sequence the logits it gets alone, and transformers' logits."""
    hf, ours = pair
    bs = 4
    prompts = [_prompt(n, seed=100 + n) for n in (30, 11, 19, 9)]
    cached = [18, 0, 18, 8]  # tokens already in the cache before the mixed step
    shuffled = random_blocks(NUM_BLOCKS, 32, seed=7)
    tables = [shuffled[i * 8 : (i + 1) * 8] for i in range(4)]
    cache = ours.allocate_kv_cache(NUM_BLOCKS, bs)
    for prompt, n, table in zip(prompts, cached, tables, strict=True):
        if n:
            run_chunks(ours, cache, prompt[:n], [n], table, bs)

    new = [len(p) - n for p, n in zip(prompts, cached, strict=True)]
    new[2] = 1  # sequence 2 decodes one token instead of finishing its prompt
    md = AttentionMetadata.build(cached, new, tables, bs)
    md.check_invariants()
    flat = [t for p, n, k in zip(prompts, cached, new, strict=True) for t in p[n : n + k]]
    with torch.inference_mode():
        batched = ours.compute_logits(ours(torch.tensor(flat), md.positions(), cache, md))

    for i, (prompt, n, k) in enumerate(zip(prompts, cached, new, strict=True)):
        rows = batched[md.query_start_loc[i] : md.query_start_loc[i + 1]]
        alone_cache = ours.allocate_kv_cache(NUM_BLOCKS, bs)
        alone = run_chunks(ours, alone_cache, prompt[: n + k], [n + k], tables[i], bs)[n:]
        torch.testing.assert_close(rows, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(rows, hf_logits(hf, prompt[: n + k])[n:], atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3")
    save_hf_model(hf, tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    with pytest.warns(UserWarning, match="byte-level"):
        ours, _, _ = load_model(str(tmp_path))
    ids = _prompt(12, seed=3)
    got = run_chunks(ours, ours.allocate_kv_cache(8, 4), ids, [12], [5, 2, 7], 4)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)
