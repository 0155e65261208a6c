"""The paged KV cache: where K/V are written, what is read, and how bad metadata is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_cases import (
    fingerprint,
    one_thread,  # noqa: F401 - autouse fixture
    random_blocks,
    run_chunks,
)

from kvoffload.engine import AttentionMetadata, DecoderModel, load_model, slot_mapping
from kvoffload.errors import ContractError

POISON = 12345.0
TESTS_DIR = str(Path(__file__).parent)
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def tiny() -> DecoderModel:
    return load_model("tiny")[0]


def _poisoned(model: DecoderModel, block_size: int) -> torch.Tensor:
    return torch.full(model.kv_cache_shape(NUM_BLOCKS, block_size), POISON)


def test_kv_cache_shape_and_bytes(tiny: DecoderModel) -> None:
    c = tiny.config
    assert tiny.kv_cache_shape(7, 16) == (7, c.num_layers, 2, 16, c.num_kv_heads, c.head_dim)
    cache = tiny.allocate_kv_cache(7, 16)
    assert cache.dtype == torch.float32 and not cache.any()
    assert tiny.kv_bytes_per_token() == cache[0].numel() * 4 // 16


def test_kv_written_exactly_at_slot_mapping(tiny: DecoderModel) -> None:
    """Only the slots of the new tokens change; every other element (other blocks, the unused tail
    of the last block, blocks listed in the table but past seq_len) keeps its poison."""
    bs = 4
    cache = _poisoned(tiny, bs)
    table = [9, 3, 17, 0, 25, 11]  # 6 blocks for 13 tokens: blocks 25 and 11 stay unused
    ids = list(range(40, 53))
    run_chunks(tiny, cache, ids, [5, 8], table, bs)
    written = torch.zeros(NUM_BLOCKS, bs, dtype=torch.bool)
    for slot in slot_mapping(table, 0, 13, bs):
        written[slot // bs, slot % bs] = True
    per_slot = cache.permute(0, 3, 1, 2, 4, 5).reshape(NUM_BLOCKS, bs, -1)  # (block, offset, rest)
    assert (per_slot[written] != POISON).all()
    assert (per_slot[~written] == POISON).all()
    assert written.sum() == 13


def test_kv_values_do_not_depend_on_block_placement(tiny: DecoderModel) -> None:
    """Position p's K/V is the same whether blocks are contiguous, shuffled or chunked."""
    bs, ids = 4, list(range(100, 122))
    contiguous = tiny.allocate_kv_cache(NUM_BLOCKS, bs)
    shuffled = tiny.allocate_kv_cache(NUM_BLOCKS, bs)
    table_a = list(range(6))
    table_b = random_blocks(NUM_BLOCKS, 6, seed=5)
    logits_a = run_chunks(tiny, contiguous, ids, [22], table_a, bs)
    logits_b = run_chunks(tiny, shuffled, ids, [3, 1, 9, 9], table_b, bs)
    torch.testing.assert_close(logits_a, logits_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(contiguous[table_a], shuffled[table_b], atol=1e-5, rtol=0)


def test_poison_outside_the_sequence_never_leaks(tiny: DecoderModel) -> None:
    """NaN everywhere except what the sequence writes: outputs stay finite and unchanged."""
    bs, ids, table = 4, list(range(7, 30)), random_blocks(NUM_BLOCKS, 8, seed=1)
    clean = run_chunks(tiny, tiny.allocate_kv_cache(NUM_BLOCKS, bs), ids, [10, 1, 12], table, bs)
    dirty_cache = torch.full(tiny.kv_cache_shape(NUM_BLOCKS, bs), float("nan"))
    dirty = run_chunks(tiny, dirty_cache, ids, [10, 1, 12], table, bs)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=1e-5, rtol=0)


def test_corrupted_cached_kv_changes_the_output(tiny: DecoderModel) -> None:
    """The model reads the cache: a continuation over corrupted prefix KV gives other logits.
    (Guards the tests above against a model that ignores its context.)"""
    bs, ids, table = 4, list(range(60, 90)), random_blocks(NUM_BLOCKS, 8, seed=2)
    cache = tiny.allocate_kv_cache(NUM_BLOCKS, bs)
    run_chunks(tiny, cache, ids[:16], [16], table, bs)
    md = AttentionMetadata.build([16], [14], [table], bs)
    with torch.inference_mode():
        clean = tiny.compute_logits(tiny(torch.tensor(ids[16:]), md.positions(), cache.clone(), md))
        corrupted = cache.clone()
        corrupted[table[1]] = torch.randn(corrupted[table[1]].shape)
        bad = tiny.compute_logits(tiny(torch.tensor(ids[16:]), md.positions(), corrupted, md))
    assert (clean - bad).abs().max() > 0.1
    assert not torch.equal(clean.argmax(-1), bad.argmax(-1))


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    start=st.integers(0, 40),
    count=st.integers(0, 40),
)
def test_slot_mapping_matches_the_per_token_formula(
    data: st.DataObject, block_size: int, start: int, count: int
) -> None:
    n_blocks = -(-(start + count) // block_size)
    table = data.draw(
        st.lists(st.integers(0, 999), min_size=n_blocks, max_size=n_blocks + 2, unique=True)
    )
    expected = [
        table[p // block_size] * block_size + p % block_size for p in range(start, start + count)
    ]
    assert slot_mapping(table, start, count, block_size) == expected


def test_slot_mapping_rejects_a_short_table() -> None:
    with pytest.raises(ContractError, match="block table has 2"):
        slot_mapping([4, 5], 6, 3, 4)


def test_metadata_build_and_positions() -> None:
    md = AttentionMetadata.build([5, 0, 8], [3, 2, 1], [[1, 2], [3], [4, 5, 6]], 4)
    assert md.query_start_loc == [0, 3, 5, 6]
    assert md.seq_lens == [8, 2, 9]
    assert md.slot_mapping.tolist() == [9, 10, 11, 12, 13, 24]
    assert md.positions().tolist() == [5, 6, 7, 0, 1, 8]
    assert (md.num_seqs, md.num_tokens) == (3, 6)
    md.check_invariants()
    md.slot_mapping[0] = 0
    with pytest.raises(ContractError, match="slot_mapping disagrees"):
        md.check_invariants()


def _bad(md: AttentionMetadata, **change: object) -> AttentionMetadata:
    fields = {
        k: getattr(md, k)
        for k in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "block_size")
    }
    fields.update(change)
    return AttentionMetadata(**fields)


GOOD = AttentionMetadata.build([4, 0], [1, 3], [[2, 3], [5]], 4)


@pytest.mark.parametrize(
    ("md", "message"),
    [
        (_bad(GOOD, query_start_loc=[0, 1, 3]), "query_start_loc must run"),
        (_bad(GOOD, query_start_loc=[0, 4]), "query_start_loc has 2 entries"),
        (_bad(GOOD, seq_lens=[5, 2]), "3 new tokens with seq_len=2"),
        (_bad(GOOD, block_tables=[[2], [5]]), "needs 2 blocks, table has 1"),
        (_bad(GOOD, block_tables=[[2, NUM_BLOCKS], [5]]), "outside"),
        (_bad(GOOD, block_tables=[[2, -1], [5]]), "outside"),
        (_bad(GOOD, block_size=8), "block_size=8"),
        (_bad(GOOD, slot_mapping=torch.zeros(3, dtype=torch.long)), "slot_mapping has shape"),
        (_bad(GOOD, seq_lens=[40000, 3]), "max_position"),
    ],
)
def test_bad_metadata_is_refused_before_any_write(
    tiny: DecoderModel, md: AttentionMetadata, message: str
) -> None:
    cache = _poisoned(tiny, 4)
    with torch.inference_mode(), pytest.raises(ContractError, match=message):
        tiny(torch.tensor([1, 2, 3, 4]), torch.tensor([4, 0, 1, 2]), cache, md)
    assert (cache == POISON).all()


def test_wrong_cache_or_inputs_are_refused(tiny: DecoderModel) -> None:
    ids, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([4, 0, 1, 2])
    with torch.inference_mode():
        with pytest.raises(ContractError, match="kv_cache"):
            tiny(ids, pos, torch.zeros(NUM_BLOCKS, 2, 4, 2, 16), GOOD)
        with pytest.raises(ContractError, match="kv_cache"):
            tiny(ids, pos, tiny.allocate_kv_cache(NUM_BLOCKS, 4).double(), GOOD)
        with pytest.raises(ContractError, match="positions"):
            tiny(ids, pos[:3], tiny.allocate_kv_cache(NUM_BLOCKS, 4), GOOD)


def test_presets_are_deterministic_across_processes() -> None:
    script = (
        f"import sys; sys.path.insert(0, {TESTS_DIR!r}); "
        "from model_cases import fingerprint; print(fingerprint('tiny', 3))"
    )
    # One thread here (autouse fixture) and there: GEMM results depend on the thread count.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    assert out.stdout.strip() == fingerprint("tiny", 3)
    assert fingerprint("tiny", 4) != fingerprint("tiny", 3)


@pytest.mark.cuda
def test_cuda_matches_cpu() -> None:
    ids, table, chunks = list(range(200, 230)), random_blocks(NUM_BLOCKS, 8, seed=3), [20, 1, 9]
    cpu = load_model("tiny")[0]
    expected = run_chunks(cpu, cpu.allocate_kv_cache(NUM_BLOCKS, 4), ids, chunks, table, 4)
    gpu = load_model("tiny", device="cuda", dtype="float32")[0]
    got = run_chunks(gpu, gpu.allocate_kv_cache(NUM_BLOCKS, 4), ids, chunks, table, 4)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, atol=2e-3, rtol=0)
    bf16 = load_model("tiny", device="cuda")[0]  # CUDA defaults to bfloat16
    assert bf16.dtype == torch.bfloat16
    low = run_chunks(bf16, bf16.allocate_kv_cache(NUM_BLOCKS, 4), ids, chunks, table, 4)
    assert low.dtype == torch.float32 and torch.isfinite(low).all()
    assert (low.cpu() - expected).abs().max() < 0.1 * expected.abs().max()
