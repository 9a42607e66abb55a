"""Canonical digests (apps/core/digests.py; DESIGN.md §6): RFC 8785 canonical JSON, so equal values
hash equally whatever their key order, and values JSON cannot carry are refused."""

from __future__ import annotations

import hashlib
import math

import pytest

from apps.core.digests import canonical_json, sha256_json


def test_key_order_and_insignificant_form_do_not_change_the_digest():
    a = {"b": 1, "a": [1.0, "打印机"], "c": {"y": None, "x": True}}
    b = {"c": {"x": True, "y": None}, "a": [1, "打印机"], "b": 1}
    assert canonical_json(a) == canonical_json(b) == '{"a":[1,"打印机"],"b":1,"c":{"x":true,"y":null}}'.encode()
    assert sha256_json(a) == sha256_json(b) == hashlib.sha256(canonical_json(a)).hexdigest()


def test_a_changed_value_changes_the_digest():
    assert sha256_json({"priority": "P3"}) != sha256_json({"priority": "P1"})


@pytest.mark.parametrize("value", [math.nan, {1: "non-string key"}, 2**60])
def test_values_json_cannot_carry_are_refused(value):
    with pytest.raises(Exception):  # noqa: B017 - rfc8785 raises its own error classes
        canonical_json(value)


# --- the fast encoder writes exactly rfc8785's bytes ---------------------------------------------

import rfc8785  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", "\x00", "a\x00b", "\ue000", "\U0001f600", "\ufffd", '"\\/', "\b\f\n\r\t\x1f\x7f", "\u2028", "打印机"])
_numbers = (st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
            | st.floats(allow_nan=False, allow_infinity=False)
            | st.sampled_from([0.0, -0.0, 1.0, 1e16, 1e21, 1e-7, 1.5e-6, 123456789012345680000.0, 5e-324]))
_json = st.recursive(
    st.none() | st.booleans() | _numbers | _texts,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_texts, inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(_json)
def test_canonical_json_equals_rfc8785_byte_for_byte(value):
    assert canonical_json(value) == rfc8785.dumps(value)


def test_keys_beyond_the_bmp_sort_by_utf16_code_units_as_jcs_says():
    # U+FB01 sorts after U+1F600 in UTF-16 (0xD83D…) but before it by code point.
    value = {"\ufb01": 1, "\U0001f600": 2, "a": 0.5}
    assert canonical_json(value) == rfc8785.dumps(value) == '{"a":0.5,"\U0001f600":2,"\ufb01":1}'.encode()


def test_floats_are_written_in_ecmascript_form_inside_structures():
    value = {"score": 1e21, "w": [1.0, 1e-7, -0.0, 0.1], "s": "1e21"}
    assert canonical_json(value) == b'{"s":"1e21","score":1e+21,"w":[1,1e-7,0,0.1]}' == rfc8785.dumps(value)


@pytest.mark.parametrize("value", [{"x": [math.inf]}, {"x": {"y": 2**53}}, {"x": "\ud800"}, {(1, 2): 1}])
def test_what_rfc8785_refuses_inside_a_structure_is_refused_the_same_way(value):
    with pytest.raises(rfc8785.CanonicalizationError):
        rfc8785.dumps(value)
    with pytest.raises(rfc8785.CanonicalizationError):
        canonical_json(value)
