"""Request parsing and validation for the reference ticket service.

Every function either returns clean Python values or raises :class:`ApiError`,
which the HTTP layer turns into a JSON error response.
"""

import hashlib
import json
import re
from datetime import datetime

PRIORITIES = ("P1", "P2", "P3", "P4")
STATUSES = ("open", "in_progress", "resolved", "closed")
FAULT_MODES = ("none", "drop_after_commit", "fail_503", "delay")

MAX_FENCING_TOKEN = 2**63 - 1  # largest value an SQLite INTEGER holds
MAX_DELAY_SECONDS = 60.0

_IDEMPOTENCY_KEY = re.compile(r"[\x21-\x7e]{1,255}")
_FENCING_TOKEN = re.compile(r"[0-9]{1,19}")
_IF_MATCH = re.compile(r'"?([0-9]{1,19})"?')

# field -> (maximum length, required); lengths count characters.
_CREATE_STRINGS = {
    "title": (200, True),
    "description": (20_000, False),
    "device": (200, True),
    "requester": (200, False),
    "tenant": (100, True),
}
# field -> (maximum items, maximum item length)
_CREATE_LISTS = {"labels": (50, 100), "evidence": (100, 2_000)}
_CREATE_FIELDS = {*_CREATE_STRINGS, *_CREATE_LISTS, "priority", "due_at"}
_PATCH_FIELDS = {"status", "priority", "assignee", "comment"}


class ApiError(Exception):
    """An HTTP error response: ``status`` plus body ``{"error": error, **extra}``.

    ``headers`` (optional dict) are added to the response, e.g. ``Allow``.
    """

    def __init__(self, status, error, headers=None, **extra):
        super().__init__(f"{status} {error}")
        self.status = status
        self.body = {"error": error, **extra}
        self.headers = headers or {}


def invalid(detail):
    """Return the 400 ``{"error":"invalid_params","detail":detail}`` error."""
    return ApiError(400, "invalid_params", detail=detail)


def canonical_json(value):
    """Serialise ``value`` canonically: sorted keys, no spaces, raw UTF-8 text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def body_digest(value):
    """Return the hex SHA-256 of :func:`canonical_json` of ``value``."""
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw):
    """Decode a request body (bytes) that must be a JSON object; return the dict.

    Raises 400 ``invalid_params`` for empty bodies, bad UTF-8, bad JSON,
    NaN/Infinity, lone surrogates, or a top-level value that is not an object.
    """
    if not raw:
        raise invalid("request body must be a JSON object")
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        canonical_json(value).encode("utf-8")  # rejects lone surrogates such as "\ud800"
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise invalid(f"body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid("request body must be a JSON object")
    return value


def _unknown_fields(payload, allowed):
    unknown = sorted(set(payload) - allowed)
    if unknown:
        raise invalid(f"unknown field(s): {', '.join(unknown)}")


def _string(payload, name, max_len, required, default=""):
    value = payload.get(name)
    if value is None:
        if required:
            raise invalid(f"{name}: required")
        return default
    if not isinstance(value, str) or len(value) > max_len or (required and not value.strip()):
        raise invalid(
            f"{name}: must be a {'non-blank ' if required else ''}string of at most {max_len} characters"
        )
    return value


def _string_list(payload, name, max_items, max_len):
    value = payload.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > max_items:
        raise invalid(f"{name}: must be a list of at most {max_items} strings")
    if not all(isinstance(item, str) and 0 < len(item) <= max_len for item in value):
        raise invalid(f"{name}: every item must be a non-empty string of at most {max_len} characters")
    return list(value)


def _priority(payload):
    value = payload.get("priority")
    if value not in PRIORITIES:
        raise invalid(f"priority: must be one of {', '.join(PRIORITIES)}")
    return value


def _due_at(payload):
    """The optional ``due_at``: an ISO 8601 date and time with its offset, at most 40 characters;
    returned as given, or None when absent."""
    value = payload.get("due_at")
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value) if isinstance(value, str) and len(value) <= 40 else None
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise invalid("due_at: must be an ISO 8601 date and time with its UTC offset")
    return value


def validate_create(payload):
    """Validate a ``POST /tickets`` body; return the ticket fields with defaults.

    Returns ``{"title", "description", "priority", "device", "requester",
    "tenant", "labels", "evidence"}``, and ``"due_at"`` when the body gives one.
    Raises 400 ``invalid_params`` for unknown fields, missing required fields
    (title, priority, device, tenant) or values of the wrong type or length.
    """
    _unknown_fields(payload, _CREATE_FIELDS)
    fields = {name: _string(payload, name, *spec) for name, spec in _CREATE_STRINGS.items()}
    fields["priority"] = _priority(payload)
    fields.update({name: _string_list(payload, name, *spec) for name, spec in _CREATE_LISTS.items()})
    due = _due_at(payload)
    if due is not None:
        fields["due_at"] = due
    return fields


def validate_patch(payload):
    """Validate a ``PATCH /tickets/<id>`` body; return only the fields it sets.

    Allowed: ``status`` (one of :data:`STATUSES`), ``priority`` (P1..P4),
    ``assignee`` (string of 1..200 characters, or null to unassign), ``comment``
    (non-blank string of at most 20000 characters). Raises 400 ``invalid_params``
    for unknown fields, bad values or an empty body.
    """
    _unknown_fields(payload, _PATCH_FIELDS)
    if not payload:
        raise invalid(f"body must set at least one of: {', '.join(sorted(_PATCH_FIELDS))}")
    changes = {}
    if "status" in payload:
        if payload["status"] not in STATUSES:
            raise invalid(f"status: must be one of {', '.join(STATUSES)}")
        changes["status"] = payload["status"]
    if "priority" in payload:
        changes["priority"] = _priority(payload)
    if "assignee" in payload:
        assignee = payload["assignee"]
        if assignee is not None and not (isinstance(assignee, str) and 0 < len(assignee) <= 200):
            raise invalid("assignee: must be null or a string of 1..200 characters")
        changes["assignee"] = assignee
    if "comment" in payload:
        changes["comment"] = _string(payload, "comment", 20_000, required=True)
    return changes


def validate_comment(payload):
    """Validate a ``POST /tickets/<id>/comments`` body ``{"body": str}``; return the text.
    Raises 400 ``invalid_params`` for unknown fields or a blank or too long body."""
    _unknown_fields(payload, {"body"})
    return _string(payload, "body", 20_000, required=True)


def parse_idempotency_key(value):
    """Return the ``Idempotency-Key`` header value.

    Missing or blank -> 400 ``idempotency_key_required``; anything but 1..255
    visible ASCII characters -> 400 ``invalid_params``.
    """
    if value is None or not value.strip():
        raise ApiError(400, "idempotency_key_required")
    if not _IDEMPOTENCY_KEY.fullmatch(value):
        raise invalid("Idempotency-Key: must be 1..255 visible ASCII characters")
    return value


def parse_fencing_token(value):
    """Return the ``X-Fencing-Token`` header as an int, or None when absent.

    Anything but a non-negative integer below 2**63 -> 400 ``invalid_params``.
    """
    if value is None:
        return None
    value = value.strip()
    if not _FENCING_TOKEN.fullmatch(value) or int(value) > MAX_FENCING_TOKEN:
        raise invalid("X-Fencing-Token: must be a non-negative integer")
    return int(value)


def parse_if_match(value):
    """Return the version named by an ``If-Match`` header (``"3"`` or ``3``).

    Missing -> 428 ``precondition_required``; malformed -> 400 ``invalid_params``.
    """
    if value is None or not value.strip():
        raise ApiError(428, "precondition_required", detail='send If-Match: "<version>"')
    match = _IF_MATCH.fullmatch(value.strip())
    if not match:
        raise invalid('If-Match: must be a version ETag such as "3"')
    return int(match.group(1))


def validate_faults(payload):
    """Validate a ``POST /_admin/faults`` body; return ``(mode, count, delay_seconds)``.

    ``mode`` is one of :data:`FAULT_MODES`; ``count`` an int >= 1 (default 1);
    ``delay_seconds`` a number in 0..60 (default 1.0). Raises 400 ``invalid_params``.
    """
    _unknown_fields(payload, {"mode", "count", "delay_seconds"})
    mode = payload.get("mode")
    if mode not in FAULT_MODES:
        raise invalid(f"mode: must be one of {', '.join(FAULT_MODES)}")
    count = payload.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise invalid("count: must be an integer >= 1")
    delay = payload.get("delay_seconds", 1.0)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= MAX_DELAY_SECONDS:
        raise invalid(f"delay_seconds: must be a number between 0 and {MAX_DELAY_SECONDS:g}")
    return mode, count, float(delay)
