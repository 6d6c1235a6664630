"""The simulator's heaps run heapq's algorithms: the same pops and the same array, operation for operation."""

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from planner.sim.seqheap import COMPILED, SeqHeap, TupleSeqHeap, make_seq_heap

# keys from a few values, so that equal keys (ordered by item) are common; items are unique, as the simulator's are
ops = st.lists(st.tuples(st.sampled_from(("push", "pop", "replace")), st.sampled_from((0.0, 0.5, 1.0, 2.5, 7.0, 1e9))),
               max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_both_heaps_match_heapq_on_tuples_step_by_step(ops):
    ref: list[tuple[float, int]] = []
    heaps = [SeqHeap(), TupleSeqHeap()]
    for item, (op, key) in enumerate(ops):
        if op == "push" or not ref:
            heapq.heappush(ref, (key, item))
            for h in heaps:
                h.push(key, item)
        elif op == "pop":
            want = heapq.heappop(ref)
            for h in heaps:
                assert (h.top_key(), h.top_item()) == want
                assert h.pop() == want[1]
        else:
            want = heapq.heapreplace(ref, (key, item))
            for h in heaps:
                assert (h.top_key(), h.top_item()) == want
                h.replace(key, item)
        for h in heaps:
            assert len(h) == len(ref)
            assert h.pairs() == ref  # the same array: code that walks it sees the same order
    for h in heaps:
        h.clear()
        assert len(h) == 0 and h.pairs() == []


def test_make_seq_heap_picks_the_vectors_only_when_compiled():
    assert type(make_seq_heap()) is (SeqHeap if COMPILED else TupleSeqHeap)
