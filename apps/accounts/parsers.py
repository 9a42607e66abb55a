"""Request body parsers of the API (DRF ``DEFAULT_PARSER_CLASSES``). Kept apart from
``apps.accounts.api``: DRF imports its parser classes while it builds ``APIView``."""

from __future__ import annotations

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

#: The deepest nesting of arrays and objects a request body may have: faultdesk's own bodies are
#: at most four levels deep; deeper ones are refused before any code walks them recursively.
MAX_JSON_DEPTH = 32


def json_depth_exceeds(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests arrays/objects deeper than ``limit`` (iterative: no
    recursion of its own)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser, refusing (400) a body nested deeper than :data:`MAX_JSON_DEPTH` or so
    deep that Python's decoder gives up (``RecursionError``)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply") from None
        if json_depth_exceeds(data):
            raise ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
        return data
