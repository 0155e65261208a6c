"""Concrete load/store specs for the media kvoffload moves blocks between.

Specs carry plain ``list[int]`` block ids: the scheduler side builds them every step and never
touches numpy or torch; the worker side turns them into index tensors once per transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvoffload.manager_contract import LoadStoreSpec

__all__ = ["BlockIDsLoadStoreSpec", "CPULoadStoreSpec", "GPULoadStoreSpec"]


@dataclass(slots=True)
class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Blocks addressed by integer ids in a tier's own block pool, one id per offloaded block."""

    block_ids: list[int]


@dataclass(slots=True)
class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Slots of the host-memory tier."""

    medium: ClassVar[str] = "CPU"


@dataclass(slots=True)
class GPULoadStoreSpec(LoadStoreSpec):
    """Blocks of the engine's own KV cache (the "device", whatever it is: CUDA or CPU).

    ``block_ids`` are engine block ids, concatenated group by group; ``group_sizes[g]`` says how
    many belong to KV-cache group ``g`` (so ``sum(group_sizes) == len(block_ids)``).
    ``block_indices[g]`` is the position, within the request, of group ``g``'s first engine block
    in this transfer: a load whose first offloaded block is partly present on the engine already
    starts at ``block_indices[g] % block_size_factor`` pages into that offloaded block.
    """

    medium: ClassVar[str] = "GPU"
    block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]

    def __post_init__(self) -> None:
        if sum(self.group_sizes) != len(self.block_ids) or len(self.group_sizes) != len(
            self.block_indices
        ):
            raise ValueError(
                f"GPULoadStoreSpec: group_sizes {self.group_sizes} must sum to len(block_ids)="
                f"{len(self.block_ids)} and match block_indices {self.block_indices} in length"
            )
