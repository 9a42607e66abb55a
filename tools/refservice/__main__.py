"""Command line entry point: ``python -m tools.refservice [options]``.

Options: ``--host`` (127.0.0.1), ``--port`` (8765; 0 picks a free port),
``--db`` (var/refservice/tickets.sqlite3), ``--api-key`` (else the
``REFSERVICE_API_KEY`` environment variable; neither means auth is off),
``--log-level`` (INFO), ``--webhook-url`` (else ``REFSERVICE_WEBHOOK_URL``; the
HMAC secret comes from ``REFSERVICE_WEBHOOK_SECRET``; both needed to send
webhooks). Stops cleanly on SIGINT or SIGTERM.
"""

import argparse
import logging
import os
import signal
import sys

from .server import make_server

log = logging.getLogger("tools.refservice")


def build_parser():
    """Return the ``argparse`` parser for the command line options."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.refservice", description="Run the faultdesk reference ticket service."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8765, help="TCP port, 0 for any free one (default: %(default)s)"
    )
    parser.add_argument(
        "--db", default="var/refservice/tickets.sqlite3", help="SQLite file (default: %(default)s)"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer key; default: $REFSERVICE_API_KEY; none = auth off"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: %(default)s)")
    parser.add_argument("--webhook-url", default=None,
                        help="deliver signed status-change webhooks here; default: $REFSERVICE_WEBHOOK_URL")
    return parser


def resolve_api_key(cli_value, environ=os.environ):
    """Return the API key: ``--api-key`` if given, else ``REFSERVICE_API_KEY``, else None (auth off)."""
    return cli_value or environ.get("REFSERVICE_API_KEY") or None


def _stop(signum, frame):
    raise KeyboardInterrupt


def main(argv=None):
    """Run the service in the foreground until interrupted; return the exit code (0)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    api_key = resolve_api_key(args.api_key)
    webhook_url = args.webhook_url or os.environ.get("REFSERVICE_WEBHOOK_URL") or None
    webhook_secret = os.environ.get("REFSERVICE_WEBHOOK_SECRET") or None
    server = make_server(args.host, args.port, args.db, api_key, webhook_url, webhook_secret)
    log.info("refservice listening on %s db=%s auth=%s webhooks=%s", server.url, args.db,
             "on" if api_key else "off", webhook_url if webhook_secret else "off")
    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        log.info("refservice stopping")
    finally:
        if server.webhooks is not None:
            server.webhooks.stop()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
