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
