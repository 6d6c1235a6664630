"""The simulator's heaps: min-heaps of ``(float key, int item)`` pairs (a replica's running sequences by finish
position, and the pending events by time and sequence number).

It runs ``heapq``'s algorithms step for step (``heappush``'s sift toward the root, ``heappop``'s sift of the last
element to a leaf and back up), so after any sequence of operations its array holds the pairs in exactly the order a
``heapq`` list of ``(key, item)`` tuples would: the simulator's results do not depend on which of the two it runs.
The keys and the items live in two unboxed vectors (``librt.vecs``): compiled with mypyc, a comparison is one machine
instruction instead of a tuple comparison through the interpreter's rich-compare protocol, and a push allocates no
tuple. Interpreted, the same loops run as Python bytecode, slower than ``heapq``'s C code; ``make_seq_heap`` gives
the interpreted planner ``TupleSeqHeap``, a ``heapq`` list behind the same methods.
"""

from __future__ import annotations

import heapq
from typing import cast

from librt.vecs import append, pop, vec
from mypy_extensions import i64, mypyc_attr


class SeqHeap:
    """Min-heap of ``(key, item)`` ordered by key, then item (items are unique). Interpreted: ``TupleSeqHeap``."""

    def __init__(self) -> None:
        self.keys: vec[float] = vec[float]()
        self.items: vec[i64] = vec[i64]()

    def __len__(self) -> int:
        return len(self.keys)

    def top_key(self) -> float:
        """The smallest key (the heap must not be empty)."""
        return self.keys[0]

    def top_item(self) -> int:
        """The item of the smallest pair (the heap must not be empty)."""
        return self.items[0]

    def replace(self, key: float, item: int) -> None:
        """``heapq.heapreplace``: the smallest pair gives way to ``(key, item)`` (the heap must not be empty)."""
        self.keys[0] = key
        self.items[0] = item
        self._sift_down_from(0)

    def push(self, key: float, item: int) -> None:
        """``heapq.heappush``: append, then move the new pair up past every larger parent."""
        self.keys = append(self.keys, key)
        self.items = append(self.items, item)
        self._sift_up_from(0, len(self.keys) - 1)

    def pop(self) -> int:
        """``heapq.heappop``: the item of the smallest pair, removed."""
        keys, items = self.keys, self.items
        first: i64 = items[0]
        keys, last_key = pop(keys)
        items, last_item = pop(items)
        self.keys, self.items = keys, items
        if len(keys):
            keys[0] = last_key
            items[0] = last_item
            self._sift_down_from(0)
        return first

    def clear(self) -> None:
        self.keys = vec[float]()
        self.items = vec[i64]()

    def pairs(self) -> list[tuple[float, int]]:
        """Every ``(key, item)`` in array order (the order a ``heapq`` list would hold them in)."""
        keys, items = self.keys, self.items
        return [(keys[i], int(items[i])) for i in range(len(keys))]

    def _sift_up_from(self, start: i64, pos: i64) -> None:
        """heapq's ``_siftdown``: the pair at ``pos`` moves toward ``start`` while it is smaller than its parent."""
        keys, items = self.keys, self.items
        key = keys[pos]
        item = items[pos]
        while pos > start:
            parent = (pos - 1) >> 1
            pk = keys[parent]
            if key < pk or (key == pk and item < items[parent]):
                keys[pos] = pk
                items[pos] = items[parent]
                pos = parent
                continue
            break
        keys[pos] = key
        items[pos] = item

    def _sift_down_from(self, pos: i64) -> None:
        """heapq's ``_siftup``: the pair at ``pos`` goes down to a leaf along the smaller children, then back up."""
        keys, items = self.keys, self.items
        end: i64 = len(keys)
        start = pos
        key = keys[pos]
        item = items[pos]
        child = 2 * pos + 1
        while child < end:
            right = child + 1
            if right < end:
                ck = keys[child]
                rk = keys[right]
                if not (ck < rk or (ck == rk and items[child] < items[right])):
                    child = right
            keys[pos] = keys[child]
            items[pos] = items[child]
            pos = child
            child = 2 * pos + 1
        keys[pos] = key
        items[pos] = item
        self._sift_up_from(start, pos)


@mypyc_attr(native_class=False)
class TupleSeqHeap(list[tuple[float, int]]):
    """``SeqHeap``'s methods on a ``heapq`` list of ``(key, item)`` tuples: what the interpreted planner uses
    (``make_seq_heap``). A list itself, so that ``len`` and truth tests stay C calls; a plain Python class even when
    the module is compiled, so that it can extend ``list``."""

    def top_key(self) -> float:
        return self[0][0]

    def top_item(self) -> int:
        return self[0][1]

    def replace(self, key: float, item: int) -> None:
        heapq.heapreplace(self, (key, item))

    def push(self, key: float, item: int) -> None:
        heapq.heappush(self, (key, item))

    def pop(self) -> int:  # type: ignore[override]  # SeqHeap.pop: the item of the smallest pair
        return heapq.heappop(self)[1]

    def pairs(self) -> list[tuple[float, int]]:
        return list(self)


COMPILED = not __file__.endswith(".py")
"""Whether this module runs compiled (an extension module) or from its source."""


def make_seq_heap() -> SeqHeap:
    """An empty heap: on unboxed vectors when compiled, a ``heapq`` list when interpreted (module doc)."""
    return SeqHeap() if COMPILED else cast(SeqHeap, TupleSeqHeap())
