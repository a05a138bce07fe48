"""vLLM's paged KV tensors seen as blocks of opaque bytes.

A stored block is the concatenation, over this rank's attention layers in name
order, of the layer's page for that block. Where every page is one contiguous range
of host memory, stores read and write the pages in place (:meth:`PagedKV.block_pages`);
otherwise pages are copied whole through staging rows with ``index_select`` /
``index_copy_`` along the block dimension. Either way no code here knows where K, V
or tokens are inside a page.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


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
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

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

    def layer(self, name: str) -> LayerPages | None:
        """Return a layer by name, or None for layers without their own pages."""
        return self._by_name.get(name)

    def gather(self, layer: LayerPages, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the layer's pages of ``block_ids`` into rows of ``out``.

        Args:
            layer: The layer to copy from.
            block_ids: Block indices (int64, on the KV tensor's device).
            out: ``[len(block_ids), block_bytes]`` uint8 staging rows.
        """
        tensor, dim, count = layer.tensor, layer.block_dim, len(block_ids)
        pages = self._pages(layer, count)
        torch.index_select(tensor, dim, block_ids, out=pages.movedim(0, dim))
        flat = pages.view(count, -1).view(torch.uint8)
        out[:, layer.offset : layer.offset + layer.page_bytes].copy_(flat)

    def scatter(self, layer: LayerPages, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy rows of ``rows`` into the layer's pages of ``block_ids``.

        Args:
            layer: The layer to copy into.
            block_ids: Block indices (int64, on the KV tensor's device).
            rows: ``[len(block_ids), block_bytes]`` uint8 staging rows.
        """
        count = len(block_ids)
        pages = self._pages(layer, count)
        source = rows[:, layer.offset : layer.offset + layer.page_bytes]
        pages.view(count, -1).view(torch.uint8).copy_(source, non_blocking=True)
        layer.tensor.index_copy_(layer.block_dim, block_ids, pages.movedim(0, layer.block_dim))

    def _pages(self, layer: LayerPages, count: int) -> torch.Tensor:
        """Return reusable ``[count, *page shape]`` scratch memory for the layer's pages.

        Reusing it avoids faulting fresh pages in on every step.
        """
        tensor = layer.tensor
        shape = [size for dim, size in enumerate(tensor.shape) if dim != layer.block_dim]
        numel = count * layer.page_bytes // tensor.element_size()
        key = (tensor.dtype, tensor.device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < numel:
            scratch = torch.empty(numel, dtype=tensor.dtype, device=tensor.device)
            self._scratch[key] = scratch
        return scratch[:numel].view(count, *shape)


class StagingPool:
    """Reusable host staging tensors (pinned when the KV is on a GPU).

    A step's loads return theirs at once; a step's saves keep theirs until their
    background writes finish. Reusing tensors avoids faulting in fresh pages (or
    pinning them) each step. Each request gets the smallest free tensor that fits, and
    free tensors beyond twice the largest one ever handed out are dropped, smallest
    first, so the pool stays near the largest step's needs however steps vary.
    """

    def __init__(self, block_bytes: int, pin: bool) -> None:
        self._block_bytes = block_bytes
        self._pin = pin
        self._free: list[torch.Tensor] = []
        self._largest = 0  # Rows of the largest tensor handed out so far.
        self._lock = threading.Lock()

    def acquire(self, count: int) -> torch.Tensor:
        """Return a uint8 tensor of at least ``count`` rows of ``block_bytes``.

        Nobody else uses it until it is given back with :meth:`release`.
        """
        with self._lock:
            fits = [i for i, tensor in enumerate(self._free) if tensor.shape[0] >= count]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
            self._largest = max(self._largest, count)
        return torch.empty((count, self._block_bytes), dtype=torch.uint8, pin_memory=self._pin)

    def release(self, tensor: torch.Tensor) -> None:
        """Give back a tensor from :meth:`acquire` (callable from any thread)."""
        with self._lock:
            self._free.append(tensor)
            self._free.sort(key=lambda kept: kept.shape[0])
            while sum(kept.shape[0] for kept in self._free) > 2 * self._largest:
                del self._free[0]

    def free_rows(self) -> int:
        """Return the rows the pool keeps for reuse."""
        with self._lock:
            return sum(tensor.shape[0] for tensor in self._free)


def row_payloads(rows: torch.Tensor) -> list[list[memoryview]]:
    """Return each row of a contiguous host uint8 tensor as a one-segment payload."""
    array = rows.numpy()
    return [[memoryview(array[index])] for index in range(array.shape[0])]


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
