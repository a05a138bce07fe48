"""vLLM's paged KV tensors seen as blocks of opaque bytes.

A stored block is the concatenation, over this rank's attention layers in name
order, of the layer's page for that block. Where every page is one contiguous range
of host memory, stores read and write the pages in place (:meth:`PagedKV.block_pages`);
otherwise pages are copied whole, one layer at a time, between the KV tensors and
staging memory with ``index_select`` / ``index_copy_`` along the block dimension.
Staging memory holds a batch of blocks layer by layer, so that each layer's pages move
between device and host in one contiguous, asynchronous copy. Either way no code here
knows where K, V or tokens are inside a page.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ucm.transfer.streams import COMPLETE, CopyEvent


@dataclass(frozen=True)
class LayerPages:
    """Where one layer's pages live and where they go inside a stored block."""

    name: str
    """The attention layer's name."""
    tensor: torch.Tensor
    """The layer's KV cache tensor (a view into vLLM's allocation)."""
    block_dim: int
    """The dimension of ``tensor`` that indexes blocks."""
    offset: int
    """Byte offset of this layer's page inside a stored block."""
    page_bytes: int
    """Bytes of one block of this layer."""


def find_block_dim(tensor: torch.Tensor, backend: object | None, num_blocks: int | None) -> int:
    """Find the dimension of a layer's KV tensor that indexes blocks.

    Args:
        tensor: The layer's KV cache tensor.
        backend: The layer's attention backend class, if known.
        num_blocks: The number of blocks vLLM allocated, if known.

    Returns:
        The block dimension.

    Raises:
        ValueError: No method identifies the block dimension unambiguously.
    """
    if backend is not None and hasattr(backend, "supported_kv_cache_layouts"):
        return 0  # vLLM >= 0.32 hands out logical [blocks, heads, tokens, content] views.
    shape_of = getattr(backend, "get_kv_cache_shape", None)
    if shape_of is not None and tensor.dim() >= 2:
        try:
            first = tuple(shape_of(2, 16, 1, 64))
            second = tuple(shape_of(3, 16, 1, 64))
        except (TypeError, ValueError, AssertionError, NotImplementedError):
            first = second = ()
        changed = [d for d, (a, b) in enumerate(zip(first, second, strict=False)) if a != b]
        if len(first) == tensor.dim() and len(changed) == 1:
            return changed[0]
    if num_blocks is not None:
        matches = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
        if len(matches) == 1:
            return matches[0]
    raise ValueError(
        f"ucm: cannot find the block dimension of a KV tensor of shape {tuple(tensor.shape)} "
        f"(attention backend {backend!r})"
    )


class PagedKV:
    """The KV tensors of one worker rank, addressed by block."""

    def __init__(self, layers: Sequence[tuple[str, torch.Tensor, int]]) -> None:
        """Lay the layers out inside a stored block.

        Args:
            layers: ``(name, tensor, block_dim)`` per attention layer; layers that
                share one tensor are stored once.
        """
        pages: list[LayerPages] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        offset = 0
        for name, tensor, block_dim in sorted(layers, key=lambda item: item[0]):
            identity = (tensor.data_ptr(), tuple(tensor.shape))
            if identity in seen:
                continue
            seen.add(identity)
            page_bytes = tensor.numel() // tensor.shape[block_dim] * tensor.element_size()
            pages.append(LayerPages(name, tensor, block_dim, offset, page_bytes))
            offset += page_bytes
        if not pages:
            raise ValueError("ucm: no KV cache tensors to transfer")
        self.layers: tuple[LayerPages, ...] = tuple(pages)
        """The layers, in the order their pages appear inside a block."""
        self.block_bytes = offset
        """Bytes of one stored block (all layers of this rank)."""
        self.device = pages[0].tensor.device
        """The device the KV tensors live on."""
        self._page_rows = _page_rows(pages) if self.device.type == "cpu" else None
        self._by_name: Mapping[str, LayerPages] = {page.name: page for page in pages}
        self._scratches: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        # The last indices made into a tensor: a step copies every layer with the same.
        self._last_index: tuple[tuple[int, ...], torch.Tensor] | None = None

    @property
    def in_place(self) -> bool:
        """Whether :meth:`block_pages` can give stores the pages themselves."""
        return self._page_rows is not None

    def block_pages(self, block_ids: Sequence[int]) -> list[list[memoryview]]:
        """Return, per block, its pages in every layer as writable views of the KV memory.

        The concatenation of a block's views is the stored block, so a store reads
        into or writes from vLLM's KV cache directly. Only valid where :attr:`in_place`.
        """
        assert self._page_rows is not None, "pages are not contiguous host memory"
        rows = self._page_rows
        return [
            [memory[block * stride : block * stride + size] for memory, stride, size in rows]
            for block in block_ids
        ]

    def staged_layer(self, layer: LayerPages, rows: torch.Tensor, count: int) -> torch.Tensor:
        """Return the layer's pages of ``count`` staged blocks, ``[count, page_bytes]`` uint8.

        Staging memory holds blocks layer by layer: first every block's page of the first
        layer, then of the second, and so on, so that one layer's pages are one contiguous
        range that a single (asynchronous) copy moves between device and host.

        Args:
            layer: The layer.
            rows: Staging memory from :class:`StagingPool` (at least ``count`` blocks).
            count: The number of blocks staged in it.
        """
        start = count * layer.offset
        return rows.view(-1)[start : start + count * layer.page_bytes].view(count, -1)

    def staged_payloads(self, rows: torch.Tensor, count: int) -> list[list[memoryview]]:
        """Return, per staged block, its pages in every layer as views of staging memory.

        The concatenation of a block's views is the stored block (as with
        :meth:`block_pages`), so stores read into and write from staging memory directly.
        """
        arrays = [self.staged_layer(layer, rows, count).numpy() for layer in self.layers]
        return [[memoryview(array[index]) for array in arrays] for index in range(count)]

    def layer(self, name: str) -> LayerPages | None:
        """Return a layer by name, or None for layers without their own pages."""
        return self._by_name.get(name)

    def gather(
        self, layer: LayerPages, block_ids: Sequence[int], rows: torch.Tensor, count: int
    ) -> None:
        """Copy the layer's pages of ``block_ids`` into staging memory.

        On an accelerator the copy to the host is asynchronous (issue it on a copy
        stream, and wait for an event recorded after it before reading ``rows``).

        Args:
            layer: The layer to copy from.
            block_ids: The blocks, ``count`` of them, in staging order.
            rows: Staging memory from :class:`StagingPool`, pinned on an accelerator.
            count: The number of blocks staged in ``rows``.
        """
        staged = self.staged_layer(layer, rows, count)
        index = self._index(block_ids)
        if self.device.type == "cpu":
            pages = self._as_pages(layer, staged)
            torch.index_select(layer.tensor, layer.block_dim, index, out=pages)
            return
        scratch = self._scratch(layer, count)
        torch.index_select(layer.tensor, layer.block_dim, index, out=self._as_pages(layer, scratch))
        staged.copy_(scratch.view(torch.uint8), non_blocking=True)

    def scatter(
        self,
        layer: LayerPages,
        block_ids: Sequence[int],
        rows: torch.Tensor,
        count: int,
        positions: Sequence[int] | None = None,
    ) -> None:
        """Copy staged pages into the layer's pages of ``block_ids``.

        On an accelerator the copy from the host is asynchronous (issue it on a copy
        stream, and release ``rows`` with an event recorded after it).

        Args:
            layer: The layer to copy into.
            block_ids: The blocks to write, one per staged block copied.
            rows: Staging memory from :class:`StagingPool` holding ``count`` blocks.
            count: The number of blocks staged in ``rows``.
            positions: Which staged blocks to copy, in the order of ``block_ids``;
                None copies all of them.
        """
        staged = self.staged_layer(layer, rows, count)
        if self.device.type == "cpu":
            pages = self._as_pages(layer, staged)
        else:
            scratch = self._scratch(layer, count)
            scratch.view(torch.uint8).copy_(staged, non_blocking=True)
            pages = self._as_pages(layer, scratch)
        if positions is not None:
            pages = pages.index_select(layer.block_dim, self._index(positions))
        layer.tensor.index_copy_(layer.block_dim, self._index(block_ids), pages)

    def _index(self, indices: Sequence[int]) -> torch.Tensor:
        """Return indices as an int64 tensor on the KV device; on an accelerator they go
        through pinned memory and are copied without a host wait, on the current stream
        (the copy stream: only copies issued there use the tensor, so it can be reused)."""
        key = tuple(indices)
        if self._last_index is not None and self._last_index[0] == key:
            return self._last_index[1]
        index = torch.tensor(key, dtype=torch.int64)
        if self.device.type != "cpu":
            index = index.pin_memory().to(self.device, non_blocking=True)
        self._last_index = (key, index)
        return index

    def _as_pages(self, layer: LayerPages, data: torch.Tensor) -> torch.Tensor:
        """View contiguous ``[count, ...]`` memory as ``count`` pages of the layer, with the
        block dimension where the layer's tensor has it."""
        tensor = layer.tensor
        shape = [size for dim, size in enumerate(tensor.shape) if dim != layer.block_dim]
        pages = data.view(tensor.dtype).view(data.shape[0], *shape)
        return pages.movedim(0, layer.block_dim)

    def _scratch(self, layer: LayerPages, count: int) -> torch.Tensor:
        """Return reusable device memory for ``count`` of the layer's pages, ``[count, n]``
        of the layer's dtype. Only the copy stream uses it, so its reuse is ordered."""
        tensor = layer.tensor
        numel = count * layer.page_bytes // tensor.element_size()
        key = (tensor.dtype, tensor.device)
        scratch = self._scratches.get(key)
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(numel, dtype=tensor.dtype, device=tensor.device)
            self._scratches[key] = scratch
        return scratch[:numel].view(count, -1)


class StagingPool:
    """Reusable host staging memory (pinned when the KV is on an accelerator).

    A step's loads return theirs once their copies into the pages have run; a step's
    saves keep theirs until their background writes finish. Reusing memory avoids
    faulting in fresh pages (or pinning them) each step. Each request gets the smallest
    free tensor that fits, and free tensors beyond twice the largest one ever handed out
    are dropped, smallest first, so the pool stays near the largest step's needs however
    steps vary.
    """

    def __init__(self, block_bytes: int, pin: bool) -> None:
        self._block_bytes = block_bytes
        self._pin = pin
        self._free: list[tuple[torch.Tensor, CopyEvent]] = []
        self._largest = 0  # Rows of the largest tensor handed out so far.
        self._lock = threading.Lock()

    def acquire(self, count: int) -> torch.Tensor:
        """Return a uint8 tensor of at least ``count`` rows of ``block_bytes``.

        Nobody else uses it until it is given back with :meth:`release`; a tensor given
        back with an event is handed out only once that event is reached.
        """
        with self._lock:
            fits = [i for i, (tensor, _) in enumerate(self._free) if tensor.shape[0] >= count]
            if fits:
                tensor, released = self._free.pop(
                    min(fits, key=lambda i: self._free[i][0].shape[0])
                )
            else:
                self._largest = max(self._largest, count)
                released = None
        if released is None:
            return torch.empty((count, self._block_bytes), dtype=torch.uint8, pin_memory=self._pin)
        released.synchronize()  # The copy stream may still copy out of or into it.
        return tensor

    def release(self, tensor: torch.Tensor, after: CopyEvent = COMPLETE) -> None:
        """Give back a tensor from :meth:`acquire` (callable from any thread).

        Args:
            tensor: The tensor.
            after: An event after the last copy that uses the tensor, for copies still
                queued on a copy stream.
        """
        with self._lock:
            self._free.append((tensor, after))
            self._free.sort(key=lambda kept: kept[0].shape[0])
            while sum(kept.shape[0] for kept, _ in self._free) > 2 * self._largest:
                del self._free[0]

    def free_rows(self) -> int:
        """Return the rows the pool keeps for reuse."""
        with self._lock:
            return sum(tensor.shape[0] for tensor, _ in self._free)


def _page_rows(pages: Sequence[LayerPages]) -> list[tuple[memoryview, int, int]] | None:
    """Return, per layer, a writable byte view of its memory from block 0 on, the byte
    stride between blocks and the page size; None unless every page of every layer
    is one contiguous range of memory."""
    rows = []
    for layer in pages:
        tensor, dim = layer.tensor, layer.block_dim
        if not tensor.select(dim, 0).is_contiguous() or tensor.stride(dim) <= 0:
            return None
        page = tensor.numel() // tensor.shape[dim]
        span = (tensor.shape[dim] - 1) * tensor.stride(dim) + page
        flat = torch.as_strided(tensor, (span,), (1,), tensor.storage_offset())
        memory = flat.view(torch.uint8).numpy().data
        rows.append((memory, tensor.stride(dim) * tensor.element_size(), layer.page_bytes))
    return rows
