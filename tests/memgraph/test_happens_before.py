"""memgraph.happens_before.waits_for against a depth-first search, on random DAGs, with
windows small enough that targets fall into several lifetime classes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from einpage.errors import EinpageError
from memgraph.happens_before import waits_for


def reaches(deps, source: int, target: int) -> bool:
    """Whether `target` is a proper ancestor of `source` (a plain depth-first search)."""
    if not 0 <= target < source < len(deps):
        return False
    stack, seen = [source], {source}
    while stack:
        for dep in deps[stack.pop()]:
            if dep == target:
                return True
            if dep > target and dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return False


@st.composite
def dags_and_questions(draw):
    n = draw(st.integers(1, 80))
    deps = [()]
    for i in range(1, n):
        far = draw(st.booleans())  # now and then a dependency reaching far back
        low = 0 if far else max(0, i - 4)
        deps.append(tuple(sorted(draw(st.sets(st.integers(low, i - 1), max_size=3)))))
    node = st.integers(-1, n)
    questions = draw(st.lists(st.tuples(node, node), max_size=60))
    return deps, questions


@given(case=dags_and_questions(), window=st.sampled_from([1, 2, 3, 512]), growth=st.integers(2, 4))
def test_answers_equal_a_depth_first_search(case, window, growth):
    deps, questions = case
    got = waits_for(deps, questions, window=window, growth=growth)
    assert got == [reaches(deps, s, t) for s, t in questions]


def test_a_long_chain_is_answered_across_classes():
    n = 5000
    deps = [()] + [(i - 1,) for i in range(1, n)]
    questions = [(n - 1, 0), (n - 1, n - 2), (2500, 10), (10, 2500), (3, 3)]
    assert waits_for(deps, questions, window=4, growth=2) == [True, True, True, False, False]


def test_bad_shapes_of_classes_are_refused():
    with pytest.raises(EinpageError, match="window must be >= 1 and growth >= 2"):
        waits_for([()], [], window=0)
