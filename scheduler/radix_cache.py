"""Radix-tree prefix cache over token ids (page size 1): shared prompt prefixes reuse KV slots.

Each node holds a run of token ids and the KV slots computed for them. `lock_ref` counts the running
requests that use a node (and so all its ancestors); only unlocked leaves are evicted, least recently
used first. Slots held by the tree are either evictable (unlocked) or protected (locked).

A key may have a namespace (a LoRA adapter's id): the same tokens under two namespaces are two entries (their
KV differs), so a namespace's entries hang below the root under (namespace, first token); None is the base
model's, under the first token alone.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from model_executor.memory_pool import SlotAllocator


class TreeNode:
    _ids = itertools.count()

    def __init__(self, parent: TreeNode | None = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None):
        self.id = next(self._ids)
        self.parent = parent
        self.key: list[int] = key or []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.children: dict[object, TreeNode] = {}  # by first token (below the root: with the namespace)
        self.namespace = None if parent is None else parent.namespace
        self.lock_ref = 0
        self.last_access = time.monotonic()

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction
        return self.last_access < other.last_access


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: SlotAllocator):
        self.allocator = allocator
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ---- sizes ---------------------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insert ---------------------------------------------------------------------
    def _edge(self, node: TreeNode, token: int, namespace) -> object:
        """The children key of `token` under `node`: below the root, with the namespace (unless None)."""
        return (namespace, token) if node is self.root and namespace is not None else token

    def match_prefix(self, key: list[int], namespace=None) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of key (in namespace): its slots and the deepest node (split to end exactly
        there)."""
        node, values, now = self.root, [], time.monotonic()
        node.last_access = now
        while key:
            child = node.children.get(self._edge(node, key[0], namespace))
            if child is None:
                break
            n = _common_prefix_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, key = child, key[n:]
        slots = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return slots, node

    def insert(self, key: list[int], value: torch.Tensor, namespace=None) -> int:
        """Insert key -> slots (in namespace); returns how many leading tokens were already cached.

        The caller owns value[:returned] and must free those duplicate slots: the tree keeps its own.
        """
        assert len(key) == value.numel()
        node, done, now = self.root, 0, time.monotonic()
        while done < len(key):
            edge = self._edge(node, key[done], namespace)
            child = node.children.get(edge)
            if child is None:
                new = TreeNode(node, key[done:], value[done:].clone())
                new.namespace = namespace
                node.children[edge] = new
                self._evictable += len(new.key)
                return done
            n = _common_prefix_len(child.key, key[done:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, done = child, done + n
        return done

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child after n tokens; returns the new upper node (same lock count as child)."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n].clone())
        upper.namespace = child.namespace
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[self._edge(child.parent, child.key[0], child.namespace)] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:].clone()
        return upper

    # ---- locking -------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock_ref"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, LRU first; returns how many were freed."""
        leaves = [n for n in self._iter_nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._edge(parent, leaf.key[0], leaf.namespace)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def flush(self) -> bool:
        """Drop every cached prefix; refused (False) while any node is locked by a running request."""
        if self._protected:
            return False
        self.evict(self._evictable)
        self.reset()
        return True

    def _iter_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
