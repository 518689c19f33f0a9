"""The KV block pool and per-segment prefix cache: layout, hits, holding, LRU eviction."""

from __future__ import annotations

import pytest

from reproduce.engine.kvcache import BlockPool, layout_and_length, prompt_layout


def test_layout_gives_each_block_to_the_segment_it_ends_in() -> None:
    assert prompt_layout([("p", 30), ("u", 10)], 4) == [("p", 7), ("u", 3)]
    assert prompt_layout([("p", 32), ("u", 3)], 16) == [("p", 2), ("u", 0)]
    with pytest.raises(ValueError, match="tokens"):
        prompt_layout([("p", 0)], 4)


def test_layout_and_length_in_one_pass() -> None:
    assert layout_and_length([("p", 30), ("u", 10)], 4) == ([("p", 7), ("u", 3)], 40)
    assert layout_and_length([], 16) == ([], 0)


def test_an_execution_holds_its_hits_and_releases_them_with_its_private_blocks() -> None:
    pool = BlockPool(20)
    assert pool.allocate(8)
    pool.commit("p", 0, 5)
    pool.commit("u", 0, 3)
    pool.release([("p", 5), ("u", 3)], [5, 3], 0)  # the first execution leaves
    assert pool.free_cached == 8 and pool.num_free == 20
    layout = [("p", 5), ("v", 4)]
    hits, total, free_hit = pool.lookup(layout, 100)
    assert (hits, total, free_hit) == ([5, 0], 5, 5)
    pool.hold_hits(layout, hits)
    assert pool.allocate(4)  # its own blocks, private until filled
    assert pool.free_cached == 3 and pool.num_free == 11
    pool.check()
    held = list(hits)
    pool.release(layout, held, 4)
    assert held == [0, 0]
    assert pool.free_cached == 8 and pool.num_free == 20 and pool.usage == 0.0
    pool.release(layout, None, 0)  # holding nothing, it returns nothing
    pool.check()
    assert pool.num_free == 20


def test_commit_then_hit_then_release_makes_blocks_evictable() -> None:
    pool = BlockPool(20)
    layout = [("p", 5), ("u", 3)]
    assert pool.lookup(layout, 100) == ([0, 0], 0, 0)
    assert pool.allocate(8)
    pool.commit("p", 0, 5)
    pool.commit("u", 0, 3)
    assert pool.num_free == 12 and pool.free_cached == 0
    # a second holder of the prefix: nothing free is touched
    assert pool.lookup([("p", 5), ("v", 3)], 100) == ([5, 0], 5, 0)
    pool.hold("p", 0, 5)
    pool.hold("p", 5, 0)
    pool.hold("p", 5, 0)
    pool.hold("u", 3, 0)
    pool.check()
    assert pool.free_cached == 8 and pool.num_free == 20 and pool.usage == 0.0
    # a hit on free cached blocks takes them out of the free pool
    assert pool.lookup(layout, 100) == ([5, 3], 8, 8)
    assert pool.lookup(layout, 6) == ([5, 1], 6, 6)


def test_eviction_takes_the_least_recently_released_segment_tail_first() -> None:
    pool = BlockPool(10)
    for sid in ("a", "b"):
        assert pool.allocate(4)
        pool.commit(sid, 0, 4)
    pool.hold("a", 4, 0)
    pool.hold("b", 4, 0)
    assert pool.allocate(5)  # 2 empty + 3 evicted from a's tail
    assert pool.cached_blocks("a") == 1 and pool.cached_blocks("b") == 4
    assert not pool.allocate(6)
    pool.check()


def test_duplicate_blocks_are_adopted_not_double_counted() -> None:
    pool = BlockPool(20)
    assert pool.allocate(6)
    pool.commit("u", 0, 6)  # first execution of a call cached 6 blocks
    assert pool.allocate(4)  # a concurrent retry computed 4 of the same blocks itself
    assert pool.commit("u", 0, 4) == 4
    assert pool.num_free == 20 - 6
    pool.hold("u", 6, 0)
    pool.hold("u", 4, 0)
    pool.check()
    assert pool.num_free == 20 and pool.cached_blocks("u") == 6
