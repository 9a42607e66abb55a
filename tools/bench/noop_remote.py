"""A no-op ticket service for the outbox benchmark: it speaks just enough of the reference ticket
service's API (``POST /tickets``, ``POST /ticket-batches``, ``GET /tickets?idempotency_key=``,
``GET /healthz``) to answer at once, storing nothing — so the dispatcher's own cost is what is
measured.

``python -m tools.bench.noop_remote --port P [--no-batch]``. Each ``POST /tickets`` answers 201 with a
new ticket id, each item of a ``POST /ticket-batches`` a 201 result of its own; a lookup finds
nothing; anything else is 404 (``--no-batch``: the batch endpoint too, as a ticket service without
one answers).

It is a minimal HTTP/1.1 server on asyncio (keep-alive, ``Content-Length`` bodies, no chunked
requests): the stdlib's ``http.server`` spent ~0.4 ms of CPU per request parsing headers with the
e-mail parser and starting a thread per connection, a fifth of the budget the outbox drain has per
message on two cores, which would have been measured as the dispatcher's."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json

_ids = itertools.count(1)
_REASONS = {200: b"OK", 201: b"Created", 400: b"Bad Request", 404: b"Not Found"}


def _response(status: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status, _REASONS[status], len(data)))
    return head + data


def _ticket(key: str | None) -> dict:
    return {"id": f"NOOP-{next(_ids):06d}", "version": 1, "status": "open", "idempotency_key": key}


#: whether ``POST /ticket-batches`` is answered (``--no-batch``: 404, as a service without it)
BATCH = True


def answer(method: bytes, path: bytes, headers: dict[bytes, bytes], body: bytes = b"") -> bytes:
    """The response bytes for one request: ``method`` and ``path`` as sent, ``headers`` with
    lower-case names, ``body`` the request body."""
    if method == b"GET" and path.startswith(b"/healthz"):
        return _response(200, {"ok": True})
    if method == b"GET" and path.startswith(b"/tickets"):
        return _response(200, {"results": []})
    if method == b"POST" and path.rstrip(b"/") == b"/tickets":
        key = headers.get(b"idempotency-key")
        return _response(201, _ticket(key.decode() if key is not None else None))
    if BATCH and method == b"POST" and path == b"/ticket-batches":
        try:
            items = json.loads(body)["items"]
            results = [{"idempotency_key": item["idempotency_key"], "status": 201, "replayed": False,
                        "ticket": _ticket(item["idempotency_key"])} for item in items]
        except (ValueError, KeyError, TypeError):
            return _response(400, {"error": "invalid_params"})
        return _response(200, {"results": results})
    return _response(404, {"detail": "not found"})


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection: requests answered in order until the client closes it or asks to."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ")
            if len(parts) != 3:
                writer.write(_response(400, {"detail": "bad request line"}))
                return
            headers = {}
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get(b"content-length") or 0)
            body = await reader.readexactly(length) if length else b""
            writer.write(answer(parts[0], parts[1], headers, body))
            if headers.get(b"connection", b"").lower() == b"close":
                return
    finally:
        writer.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=128)
    async with server:
        await server.serve_forever()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.noop_remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-batch", action="store_true", help="answer POST /ticket-batches with 404")
    args = parser.parse_args(argv)
    global BATCH
    BATCH = not args.no_batch
    asyncio.run(_main(args.port))


if __name__ == "__main__":
    main()
