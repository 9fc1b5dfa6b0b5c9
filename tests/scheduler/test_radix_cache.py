"""The radix prefix cache alone: prefix matching, node splits, LRU eviction, locks, flush."""

from __future__ import annotations

import itertools

import pytest
import torch

from model_executor.memory_pool import SlotAllocator
from scheduler import radix_cache
from scheduler.radix_cache import RadixCache

POOL = 64


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch):
    """Every access gets a distinct, increasing time, so LRU order does not depend on clock resolution."""
    ticks = itertools.count()
    monkeypatch.setattr(radix_cache.time, "monotonic", lambda: float(next(ticks)))


@pytest.fixture
def cache():
    return RadixCache(SlotAllocator(POOL))


def put(cache: RadixCache, key: list[int]) -> torch.Tensor:
    """Insert key with freshly allocated slots, freeing the duplicates as the scheduler does."""
    slots = cache.allocator.alloc(len(key))
    already = cache.insert(key, slots)
    cache.allocator.free(slots[:already])
    return slots


def cached_keys(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every root-to-leaf token sequence in the tree."""
    out, stack = set(), [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + tuple(node.key)
        if not node.children and node is not cache.root:
            out.add(path)
        stack.extend((child, path) for child in node.children.values())
    return out


def assert_accounted(cache: RadixCache) -> None:
    cache.allocator.check_invariant(cache.total_size())


def test_match_returns_the_longest_cached_prefix(cache):
    slots = put(cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert got.tolist() == slots.tolist() and node.key == [1, 2, 3, 4]
    got, node = cache.match_prefix([7, 1, 2])
    assert got.numel() == 0 and node is cache.root
    assert cache.match_prefix([])[1] is cache.root


def test_match_inside_a_node_splits_it(cache):
    slots = put(cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 9])
    assert got.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and node.parent is cache.root
    assert [c.key for c in node.children.values()] == [[3, 4]]
    assert node.children[3].value.tolist() == slots[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == slots.tolist()  # still whole after the split
    assert cache.total_size() == 4 and cache.evictable_size() == 4
    assert_accounted(cache)


def test_insert_reports_the_shared_prefix_and_keeps_the_tree_slots(cache):
    first = put(cache, [1, 2, 3, 4])
    second = cache.allocator.alloc(4)
    assert cache.insert([1, 2, 5, 6], second) == 2  # the caller frees second[:2]
    cache.allocator.free(second[:2])
    assert cached_keys(cache) == {(1, 2, 3, 4), (1, 2, 5, 6)}
    assert cache.match_prefix([1, 2, 5, 6])[0].tolist() == first[:2].tolist() + second[2:].tolist()
    assert cache.insert([1, 2], torch.tensor([60, 61])) == 2  # fully cached: nothing new
    assert cache.total_size() == 6
    assert_accounted(cache)


def test_eviction_is_least_recently_used_first(cache):
    for key in ([1, 1], [2, 2], [3, 3]):
        put(cache, key)
    cache.match_prefix([1, 1])  # [2, 2] is now the oldest, then [3, 3], then [1, 1]
    assert cache.evict(2) == 2
    assert cached_keys(cache) == {(1, 1), (3, 3)}
    assert cache.evict(1) == 2  # whole leaves only
    assert cached_keys(cache) == {(1, 1)}
    assert cache.allocator.available_size() == POOL - 2
    assert_accounted(cache)


def test_a_parent_left_without_children_is_evicted_in_turn(cache):
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])  # root -> [1, 2] -> {[3], [4]}
    put(cache, [9, 9])
    cache.match_prefix([9, 9])  # the [1, 2] branch is older
    assert cache.evict(4) == 4  # [3], [4] and then their parent [1, 2], before [9, 9]
    assert cached_keys(cache) == {(9, 9)}
    assert_accounted(cache)


def test_locked_nodes_survive_eviction(cache):
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    put(cache, [5, 6])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)  # a running request holds [1, 2, 3] (and so its ancestor [1, 2])
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(POOL) == 3  # only [4] and [5, 6] can go
    assert cached_keys(cache) == {(1, 2, 3)}
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(POOL) == 3 and cache.total_size() == 0
    assert cache.allocator.available_size() == POOL
    with pytest.raises(AssertionError, match="unbalanced"):
        cache.dec_lock_ref(node)


def test_a_split_keeps_the_lock_on_both_halves(cache):
    put(cache, [1, 2, 3, 4])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    _, upper = cache.match_prefix([1, 2])  # splits the locked node
    assert upper.lock_ref == 1 and node.lock_ref == 1 and node.parent is upper
    assert cache.evict(POOL) == 0
    cache.dec_lock_ref(node)  # unlocks both halves
    assert upper.lock_ref == 0 and cache.evictable_size() == 4
    assert cache.evict(POOL) == 4


def test_flush_is_refused_while_locked(cache):
    put(cache, [1, 2, 3])
    put(cache, [7, 8])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    free_before = cache.allocator.available_size()
    assert cache.flush() is False
    assert cached_keys(cache) == {(1, 2, 3), (7, 8)}  # nothing freed, not even the unlocked part
    assert cache.allocator.available_size() == free_before
    cache.dec_lock_ref(node)
    assert cache.flush() is True
    assert cache.total_size() == 0 and cache.match_prefix([1, 2, 3])[0].numel() == 0
    assert cache.allocator.available_size() == POOL
