"""Model providers (DESIGN.md §10; spec §16.5, long-task-runtime.md "预算").

Two providers draft a ticket from the recorded context:

* ``local`` (the default): the deterministic rules-based drafter of :mod:`apps.llm.drafter`. It
  costs nothing and needs no network.
* ``openai_compatible``: any chat-completions endpoint (OpenAI, vLLM, Ollama, llama.cpp server) with
  JSON-schema structured output. The provider makes exactly one HTTP attempt per call; the
  controller decides retries and re-asks, each as its own reservation in the task's ledger, so no
  layer retries on its own outside the budget and the deadline.

A call's cost cannot exceed its reservation (``c ≤ r``): the reservation prices an upper bound of
the prompt's tokens (each token is at least one UTF-8 byte, plus a per-message overhead and the
schema) plus ``max_tokens``, which caps generation. Usage the server reports above that bound is
recorded as an overrun and charged at the bound. A call whose usage is unknown (a timeout, a
cancel, a dropped connection after the request was sent) is charged the whole reservation; one the
server refused before doing any work (429, 5xx, no connection) is charged nothing.

The model only proposes content (title, description, priority, alert summary, cited evidence ids,
missing information). Device, tenant, requester and labels come from the task's recorded state;
the tool, its target and its approval are the controller's and the policy's.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import jsonschema
from django.conf import settings

from apps.gateway import errors as gateway_errors
from apps.gateway import tools
from apps.gateway.http import http_request
from apps.gateway.redaction import redact, redact_data
from apps.llm.drafter import LOCAL_MODEL_ID

LOCAL = "local"
OPENAI_COMPATIBLE = "openai_compatible"
PROVIDERS = (LOCAL, OPENAI_COMPATIBLE)

#: the versions of :func:`model_output_parse` this build carries, each pinned in an artifact bundle:
#: ``/1`` strict JSON; ``/2`` also takes raw control characters (a line break) inside a string, which
#: small models under a grammar write and strict JSON refuses — nothing else is relaxed
OUTPUT_PARSERS = {"model-output-parser/1": {"strict": True}, "model-output-parser/2": {"strict": False}}
#: the output parser new tasks are pinned to
OUTPUT_PARSER_VERSION = "model-output-parser/2"

#: what the model must return (strict structured output)
MODEL_OUTPUT_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["title", "description", "priority", "alert_summary", "evidence", "missing_information"],
    "properties": {
        "title": {"type": "string", "minLength": 5, "maxLength": 200},
        "description": {"type": "string", "minLength": 10, "maxLength": 8000},
        "priority": {"enum": ["P1", "P2", "P3", "P4"]},
        "alert_summary": {"type": "string", "maxLength": 1000},
        "evidence": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "missing_information": {"type": "array", "items": {"type": "string", "maxLength": 500}, "maxItems": 5},
    },
}
_SCHEMA_TEXT = json.dumps(MODEL_OUTPUT_SCHEMA, separators=(",", ":"))


def output_schema_for(evidence_ids: list[str] | None) -> dict:
    """:data:`MODEL_OUTPUT_SCHEMA` narrowed to one call (``controller/2``): ``evidence`` may only
    name the chunk ids retrieved for the task (``evidence_ids``) — at least one when any was, none
    when none was — so that a constrained decoder cannot invent a citation. ``None`` leaves the
    schema as it is. A reply valid under the narrowed schema is valid under the general one."""
    if evidence_ids is None:
        return MODEL_OUTPUT_SCHEMA
    ids = sorted({str(i) for i in evidence_ids})
    evidence = {"type": "array", "items": {"enum": ids}, "minItems": 1, "maxItems": min(5, len(ids))} if ids \
        else {"type": "array", "items": {"type": "string"}, "maxItems": 0}  # a grammar ignores maxItems: 0
    return {**MODEL_OUTPUT_SCHEMA, "properties": {**MODEL_OUTPUT_SCHEMA["properties"], "evidence": evidence}}
_MESSAGE_OVERHEAD_TOKENS = 8
_REQUEST_OVERHEAD_TOKENS = 32

#: how a call asks for its JSON schema (``MODEL_RESPONSE_FORMAT``)
RESPONSE_FORMATS = ("json_schema", "json_object")

#: the longest string bound sent to llama.cpp as a grammar: its converter writes ``maxLength: n`` as n
#: nested optional groups (past about 1,000 the grammar is refused and the server process dies), and a
#: small model fills what it is allowed — 400 keeps a whole reply within the output cap
GRAMMAR_MAX_LENGTH = 400


def grammar_schema(schema):
    """``schema`` with every ``maxLength`` above :data:`GRAMMAR_MAX_LENGTH` lowered to it — what
    llama-cpp-python's server can turn into a grammar (``json_object``). The reply is still checked
    against the whole schema (:func:`model_output_parse`); only generation is bounded tighter."""
    if isinstance(schema, dict):
        out = {k: grammar_schema(v) for k, v in schema.items()}
        if isinstance(out.get("maxLength"), int) and out["maxLength"] > GRAMMAR_MAX_LENGTH:
            out["maxLength"] = GRAMMAR_MAX_LENGTH
        return out
    if isinstance(schema, list):
        return [grammar_schema(v) for v in schema]
    return schema

#: outcomes after which the server did no billable work
NOT_PROCESSED = ("rate_limited", "unavailable")
#: outcomes worth another attempt (each a new reservation with one retry)
TRANSIENT = ("rate_limited", "unavailable", "timeout")


def model_output_parse(content: str | None, version: str = OUTPUT_PARSER_VERSION) -> tuple[dict | None, list[str]]:
    """Parse a reply's content with output parser ``version`` (a key of :data:`OUTPUT_PARSERS`):
    JSON, then :data:`MODEL_OUTPUT_SCHEMA`. Returns ``(output, [])`` or ``(None, problems)`` with each
    problem as ``"path: message"``. Raises ``KeyError`` for a version this build does not carry."""
    strict = OUTPUT_PARSERS[version]["strict"]
    if content is not None and not isinstance(content, str):
        return None, [f"(root): the reply's content is {type(content).__name__}, not text"]
    if content is None or not content.strip():
        return None, ["(root): the reply is empty"]
    try:
        value = json.loads(content, strict=strict)
    except json.JSONDecodeError as exc:
        return None, [f"(root): not JSON ({exc.msg} at character {exc.pos})"]
    problems = [_short(f"{'/'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}")
                for err in jsonschema.Draft202012Validator(MODEL_OUTPUT_SCHEMA).iter_errors(value)]
    problems += _unstorable(value, "")
    return (value, []) if not problems else (None, problems[:10])


def _storable(text: str) -> bool:
    return "\x00" not in text and not _SURROGATE.search(text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unstorable(value, path: str) -> list[str]:
    """``"path: …"`` for each string (key or value) of a parsed reply that PostgreSQL cannot store
    or canonical JSON cannot digest: U+0000, or a surrogate code point JSON's ``\\ud800`` escapes
    let through unpaired. Such a reply is malformed, re-asked like any other."""
    if isinstance(value, str):
        return [] if _storable(value) else [f"{path or '(root)'}: contains U+0000 or an unpaired surrogate"]
    if isinstance(value, dict):
        return [p for k, v in value.items()
                for p in (_unstorable(k, path) or _unstorable(v, f"{path}/{k}".lstrip("/")))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _unstorable(v, f"{path}/{i}".lstrip("/"))]
    return []


def recordable_text(text: str) -> str:
    """``text`` as it can be recorded in a jsonb event payload: each U+0000 and unpaired surrogate
    written as its JSON escape (``\\u0000``, ``\\ud800``), so that a recorded malformed reply
    parses back to the same refusal when it is replayed. Every other character is kept."""
    if _storable(text):
        return text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text.replace("\x00", "\\u0000"))


def _short(text: str, limit: int = 300) -> str:
    """A problem as recorded and shown back to the model: at most ``limit`` characters (a schema
    error quotes the offending value, which may be the whole reply), recordable
    (:func:`recordable_text`)."""
    text = recordable_text(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class CallResult:
    """One model call. ``outcome`` is one of ``ok``, ``malformed``, ``rate_limited``,
    ``unavailable``, ``timeout``, ``cancelled``, ``error``. ``usage`` is
    ``{"prompt_tokens", "completion_tokens"}`` as the server reported it, or None when unknown.
    ``output`` is the parsed reply (``ok`` only), ``content`` the raw text. ``sent`` is False when
    the request certainly never left the process (the tool gateway refused its destination)."""

    outcome: str
    content: str | None = None
    output: dict | None = None
    problems: list[str] = field(default_factory=list)
    usage: dict | None = None
    latency_ms: int = 0
    http_status: int | None = None
    retry_after: float | None = None
    error: str | None = None
    sent: bool | None = None


class OpenAICompatibleProvider:
    """Chat completions with JSON-schema structured output at ``base_url`` (e.g.
    ``http://127.0.0.1:8767/v1``), through the tool gateway (tool ``model``): the gateway checks that
    ``base_url`` is a destination the model may be reached at, injects the API key (the provider never
    holds it), caps the reply at ``MODEL_MAX_REPLY_BYTES`` and records the call. ``units_per_1k``
    prices tokens in the ledger's cost units."""

    name = OPENAI_COMPATIBLE

    def __init__(self, *, base_url: str, model: str, max_output_tokens: int, units_per_1k: float,
                 response_format: str = "json_schema", output_parser: str = OUTPUT_PARSER_VERSION):
        if output_parser not in OUTPUT_PARSERS:
            raise ValueError(f"output parser {output_parser!r} is not in this build")
        self.output_parser = output_parser
        if response_format not in RESPONSE_FORMATS:
            raise ValueError(f"response_format must be one of {RESPONSE_FORMATS}, not {response_format!r}")
        self.response_format = response_format
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_output_tokens = int(max_output_tokens)
        self.units_per_1k = float(units_per_1k)

    # --- the ledger -----------------------------------------------------------------------------
    def prompt_token_bound(self, messages: list[dict], schema: dict | None = None) -> int:
        """An upper bound of the prompt's tokens: UTF-8 bytes of every message and of the schema
        (``schema``, default :data:`MODEL_OUTPUT_SCHEMA`), plus per-message and per-request
        overheads (a token covers at least one byte)."""
        size = sum(len(m["content"].encode()) + _MESSAGE_OVERHEAD_TOKENS for m in messages)
        schema_text = _SCHEMA_TEXT if schema is None else json.dumps(schema, separators=(",", ":"))
        return size + len(schema_text.encode()) + _REQUEST_OVERHEAD_TOKENS

    def units(self, tokens: int) -> int:
        """Cost units of ``tokens`` (rounded up)."""
        return math.ceil(tokens * self.units_per_1k / 1000)

    def reservation(self, messages: list[dict], schema: dict | None = None) -> dict:
        """``{"tokens", "money"}`` to reserve for one call with ``messages`` (and ``schema``): the
        prompt bound plus ``max_tokens``, and its price."""
        tokens = self.prompt_token_bound(messages, schema) + self.max_output_tokens
        return {"tokens": tokens, "money": self.units(tokens)}

    def cost(self, result: CallResult, reserved: dict) -> tuple[dict, dict | None]:
        """``(used, overrun)``: what ``result`` is charged — at most ``reserved`` per dimension —
        and, when the server reported more tokens than the bound, the overrun it reported."""
        if result.outcome in NOT_PROCESSED or result.sent is False \
                or (result.outcome == "error" and result.http_status is not None):
            return {"tokens": 0, "money": 0}, None
        if result.usage is None:
            return {"tokens": reserved["tokens"], "money": reserved["money"]}, None  # unknown: the worst case
        reported = result.usage["prompt_tokens"] + result.usage["completion_tokens"]  # sanitized: ints ≥ 0
        tokens = max(0, min(reported, reserved["tokens"]))
        overrun = {"reported_tokens": reported, "reserved_tokens": reserved["tokens"]} \
            if reported > reserved["tokens"] else None
        return {"tokens": tokens, "money": min(self.units(tokens), reserved["money"])}, overrun

    # --- the call -------------------------------------------------------------------------------
    def request_body(self, messages: list[dict], schema: dict | None = None) -> dict:
        """The chat-completions request: ``messages`` at temperature 0, ``max_tokens`` capped, and
        the reply constrained to ``schema`` (default :data:`MODEL_OUTPUT_SCHEMA`): by OpenAI's
        ``json_schema`` response format (vLLM and Ollama take it too), or — ``response_format``
        ``json_object`` — by ``{"type": "json_object", "schema": …}``, the only form in which
        llama-cpp-python's server turns the schema into a grammar."""
        schema = schema or MODEL_OUTPUT_SCHEMA
        if self.response_format == "json_object":  # llama-cpp-python's server: the schema becomes a grammar
            response_format = {"type": "json_object", "schema": grammar_schema(schema)}
        else:
            response_format = {"type": "json_schema",
                               "json_schema": {"name": "ticket_draft", "strict": True, "schema": schema}}
        return {"model": self.model, "messages": messages, "temperature": 0, "max_tokens": self.max_output_tokens,
                "response_format": response_format}

    def complete(self, messages: list[dict], *, timeout: float, schema: dict | None = None,
                 should_stop: Callable[[], bool] | None = None, poll_seconds: float = 0.25) -> CallResult:
        """One HTTP attempt, at most ``timeout`` seconds. While it runs, ``should_stop()`` is asked
        every ``poll_seconds``; when it says True the call is abandoned (``cancelled``; the
        request may still complete at the server, so its usage is unknown)."""
        box: dict = {}
        started = time.monotonic()

        limit = settings.FAULTDESK["MODEL_MAX_REPLY_BYTES"]
        body = self.request_body(messages, schema)

        def run() -> None:
            try:
                # The gateway reads at most ``limit`` bytes of the reply (a server that sends more is
                # cut off) and ends the whole call at ``timeout``.
                box["response"] = http_request(tools.MODEL, "POST", f"{self.base_url}/chat/completions", json=body,
                                               timeout=timeout, connect_timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - classified below
                box["error"] = exc

        # the call's thread carries this context (the task's ids bound for the logs and the gateway's record)
        worker = threading.Thread(target=contextvars.copy_context().run, args=(run,), name="model-call", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(poll_seconds)
            if not worker.is_alive():
                break
            if should_stop is not None and should_stop():
                return CallResult(outcome="cancelled", latency_ms=_ms(started),
                                  error="the task was cancelled while the model call was in flight")
            if time.monotonic() - started > timeout:
                # the whole call's deadline (the gateway's own ends the request on its thread)
                return CallResult(outcome="timeout", latency_ms=_ms(started),
                                  error=f"no complete answer within {timeout:.1f} s")
        latency = _ms(started)
        if isinstance(box.get("error"), gateway_errors.ResponseTooLarge):
            result = CallResult(outcome="malformed", latency_ms=latency, http_status=box["error"].status,
                                problems=[f"(response): the reply is larger than {limit} bytes; not read further"])
        elif "error" in box:
            result = _transport_failure(box["error"], latency, timeout)
        else:
            result = _classify(box["response"], latency, self.output_parser)
        return self._redacted(result)

    def _redacted(self, result: CallResult) -> CallResult:
        """The result with the API key removed from every text that is recorded (an upstream may
        echo the request's Authorization header in an error or a reply): the gateway, which holds
        the key, redacts it."""

        def clean(text):
            return redact(tools.MODEL, text)

        result.content, result.error = clean(result.content), clean(result.error)
        result.problems = [clean(pr) for pr in result.problems]
        if result.output is not None:  # parsed from the content: a credential escaped inside it comes out here
            result.output = redact_data(tools.MODEL, result.output)
        return result


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _transport_failure(exc: Exception, latency: int, timeout: float) -> CallResult:
    """The result of a call the gateway ended without an answer: a refused destination is an
    ``error`` that never left (charged nothing, not retried); no connection is ``unavailable``;
    anything after the request may have been sent is ``timeout`` (usage unknown)."""
    if isinstance(exc, gateway_errors.DestinationRefused):
        return CallResult(outcome="error", latency_ms=latency, sent=False,
                          error=f"refused by the tool gateway: {exc.detail}"[:300])
    if isinstance(exc, gateway_errors.ConnectFailed):
        return CallResult(outcome="unavailable", latency_ms=latency, sent=False,
                          error=f"no connection: {exc.detail}"[:300])
    if isinstance(exc, gateway_errors.CallTimedOut):  # the whole call's deadline, as the poll below says it
        return CallResult(outcome="timeout", latency_ms=latency, error=f"no complete answer within {timeout:.1f} s")
    # the request may have been sent: usage unknown
    return CallResult(outcome="timeout", latency_ms=latency, error=f"transport error: {exc}"[:300])


def _classify(response: httpx.Response, latency: int, parser: str = OUTPUT_PARSER_VERSION) -> CallResult:
    status = response.status_code
    retry_after = None
    if "retry-after" in response.headers:
        try:
            retry_after = float(response.headers["retry-after"])
        except ValueError:
            retry_after = None
        if retry_after is not None and not (math.isfinite(retry_after) and retry_after >= 0):
            retry_after = None
    if status == 429:
        return CallResult(outcome="rate_limited", http_status=status, latency_ms=latency, retry_after=retry_after,
                          error=response.text[:300])
    if status >= 500:
        return CallResult(outcome="unavailable", http_status=status, latency_ms=latency, retry_after=retry_after,
                          error=response.text[:300])
    if status != 200:
        return CallResult(outcome="error", http_status=status, latency_ms=latency,
                          error=f"HTTP {status}: {response.text[:300]}")

    def malformed(problem: str, **extra) -> CallResult:
        return CallResult(outcome="malformed", http_status=status, latency_ms=latency, problems=[_short(problem)],
                          **extra)

    try:
        body = response.json()
    except ValueError:
        return malformed("(response): the body is not JSON")
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return malformed("(response): not a chat completion (no choices)")
    choice = choices[0]
    usage = _usage(body.get("usage"))
    message = choice.get("message")
    if not isinstance(message, dict):
        return malformed("(response): the choice has no message object", usage=usage)
    content = message.get("content")
    if message.get("refusal"):
        return malformed(f"(root): the model refused: {str(message['refusal'])[:200]}", usage=usage,
                         content=content if isinstance(content, str) else None)
    if choice.get("finish_reason") == "length":
        return malformed("(root): the reply was cut off at max_tokens", usage=usage,
                         content=content if isinstance(content, str) else None)
    output, problems = model_output_parse(content, parser)
    return CallResult(outcome="ok" if output is not None else "malformed", http_status=status, latency_ms=latency,
                      usage=usage, content=content if isinstance(content, str) else None, output=output,
                      problems=problems)


def _usage(raw) -> dict | None:
    """``{"prompt_tokens", "completion_tokens"}`` as non-negative ints, or None when the server's
    usage is missing or not believable (negative, not a finite number): then it is unknown and the
    call is charged its whole reservation."""
    if not isinstance(raw, dict):
        return None
    out = {}
    for key in ("prompt_tokens", "completion_tokens"):
        value = raw.get(key, 0)
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            return None
        out[key] = int(value)
    return out


def provider_for(bundle: dict, conf: dict) -> OpenAICompatibleProvider | None:
    """The provider pinned in a task's artifact ``bundle``: None for ``local``; the
    OpenAI-compatible provider at the pinned base URL and model otherwise (the price comes from
    ``conf``, settings.FAULTDESK; the API key is the tool gateway's). Raises ValueError for an
    unknown provider."""
    name = bundle.get("model_provider", LOCAL)
    if name == LOCAL:
        return None
    if name != OPENAI_COMPATIBLE:
        raise ValueError(f"unknown model provider {name!r}")
    return OpenAICompatibleProvider(
        base_url=bundle["model_base_url"], model=bundle["model"],
        max_output_tokens=bundle.get("max_output_tokens", conf["MODEL_MAX_OUTPUT_TOKENS"]),
        units_per_1k=bundle.get("units_per_1k_tokens", conf["MODEL_UNITS_PER_1K_TOKENS"]),
        response_format=bundle.get("response_format", "json_schema"),
        output_parser=bundle.get("output_parser", "model-output-parser/1"),
    )


def runs_in_process(bundle: dict | None) -> bool:
    """Does the model pinned in ``bundle`` run in this process (the local drafter: no outside call,
    no wait), so that a draft needs no worker of the model pool?"""
    return (bundle or {}).get("model_provider", LOCAL) == LOCAL


def bundle_entries(conf: dict) -> dict:
    """The model part of a new task's artifact bundle (provider, model, base URL, output cap,
    price, output parser). Raises ValueError for an unknown provider."""
    name = conf["MODEL_PROVIDER"]
    if name == LOCAL:
        return {"model_provider": LOCAL, "model": LOCAL_MODEL_ID}
    if name != OPENAI_COMPATIBLE:
        raise ValueError(f"FAULTDESK_MODEL_PROVIDER must be one of {PROVIDERS}, not {name!r}")
    if conf.get("MODEL_RESPONSE_FORMAT", "json_schema") not in RESPONSE_FORMATS:
        raise ValueError(f"FAULTDESK_MODEL_RESPONSE_FORMAT must be one of {RESPONSE_FORMATS}, "
                         f"not {conf['MODEL_RESPONSE_FORMAT']!r}")
    return {"model_provider": OPENAI_COMPATIBLE, "model": conf["MODEL_NAME"],
            "model_base_url": conf["MODEL_BASE_URL"], "max_output_tokens": conf["MODEL_MAX_OUTPUT_TOKENS"],
            "units_per_1k_tokens": conf["MODEL_UNITS_PER_1K_TOKENS"], "output_parser": OUTPUT_PARSER_VERSION,
            "response_format": conf.get("MODEL_RESPONSE_FORMAT", "json_schema")}
