"""Canonical byte views of the engine's KV cache and the host slot layout built over them.

The engine hands over its KV cache tensors in whatever shape its attention backend uses. Each is
reduced to one or more *page views*: uint8 tensors ``(num_blocks, page_bytes)`` whose row ``i``
holds every byte the tensor keeps for engine block ``i`` (its *page*), contiguous in memory.
Copies then move raw pages and never care about dtypes or head layouts.

Recognised shapes (``N`` = ``num_blocks``):

* ``[N, ...]``: one tensor per layer, or one cross-layer tensor ``[N, num_layers, ...]``;
* ``[2, N, ...]``: K and V split; one view when the block dimension is physically outermost,
  otherwise two views (K and V), one per half.

A page must be one dense run of bytes; pages of distinct blocks must not overlap. Views of one
storage that sit side by side in every block (per-layer views sliced out of one cross-layer
tensor) are merged into one view, so they move as one large copy; aliases are kept once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvoffload.errors import ConfigError

__all__ = ["GroupLayout", "KVCacheLayout", "PageView"]


@dataclass(frozen=True, slots=True)
class PageView:
    """``num_blocks`` pages of ``page_bytes`` bytes each; page ``i`` starts ``i * block_stride``
    bytes after page 0. ``pages`` is the uint8 ``(num_blocks, page_bytes)`` view over the engine's
    storage, strides ``(block_stride, 1)``.
    """

    pages: torch.Tensor

    @property
    def page_bytes(self) -> int:
        return self.pages.shape[1]

    @property
    def block_stride(self) -> int:
        return self.pages.stride(0)

    @property
    def address(self) -> int:
        """The address of page 0."""
        return self.pages.data_ptr()

    @property
    def storage_address(self) -> int:
        return self.pages.untyped_storage().data_ptr()

    def extent(self) -> tuple[int, int]:
        """The byte range ``[start, end)`` spanned by all pages."""
        return self.address, self.address + (
            self.pages.shape[0] - 1
        ) * self.block_stride + self.page_bytes


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """The page views of one KV-cache group and where each lands inside a host slot.

    A host slot holds one offloaded block: for view ``v``, its ``block_size_factor`` pages lie
    back to back from byte ``slot_offsets[v]`` of the slot (view-major, page-minor).
    """

    views: tuple[PageView, ...]
    slot_offsets: tuple[int, ...]
    #: Engine blocks (pages of each view) per offloaded block of this group.
    block_size_factor: int
    #: Bytes one offloaded block of this group occupies: ``factor * sum(page bytes)``.
    bytes_per_offloaded_block: int


class KVCacheLayout:
    """Every KV-cache group's page views, and the host slot size derived from them.

    Invariants: every view has ``num_blocks`` rows; views within a group do not overlap; the host
    slot size is the largest group's ``bytes_per_offloaded_block`` (the scheduler's tier has one
    pool of uniform slots shared by all groups, so smaller groups leave the slot tail unused).
    """

    def __init__(self, groups: Sequence[GroupLayout], num_blocks: int, device: torch.device):
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        self.device = device
        #: Host bytes per offloaded block (one slot), whatever its group.
        self.slot_bytes = max(g.bytes_per_offloaded_block for g in self.groups)

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        block_size_factor: int | Sequence[int],
        num_blocks: int | None = None,
        group_tensors: Sequence[Sequence[int]] | None = None,
        block_dim: int | None = None,
    ) -> KVCacheLayout:
        """Build the layout of ``kv_caches``.

        ``group_tensors[g]`` lists the indices (in ``kv_caches`` order) of group ``g``'s tensors;
        by default one group holds them all. ``block_size_factor`` is one for all groups or one
        per group. ``num_blocks`` is inferred when every tensor agrees on exactly one candidate;
        pass it to resolve ``[2, N, ...]`` shapes. ``block_dim`` (0, or 1 after a leading K/V dim)
        says where the blocks are when the caller knows, e.g. for ``[2, 2, ...]`` shapes where
        either could be. Raises :class:`ConfigError` for shapes that are ambiguous, inconsistent
        or not paged.
        """
        names, tensors = _named_tensors(kv_caches)
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise ConfigError(
                "kv_caches", f"all tensors must be on one device, got {sorted(map(str, devices))}"
            )
        if num_blocks is None:
            num_blocks = _infer_num_blocks(names, tensors)
        elif not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError("num_blocks", f"must be a positive integer, got {num_blocks!r}")
        if group_tensors is None:
            group_tensors = [range(len(tensors))]
        _check_groups(group_tensors, len(tensors))
        factors = _factors(block_size_factor, len(group_tensors))
        if block_dim not in (None, 0, 1):
            raise ConfigError("block_dim", f"must be None, 0 or 1, got {block_dim!r}")
        views = [
            _page_views(name, t, num_blocks, block_dim)
            for name, t in zip(names, tensors, strict=True)
        ]
        groups = []
        for members, factor in zip(group_tensors, factors, strict=True):
            group_views = _merge_views(
                [v for i in members for v in views[i]], [names[i] for i in members]
            )
            offsets = []
            position = 0
            for view in group_views:
                offsets.append(position)
                position += view.page_bytes * factor
            groups.append(GroupLayout(tuple(group_views), tuple(offsets), factor, position))
        return cls(groups, num_blocks, next(iter(devices)))

    @property
    def page_views(self) -> tuple[PageView, ...]:
        """Every group's views, in group order (a view shared by groups is listed once per group)."""
        return tuple(v for g in self.groups for v in g.views)


def _named_tensors(
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(kv_caches, Mapping):
        names, tensors = [str(k) for k in kv_caches], list(kv_caches.values())
    else:
        tensors = list(kv_caches)
        names = [f"kv_caches[{i}]" for i in range(len(tensors))]
    if not tensors:
        raise ConfigError("kv_caches", "no tensors given")
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ConfigError("kv_caches", f"{name} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() == 0 or t.numel() == 0:
            raise ConfigError(
                "kv_caches", f"{name} has shape {tuple(t.shape)}; a paged KV tensor needs blocks"
            )
    return names, tensors


def _block_dim_candidates(shape: Sequence[int]) -> dict[int, int]:
    """num_blocks candidate -> block dim: dim 0, or dim 1 after a leading K/V dim of size 2."""
    candidates: dict[int, int] = {}
    if len(shape) >= 2 and shape[0] == 2:
        candidates[shape[1]] = 1
    if shape[0] in candidates:  # [2, 2, ...]: either dim could hold the blocks
        candidates[shape[0]] = -1
    else:
        candidates[shape[0]] = 0
    return candidates


def _infer_num_blocks(names: list[str], tensors: list[torch.Tensor]) -> int:
    common: set[int] | None = None
    for t in tensors:
        cands = set(_block_dim_candidates(t.shape))
        common = cands if common is None else common & cands
    if not common:
        shapes = ", ".join(f"{n}={tuple(t.shape)}" for n, t in zip(names, tensors, strict=True))
        raise ConfigError(
            "num_blocks",
            f"the tensors agree on no block count (dim 0, or dim 1 after a leading 2): {shapes}",
        )
    if len(common) > 1:
        raise ConfigError(
            "num_blocks",
            f"ambiguous: tensors shaped like {tuple(tensors[0].shape)} could hold {sorted(common)} blocks; "
            "pass num_blocks",
        )
    return common.pop()


def _factors(block_size_factor: int | Sequence[int], num_groups: int) -> list[int]:
    factors = (
        [block_size_factor] * num_groups
        if isinstance(block_size_factor, int)
        else list(block_size_factor)
    )
    if len(factors) != num_groups or not all(isinstance(f, int) and f >= 1 for f in factors):
        raise ConfigError(
            "block_size_factor",
            f"needs one positive integer, or one per group ({num_groups}), got {block_size_factor!r}",
        )
    return factors


def _check_groups(group_tensors: Sequence[Sequence[int]], num_tensors: int) -> None:
    if not group_tensors:
        raise ConfigError("group_tensors", "at least one group is needed")
    seen: set[int] = set()
    for g, members in enumerate(group_tensors):
        members = list(members)
        if not members:
            raise ConfigError("group_tensors", f"group {g} has no tensors")
        bad = [i for i in members if not isinstance(i, int) or not 0 <= i < num_tensors]
        if bad:
            raise ConfigError(
                "group_tensors", f"group {g} names tensors {bad}, outside [0, {num_tensors})"
            )
        seen.update(members)
    missing = sorted(set(range(num_tensors)) - seen)
    if missing:
        raise ConfigError("group_tensors", f"tensors {missing} belong to no group")


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the elements form one gap-free run (in some dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _page_views(
    name: str, t: torch.Tensor, num_blocks: int, known_dim: int | None = None
) -> list[PageView]:
    candidates = _block_dim_candidates(t.shape)
    block_dim = candidates.get(num_blocks)
    if known_dim is not None and block_dim is not None:
        # The caller's word settles [2, 2, ...]; it must still be a possible block dim.
        possible = {0} if t.shape[0] == num_blocks else set()
        if len(t.shape) >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            possible.add(1)
        if known_dim not in possible:
            raise ConfigError(
                "block_dim",
                f"{name} has shape {tuple(t.shape)}: dim {known_dim} cannot hold {num_blocks} "
                "blocks (dim 0, or dim 1 after a leading 2)",
            )
        block_dim = known_dim
    if block_dim is None:
        raise ConfigError(
            "kv_caches",
            f"{name} has shape {tuple(t.shape)}: no block dim of size {num_blocks} (dim 0, or dim 1 after a leading 2)",
        )
    if block_dim < 0:
        raise ConfigError(
            "kv_caches",
            f"{name} has shape {tuple(t.shape)}: dim 0 and dim 1 could both be the block dim "
            "(pass block_dim)",
        )
    whole = t.movedim(block_dim, 0)
    if _is_dense(whole.shape[1:], whole.stride()[1:]):
        return [_page_view(name, whole)]
    if block_dim == 1:  # K and V halves, each paged on its own
        halves = [t[0], t[1]]
        if all(_is_dense(h.shape[1:], h.stride()[1:]) for h in halves):
            return [_page_view(f"{name}[{i}]", h) for i, h in enumerate(halves)]
    raise ConfigError(
        "kv_caches",
        f"{name} (shape {tuple(t.shape)}, strides {t.stride()}): a block's elements are not one contiguous run",
    )


def _page_view(name: str, t: torch.Tensor) -> PageView:
    """The page view of ``t``, whose dim 0 is the block dim and whose pages are dense."""
    es = t.element_size()
    page_bytes = math.prod(t.shape[1:]) * es
    stride = t.stride(0) * es if t.shape[0] > 1 else page_bytes
    if stride < page_bytes:
        raise ConfigError(
            "kv_caches",
            f"{name}: pages of {page_bytes} bytes overlap (block stride {stride} bytes)",
        )
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )
    return PageView(flat.as_strided((t.shape[0], page_bytes), (stride, 1), t.storage_offset() * es))


def _merge_views(views: list[PageView], names: list[str]) -> list[PageView]:
    """Drop aliases, merge views adjacent in every block, reject overlaps.

    Order: storages as first seen; within a storage, by address (layer order for a cross-layer tensor).
    """
    by_storage: dict[int, list[PageView]] = {}
    for v in views:
        by_storage.setdefault(v.storage_address, []).append(v)
    merged: list[PageView] = []
    for same in by_storage.values():
        same.sort(key=lambda v: (v.block_stride, v.address))
        kept: list[PageView] = []
        for v in same:
            last = kept[-1] if kept else None
            if last is not None and last.block_stride == v.block_stride:
                if (last.address, last.page_bytes) == (v.address, v.page_bytes):
                    continue  # the same pages registered twice (layers sharing one cache)
                joined = last.page_bytes + v.page_bytes
                if v.address == last.address + last.page_bytes and (
                    joined <= v.block_stride or v.pages.shape[0] == 1
                ):
                    kept[-1] = PageView(
                        last.pages.as_strided((v.pages.shape[0], joined), (v.block_stride, 1))
                    )
                    continue
            kept.append(v)
        for i, a in enumerate(kept):
            for b in kept[i + 1 :]:
                if _overlap(a, b):
                    raise ConfigError(
                        "kv_caches", f"tensors of one group ({', '.join(names)}) overlap in memory"
                    )
        merged.extend(kept)
    return merged


def _overlap(a: PageView, b: PageView) -> bool:
    (a0, a1), (b0, b1) = a.extent(), b.extent()
    if a1 <= b0 or b1 <= a0:
        return False
    if a.block_stride != b.block_stride:
        return True
    s = a.block_stride
    return (b.address - a.address) % s < a.page_bytes or (a.address - b.address) % s < b.page_bytes
