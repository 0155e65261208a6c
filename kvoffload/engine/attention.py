"""Attention over a paged, cross-layer KV cache.

The engine owns one KV tensor of shape ``(num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim)`` (see :meth:`DecoderModel.kv_cache_shape`): engine block ``b`` is
``kv_cache[b]``, one contiguous piece holding every layer's keys (index 0) and values (index 1)
for ``block_size`` token positions, so that offloading copies a block in one piece. Token
position ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its *slot* is ``block_id * block_size + offset``.

Each engine step runs one forward pass over a flattened batch: every sequence contributes its
new tokens (a prefill chunk, possibly continuing after cached context, or one decode token).
:class:`AttentionMetadata` describes that batch; :func:`plan_attention` validates it once per
step and precomputes the index tensors that every layer reuses; :func:`paged_attention` writes a
layer's new K/V into the cache and attends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvoffload.errors import ContractError

__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "paged_attention",
    "plan_attention",
    "slot_mapping",
]


def slot_mapping(block_table: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """Slots of token positions ``start .. start + count - 1`` of a sequence with ``block_table``.

    Costs one ``range`` per block touched, not Python work per token.
    Raises :class:`ContractError` if the block table is too short.
    """
    if start < 0 or count < 0:
        raise ContractError(f"slot_mapping: start={start} and count={count} must be >= 0")
    end = start + count
    if end > len(block_table) * block_size:
        raise ContractError(
            f"slot_mapping: positions up to {end} need {-(-end // block_size)} blocks, "
            f"the block table has {len(block_table)} (block_size={block_size})"
        )
    slots: list[int] = []
    pos = start
    while pos < end:
        index, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        base = block_table[index] * block_size + offset
        slots.extend(range(base, base + run))
        pos += run
    return slots


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened batch of one forward pass.

    Sequence ``i`` owns new tokens ``query_start_loc[i] : query_start_loc[i + 1]`` of the flat
    batch; they occupy positions ``seq_lens[i] - num_new .. seq_lens[i] - 1`` of the sequence
    (everything before them is already in the cache). ``block_tables[i]`` covers at least
    ``seq_lens[i]`` tokens. ``slot_mapping[t]`` is the slot where flat token ``t``'s K/V is
    written, and must agree with the block table (:meth:`check_invariants` verifies it).
    """

    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @classmethod
    def build(
        cls,
        num_cached_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences that each add ``num_new_tokens[i]`` tokens after
        ``num_cached_tokens[i]`` cached ones (a prefix hit, an earlier chunk, or earlier decodes).
        """
        if not len(num_cached_tokens) == len(num_new_tokens) == len(block_tables):
            raise ContractError(
                f"AttentionMetadata.build: {len(num_cached_tokens)} cached counts, "
                f"{len(num_new_tokens)} new counts and {len(block_tables)} block tables"
            )
        query_start_loc = [0]
        slots: list[int] = []
        for cached, new, table in zip(num_cached_tokens, num_new_tokens, block_tables, strict=True):
            query_start_loc.append(query_start_loc[-1] + new)
            slots.extend(slot_mapping(table, cached, new, block_size))
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=[c + n for c, n in zip(num_cached_tokens, num_new_tokens, strict=True)],
            block_tables=[list(t) for t in block_tables],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_size=block_size,
        )

    def positions(self) -> torch.Tensor:
        """Each new token's position in its sequence, ``(T,)``: ``positions`` for a forward pass."""
        out: list[int] = []
        for i, seq_len in enumerate(self.seq_lens):
            out.extend(
                range(seq_len - (self.query_start_loc[i + 1] - self.query_start_loc[i]), seq_len)
            )
        return torch.tensor(out, dtype=torch.long, device=self.slot_mapping.device)

    def check_invariants(self) -> None:
        """Full consistency check, including that ``slot_mapping`` agrees with the block tables.

        :func:`plan_attention` makes the cheap structural checks every step; this one costs a
        device-to-host copy of the slot mapping and is meant for tests.
        """
        expected: list[int] = []
        for i in range(self.num_seqs):
            new = self.query_start_loc[i + 1] - self.query_start_loc[i]
            expected.extend(
                slot_mapping(self.block_tables[i], self.seq_lens[i] - new, new, self.block_size)
            )
        if self.slot_mapping.tolist() != expected:
            raise ContractError(
                "AttentionMetadata: slot_mapping disagrees with block_tables/seq_lens"
            )


@dataclass(slots=True)
class _SeqPlan:
    """One sequence attended on its own (a prefill chunk, or a decode that is not batched)."""

    q_start: int
    q_end: int
    seq_len: int
    #: Block ids covering ``seq_len`` tokens; ``None`` when nothing was cached before this step
    #: (the new tokens' own K/V is then used directly, without reading the cache back).
    blocks: torch.Tensor | None
    #: Bottom-right-aligned causal mask ``(q_len, seq_len)``; ``None`` where not needed.
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionPlan:
    """Index tensors derived once per step from :class:`AttentionMetadata`, reused by all layers."""

    write_blocks: torch.Tensor  # (T,) block id of each new token
    write_offsets: torch.Tensor  # (T,) offset within the block
    seqs: list[_SeqPlan]
    #: ``(2, max_blocks, block_size, KVH, D)``: reused by every layer for one sequence's K/V.
    scratch: torch.Tensor


def plan_attention(
    attn: AttentionMetadata, num_tokens: int, kv_cache: torch.Tensor, max_positions: int
) -> AttentionPlan:
    """Validate ``attn`` against the batch and the cache, and precompute per-step indices.

    Raises :class:`ContractError` (before anything is written) when the metadata is inconsistent:
    wrong lengths, a block table too short or naming a block outside the cache, a sequence longer
    than ``max_positions``.
    """
    _check_batch(attn, num_tokens, kv_cache)
    bs, device = attn.block_size, kv_cache.device
    pending, flat = _sequence_tables(attn, kv_cache.shape[0], max_positions)

    # One host-to-device copy for every block table of the step; each sequence gets a view.
    all_blocks = torch.tensor(flat, dtype=torch.long, device=device)
    seqs: list[_SeqPlan] = []
    max_blocks = 0
    for q_start, q_end, seq_len, offset in pending:
        if offset < 0:
            seqs.append(_SeqPlan(q_start, q_end, seq_len, None, None))
            continue
        n_blocks = -(-seq_len // bs)
        max_blocks = max(max_blocks, n_blocks)
        q_len = q_end - q_start
        mask = None
        if q_len > 1:  # bottom-right causal: new token t sees positions <= seq_len - q_len + t
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=device)
            mask.tril_(seq_len - q_len)
        seqs.append(_SeqPlan(q_start, q_end, seq_len, all_blocks[offset : offset + n_blocks], mask))

    slots = attn.slot_mapping.to(device=device, dtype=torch.long)
    block_shape = kv_cache.shape[3:]
    return AttentionPlan(
        write_blocks=torch.div(slots, bs, rounding_mode="floor"),
        write_offsets=torch.remainder(slots, bs),
        seqs=seqs,
        scratch=kv_cache.new_empty((2, max_blocks, *block_shape)),
    )


def _check_batch(attn: AttentionMetadata, num_tokens: int, kv_cache: torch.Tensor) -> None:
    """:class:`ContractError` unless the metadata's lengths fit the batch and the cache."""
    qsl, seq_lens, tables, bs = (
        attn.query_start_loc,
        attn.seq_lens,
        attn.block_tables,
        attn.block_size,
    )
    if bs != kv_cache.shape[3]:
        raise ContractError(
            f"block_size={bs} but the KV cache has blocks of {kv_cache.shape[3]} tokens"
        )
    if not len(qsl) == len(seq_lens) + 1 == len(tables) + 1:
        raise ContractError(
            f"query_start_loc has {len(qsl)} entries, seq_lens {len(seq_lens)}, block_tables "
            f"{len(tables)}: need num_seqs + 1, num_seqs, num_seqs"
        )
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise ContractError(
            f"query_start_loc must run from 0 to num_tokens={num_tokens}, got {qsl[0]}..{qsl[-1]}"
        )
    if attn.slot_mapping.shape != (num_tokens,):
        raise ContractError(
            f"slot_mapping has shape {tuple(attn.slot_mapping.shape)}, expected ({num_tokens},)"
        )


def _sequence_tables(
    attn: AttentionMetadata, num_blocks: int, max_positions: int
) -> tuple[list[tuple[int, int, int, int]], list[int]]:
    """Check every sequence; returns ``(q_start, q_end, seq_len, offset in flat)`` per sequence
    (offset -1: nothing cached) and the block tables of those with cached context, concatenated."""
    qsl, bs = attn.query_start_loc, attn.block_size
    pending: list[tuple[int, int, int, int]] = []
    flat: list[int] = []
    for i, seq_len in enumerate(attn.seq_lens):
        q_start, q_end = qsl[i], qsl[i + 1]
        q_len = q_end - q_start
        if q_len < 1 or seq_len < q_len:
            raise ContractError(f"sequence {i}: {q_len} new tokens with seq_len={seq_len}")
        if seq_len > max_positions:
            raise ContractError(
                f"sequence {i}: seq_len={seq_len} exceeds max_position_embeddings={max_positions}"
            )
        n_blocks = -(-seq_len // bs)
        table = attn.block_tables[i]
        if len(table) < n_blocks:
            raise ContractError(
                f"sequence {i}: seq_len={seq_len} needs {n_blocks} blocks, table has {len(table)}"
            )
        table = table[:n_blocks]
        if min(table) < 0 or max(table) >= num_blocks:
            raise ContractError(
                f"sequence {i}: block table names a block outside [0, {num_blocks})"
            )
        if seq_len == q_len:  # nothing cached: attend over the new K/V directly
            pending.append((q_start, q_end, seq_len, -1))
        else:
            pending.append((q_start, q_end, seq_len, len(flat)))
            flat.extend(table)
    return pending, flat


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: AttentionPlan,
) -> torch.Tensor:
    """Write this step's K/V of ``layer`` into the cache, then attend; returns ``(T, H * D)``.

    ``q`` is ``(T, H, D)``, ``k`` and ``v`` are ``(T, KVH, D)`` (RoPE already applied); they may
    be strided views. Each new token attends causally to every earlier position of its sequence.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    layer_cache = kv_cache[:, layer]  # (num_blocks, 2, block_size, KVH, D), a strided view
    layer_cache[:, 0][plan.write_blocks, plan.write_offsets] = k
    layer_cache[:, 1][plan.write_blocks, plan.write_offsets] = v

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for s in plan.seqs:
        q_len = s.q_end - s.q_start
        if s.blocks is None:
            keys, values = k[s.q_start : s.q_end], v[s.q_start : s.q_end]
        else:
            keys, values = _gather(layer_cache, s.blocks, s.seq_len, plan.scratch)
        if q_len == 1:
            # Decode: the group's query heads form the query rows of their shared KV head.
            query = q[s.q_start].reshape(1, num_kv_heads, group, head_dim)
            o = F.scaled_dot_product_attention(
                query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
            )
            out[s.q_start] = o.reshape(num_heads, head_dim)
            continue
        # SDPA's fused CPU kernel needs 4-D inputs; 3-D falls back to the ~5x slower math path.
        o = F.scaled_dot_product_attention(
            q[s.q_start : s.q_end].transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=s.mask,
            is_causal=s.mask is None,
            enable_gqa=group > 1,
        )
        out[s.q_start : s.q_end] = o[0].transpose(0, 1)

    return out.view(num_tokens, num_heads * head_dim)


def _gather(
    layer_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values ``(seq_len, KVH, D)``, copied into ``scratch``."""
    n, (_, _, block_size, num_kv_heads, head_dim) = blocks.shape[0], layer_cache.shape
    keys = scratch[0, :n]
    values = scratch[1, :n]
    # index_select on the (block, token, head, dim) view of one layer's K (or V) copies whole
    # blocks into place in one copy: measured ~7x faster than advanced indexing of the layer view
    # followed by the K/V-major reshape, and ~400x faster than index_select on a transposed view.
    torch.index_select(layer_cache[:, 0], 0, blocks, out=keys)
    torch.index_select(layer_cache[:, 1], 0, blocks, out=values)
    return (
        keys.view(n * block_size, num_kv_heads, head_dim)[:seq_len],
        values.view(n * block_size, num_kv_heads, head_dim)[:seq_len],
    )
