"""A scripted model server: the OpenAI-compatible chat-completions API on loopback, answering from
a script (ADR 0013). Tests and the demo drive the ``openai_compatible`` provider against it
as a real HTTP server; there is no hosted model here.

A script is a list of steps, consumed one per ``POST /v1/chat/completions``. When the script runs
out, each further request gets ``default`` (a valid draft built from the prompt). A step is a dict:

* ``{"reply": "draft"}`` — a valid reply built from the prompt: it cites the first evidence
  ``chunk_id`` values the prompt shows and summarises the request. ``"overrides": {...}`` replaces
  fields of that reply (e.g. ``{"priority": "P1"}`` or ``{"missing_information": ["…"]}``).
* ``{"content": "..."}`` — this exact message content (e.g. malformed JSON).
* ``{"status": 503}`` (or 429, 500, 400 …) — an error answer; ``"retry_after": 1`` adds the header.
* ``{"drop": true}`` — close the connection without answering.
* Any step may add ``"delay_seconds": 2.5`` (wait before answering), ``"usage": {"prompt_tokens",
  "completion_tokens"}`` (report this usage), ``"finish_reason": "length"``, ``"refusal": "..."``.

``GET /healthz`` needs no key. Admin endpoints (same bearer key): ``GET /_script/requests`` lists
what was received (model, the messages, ``max_tokens``, ``response_format``, time); ``POST /_script``
replaces the script with ``{"steps": [...], "default": {...}}`` and clears the request log.

``python -m tools.scripted_model_server --port 8767 [--script steps.json] [--api-key KEY]`` runs it
standalone (``make up`` does, on ``MODEL_PORT``, so ``FAULTDESK_MODEL_PROVIDER=openai_compatible``
works out of the box).
"""

from __future__ import annotations

import html
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CHUNK_IDS = re.compile(r'<evidence chunk_id="([^"]+)"')
_REQUEST = re.compile(r"<request[^>]*>(.*?)</request>", re.S)
_DEVICE = re.compile(r"<device>(.*?)</device>", re.S)


def draft_from_prompt(messages: list[dict]) -> dict:
    """A valid model reply for ``messages`` (prompt template ``ticket-draft/3``): title and
    description from the request and device, the first three evidence chunk ids cited."""
    text = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "user")
    ids = list(dict.fromkeys(_CHUNK_IDS.findall(text)))[:3]
    found = _REQUEST.search(text)
    symptom = html.unescape(found.group(1)).strip() if found else "device fault"
    device = {}
    if (d := _DEVICE.search(text)) is not None:
        try:
            device = json.loads(html.unescape(d.group(1)))
        except json.JSONDecodeError:
            device = {}
    tag = device.get("asset_tag") or "device"
    alert = device.get("alert_code") or "no active alert"
    return {
        "title": f"[{tag}] {alert}: {symptom[:80]}"[:200],
        "description": f"Reported: {symptom}\n\nDevice {tag} is {device.get('state', 'unknown')} with {alert}. "
                       "Follow the cited procedure before dispatching a technician.",
        "priority": "P2",
        "alert_summary": f"{tag} is {device.get('state', 'unknown')} with {alert}",
        "evidence": ids or ["none"],
        "missing_information": [],
    }


class ScriptedModelServer(ThreadingHTTPServer):
    """The server. ``steps``: the script; ``default``: the step once it ran out; ``api_key``:
    the bearer key every request must carry. ``requests`` is the log of received completions."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], *, steps: list[dict] | None = None, default: dict | None = None,
                 api_key: str = "test-model-key"):
        super().__init__(address, _Handler)
        self.lock = threading.Lock()
        self.api_key = api_key
        self.set_script(steps or [], default)

    @property
    def url(self) -> str:
        """The base URL of the OpenAI-compatible API (``http://host:port/v1``)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def set_script(self, steps: list[dict], default: dict | None = None) -> None:
        """Replace the script and clear the request log."""
        with self.lock:
            self.steps = list(steps)
            self.default = default or {"reply": "draft"}
            self.requests: list[dict] = []

    def next_step(self, body: dict) -> dict:
        with self.lock:
            self.requests.append({"at": time.time(), "model": body.get("model"), "messages": body.get("messages"),
                                  "max_tokens": body.get("max_tokens"),
                                  "response_format": body.get("response_format")})
            return self.steps.pop(0) if self.steps else dict(self.default)


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedModelServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        return

    def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.server.api_key}":
            return True
        self._send(401, {"error": {"message": "invalid API key", "type": "invalid_request_error"}})
        return False

    def _body(self) -> dict | list | None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            self._send(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}})
            return None
        return body if isinstance(body, dict) else []  # not an object: each endpoint refuses it

    def do_GET(self):  # noqa: N802
        if self.path == "/healthz":
            self._send(200, {"ok": True})
            return
        if not self._authorized():
            return
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "scripted-model", "object": "model"}]})
        elif self.path == "/_script/requests":
            with self.server.lock:
                self._send(200, {"requests": list(self.server.requests), "remaining": len(self.server.steps)})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):  # noqa: N802
        if not self._authorized():
            return
        body = self._body()
        if body is None:
            return
        if self.path == "/_script":
            if not isinstance(body, dict):
                self._send(400, {"error": {"message": "the body must be an object: {steps, default}"}})
                return
            steps, default = body.get("steps") or [], body.get("default")
            if not isinstance(steps, list) or not all(isinstance(x, dict) for x in steps) \
                    or not (default is None or isinstance(default, dict)):
                self._send(400, {"error": {"message": "steps must be a list of objects, default an object or null"}})
                return
            self.server.set_script(steps, default)
            self._send(200, {"steps": len(self.server.steps)})
            return
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self._send(400, {"error": {"message": "messages is required", "type": "invalid_request_error"}})
            return
        step = self.server.next_step(body)
        try:
            self._complete(body, step)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout or a cancel on its side)
        except Exception as exc:  # noqa: BLE001 - a bad step answers 500, never a dropped connection
            self._send(500, {"error": {"message": f"scripted step failed: {type(exc).__name__}: {exc}",
                                       "type": "server_error"}})

    def _complete(self, body: dict, step: dict) -> None:
        if step.get("delay_seconds"):
            time.sleep(float(step["delay_seconds"]))
        if step.get("drop"):
            self.close_connection = True
            self.connection.close()
            return
        status = int(step.get("status", 200))
        if status != 200:
            headers = {"Retry-After": step["retry_after"]} if "retry_after" in step else None
            self._send(status, {"error": {"message": step.get("message", f"scripted {status}"),
                                          "type": "server_error" if status >= 500 else "invalid_request_error"}},
                       headers)
            return
        messages = body["messages"]
        if "content" in step:
            content = step["content"]
        else:
            content = json.dumps({**draft_from_prompt(messages), **(step.get("overrides") or {})})
        prompt_chars = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
        usage = step.get("usage") or {"prompt_tokens": max(1, prompt_chars // 4),
                                      "completion_tokens": max(1, len(str(content or "")) // 4)}
        message = {"role": "assistant", "content": content}
        if step.get("refusal"):
            message = {"role": "assistant", "content": None, "refusal": step["refusal"]}
        self._send(200, {
            "id": f"chatcmpl-scripted-{len(self.server.requests)}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model", "scripted-model"),
            "choices": [{"index": 0, "message": message, "finish_reason": step.get("finish_reason", "stop")}],
            "usage": usage if "usage" in step else {**usage, "total_tokens": usage["prompt_tokens"]
                                                    + usage["completion_tokens"]},
        })


def serve_in_thread(host: str = "127.0.0.1", port: int = 0, *, steps: list[dict] | None = None,
                    default: dict | None = None, api_key: str = "test-model-key") -> ScriptedModelServer:
    """Start a :class:`ScriptedModelServer` on ``host:port`` (0: any free port) in a daemon
    thread and return it; ``server.shutdown()`` stops it."""
    server = ScriptedModelServer((host, port), steps=steps, default=default, api_key=api_key)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-model-server",
                     daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> None:
    """Command line: serve until interrupted. ``--script`` is a JSON file with a list of steps
    (or ``{"steps": [...], "default": {...}}``)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(description="faultdesk's scripted OpenAI-compatible model server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--script", help="JSON file: a list of steps, or {steps, default}")
    parser.add_argument("--api-key", default=os.environ.get("FAULTDESK_MODEL_API_KEY", "faultdesk-model-dev-key"))
    args = parser.parse_args(argv)
    steps, default = [], None
    if args.script:
        with open(args.script, encoding="utf-8") as fh:
            loaded = json.load(fh)
        steps, default = (loaded, None) if isinstance(loaded, list) else (loaded.get("steps") or [],
                                                                           loaded.get("default"))
    server = ScriptedModelServer((args.host, args.port), steps=steps, default=default, api_key=args.api_key)
    print(f"scripted model server on {server.url} ({len(steps)} scripted steps)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
