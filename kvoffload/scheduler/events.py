"""Turning a tier's :class:`~kvoffload.manager_contract.OffloadingEvent` into self-describing KV events.

A manager's events carry keys only. Routers need more: a ``BlockStored`` for an offloaded block
carries its real token ids, block size, parent hash and group (vLLM sent empty token lists for
years, and consumers such as Dynamo dropped those events). The connector records that
description when it plans a store and this module attaches it when the store's event comes out.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.events.messages import BlockRemoved, BlockStored, external_block_hash
from kvoffload.keys import BlockHash, OffloadKey, offload_key_group, offload_key_hash
from kvoffload.manager_contract import OffloadingEvent
from kvoffload.scheduler.state import RequestKVState

__all__ = ["OffloadEventDescriber"]

#: How many announced blocks' descriptions are kept for a later tier's stored event.
RECENT_DESCRIPTIONS = 65536


class _BlockDescription:
    """What a block holds; ``stores``: planned stores of it whose stored event is not out yet."""

    __slots__ = ("block_size", "parent", "stores", "token_ids")

    def __init__(self, parent: BlockHash | None, token_ids: list[int], block_size: int) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.block_size = block_size
        self.stores = 1


def _what_block_holds(
    state: RequestKVState, g: int, block: int
) -> tuple[BlockHash | None, list[int], int]:
    """Block ``block`` of the request's group ``g``: its parent's hash, its tokens, its size."""
    obs = state.config.groups[g].offloaded_block_size
    parent = offload_key_hash(state.group_states[g].offload_keys[block - 1]) if block else None
    return parent, list(state.request.all_token_ids[block * obs : (block + 1) * obs]), obs


class OffloadEventDescriber:
    """Remembers what each block being stored holds, and converts tier events into KV events.

    Descriptions are recorded when a store is planned and dropped when its stored event is
    converted or the store fails, so memory stays bounded by the blocks in flight. A key can be
    planned again before the stored event of its last store is converted (stored, evicted and
    stored again within one step): descriptions count their stores, so each stored event finds
    one (a key's tokens and parent never change, so one description serves every store).
    ``locality`` is set on events of ``STORAGE`` tiers (an event's own locality wins).
    Descriptions of announced blocks are kept for the last :data:`RECENT_DESCRIPTIONS` blocks,
    so a block that cascades to a further tier (host, then disk) is described there too.
    """

    def __init__(self, int_block_hashes: bool = True, locality: str | None = None) -> None:
        self._as_int = int_block_hashes
        self._locality = locality
        self._pending: dict[OffloadKey, _BlockDescription] = {}
        self._recent: dict[OffloadKey, _BlockDescription] = {}

    def record(
        self, key: OffloadKey, parent: BlockHash | None, token_ids: list[int], block_size: int
    ) -> None:
        """Describe block ``key`` (its tokens and its parent's hash) before it is stored."""
        desc = self._pending.get(key)
        if desc is None:
            self._pending[key] = _BlockDescription(parent, token_ids, block_size)
        else:
            desc.stores += 1

    def record_request_blocks(
        self, state: RequestKVState, keys: Sequence[OffloadKey], located: Sequence[tuple[int, int]]
    ) -> None:
        """Describe the request's blocks ``keys`` before they are stored; ``located[i]`` is
        ``keys[i]``'s ``(group, offloaded block index)``. The parent of block ``i`` of a group
        is its block ``i - 1``."""
        for key, (g, block) in zip(keys, located, strict=True):
            parent, token_ids, block_size = _what_block_holds(state, g, block)
            self.record(key, parent, token_ids, block_size)

    def remember_request_blocks(self, state: RequestKVState, first_token: int) -> None:
        """Describe the request's blocks from token ``first_token`` on for stored events that no
        planned store describes: blocks a tiering manager promotes into the host tier because
        this request's lookup met them on a secondary tier (it answered ``RETRY``). Kept with
        the recent descriptions (bounded); a block already described there is skipped."""
        recent, groups = self._recent, state.config.groups
        for g, group_state in enumerate(state.group_states):
            keys = group_state.offload_keys
            for block in range(first_token // groups[g].offloaded_block_size, len(keys)):
                key = keys[block]
                if key not in recent:
                    self._keep_recent(key, _BlockDescription(*_what_block_holds(state, g, block)))

    def forget(self, keys: Sequence[OffloadKey]) -> None:
        """Drop descriptions of blocks whose store will never be announced."""
        for key in keys:
            self._take(key)

    def _take(self, key: OffloadKey) -> _BlockDescription | None:
        """One store's use of ``key``'s description (None if none is recorded)."""
        desc = self._pending.get(key)
        if desc is not None:
            desc.stores -= 1
            if desc.stores == 0:
                del self._pending[key]
        return desc

    def clear(self) -> None:
        self._pending.clear()
        self._recent.clear()

    def _describe(self, key: OffloadKey) -> _BlockDescription | None:
        """A stored event's description of ``key``: one planned store's, else a recent one's."""
        desc = self._take(key)
        if desc is None:
            return self._recent.get(key)
        self._keep_recent(key, desc)
        return desc

    def _keep_recent(self, key: OffloadKey, desc: _BlockDescription) -> None:
        recent = self._recent
        recent[key] = desc
        if len(recent) > RECENT_DESCRIPTIONS:
            del recent[next(iter(recent))]

    def convert(self, events: Sequence[OffloadingEvent]) -> list[BlockStored | BlockRemoved]:
        """One ``BlockRemoved`` per group per removal event; one ``BlockStored`` per run of
        consecutive blocks (each block's parent is the previous block) per stored event."""
        out: list[BlockStored | BlockRemoved] = []
        ext, as_int = external_block_hash, self._as_int
        for event in events:
            locality = event.locality or self._locality
            if event.removed:
                by_group: dict[int, list[bytes | int]] = {}
                for key in event.keys:
                    by_group.setdefault(offload_key_group(key), []).append(
                        ext(offload_key_hash(key), as_int)
                    )
                for group, hashes in by_group.items():
                    out.append(
                        BlockRemoved(hashes, event.medium, group_idx=group, locality=locality)
                    )
                continue
            run: BlockStored | None = None
            run_last: BlockHash | None = None
            run_group = -1
            for key in event.keys:
                desc = self._describe(key)
                h, group = offload_key_hash(key), offload_key_group(key)
                if desc is None:  # not planned by this connector: announce what we know
                    desc = _BlockDescription(None, [], 0)
                extends = (
                    run is not None
                    and group == run_group
                    and desc.parent == run_last
                    and desc.block_size == run.block_size
                    and desc.token_ids
                )
                if extends and run is not None:
                    run.block_hashes.append(ext(h, as_int))
                    run.token_ids.extend(desc.token_ids)
                else:
                    run = BlockStored(
                        block_hashes=[ext(h, as_int)],
                        parent_block_hash=None if desc.parent is None else ext(desc.parent, as_int),
                        token_ids=list(desc.token_ids),
                        block_size=desc.block_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        group_idx=group,
                        locality=locality,
                    )
                    out.append(run)
                run_last, run_group = h, group
        return out
