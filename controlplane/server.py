"""`berth controlplane serve`: run the control plane's HTTP API until SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys

import structlog
from aiohttp import web

from common import logs
from controlplane.api.app import create_app
from controlplane.wiring import Config, ConfigError, default_db_url

log = structlog.get_logger("berth.controlplane")


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth controlplane", description="Berth's control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 8080), metavar="HOST:PORT",
                       help="address to listen on (default 127.0.0.1:8080; port 0 picks a free one)")
    serve.add_argument("--db", default=None, metavar="URL",
                       help=f"sqlite:///PATH (default {default_db_url()})")
    serve.add_argument("--bootstrap", default=None, metavar="FILE", help="JSON file applied idempotently at start")
    serve.add_argument("--authzen", default=None, metavar="URL",
                       help="decide with a remote OpenID AuthZEN service at URL instead of the embedded Cedar policies")
    serve.add_argument("--authzen-timeout", type=float, default=2.0, metavar="SECONDS",
                       help="a remote decision slower than this is a deny (default 2)")
    serve.add_argument("--node-grace", type=float, default=30.0, metavar="SECONDS",
                       help="a node whose agent is silent for longer is lost (default 30)")
    serve.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--synchronous", choices=("FULL", "NORMAL"), default="FULL",
                       help="SQLite durability: FULL survives power loss (default), NORMAL survives a crash")
    return parser


async def serve(config: Config, host: str, port: int) -> None:
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    addresses = [s.getsockname() for s in site._server.sockets]  # type: ignore[union-attr]
    bound = addresses[0]
    settle_garbage_collector()
    log.info("listening", address=f"http://{bound[0]}:{bound[1]}", db=config.db)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()


GC_THRESHOLD = (50_000, 20, 20)


def settle_garbage_collector() -> None:
    """After start-up, everything alive (the catalog, the calendar, the code) is kept for the process's life:
    freeze it out of the cyclic collector's reach, and collect the young generation less often, so a busy server
    does not rescan the whole fleet's catalog many times a second."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_format, args.log_level)
    config = Config(db=args.db or default_db_url(), bootstrap=args.bootstrap, synchronous=args.synchronous,
                    authzen=args.authzen, authzen_timeout_s=args.authzen_timeout, node_grace_s=args.node_grace)
    try:
        asyncio.run(serve(config, *args.listen))
    except ConfigError as exc:
        print(f"berth controlplane: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"berth controlplane: cannot listen on {args.listen[0]}:{args.listen[1]}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0
