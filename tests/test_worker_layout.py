"""KVCacheLayout: page views for every supported KV cache shape, and clear errors for the rest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from worker_cases import DEVICES, LAYOUTS, make_cache

from kvoffload.errors import ConfigError
from kvoffload.worker import KVCacheLayout

PAGE = (
    2 * 4 * 2 * 8 * 2
)  # K/V x tokens x heads x dim x bf16 bytes, one layer's block in worker_cases


def layout_of(cache, factor=1, **kw):
    return KVCacheLayout.from_kv_caches(
        cache.tensors, factor, kw.pop("num_blocks", cache.num_blocks), cache.group_tensors, **kw
    )


@pytest.mark.parametrize(
    ("layout", "pages_per_group"),
    [
        ("per_layer", [[PAGE] * 3]),
        ("kv_split", [[PAGE // 2] * 6]),
        ("cross_layer", [[3 * PAGE]]),
        ("layer_views_of_cross", [[3 * PAGE]]),  # three per-layer views merged into one
        ("kv_split_block_outer", [[PAGE] * 3]),  # K and V of a block are adjacent: one page
        ("two_groups", [[PAGE, PAGE], [PAGE // 4, PAGE // 4]]),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_page_views_of_each_layout(layout, pages_per_group, device):
    cache = make_cache(layout, device)
    kv = layout_of(cache, factor=4)
    assert [[v.page_bytes for v in g.views] for g in kv.groups] == pages_per_group
    for group, pages in zip(kv.groups, pages_per_group, strict=True):
        assert all(v.pages.shape == (cache.num_blocks, v.page_bytes) for v in group.views)
        assert group.bytes_per_offloaded_block == 4 * sum(pages)
        assert list(group.slot_offsets) == [4 * sum(pages[:i]) for i in range(len(pages))]
    assert kv.slot_bytes == max(4 * sum(p) for p in pages_per_group)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_views_alias_every_byte_of_each_block(layout):
    """Writing engine block b through the page views changes exactly block b of every tensor."""
    cache = make_cache(layout)
    kv = layout_of(cache)
    for group in kv.groups:
        for view in group.views:
            view.pages[5].fill_(0xFF)
    for t in range(len(cache.tensors)):
        assert torch.all(cache.page(t, 5) == 0xFF)
        assert torch.all(cache.page(t, 4) == 0) and torch.all(cache.page(t, 6) == 0)


def test_aliases_are_kept_once():
    cache = make_cache("per_layer")
    kv = KVCacheLayout.from_kv_caches([cache.tensors[0], cache.tensors[0], cache.tensors[1]], 1)
    assert len(kv.groups[0].views) == 2


def test_mapping_input_keeps_names_in_errors():
    good = torch.zeros(8, 2, 4)
    with pytest.raises(ConfigError, match=r"layer\.1"):
        KVCacheLayout.from_kv_caches(
            {"layer.0": good, "layer.1": torch.zeros(8, 2, 4)[:, :, ::2]}, 1
        )


def test_num_blocks_is_inferred_when_unambiguous():
    assert layout_of(make_cache("per_layer"), num_blocks=None).num_blocks == 24
    assert layout_of(make_cache("cross_layer"), num_blocks=None).num_blocks == 24


def test_kv_split_needs_num_blocks():
    with pytest.raises(ConfigError, match=r"ambiguous.*pass num_blocks"):
        layout_of(make_cache("kv_split"), num_blocks=None)


def test_ambiguous_block_dim_is_rejected_unless_the_caller_names_it():
    cache = torch.arange(32, dtype=torch.float32).reshape(2, 2, 8)
    with pytest.raises(ConfigError, match=r"dim 0 and dim 1 could both.*pass block_dim"):
        KVCacheLayout.from_kv_caches([cache], 1, num_blocks=2)
    # Block dim 0: block 1 is cache[1] (one dense page); block dim 1: block 1 is cache[:, 1].
    (view,) = KVCacheLayout.from_kv_caches([cache], 1, num_blocks=2, block_dim=0).page_views
    assert torch.equal(view.pages[1].view(torch.float32), cache[1].flatten())
    pages = KVCacheLayout.from_kv_caches([cache], 1, num_blocks=2, block_dim=1).page_views
    assert [
        torch.equal(p.pages[1].view(torch.float32), cache[k, 1]) for k, p in enumerate(pages)
    ] == [
        True,
        True,
    ]
    with pytest.raises(ConfigError, match="dim 1 cannot hold 3 blocks"):
        KVCacheLayout.from_kv_caches([torch.zeros(3, 2, 8)], 1, num_blocks=3, block_dim=1)
    with pytest.raises(ConfigError, match="block_dim"):
        KVCacheLayout.from_kv_caches([cache], 1, num_blocks=2, block_dim=2)


def test_inconsistent_block_counts_are_rejected():
    with pytest.raises(ConfigError, match="agree on no block count"):
        KVCacheLayout.from_kv_caches([torch.zeros(8, 4), torch.zeros(9, 4)], 1)
    with pytest.raises(ConfigError, match="no block dim of size 8"):
        KVCacheLayout.from_kv_caches([torch.zeros(8, 4), torch.zeros(9, 4)], 1, num_blocks=8)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.zeros(8, 4, 6)[:, :, ::2],  # strided inside a page
        torch.zeros(8, 4, 6)[:, :, :3],  # pages with holes
        torch.zeros(1, 4).expand(8, 4),  # every block the same memory
        torch.zeros(4, 8).t(),  # blocks interleaved element by element
    ],
    ids=["strided", "holes", "expanded", "interleaved"],
)
def test_non_paged_tensors_are_rejected(tensor):
    with pytest.raises(ConfigError, match="kv_caches"):
        KVCacheLayout.from_kv_caches([tensor], 1, num_blocks=8)


def test_overlapping_tensors_are_rejected():
    cross = torch.zeros(8, 3, 16)
    with pytest.raises(ConfigError, match="overlap"):
        KVCacheLayout.from_kv_caches([cross, cross[:, 1]], 1)


def test_interleaved_views_of_one_storage_are_kept_apart():
    """Layers 0 and 2 of a cross-layer tensor: same stride, disjoint within each block."""
    cross = torch.zeros(8, 3, 16)
    kv = KVCacheLayout.from_kv_caches([cross[:, 0], cross[:, 2]], 1)
    assert [v.page_bytes for v in kv.groups[0].views] == [64, 64]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_caches": []}, "kv_caches"),
        ({"kv_caches": [torch.zeros(0, 4)]}, "kv_caches"),
        ({"kv_caches": [torch.tensor(1.0)]}, "kv_caches"),
        ({"kv_caches": [[1, 2]]}, "kv_caches"),
        ({"block_size_factor": 0}, "block_size_factor"),
        ({"block_size_factor": [1, 2]}, "block_size_factor"),  # one group
        ({"num_blocks": 0}, "num_blocks"),
        ({"group_tensors": []}, "group_tensors"),
        ({"group_tensors": [[0], []]}, "group_tensors"),
        ({"group_tensors": [[0, 2]]}, "group_tensors"),
        ({"group_tensors": [[0]]}, "group_tensors"),  # tensor 1 in no group
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    args: dict[str, Any] = {
        "kv_caches": [torch.zeros(8, 4), torch.zeros(8, 4)],
        "block_size_factor": 1,
        "num_blocks": 8,
        "group_tensors": None,
    }
    args.update(kwargs)
    with pytest.raises(ConfigError) as info:
        KVCacheLayout.from_kv_caches(**args)
    assert info.value.field == field


@pytest.mark.cuda
def test_tensors_on_two_devices_are_rejected():
    with pytest.raises(ConfigError, match="one device"):
        KVCacheLayout.from_kv_caches([torch.zeros(8, 4), torch.zeros(8, 4, device="cuda")], 1)
