"""PagePool against a reference model (a dict of refcounts), driven by hypothesis."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.core.page_pool import OutOfPages, PagePool
from tests.helpers import examples

NUM_PAGES = 24


class PagePoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(NUM_PAGES, page_size=4)
        self.ref: dict[int, int] = {}  # page -> holders
        self.holdings: list[np.ndarray] = []  # each: one holder's references

    @rule(count=st.integers(0, 10))
    def alloc(self, count):
        free = NUM_PAGES - len(self.ref)
        if count > free:
            with pytest.raises(OutOfPages):
                self.pool.alloc(count)
            return
        pages = self.pool.alloc(count)
        assert len(set(pages.tolist())) == count
        for p in pages.tolist():
            assert p not in self.ref
            self.ref[p] = 1
        self.holdings.append(pages)

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def share(self, data):
        pages = data.draw(st.sampled_from(self.holdings))
        self.pool.incref(pages)
        for p in pages.tolist():
            self.ref[p] += 1
        self.holdings.append(pages.copy())

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def release(self, data):
        i = data.draw(st.integers(0, len(self.holdings) - 1))
        pages = self.holdings.pop(i)
        self.pool.decref(pages)
        for p in pages.tolist():
            self.ref[p] -= 1
            if self.ref[p] == 0:
                del self.ref[p]

    @invariant()
    def accounting(self):
        self.pool.check()
        assert self.pool.num_free == NUM_PAGES - len(self.ref)
        for p, count in self.ref.items():
            assert self.pool.refcount[p] == count
        assert set(self.pool.free_page_ids().tolist()).isdisjoint(self.ref)


TestPagePool = PagePoolMachine.TestCase
TestPagePool.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)


def test_double_free_detected():
    pool = PagePool(4, 1)
    pages = pool.alloc(2)
    pool.decref(pages)
    with pytest.raises(RuntimeError):
        pool.decref(pages)
