"""Which engine page goes to which host slot position: one transfer's page map, validated.

A :class:`~kvoffload.load_store_specs.GPULoadStoreSpec` lists engine block ids group by group
(``group_sizes[g]`` of them for group ``g``); the co-indexed
:class:`~kvoffload.load_store_specs.CPULoadStoreSpec` lists host slots, group by group too, one per
offloaded block of ``block_size_factors[g]`` engine pages. Group ``g``'s engine pages fill its slots
in order, starting ``block_indices[g] % factor`` pages into its first slot: the head of that
offloaded block is already on the engine (loads only; stores are always whole blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.errors import ContractError
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec

__all__ = ["BlockMapping", "GroupMapping"]


@dataclass(frozen=True, slots=True)
class GroupMapping:
    """Group ``group``'s share of a transfer (int64 arrays).

    ``slots`` are its host slots, one per offloaded block. Page ``i`` is engine block
    ``engine_blocks[i]`` <-> page position ``first_page + i`` counted across ``slots`` (so position
    ``slot_pages[i] = (first_page + i) % factor`` of slot ``host_slots[i]``).
    """

    group: int
    slots: np.ndarray
    first_page: int
    engine_blocks: np.ndarray
    host_slots: np.ndarray
    slot_pages: np.ndarray


@dataclass(frozen=True, slots=True)
class BlockMapping:
    """The page map of one transfer: one :class:`GroupMapping` per group with pages in it."""

    groups: tuple[GroupMapping, ...]
    num_pages: int

    @classmethod
    def from_specs(
        cls,
        engine: GPULoadStoreSpec,
        host: CPULoadStoreSpec,
        *,
        is_store: bool,
        block_size_factors: Sequence[int],
        num_engine_blocks: int,
        num_host_slots: int,
    ) -> BlockMapping:
        """Validate the two specs against each other and the pools, and build the map.

        Raises :class:`ContractError` (naming the mismatch) when: the group count differs from the
        layout's; a store's group is not whole offloaded blocks; the slot count does not match the
        pages; an id is out of range; a destination is written twice.
        """
        sizes, indices = engine.group_sizes, engine.block_indices
        if len(sizes) != len(block_size_factors):
            raise ContractError(
                f"spec has {len(sizes)} groups (group_sizes {sizes}); the KV cache has {len(block_size_factors)}"
            )
        engine_ids = _ids(engine.block_ids, num_engine_blocks, "engine block")
        host_ids = _ids(host.block_ids, num_host_slots, "host slot")
        groups: list[GroupMapping] = []
        page_start = slot_start = 0
        needed = 0
        for g, (size, index, f) in enumerate(zip(sizes, indices, block_size_factors, strict=True)):
            if size < 0 or index < 0:
                raise ContractError(f"group {g}: negative size {size} or block index {index}")
            skip = index % f
            if is_store and (skip or size % f):
                raise ContractError(
                    f"store group {g}: {size} engine blocks from block index {index} are not whole "
                    f"offloaded blocks of {f}"
                )
            if size == 0:
                continue
            num_slots = -(-(skip + size) // f)
            needed += num_slots
            slots = host_ids[slot_start : slot_start + num_slots]
            if len(slots) < num_slots:
                continue  # reported below with the totals
            positions = np.arange(skip, skip + size, dtype=np.int64)
            groups.append(
                GroupMapping(
                    g,
                    slots,
                    skip,
                    engine_ids[page_start : page_start + size],
                    slots[positions // f],
                    positions % f,
                )
            )
            page_start += size
            slot_start += num_slots
        if needed != len(host_ids):
            raise ContractError(
                f"{len(host_ids)} host slots given for {needed} offloaded blocks "
                f"(group_sizes {sizes}, block_indices {indices}, factors {list(block_size_factors)})"
            )
        if is_store:
            _unique(host_ids, "host slot")
        else:
            for gm in groups:
                _unique(gm.engine_blocks, f"group {gm.group} engine block")
        return cls(tuple(groups), len(engine_ids))


def _ids(ids: list[int], limit: int, what: str) -> np.ndarray:
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ContractError(f"{what} ids must be integers: {exc}") from None
    if arr.ndim != 1:
        raise ContractError(f"{what} ids must be a flat list, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        bad = arr[(arr < 0) | (arr >= limit)][:5].tolist()
        raise ContractError(f"{what} ids {bad} out of range [0, {limit})")
    return arr


def _unique(ids: np.ndarray, what: str) -> None:
    if ids.size > 1:
        ordered = np.sort(ids)
        dup = ordered[1:][ordered[1:] == ordered[:-1]]
        if dup.size:
            raise ContractError(f"{what} {int(dup[0])} is written twice in one transfer")
