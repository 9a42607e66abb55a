"""The reducer kernel's state copy: δ copies the state at every event, so the copy must be as deep
as :func:`copy.deepcopy`'s for every JSON-shaped state."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from apps.tasks.reducer.core import COMPLETED, Status, copy_state

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(list(Status)),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=30,
)


def _containers(value, found=None):
    found = [] if found is None else found
    if isinstance(value, dict):
        found.append(value)
        for v in value.values():
            _containers(v, found)
    elif isinstance(value, list):
        found.append(value)
        for v in value:
            _containers(v, found)
    return found


@given(json_values)
def test_copy_state_equals_deepcopy_and_shares_no_container_with_the_original(value):
    copied = copy_state(value)
    assert copied == copy.deepcopy(value) == value
    originals = {id(c) for c in _containers(value)}
    assert not originals & {id(c) for c in _containers(copied)}


def test_copy_state_keeps_statuses_as_their_members_and_hands_other_types_to_deepcopy():
    state = {"status": COMPLETED, "pair": (1, [2]), "nested": {"list": [1, {"a": "b"}]}}
    copied = copy_state(state)
    assert copied["status"] is Status.COMPLETED
    assert copied["pair"] == (1, [2]) and copied["pair"][1] is not state["pair"][1]
    copied["nested"]["list"][1]["a"] = "changed"
    assert state["nested"]["list"][1]["a"] == "b"
