"""remat.core.maxima: a peak that keeps the live totals it is the largest of, through the
arithmetic the profiler does on it, and nothing wrong where it cannot."""

from __future__ import annotations

import json
import pickle

from remat.core.maxima import Maximum, collecting, largest, maximum_of


def test_a_maximum_is_its_largest_term_and_shifts_with_plain_ints() -> None:
    peak = Maximum((30, 70, 50))
    assert peak == 70 and isinstance(peak, int)
    shifted = peak - 20 + 5  # a transient: the peak less the exit, plus clones
    assert shifted == 55 and isinstance(shifted, Maximum) and shifted.terms == (15, 55, 35)
    assert (5 + peak).terms == (35, 75, 55)


def test_what_is_no_maximum_of_the_terms_is_a_plain_int() -> None:
    peak, other = Maximum((30, 70)), Maximum((1, 2))
    for value in (peak + other, other + peak, peak - other, 100 - peak, -peak, 2 * peak,
                  peak * 2, peak // 2, peak + True):
        assert type(value) is int
    assert peak + other == 72 and 100 - peak == 30


def test_largest_merges_every_term_where_the_builtin_would_keep_one_object() -> None:
    a, b = Maximum((3, 9)), Maximum((4, 8))
    assert max(0, a, b) is a  # the builtin: b's terms lost
    merged = largest(0, a, b)
    assert merged == 9 and merged.terms == (0, 3, 9, 4, 8)
    assert type(largest(1, 5)) is int


def test_maxima_are_made_only_while_collecting_and_survive_pickle_and_json() -> None:
    assert type(maximum_of((1, 5, 3))) is int
    with collecting():
        found = maximum_of((1, Maximum((7, 2)), 3))
    assert isinstance(found, Maximum) and found.terms == (1, 7, 2, 3)
    assert type(maximum_of((1, 2))) is int  # the block is over
    assert pickle.loads(pickle.dumps(found)).terms == found.terms
    assert json.loads(json.dumps({"peak": found})) == {"peak": 7}
