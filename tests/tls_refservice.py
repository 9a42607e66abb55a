"""The reference ticket service behind TLS, for tests that run the production settings (which send
credentials only to https URLs): ``python -m tests.tls_refservice --port N --db FILE --cert PEM
--key PEM --api-key KEY``. The handshake happens on accept; everything else is the service's own."""

from __future__ import annotations

import argparse
import signal
import ssl
import sys

from tools.refservice.server import make_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tls_refservice")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--api-key", required=True)
    args = parser.parse_args(argv)
    server = make_server("127.0.0.1", args.port, args.db, args.api_key, None, None)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(args.cert, args.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"tls refservice on https://127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
