"""Whole-page gather/scatter between paged KV tensors and staging rows, any layout."""

from __future__ import annotations

import pytest
import torch

from ucm.testing.streams import LaggingStream
from ucm.transfer.paged import PagedKV, StagingPool, find_block_dim

LAYOUTS = {
    "cpu [blocks, heads, tokens, 2*head]": (0, lambda: torch.randn(64, 4, 32, 16)),
    "flash [2, blocks, tokens, heads, head]": (1, lambda: torch.randn(2, 64, 32, 4, 8)),
    "strided view of a permuted allocation": (
        0,
        lambda: torch.randn(32, 64, 4, 16).transpose(0, 1),
    ),
    "bf16 pages": (0, lambda: torch.randn(64, 2, 32, 8).to(torch.bfloat16)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_copies_exactly_the_chosen_blocks(layout: str) -> None:
    dim, make = LAYOUTS[layout]
    torch.manual_seed(0)
    source = PagedKV([("layer.0", make(), dim), ("layer.1", make(), dim)])
    target = PagedKV([(f"layer.{i}", torch.zeros_like(make()), dim) for i in range(2)])
    ids = [5, 3, 17, 40]
    rows = StagingPool(source.block_bytes, pin=False).acquire(len(ids))
    for layer in source.layers:
        source.gather(layer, ids, rows, len(ids))
    for layer in target.layers:
        target.scatter(layer, ids, rows, len(ids))
    index = torch.tensor(ids)
    rest = torch.tensor([i for i in range(64) if i not in ids])
    for src, dst in zip(source.layers, target.layers, strict=True):
        assert torch.equal(dst.tensor.index_select(dim, index), src.tensor.index_select(dim, index))
        assert not dst.tensor.index_select(dim, rest).any()
    payloads = source.staged_payloads(rows, len(ids))
    assert all(sum(page.nbytes for page in pages) == source.block_bytes for pages in payloads)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_blocks_are_the_stored_blocks_layer_by_layer(layout: str) -> None:
    dim, make = LAYOUTS[layout]
    torch.manual_seed(0)
    paged = PagedKV([("layer.0", make(), dim), ("layer.1", make(), dim)])
    ids = [9, 2, 63]
    rows = torch.empty((8, paged.block_bytes), dtype=torch.uint8)  # More rows than used.
    for layer in paged.layers:
        paged.gather(layer, ids, rows, len(ids))
    staged = [b"".join(pages) for pages in paged.staged_payloads(rows, len(ids))]
    for block, stored in zip(ids, staged, strict=True):
        pages = [layer.tensor.select(dim, block).contiguous() for layer in paged.layers]
        assert stored == b"".join(bytes(page.view(-1).view(torch.uint8).numpy()) for page in pages)
    # Each layer's pages of the batch are one contiguous range (one copy to a device).
    first = paged.staged_layer(paged.layers[0], rows, len(ids))
    second = paged.staged_layer(paged.layers[1], rows, len(ids))
    assert first.is_contiguous() and second.is_contiguous()
    assert second.data_ptr() == first.data_ptr() + first.numel()


def test_scatter_copies_only_the_chosen_positions() -> None:
    torch.manual_seed(0)
    source = PagedKV([("layer.0", torch.randn(16, 2, 32, 8), 0)])
    target = PagedKV([("layer.0", torch.zeros(16, 2, 32, 8), 0)])
    rows = torch.empty((3, source.block_bytes), dtype=torch.uint8)
    source.gather(source.layers[0], [4, 5, 6], rows, 3)
    target.scatter(target.layers[0], [11, 12], rows, 3, positions=[2, 0])  # 5 failed.
    kv, loaded = source.layers[0].tensor, target.layers[0].tensor
    assert torch.equal(loaded[11], kv[6]) and torch.equal(loaded[12], kv[4])
    assert not loaded[[i for i in range(16) if i not in (11, 12)]].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_pages_are_the_stored_block_in_place(layout: str) -> None:
    dim, make = LAYOUTS[layout]
    torch.manual_seed(0)
    paged = PagedKV([("layer.0", make(), dim), ("layer.1", make(), dim)])
    contiguous = all(layer.tensor.select(dim, 0).is_contiguous() for layer in paged.layers)
    assert paged.in_place == contiguous
    if not paged.in_place:
        return
    ids = [9, 2, 63]
    rows = torch.empty((len(ids), paged.block_bytes), dtype=torch.uint8)
    for layer in paged.layers:
        paged.gather(layer, ids, rows, len(ids))
    pages = paged.block_pages(ids)
    staged = paged.staged_payloads(rows, len(ids))
    assert [b"".join(block) for block in pages] == [b"".join(block) for block in staged]
    before = [layer.tensor.clone() for layer in paged.layers]
    for segment in pages[0]:
        segment[:] = bytes(segment.nbytes)  # Writing a page writes the KV tensor.
    rest = torch.tensor([i for i in range(64) if i != 9])
    for layer, old in zip(paged.layers, before, strict=True):
        assert not layer.tensor.select(dim, 9).any()
        assert layer.tensor.index_select(dim, rest).equal(old.index_select(dim, rest))


def test_layers_sharing_one_tensor_are_stored_once() -> None:
    shared = torch.randn(8, 2, 32, 4)
    paged = PagedKV([("a", shared, 0), ("b", shared, 0), ("c", torch.randn(8, 2, 32, 4), 0)])
    assert [layer.name for layer in paged.layers] == ["a", "c"]
    assert paged.block_bytes == 2 * 2 * 32 * 4 * 4


class _LegacyBackend:
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class _LayoutAwareBackend:
    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[str, ...]:
        return ("LBHNC",)


def test_block_dimension_comes_from_the_backend_or_the_block_count() -> None:
    tensor = torch.empty(2, 10, 16, 1, 64)
    assert find_block_dim(tensor, _LegacyBackend, None) == 1
    assert find_block_dim(torch.empty(10, 2, 16, 64), _LayoutAwareBackend, None) == 0
    assert find_block_dim(torch.empty(3, 10, 7), None, num_blocks=10) == 1
    with pytest.raises(ValueError, match="block dimension"):
        find_block_dim(torch.empty(10, 10), None, num_blocks=10)


def test_staging_pool_reuses_released_tensors() -> None:
    pool = StagingPool(block_bytes=64, pin=False)
    first = pool.acquire(4)
    assert tuple(first.shape) == (4, 64)
    assert pool.acquire(2) is not first  # Still in use: a new tensor.
    pool.release(first)
    assert pool.acquire(3) is first  # Large enough: reused, no fresh pages.
    assert tuple(pool.acquire(8).shape) == (8, 64)


def test_staging_pool_hands_out_the_smallest_fit_and_stays_bounded() -> None:
    pool = StagingPool(block_bytes=16, pin=False)
    small, large = pool.acquire(2), pool.acquire(10)
    pool.release(large)
    pool.release(small)
    assert pool.acquire(2) is small  # Not the large one, which a large step needs next.
    assert pool.acquire(9) is large
    # Steps that each need a few more rows than any free tensor has: without a bound
    # the pool would keep every one of them.
    held = [pool.acquire(count) for count in range(1, 11)]
    for tensor in held:
        pool.release(tensor)
    assert pool.free_rows() <= 2 * 10
    assert pool.acquire(10).shape[0] == 10


def test_staging_pool_hands_out_a_tensor_only_after_its_copies_ran() -> None:
    pool = StagingPool(block_bytes=8, pin=False)
    stream = LaggingStream()
    rows = pool.acquire(2).zero_()
    stream.run(lambda: rows.fill_(7))  # A copy into the rows, still queued.
    pool.release(rows, stream.record())
    assert not rows.any()
    again = pool.acquire(2)
    assert again is rows and bool((again == 7).all())  # The queued copy ran first.
