"""The paged KV pool and its reference-counted page allocator."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of the pool: what one token costs and how many pages fit the budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def pages_for_budget(self, budget_bytes: int) -> int:
        return budget_bytes // (self.bytes_per_token * self.page_size)


class KVPool:
    """One preallocated K and V tensor per layer, addressed by slot = page * page_size + offset."""

    def __init__(self, layout: KVLayout, num_pages: int, device: torch.device):
        self.layout = layout
        self.num_pages = num_pages
        shape = (layout.num_layers, num_pages * layout.page_size, layout.num_kv_heads, layout.head_dim)
        # empty, not zeros: the OS maps untouched pages lazily, so start-up stays fast.
        self.k = torch.empty(shape, dtype=layout.dtype, device=device)
        self.v = torch.empty(shape, dtype=layout.dtype, device=device)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    def copy_page(self, src: int, dst: int) -> None:
        """Duplicate one page in every layer (copy-on-write of a shared partial page)."""
        size = self.layout.page_size
        for cache in (self.k, self.v):
            cache[:, dst * size : (dst + 1) * size] = cache[:, src * size : (src + 1) * size]


class PageAllocator:
    """Hands out pages and takes them back when their last reference is dropped."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, count: int) -> list[int]:
        """Take `count` fresh pages, each with one reference; raises if too few are free."""
        if count > len(self.free_pages):
            raise MemoryError(f"asked for {count} KV pages, {len(self.free_pages)} free")
        pages = [self.free_pages.popleft() for _ in range(count)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add one reference to pages that are already in use."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"sharing free page {page}"
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference from each page; a page whose count reaches zero is free again."""
        for page in pages:
            assert self.ref_counts[page] > 0, f"double free of page {page}"
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free_pages.append(page)


class PageTableManager:
    """Keeps each sequence's page table in step with how many tokens it needs KV for."""

    def __init__(self, pool: KVPool, allocator: PageAllocator):
        self.pool = pool
        self.allocator = allocator
        self.page_size = pool.layout.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def missing_pages(self, seq, num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(seq.page_table))

    def can_grow(self, seq, num_tokens: int) -> bool:
        return self.missing_pages(seq, num_tokens) <= self.allocator.num_free

    def grow(self, seq, num_tokens: int) -> None:
        """Give `seq` enough pages to hold KV for its first `num_tokens` tokens."""
        seq.page_table += self.allocator.allocate(self.missing_pages(seq, num_tokens))

    def release(self, seq) -> None:
        self.allocator.release(seq.page_table)
        seq.page_table = []

    def share_prefix(self, seq, source, num_tokens: int) -> None:
        """Reuse `source`'s KV for the first `num_tokens` tokens: full pages are shared, and
        a trailing partial page is copied, because `seq` will write its own tokens there."""
        full, partial = divmod(num_tokens, self.page_size)
        seq.page_table = source.page_table[:full]
        self.allocator.share(seq.page_table)
        if partial:
            (page,) = self.allocator.allocate(1)
            self.pool.copy_page(source.page_table[full], page)
            seq.page_table.append(page)
        seq.num_computed = num_tokens
