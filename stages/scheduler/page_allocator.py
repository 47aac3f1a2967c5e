"""KV page accounting: reference-counted fixed-size pages and the prefix cache over them. Plain CPU code;
the scheduler owns it and the worker only ever sees page ids.

A full page of prompt tokens whose KV is written may be cached under its chain hash (`prefix_cache.py`:
the adapter, its load generation and every token up to the end of the page). A cached page stays where
it is once no request references it, and is reused only when an allocation finds no uncached free page:
then the least recently released goes first (LRU). A referenced page is never handed out or uncached
into another owner's hands, so what a running request reads stays as it was written."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class OutOfPages(RuntimeError):
    pass


@dataclass
class PrefixStats:
    """Counters since the allocator was made (the scheduler exports their growth)."""

    queries: int = 0  # prompt tokens of admitted requests looked up in the cache
    hits: int = 0  # of those, tokens whose KV came from cached pages
    evictions: int = 0  # cached pages given to other content


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # unreferenced, uncached; pop() gives low ids first
        self._refs = [0] * num_pages  # running requests holding each page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self._page_of: dict[bytes, int] = {}  # chain hash -> the cached page holding that KV
        self._hash_of: dict[int, bytes] = {}
        self._owner: dict[int, str] = {}  # cached page -> its adapter (absent: base model)
        self._pages_of: dict[str, set[int]] = {}  # adapter -> its cached pages
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and unreferenced cached ones (evicted on demand), so
        the cache never holds back a page a request needs."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Pages referenced by requests."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages that hold a cached prefix (referenced or not)."""
        return len(self._hash_of)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return (num_tokens + self.page_size - 1) // self.page_size

    def allocate(self, n: int) -> list[int]:
        """`n` pages for new content, each with one reference: free pages first, then the least
        recently released cached ones (their hash is dropped)."""
        if n > self.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                self._forget(page)
                self.stats.evictions += 1
            self._refs[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page. A cached page left unreferenced becomes evictable; pages
        are released tail first, so a prefix's later pages are evicted before its earlier ones."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"KV page {page} freed more often than it was taken")
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # --- the prefix cache --------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (a request's chain); takes nothing."""
        out = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            out.append(page)
        return out

    def unreferenced(self, pages: list[int]) -> int:
        """How many of `pages` no request holds (taking them uses up free room)."""
        return sum(1 for p in pages if not self._refs[p])

    def acquire(self, pages: list[int]) -> None:
        """Take a reference to each cached page of a hit."""
        for page in pages:
            if page not in self._hash_of:
                raise RuntimeError(f"KV page {page} is not cached")
            if not self._refs[page]:
                del self._evictable[page]
            self._refs[page] += 1

    def insert(self, h: bytes, page: int, adapter: str | None) -> None:
        """Cache the KV a request wrote into `page` (it holds a reference) under chain hash `h`. The
        first page cached under a hash keeps it; a later copy of the same prefix stays uncached."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"KV page {page} is cached by no request holding it")
        if h in self._page_of or page in self._hash_of:
            return
        self._page_of[h] = page
        self._hash_of[page] = h
        if adapter is not None:
            self._owner[page] = adapter
            self._pages_of.setdefault(adapter, set()).add(page)

    def uncache(self, page: int) -> None:
        """Drop `page` from the cache (its KV may be wrong or stale); its holders keep it until they
        release it, and no later request finds it."""
        if page not in self._hash_of:
            return
        self._forget(page)
        if not self._refs[page]:
            del self._evictable[page]
            self._free.append(page)

    def drop_adapter(self, adapter: str) -> int:
        """Uncache every page of `adapter` (unloaded or replaced); returns how many."""
        pages = self._pages_of.pop(adapter, set())
        for page in pages:
            self.uncache(page)
        return len(pages)

    def _forget(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        adapter = self._owner.pop(page, None)
        if adapter is not None:
            owned = self._pages_of.get(adapter)
            if owned is not None:
                owned.discard(page)
                if not owned:
                    del self._pages_of[adapter]
