"""`berth controlplane serve`: run the control plane's HTTP API (plain, or TLS with --tls-cert) until SIGTERM;
`berth controlplane migrate`: move a SQLite database to PostgreSQL (controlplane/store/move.py); `backup` and
`restore`: copy a SQLite database while it serves, and put a copy back (controlplane/store/backup.py)."""
from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import ssl
import sys
from typing import Callable

import structlog
from aiohttp import web

from common import argtypes, logs, tls
from controlplane.api import access_log, guard
from controlplane.api.access_log import AccessLog
from controlplane.api.app import create_app, create_metrics_app
from controlplane.wiring import Config, ConfigError, default_db_url

log = structlog.get_logger("berth.controlplane")


def access_log_option(value: str) -> AccessLog | None:
    try:
        return access_log.parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--access-log: ")) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="berth controlplane", description="Berth's control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the HTTP API")
    serve.add_argument("--listen", type=argtypes.listen, default=("127.0.0.1", 8080), metavar="HOST:PORT",
                       help="address to listen on (default 127.0.0.1:8080; port 0 picks a free one)")
    serve.add_argument("--db", default=None, metavar="URL",
                       help="sqlite:///PATH, or postgresql://USER@HOST[:PORT]/DB (several replicas may share one; "
                       "?host=/run/postgresql for a unix socket; ?sslmode=verify-full&sslrootcert=FILE for TLS; the "
                       "password from PGPASSWORD or a passfile, PGPASSFILE: a password in this option is in the "
                       "process's command line, which every local user can read) (env BERTH_DB, which is not; "
                       f"default {default_db_url()})")
    serve.add_argument("--bootstrap", default=None, metavar="FILE", help="JSON file applied idempotently at start")
    serve.add_argument("--authzen", default=None, metavar="URL", type=argtypes.http_url,
                       help="decide with a remote OpenID AuthZEN service at URL instead of the embedded Cedar policies")
    serve.add_argument("--authzen-timeout", type=argtypes.seconds_within_a_day, default=2.0, metavar="SECONDS",
                       help="a remote decision slower than this is a deny (default 2)")
    serve.add_argument("--node-grace", type=argtypes.seconds_within_a_day, default=30.0, metavar="SECONDS",
                       help="a node whose agent is silent for longer is lost (default 30)")
    serve.add_argument("--commit-wait", type=argtypes.seconds_within_a_day, default=Config.commit_wait_s, metavar="SECONDS",
                       help="PostgreSQL: a request whose change is not committed within this (a synchronous standby "
                       "away, a stuck replica holding the write lock) is answered PROVIDER_UNAVAILABLE; the change "
                       "may still commit, so the client retries with the same idempotency key "
                       f"(default {Config.commit_wait_s:g})")
    limits = guard.Limits()
    serve.add_argument("--request-timeout", type=argtypes.seconds_within_a_day, default=limits.request_timeout_s,
                       metavar="SECONDS", help="a request's headers must arrive within this of its first byte, and "
                       f"then its body within this (default {limits.request_timeout_s:g})")
    serve.add_argument("--idle-timeout", type=argtypes.seconds_within_a_day, default=limits.idle_timeout_s, metavar="SECONDS",
                       help=f"close a connection with no request in progress after this (default "
                       f"{limits.idle_timeout_s:g})")
    serve.add_argument("--max-connections", type=int, default=limits.max_connections, metavar="N",
                       help="connections held open at most; at the cap the longest-waiting idle one is closed "
                       f"(default: the open-file limit less {guard.FD_RESERVE})")
    serve.add_argument("--metrics-listen", type=argtypes.listen, default=None, metavar="HOST:PORT",
                       help="also serve /metrics without a token on this address, e.g. 127.0.0.1:9464 (default off; "
                       "the API's /metrics needs the admin token)")
    serve.add_argument("--access-log", type=access_log_option, default=None, metavar="off|all|sample:N",
                       help="one structured line per request (method, path, status, duration, tenant, principal, "
                       "reservation; never a token): all, 1 in N with every error, or off (default)")
    env = os.environ.get
    serve.add_argument("--tls-cert", metavar="FILE", default=env("BERTH_TLS_CERT") or None,
                       help="serve HTTPS (TLS 1.2 or later) with this PEM certificate chain, the server's own "
                       "certificate first (env BERTH_TLS_CERT; needs --tls-key; default: plain HTTP)")
    serve.add_argument("--tls-key", metavar="FILE", default=env("BERTH_TLS_KEY") or None,
                       help="the unencrypted PEM private key of --tls-cert (env BERTH_TLS_KEY)")
    serve.add_argument("--tls-client-ca", metavar="FILE", default=env("BERTH_TLS_CLIENT_CA") or None,
                       help="mutual TLS: every client must present a certificate signed by a CA in this PEM file "
                       "(env BERTH_TLS_CLIENT_CA; needs --tls-cert)")
    serve.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    serve.add_argument("--log-level", default="info", type=str.lower,
                       choices=("debug", "info", "warning", "error", "critical"))
    serve.add_argument("--synchronous", choices=("FULL", "NORMAL"), default="FULL",
                       help="SQLite durability: FULL survives power loss (default), NORMAL survives a crash")
    migrate = sub.add_parser(
        "migrate", help="move a SQLite database to PostgreSQL (stop the control plane on it first)",
        description="Copy every table of a control plane's SQLite database into a PostgreSQL database, in one "
        "transaction (a failure leaves the target unchanged), for moving from one control plane to several "
        "replicas (docs/scale-out.md). Stop the control plane that serves the SQLite file first: the copy reads "
        "it under BEGIN IMMEDIATE, so a running one cannot write meanwhile, but what it writes afterwards is not "
        "moved. Exit 0: moved (a summary on stdout); 2: refused, nothing changed (a URL, the file, or a target "
        "that already holds data); 1: the copy failed (e.g. two bookings of one device overlap in the file), the "
        "target unchanged.")
    migrate.add_argument("--from", dest="source", required=True, metavar="sqlite:///PATH",
                         help="the SQLite database to move (brought to this Berth's schema first)")
    migrate.add_argument("--to", dest="target", required=True, metavar="postgresql://...",
                         help="an existing PostgreSQL database: postgresql://USER@HOST[:PORT]/DB (the password in "
                         "PGPASSWORD or a passfile; ?sslmode=verify-full&sslrootcert=FILE for TLS), or "
                         "postgresql://USER@/DB?host=/run/postgresql for a unix socket; it must hold no "
                         "reservations, events or catalog yet")
    migrate.add_argument("--replace", action="store_true",
                         help="empty the target first (in the same transaction as the copy) instead of refusing "
                         "one that holds data")
    backup = sub.add_parser(
        "backup", help="copy a SQLite database while the control plane serves it",
        description="Write a consistent copy of the control plane's SQLite database to a new file, while the "
        "control plane goes on serving: the copy is the database as one read transaction sees it, checked "
        "(PRAGMA integrity_check) and renamed into place once whole. Restore it by stopping the control plane "
        "and putting the copy in the database's place (docs/operations.md, \"Backups\"). PostgreSQL: use "
        "pg_dump. Exit 0: copied (a summary on stdout); 2: refused, nothing written (a URL, a path, a target "
        "that exists); 1: the copy failed, nothing left under the target's name.")
    backup.add_argument("--db", default=None, metavar="sqlite:///PATH",
                        help=f"the database the control plane serves (env BERTH_DB; default {default_db_url()})")
    backup.add_argument("--to", dest="target", required=True, metavar="FILE", help="the copy: a new file")
    backup.add_argument("--replace", action="store_true", help="overwrite FILE where it exists")
    restore = sub.add_parser(
        "restore", help="put a backup in the place of a stopped control plane's SQLite database",
        description="Put a copy `berth controlplane backup` wrote in the place of the control plane's SQLite "
        "database. Stop the control plane first: the restore refuses while any process has the database open. "
        "The database it replaces is kept beside it (NAME.replaced-TIMESTAMP, with its -wal and -shm), and its "
        "highest event and reservation numbers are carried into the restored one, so that events from then on "
        "are numbered after every cursor a client holds. What was booked after the copy was taken is gone: "
        "docs/operations.md, \"Backups\", says what that means for tenants and agents. Exit 0: restored (a "
        "summary on stdout); 2: refused, nothing changed; 1: the restore failed (a full disk), and the "
        "database is put back as it was.")
    restore.add_argument("--from", dest="copy", required=True, metavar="FILE", help="the copy to restore")
    restore.add_argument("--db", default=None, metavar="sqlite:///PATH",
                         help=f"the database to replace (env BERTH_DB; default {default_db_url()})")
    return parser


def refused(command: str, message: str) -> int:
    """A maintenance command refused before it began: the message on stderr, exit 2 (nothing changed)."""
    print(f"berth controlplane {command}: {message}", file=sys.stderr)
    return 2


def run_tool(command: str, work: Callable[[], str], refusals: tuple[type[Exception], ...],
             failure: type[Exception]) -> int:
    """A maintenance command's outcome as its exit status: 0 with the summary `work` returns on stdout; 2 where
    it raised one of `refusals` (nothing changed), 1 where it raised `failure`; each message on stderr."""
    try:
        summary = work()
    except refusals as exc:
        return refused(command, str(exc))
    except failure as exc:
        print(f"berth controlplane {command}: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0


def database_of(args: argparse.Namespace) -> tuple[str, str]:
    """The database URL (--db, else BERTH_DB, else the default) and where it came from, as errors name it."""
    if args.db:
        return args.db, "--db"
    if os.environ.get("BERTH_DB"):
        return os.environ["BERTH_DB"], "BERTH_DB"
    return default_db_url(), "the default database"


def backup_main(args: argparse.Namespace) -> int:
    """`berth controlplane backup`: the URL checked, the copy made (controlplane/store/backup.py)."""
    from controlplane.store import backup
    from controlplane.wiring import is_postgresql, sqlite_path

    db, source = database_of(args)
    if is_postgresql(db):
        return refused("backup", f"{source} {logs.redact_url(db)}: a PostgreSQL database is backed up with "
                       "PostgreSQL's tools: pg_dump -Fc -f FILE DBNAME, or your cluster's base backups and WAL "
                       "archive (docs/operations.md, \"Backups\")")

    def work() -> str:
        path = sqlite_path(db, source)
        if sys.stderr.isatty():
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            print(f"berth controlplane backup: copying {path} ({size / (1 << 20):.1f} MiB) to {args.target} ...",
                  file=sys.stderr)
        return backup.backup(path, args.target, replace=args.replace).summary()

    return run_tool("backup", work, (ConfigError, backup.Refused), backup.Failed)


def restore_main(args: argparse.Namespace) -> int:
    """`berth controlplane restore`: the URL checked, the copy put in place (controlplane/store/backup.py)."""
    from controlplane.store import backup
    from controlplane.store.sqlite import SCHEMA_VERSION
    from controlplane.wiring import is_postgresql, sqlite_path

    db, source = database_of(args)
    if is_postgresql(db):
        return refused("restore", f"{source} {logs.redact_url(db)}: a PostgreSQL database is restored with "
                       "PostgreSQL's tools: pg_restore into an empty database (docs/operations.md, \"Backups\")")
    return run_tool("restore", lambda: backup.restore(args.copy, sqlite_path(db, source), SCHEMA_VERSION).summary(),
                    (ConfigError, backup.Refused), backup.Failed)


def migrate_main(args: argparse.Namespace) -> int:
    """`berth controlplane migrate`: the URLs checked, the copy run (controlplane/store/move.py), the summary
    printed."""
    from controlplane.store import move
    from controlplane.wiring import is_postgresql, postgresql_url_problem, sqlite_path

    if not args.source.startswith("sqlite:///"):
        return refused("migrate", f"--from {logs.redact_url(args.source)!r}: give the SQLite database as "
                       "sqlite:///PATH (sqlite:////abs/path for an absolute one)")
    if not is_postgresql(args.target):
        return refused("migrate", f"--to {logs.redact_url(args.target)!r}: give the PostgreSQL database as "
                       "postgresql://USER@HOST[:PORT]/DB, its password in PGPASSWORD or a passfile (or "
                       "postgresql://USER@/DB?host=/run/postgresql)")
    problem = postgresql_url_problem(args.target)
    if problem is not None:
        return refused("migrate", f"--to {logs.redact_url(args.target)}: {problem}")

    def work() -> str:
        path = sqlite_path(args.source, "--from")
        return move.summary(path, args.target, move.move(path, args.target, replace=args.replace))

    return run_tool("migrate", work, (ConfigError, move.Refused), move.Failed)


class CannotListen(Exception):
    """A listening address cannot be bound; the message names it and the reason."""


def tls_context_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ssl.SSLContext | None:
    """The listeners' SSL context from --tls-cert, --tls-key and --tls-client-ca (None: plain HTTP); a missing
    partner option is a usage error; a file that cannot be used raises tls.TlsError naming its option. A
    certificate expired, not valid yet or expiring within 30 days is logged."""
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key (env BERTH_TLS_CERT, BERTH_TLS_KEY) go together: give both, or "
                     "neither for plain HTTP")
    if args.tls_client_ca and not args.tls_cert:
        parser.error("--tls-client-ca (env BERTH_TLS_CLIENT_CA) needs --tls-cert and --tls-key: mutual TLS is TLS "
                     "first")
    if not args.tls_cert:
        return None
    context = tls.server_context(args.tls_cert, args.tls_key, args.tls_client_ca)
    tls.log_validity(log, args.tls_cert, "--tls-cert", "the server's")
    return context


async def serve(config: Config, host: str, port: int, limits: guard.Limits = guard.Limits(), cap: int | None = None,
                metrics_listen: tuple[str, int] | None = None, access_log: AccessLog | None = None,
                ssl_context: ssl.SSLContext | None = None) -> None:
    """Serve until SIGTERM or SIGINT; with ssl_context both the API and the metrics listener serve TLS."""
    loop = asyncio.get_running_loop()
    conns = guard.Guard(limits, cap if cap is not None else guard.connection_cap(limits))
    loop.set_exception_handler(conns.exception_handler)
    logging.getLogger("aiohttp.server").addFilter(conns)  # a malformed request: one rate-limited line
    app = create_app(config, limits=limits, access_log=access_log)
    # auto_decompress off: a Content-Encoding is refused in the API's own error document (api/body.py), not by
    # aiohttp's parser in plain text (and a traceback) midway through a body that is not what its header says
    runners = [web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=limits.idle_timeout_s,
                             auto_decompress=False)]
    if metrics_listen:
        runners.append(web.AppRunner(create_metrics_app(app), access_log=None, handle_signals=False,
                                     keepalive_timeout=limits.idle_timeout_s))
    try:
        sites = []
        for runner, (h, p), flag in zip(runners, [(host, port), metrics_listen], ("--listen", "--metrics-listen")):
            await runner.setup()
            sites.append(await listen(guard.GuardedSite(runner, h, p, conns, ssl_context=ssl_context), flag))
        settle_garbage_collector()
        extra = {"metrics": f"{sites[1].url}/metrics"} if metrics_listen else {}
        if ssl_context is not None:
            extra["mutual_tls"] = ssl_context.verify_mode == ssl.CERT_REQUIRED
        log.info("listening", address=sites[0].url, db=logs.redact_url(config.db), max_connections=conns.cap, **extra)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        logging.getLogger("aiohttp.server").removeFilter(conns)


async def listen(site: guard.GuardedSite, flag: str) -> guard.GuardedSite:
    try:
        await site.start()
    except OSError as exc:
        where = site.name.removeprefix(site.scheme + "://")
        hint = {errno.EADDRINUSE: f"another process listens there (ss -ltnp 'sport = :{where.rsplit(':', 1)[1]}'): stop it, or "
                                  f"give {flag} another port",
                errno.EADDRNOTAVAIL: f"no interface of this host has that address: give {flag} one it has, or "
                                     "0.0.0.0",
                errno.EACCES: f"ports below 1024 need privileges: give {flag} a port from 1024 up"}.get(exc.errno,
                                                                                                     f"check {flag}")
        raise CannotListen(f"{flag} {where}: cannot listen ({exc.strerror}); {hint}") from None
    return site


GC_THRESHOLD = (50_000, 20, 20)


def settle_garbage_collector() -> None:
    """After start-up, everything alive (the catalog, the calendar, the code) is kept for the process's life:
    freeze it out of the cyclic collector's reach, and collect the young generation less often, so a busy server
    does not rescan the whole fleet's catalog many times a second."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "migrate":
        logs.configure("auto", "warning")  # stderr: the progress and the errors; stdout: the summary only
        return migrate_main(args)
    if args.command in ("backup", "restore"):
        logs.configure("auto", "warning")
        return backup_main(args) if args.command == "backup" else restore_main(args)
    logs.configure(args.log_format, args.log_level)
    if args.db is not None and logs.redact_url(args.db) != args.db:
        log.warning("the --db URL holds a password, which every local user can read in this process's command "
                    "line: give it in PGPASSWORD or a passfile (PGPASSFILE), or the whole URL in BERTH_DB, in the "
                    "unit's environment file (mode 0640) instead; see docs/scale-out.md")
    if args.db == "":  # a variable left unset in a unit or a script: not the default database by surprise
        parser.error("--db: empty: give sqlite:///PATH or postgresql://..., or leave --db out (BERTH_DB, or the "
                     f"default {default_db_url()})")
    db, source = database_of(args)
    config = Config(db=db, db_source=source, bootstrap=args.bootstrap, synchronous=args.synchronous,
                    authzen=args.authzen, authzen_timeout_s=args.authzen_timeout, node_grace_s=args.node_grace,
                    commit_wait_s=args.commit_wait, freeze_memory=True)
    if args.metrics_listen and args.metrics_listen[1] == args.listen[1] != 0 and (
            args.metrics_listen[0] == args.listen[0] or {args.metrics_listen[0], args.listen[0]} & {"0.0.0.0", "::"}):
        parser.error(f"--metrics-listen {args.metrics_listen[0]}:{args.metrics_listen[1]}: the API listens there "
                     "(--listen): give the metrics another port, e.g. 127.0.0.1:9464")
    limits = guard.Limits(request_timeout_s=args.request_timeout, idle_timeout_s=args.idle_timeout,
                          max_connections=args.max_connections)
    try:
        cap = guard.connection_cap(limits)
        ssl_context = tls_context_of(parser, args)
    except ValueError as exc:  # tls.TlsError is one
        print(f"berth controlplane: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config, *args.listen, limits=limits, cap=cap, metrics_listen=args.metrics_listen,
                          access_log=args.access_log, ssl_context=ssl_context))
    except ConfigError as exc:
        print(f"berth controlplane: {exc}", file=sys.stderr)
        return 2
    except CannotListen as exc:
        print(f"berth controlplane: {exc}", file=sys.stderr)
        return 1
    return 0
