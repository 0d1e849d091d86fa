"""Paged KV blocks: free list, reference counts, and a prefix cache over full blocks.

Every layer's cache holds `num_blocks` blocks of `block_size` token slots; a request owns an ordered block table.

Prefix cache. A *full* block whose KV has been computed is registered under a hash chained over every token
before it: key_i = (hash_{i-1}, tokens of block i), hash_i = blake2b-128(key_i). A new request walks its own chain
and reuses registered blocks while they match, confirming each hit by comparing the stored key (so a collision of
block i's own hash can never hand out the wrong KV). The key names its parent only by hash, so a collision of an
*earlier* block's hash could chain into a block computed after another prefix: hence a cryptographic hash, not
Python's hash(), which is unseeded for ints and easy to collide on purpose (x and x + 2**61 - 1 hash alike).
Shared blocks are never written: a request only writes slots past its computed tokens, which lie in blocks it
allocated fresh, and hits are capped so at least one prompt token is recomputed (its logits are needed).

Sliding windows. When every layer of the model attends to at most `sliding_window` keys, a block that lies wholly
before the window of a request's next query can never be read again: `allocate` gives such blocks back first (so
they do not count against the KV budget). Their ids stay at the head of the request's block table, stale, and
`num_released_blocks` counts them; the attention kernels never read a block before a query's window. With the
prefix cache on, only registered blocks are released (they stay cached, as any freed block does). A block freed
this way may be allocated to another request in the same step: the step reads only blocks inside the windows, and
steps in flight run before it on the device's stream.

Free list. Blocks with no reference sit in `free` in LRU order: allocation takes from the front. A freed block
that holds registered KV goes to the back (kept as long as possible for reuse); an unregistered one goes to the
front. Taking a registered block from the free list for a new owner evicts it from the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from asyncengine.request import Request

BlockKey = tuple  # (parent hash, token ids of the block...)


def chain_hash(parent: int, tokens: list[int]) -> int:
    """128-bit blake2b of (parent hash, token ids): collisions cannot be crafted, unlike with hash()."""
    data = parent.to_bytes(16, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None
    key: Optional[BlockKey] = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: Optional[int] = None):
        """sliding_window: the widest window when every layer has one (None: some layer sees the whole context)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were found

    # -- queries ----------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing ----------------------------------------------------------------------------------------------
    def _extend_hashes(self, request: Request, num_full_blocks: int) -> None:
        """Make request.block_hashes cover its first num_full_blocks blocks (computed once, incrementally)."""
        bs = self.block_size
        for i in range(len(request.block_hashes), num_full_blocks):
            parent = request.block_hashes[i - 1] if i else 0
            request.block_hashes.append(chain_hash(parent, request.token_ids[i * bs : (i + 1) * bs]))

    def _key(self, request: Request, i: int) -> BlockKey:
        parent = request.block_hashes[i - 1] if i else 0
        return (parent, *request.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request (at most num_tokens - 1 tokens)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self.cached.get(request.block_hashes[i])
            if block_id is None or self.blocks[block_id].key != self._key(request, i):
                break
            hits.append(block_id)
        return hits

    # -- allocation -------------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow the request's block table to hold num_tokens tokens, first adopting cached_blocks (only for a
        request with an empty table). All or nothing: returns False, changing nothing, when blocks run short
        (blocks outside every window of the request's next query, at num_computed_tokens, are released anyway)."""
        if self.sliding_window is not None:
            self.release_out_of_window(request)
        needed = self.blocks_for(num_tokens) - len(request.block_table) - len(cached_blocks)
        hits_in_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if needed > len(self.free) - hits_in_free:
            return False
        for block_id in cached_blocks:
            self._take(block_id)
            request.block_table.append(block_id)
        for _ in range(max(needed, 0)):
            block_id = next(iter(self.free))
            self._take(block_id)
            self._evict(block_id)
            request.block_table.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.key = None

    def register_full_blocks(self, request: Request, num_computed: Optional[int] = None) -> None:
        """Publish the request's full blocks among its first num_computed tokens (default: all computed ones;
        their token ids must be known) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = request.num_computed_tokens
        num_full = min(num_computed // self.block_size, len(request.block_table), len(request.token_ids) // self.block_size)
        self._extend_hashes(request, num_full)
        for i in range(request.num_registered_blocks, num_full):
            block = self.blocks[request.block_table[i]]
            block_hash = request.block_hashes[i]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash, block.key = block_hash, self._key(request, i)
                self.cached[block_hash] = block.block_id
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def release_out_of_window(self, request: Request) -> None:
        """Give back the blocks wholly before the first key that the request's next query (at position
        num_computed_tokens) sees: no later query sees them either."""
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        dead = min(max(first_visible, 0) // self.block_size, len(request.block_table))
        if self.enable_prefix_caching:  # an unregistered block would be registered later, under a stale id
            dead = min(dead, request.num_registered_blocks)
        for i in range(request.num_released_blocks, dead):
            self._release(request.block_table[i])
        request.num_released_blocks = max(request.num_released_blocks, dead)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.block_hash is None:
                self.free.move_to_end(block_id, last=False)

    def free_request(self, request: Request) -> None:
        """Drop the request's references, last block first (so a shared prefix outlives its tails)."""
        for block_id in reversed(request.block_table[request.num_released_blocks:]):
            self._release(block_id)
        request.block_table = []
        request.num_registered_blocks = 0
        request.num_released_blocks = 0

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody references."""
        for block_id in list(self.free):
            self._evict(block_id)
