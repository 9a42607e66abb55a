"""Walking parsed JSON (``json.loads`` output) without recursion."""

from __future__ import annotations

from collections.abc import Iterator


def strings_of(value) -> Iterator[str]:
    """Every string in ``value`` (parsed JSON: dicts, lists, strings, numbers, booleans, None): each
    dict key and each string value, at any depth, in no particular order. Iterative, so a deeply
    nested document cannot exhaust the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
