"""The KV page pool: reference counts, and the prefix cache (vLLM V1 style).

A full page is identified by a key: a hash of (its parent page's key, its token ids),
so a key names the whole token prefix up to the page's end. Pages are shared by
reference count: the n children of a request share their prompt's full pages, a
prefix-cache hit shares the cached pages, a preempted sequence's pages stay cached
for its recompute to hit. One mechanism, one count.

A page whose count drops to 0 returns to the pool: if it holds a cached key it stays
findable, in an LRU list, and is evicted (its key forgotten) only when an allocation
needs it; pages never keyed are handed out first. Page 0 is the scratch page and is
never handed out.

A partial hit: a prompt that ends its shared part inside a page (a 1,000-token prefix at
page size 16 ends 8 tokens into page 62) finds, among the cached children of its last
hit page, one whose first tokens equal its own, and copies the K/V of those tokens
(`partial_lookup`; the copy is the runner's, see runtime.plan.PrefixCopy). Each keyed
page, and the partial last page of every prompt prefilled, is listed under its parent's
key with its computed tokens; the most recent few children of a parent are compared, so
a lookup costs O(page size) whatever the cache holds.

A page is keyed (`cache_page`) only once its K/V has been computed by work already
enqueued (the scheduler's rule), so a hit never reads K/V that is still to be
written. Whoever holds a page never writes below its computed tokens, so a shared
page is never written. All operations cost O(pages touched).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from itertools import islice

import numpy as np

from ..plan import SCRATCH_PAGE

ROOT_KEY = b""
PARTIAL_CANDIDATES = 4  # children of a page compared by a partial lookup, most recent first


def page_key(parent: bytes, token_ids) -> bytes:
    """128-bit key of a full page: its parent's key and its tokens (a collision is ~2**-64 likely)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


def cache_root(salt: str | None, lora=None) -> bytes:
    """The key the first page of a prompt is hashed under: ROOT_KEY, or one of its own for a request with a
    `cache_salt` (vLLM's) or a LoRA adapter (`lora`, a LoRARequest: its K/V is the adapter's), so only requests
    with the same salt and adapter share its prefix-cache pages."""
    if salt is None and lora is None:
        return ROOT_KEY
    digest = hashlib.blake2b(ROOT_KEY, digest_size=16)
    if salt is not None:
        digest.update(b"salt:" + salt.encode("utf-8", "surrogatepass"))
    if lora is not None:
        lora_id, path = lora.key
        digest.update(f"lora:{lora_id}:".encode() + path.encode("utf-8", "surrogatepass"))
    return digest.digest()


class PagePool:
    def __init__(self, num_pages: int, enable_caching: bool = True):
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self._refcount = [0] * num_pages
        self._refcount[SCRATCH_PAGE] = 1  # held forever
        self._free = [p for p in range(num_pages - 1, 0, -1)]  # never keyed (or evicted); pop() = low pages first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed pages held by nobody, oldest first
        self._page_of_key: dict[bytes, int] = {}
        self._key_of_page: list[bytes | None] = [None] * num_pages
        self._children: dict[bytes, dict[int, tuple[int, ...]]] = {}  # parent key -> {page: its tokens}
        self._parent_of_page: list[bytes | None] = [None] * num_pages
        self.num_evictions = 0
        self.on_forget = None  # called with a key the cache forgets (a hybrid's state snapshots go with it)
        # what the cache gained and lost since take_events, for KV-cache events (host/kv_events.py); None: not kept
        self.events: list[tuple] | None = None

    # ----------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Pages an allocation can take now (free, plus cached pages nobody holds)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of_key)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._key_of_page[page] is not None

    def key_of(self, page: int) -> bytes | None:
        return self._key_of_page[page]

    # ------------------------------------------------------------- allocation
    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise RuntimeError(f"out of KV pages: asked for {count}, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)  # least recently used
                self._forget(page)
                self.num_evictions += 1
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def share(self, pages) -> None:
        for p in pages:
            if self._refcount[p] == 0:
                del self._evictable[p]  # a cache hit on a page nobody held
            self._refcount[p] += 1

    def free(self, pages) -> None:
        """Drop one reference to each page. Freed in reverse, so a sequence's tail pages
        become least recently used before its prefix (which more requests share)."""
        for p in reversed(pages):
            count = self._refcount[p] - 1
            if count < 0:
                raise RuntimeError(f"page {p} freed more often than held")
            self._refcount[p] = count
            if count == 0:
                if self._key_of_page[p] is not None:
                    self._evictable[p] = None
                else:
                    self._unlist(p)  # a partial page: its content is gone with its last holder
                    self._free.append(p)

    def free_after_sharing(self, pages) -> int:
        """num_free once `pages` are shared (cache hits on unheld pages leave the free count)."""
        return self.num_free - sum(1 for p in pages if self._refcount[p] == 0)

    def take_events(self) -> list[tuple]:
        """The cache's events since the last call, oldest first: ("stored", key, parent key or None, tokens, LoRARequest
        or None),
        ("removed", key)."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ the cache
    def reset_cache(self) -> bool:
        """Forget every cached page (vLLM's reset_prefix_cache), so the next prompts compute from scratch:
        only while no sequence holds a page (a held page's key is how its holder goes on); returns whether
        it did. One ("cleared",) event instead of a removal per page."""
        if self.num_free != self.num_pages - 1:  # every page but the scratch page free or evictable
            return False
        if self.on_forget is not None:
            for key in self._page_of_key:
                self.on_forget(key)
        self._page_of_key.clear()
        self._key_of_page = [None] * self.num_pages
        self._children.clear()
        self._parent_of_page = [None] * self.num_pages
        self._evictable.clear()
        self._free = [p for p in range(self.num_pages - 1, 0, -1)]
        if self.events is not None:
            self.events.append(("cleared",))
        return True

    def lookup(self, keys) -> list[int]:
        """Pages holding the longest run of `keys` from the start (not yet shared)."""
        if not self.enable_caching:
            return []
        hits = []
        for key in keys:
            page = self._page_of_key.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def partial_lookup(self, parent: bytes, token_ids) -> tuple[int, int]:
        """(page, count): a cached child page of `parent` whose first `count` tokens equal
        `token_ids`' first, the longest among the most recent few; (0, 0) if none match."""
        best_page, best = SCRATCH_PAGE, 0
        children = self._children.get(parent) if self.enable_caching else None
        if not children:
            return best_page, best
        for page in islice(reversed(children), PARTIAL_CANDIDATES):
            count = 0
            for mine, theirs in zip(token_ids, children[page]):
                if mine != theirs:
                    break
                count += 1
            if count > best:
                best_page, best = page, count
        return best_page, best

    def cache_page(self, page: int, key: bytes, parent: bytes | None = None, token_ids=None, lora=None) -> None:
        """Make a held, fully computed page findable by `key` (a no-op if the key is cached
        already); with its parent's key and its tokens it is also a partial-hit candidate. lora: the
        LoRARequest whose adapter computed it (its KV event names it)."""
        if not self.enable_caching or key in self._page_of_key or self._key_of_page[page] is not None:
            return
        self._page_of_key[key] = page
        self._key_of_page[page] = key
        if self.events is not None:  # a root (the prompt's first page) is no page's key: no parent
            self.events.append(("stored", key, parent if parent in self._page_of_key else None,
                                tuple(token_ids or ()), lora))
        if parent is not None:
            self.list_child(page, parent, token_ids)

    def list_child(self, page: int, parent: bytes, token_ids) -> None:
        """List a held page under `parent` as a partial-hit candidate, with its first, computed
        tokens: a keyed full page, or a prompt's last, partial page (whose slots below those
        tokens are never written again while it is held: it leaves the list when its last
        holder frees it, unless it was keyed by then)."""
        if not self.enable_caching:
            return
        self._children.setdefault(parent, {})[page] = tuple(token_ids)
        self._parent_of_page[page] = parent

    def _forget(self, page: int) -> None:
        key = self._key_of_page[page]
        del self._page_of_key[key]
        if self.events is not None:
            self.events.append(("removed", key))
        if self.on_forget is not None:
            self.on_forget(key)
        self._key_of_page[page] = None
        self._unlist(page)

    def _unlist(self, page: int) -> None:
        parent = self._parent_of_page[page]
        if parent is not None:
            self._parent_of_page[page] = None
            children = self._children[parent]
            del children[page]
            if not children:
                del self._children[parent]
