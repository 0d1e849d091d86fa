"""BlockManager on real Requests, no model: ref counts, all-or-nothing allocation, prefix hits confirmed by token
ids, LRU eviction of unreferenced cached blocks, usage."""

from __future__ import annotations

import pytest

from asyncengine.block_manager import BlockManager
from asyncengine.request import Request
from asyncengine.sampling_params import SamplingParams

BS = 4


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(), max_tokens=16)


def compute(bm: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """What the scheduler books after a forward pass: tokens computed, full blocks offered to the cache."""
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens
    bm.register_full_blocks(request)


def prefilled(bm: BlockManager, tokens: list[int], request_id: str) -> Request:
    """A request whose whole prompt was allocated (through the prefix cache, as the scheduler does) and computed."""
    request = make_request(tokens, request_id)
    assert bm.allocate(request, len(tokens), bm.find_cached_prefix(request))
    compute(bm, request)
    return request


def check_invariants(bm: BlockManager, requests: list[Request]) -> None:
    """ref_count of every block = number of live block tables holding it; free = exactly the unreferenced ones."""
    for block in bm.blocks:
        holders = sum(r.block_table.count(block.block_id) for r in requests)
        assert block.ref_count == holders, (block, holders)
        assert (block.block_id in bm.free) == (holders == 0), block
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash


# -- allocation and ref counts ---------------------------------------------------------------------------------
def test_allocate_and_free_keep_ref_counts_and_free_list_exact():
    bm = BlockManager(8, BS)
    a = make_request(list(range(10)), "a")  # 10 tokens -> 3 blocks
    assert bm.allocate(a, 10)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3
    assert bm.num_free_blocks == 5
    check_invariants(bm, [a])
    assert bm.allocate(a, 12)  # still 3 blocks: nothing new
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.allocate(a, 13)  # a 4th block for token 13
    assert len(a.block_table) == 4 and bm.num_free_blocks == 4
    check_invariants(bm, [a])
    bm.free_request(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, BS)
    a = make_request(list(range(12)), "a")
    assert bm.allocate(a, 12)  # 3 of 4 blocks
    b = make_request(list(range(100, 108)), "b")
    free_before = list(bm.free)
    refs_before = [blk.ref_count for blk in bm.blocks]
    assert bm.allocate(b, 8) is False  # needs 2, 1 left
    assert b.block_table == []
    assert list(bm.free) == free_before
    assert [blk.ref_count for blk in bm.blocks] == refs_before
    assert bm.allocate(a, 17) is False  # growing a by 2 blocks fails the same way
    assert len(a.block_table) == 3 and list(bm.free) == free_before
    assert bm.allocate(b, 4)  # exactly the last block fits
    assert bm.num_free_blocks == 0
    check_invariants(bm, [a, b])


def test_allocation_with_cached_blocks_counts_free_cached_hits_correctly():
    """Adopting cached blocks that sit in the free list uses those blocks, not extra ones; when the rest does not
    fit, nothing is adopted either."""
    bm = BlockManager(4, BS)
    a = prefilled(bm, list(range(9)), "a")  # blocks: 2 full (registered) + 1 partial
    a_blocks = list(a.block_table)
    bm.free_request(a)
    assert bm.num_free_blocks == 4
    b = make_request(list(range(9)) + [50] * 8, "b")  # 17 tokens -> 5 blocks: more than exist
    hits = bm.find_cached_prefix(b)
    assert hits == a_blocks[:2]
    assert bm.allocate(b, 17, hits) is False
    assert b.block_table == [] and bm.num_free_blocks == 4
    assert all(blk.ref_count == 0 for blk in bm.blocks)
    assert all(bm.blocks[h].block_hash is not None for h in hits)  # still cached
    c = make_request(list(range(9)) + [50] * 7, "c")  # 16 tokens -> 4 blocks: 2 adopted + 2 fresh
    hits = bm.find_cached_prefix(c)
    assert bm.allocate(c, 16, hits)
    assert c.block_table[:2] == a_blocks[:2] and bm.num_free_blocks == 0
    assert len(set(c.block_table)) == 4
    check_invariants(bm, [c])


# -- prefix cache ----------------------------------------------------------------------------------------------
def test_prefix_hits_are_whole_blocks_and_leave_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = prefilled(bm, list(range(10)), "a")  # 2 full blocks registered, 1 partial not
    assert len(bm.cached) == 2
    assert bm.find_cached_prefix(make_request(list(range(10)), "b")) == a.block_table[:2]
    assert bm.find_cached_prefix(make_request(list(range(7)), "c")) == a.block_table[:1]  # 2nd block not whole
    assert bm.find_cached_prefix(make_request(list(range(3)), "d")) == []
    # A prompt of exactly 2 blocks, both cached: only 1 is used, the last token must be recomputed for its logits.
    assert bm.find_cached_prefix(make_request(list(range(8)), "e")) == a.block_table[:1]
    assert bm.find_cached_prefix(make_request(list(range(9)), "f")) == a.block_table[:2]
    # A difference in the first block means no hit at all (the chain is over every token before).
    assert bm.find_cached_prefix(make_request([99] + list(range(1, 10)), "g")) == []
    # A difference in the second block keeps the first.
    assert bm.find_cached_prefix(make_request(list(range(5)) + [99] * 5, "h")) == a.block_table[:1]


def test_only_computed_full_blocks_are_registered():
    bm = BlockManager(8, BS)
    a = make_request(list(range(12)), "a")
    assert bm.allocate(a, 12)
    compute(bm, a, 6)  # one full block computed
    assert list(bm.cached.values()) == a.block_table[:1]
    compute(bm, a, 12)
    assert list(bm.cached.values()) == a.block_table[:3]


def test_hash_collision_never_hands_out_another_prefix_blocks():
    """A cache entry whose hash matches but whose tokens differ (a forced collision) is not reused."""
    bm = BlockManager(8, BS)
    a = prefilled(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    b = make_request([11, 12, 13, 14, 15, 16, 17, 18, 19], "b")
    assert bm.find_cached_prefix(b) == []  # also fills b.block_hashes
    bm.cached[b.block_hashes[0]] = a.block_table[0]  # b's first hash now points at a's block
    bm.cached[b.block_hashes[1]] = a.block_table[1]
    assert bm.find_cached_prefix(b) == []
    assert bm.find_cached_prefix(make_request(list(a.token_ids), "a2")) == a.block_table[:2]  # control


def test_colliding_earlier_block_cannot_chain_into_a_cached_block():
    """Cache poisoning through the chain: a request whose first block's hash collides with a cached block computes
    its own KV there; the block it computes next (KV under the *wrong* prefix) must never be served to a prompt
    with the genuine first block. With Python's hash() such collisions can be made on purpose (it is unseeded for
    ints and invertible per step; here x and x + 2**61 - 1 collide for free), so the chain needs a real hash."""
    m = 2**61 - 1
    assert hash((0, 5, 6)) == hash((0, 5 + m, 6))  # a real collision, no monkeypatching
    bm = BlockManager(8, 2)
    legit = prefilled(bm, [5, 6, 1], "legit")  # registers block [5, 6]
    attacker = prefilled(bm, [5 + m, 6, 7, 8, 1], "attacker")  # its [7, 8] KV is computed after [5+m, 6]
    assert attacker.block_table[0] != legit.block_table[0]
    victim = make_request([5, 6, 7, 8, 1], "victim")
    hits = bm.find_cached_prefix(victim)
    assert attacker.block_table[1] not in hits, "served KV computed under a different prefix"
    assert hits == legit.block_table[:1]


def test_prefix_caching_disabled_registers_and_finds_nothing():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prefilled(bm, list(range(9)), "a")
    assert bm.cached == {}
    assert bm.find_cached_prefix(make_request(list(range(9)), "b")) == []


# -- sharing ---------------------------------------------------------------------------------------------------
def test_shared_blocks_count_every_holder_and_outlive_one_of_them():
    bm = BlockManager(12, BS)
    a = prefilled(bm, list(range(13)), "a")  # 3 full blocks + 1
    b = prefilled(bm, list(range(13)), "b")  # adopts a's 3 full blocks, 1 fresh
    c = prefilled(bm, list(range(6)) + [77] * 3, "c")  # adopts a's first block only
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] not in a.block_table
    shared = a.block_table
    assert [bm.blocks[i].ref_count for i in shared] == [3, 2, 2, 1]
    check_invariants(bm, [a, b, c])
    bm.free_request(a)
    assert [bm.blocks[i].ref_count for i in shared[:3]] == [2, 1, 1]
    assert shared[3] in bm.free and all(i not in bm.free for i in shared[:3])
    check_invariants(bm, [b, c])
    bm.free_request(b)
    bm.free_request(c)
    assert bm.num_free_blocks == 12
    check_invariants(bm, [])


# -- eviction --------------------------------------------------------------------------------------------------
def test_freed_blocks_go_to_the_lru_list_last_block_first():
    """Freeing walks the table backwards: a cached prefix's first block is the last to be evicted; blocks with no
    cached KV are reused before any cached one."""
    bm = BlockManager(6, BS)
    a = prefilled(bm, list(range(10)), "a")  # blocks a0, a1 cached; a2 partial
    a0, a1, a2 = a.block_table
    never_used = [i for i in range(6) if i not in a.block_table]
    bm.free_request(a)
    assert list(bm.free) == [a2, *never_used, a1, a0]
    assert bm.blocks[a0].block_hash is not None and bm.blocks[a2].block_hash is None


def test_lru_evicts_oldest_freed_cached_blocks_first_and_never_referenced_ones():
    bm = BlockManager(6, BS)
    a = prefilled(bm, list(range(8)) + [0], "a")  # a0, a1 cached, a2 partial
    b = prefilled(bm, list(range(100, 108)) + [0], "b")  # b0, b1 cached, b2 partial
    (a0, a1, a2), (b0, b1, b2) = a.block_table, b.block_table
    bm.free_request(a)  # a freed first: older in the LRU order
    bm.free_request(b)
    assert list(bm.free) == [b2, a2, a1, a0, b1, b0]  # uncached first, then cached from least recently freed
    assert len(bm.cached) == 4
    keeper = prefilled(bm, list(range(100, 104)) + [5], "keeper")  # adopts b0, takes b2 fresh
    assert keeper.block_table == [b0, b2]
    x = make_request([200] * 8, "x")
    assert bm.allocate(x, 8)
    assert x.block_table == [a2, a1]  # the uncached block, then the oldest cached one (evicted)
    assert bm.blocks[a1].block_hash is None and a1 not in bm.cached.values()
    assert bm.blocks[a0].block_hash is not None
    y = make_request([300] * 8, "y")
    assert bm.allocate(y, 8)
    assert y.block_table == [a0, b1]  # all of a evicted before any of b
    assert set(bm.cached.values()) == {b0}  # b0 is referenced by keeper: never evicted
    assert bm.find_cached_prefix(make_request(list(range(8)) + [0], "a-again")) == []
    assert bm.find_cached_prefix(make_request(list(range(100, 104)) + [9], "b-again")) == [b0]
    assert bm.allocate(make_request([400] * 8, "z"), 8) is False  # nothing free: b0 is not up for grabs
    check_invariants(bm, [keeper, x, y])


def test_usage_counts_referenced_blocks_only():
    bm = BlockManager(8, BS)
    assert bm.usage == 0.0
    a = prefilled(bm, list(range(9)), "a")  # 3 blocks
    assert bm.usage == pytest.approx(3 / 8)
    b = prefilled(bm, list(range(9)), "b")  # 2 shared + 1 own
    assert bm.usage == pytest.approx(4 / 8)
    bm.free_request(a)
    assert bm.usage == pytest.approx(3 / 8)
    bm.free_request(b)
    assert bm.usage == 0.0 and len(bm.cached) == 2  # cached but unreferenced blocks count as free


def test_reset_prefix_cache_forgets_only_unreferenced_blocks():
    bm = BlockManager(8, BS)
    a = prefilled(bm, list(range(9)), "a")
    b = prefilled(bm, list(range(50, 59)), "b")
    bm.free_request(a)
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(make_request(list(range(9)), "a2")) == []
    assert bm.find_cached_prefix(make_request(list(range(50, 59)), "b2")) == b.block_table[:2]
