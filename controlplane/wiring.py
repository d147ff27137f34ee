"""The control plane assembled: store, catalog, IAM, writer state and services, opened and closed together."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection

import structlog

from common import logs
from controlplane import bootstrap as bootstrap_file
from controlplane import catalog as catalog_mod
from controlplane.catalog import Catalog
from controlplane.domain.clock import Clock
from controlplane.domain.errors import INVALID_INPUT, INVALID_STATE, PROVIDER_UNAVAILABLE, DomainError, invalid, not_found
from controlplane.domain.ids import token_hash
from controlplane.iam.cedar import CedarAuthorizer
from controlplane.billing import Billing
from controlplane.cleaning import Cleaner
from controlplane.confirmations import ConfirmationService
from controlplane.fleet import FleetService
from controlplane.iam.authorizer import Authorizer
from controlplane.nodes import NodeService, wanted_of
from controlplane.operations import OperationService
from controlplane.quotes import Quotes
from controlplane.reconciler import Reconciler
from controlplane.reservations import ReservationService
from controlplane.state import WriterState
from controlplane.store.groups import COMMIT_WAIT_S
from controlplane.store.port import CatalogChanges, Store, StoreError, Tx
from controlplane.store.sqlite import SqliteStore
from controlplane.tokens import Tokens
from controlplane.metrics import ControlPlaneMetrics
from controlplane.transitions import CatalogRef, Transitions

log = structlog.get_logger("berth.controlplane")



@contextlib.contextmanager
def collector_paused(freeze: bool = False):
    """The cyclic garbage collector off while the writer's memory is built whole: every object that makes is kept,
    and with the collector's default thresholds (at start, before the server raises them) rescanning the growing
    heap doubled a rebuild's time (docs/scale-out.md). `freeze`: what a build that succeeded made is then frozen
    out of the collector's reach (as the server freezes what its start made), else the first young collection
    after scans all of it at once, holding the API's loop (some 130 ms per 25,000 live reservations). Only for a
    process that keeps one control plane: what is frozen the collector never frees, cyclic garbage of the moment
    included (the memory itself holds no cycles: it is freed when replaced)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()


def secrets_of(tokens: dict[str, list[tuple[str, str]]], admin: str | None) -> list[str]:
    """Every token a bootstrap document declares (the logs redact them from then on)."""
    return [token for rows in tokens.values() for token, _ in rows] + ([admin] if admin else [])


def declare_secrets(tokens: dict[str, list[tuple[str, str]]], admin: str | None) -> None:
    """The logs redact a bootstrap document's tokens from now on; one holding a space, a quote or a backslash is
    redacted whole, but a line that cuts it short (aiohttp shows 100 bytes of a long header) may show its part
    after that character: said once, naming whose token it is, never the token."""
    logs.add_secrets(secrets_of(tokens, admin))
    rows = [(kind, subject, token) for kind, pairs in tokens.items() for token, subject in pairs]
    for kind, subject, token in rows + ([("admin", "adminToken", admin)] if admin else []):
        if any(c in token for c in " '\"\\"):
            log.warning("a token holds a space, a quote or a backslash: a log line that cuts it short may show part "
                        "of it; replace it with one without (openssl rand -base64 32)", kind=kind, of=subject)


class ConfigError(ValueError):
    """The control plane cannot start with this configuration; the message says what to change."""


def default_db_url() -> str:
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return f"sqlite:///{base / 'berth' / 'controlplane.db'}"


def is_postgresql(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def postgresql_url_problem(url: str) -> str | None:
    """What is wrong with the hosts and ports of a postgresql:// URL (each `host[:port]`, comma-separated), said
    before the driver reads it (it raises a bare ValueError or OverflowError); None when they read. A `/` or `@`
    left in the user or the password (a base64 password holds `/`) is said without showing either."""
    rest = url.split("://", 1)[1]
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    if netloc.count("@") > 1 or ("@" not in netloc and "@" in rest.split("?", 1)[0]):
        return ("the user or the password holds a '/' or an '@': percent-encode them in the URL (%2F and %40), or "
                "give the password in PGPASSWORD or a passfile")
    netloc = netloc.rpartition("@")[2]
    for part in filter(None, netloc.split(",")):
        port = part.rpartition("]")[2] if part.startswith("[") else part  # [IPv6]:port
        if ":" not in port:
            continue
        port = port.rpartition(":")[2]
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            return f"the port {port!r} of host {part!r} is not a number from 1 to 65535"
    return None


def sqlite_path(url: str, option: str = "--db") -> str:
    """The file of a `sqlite:///PATH` URL (PATH as written: `sqlite:////abs` and `sqlite:///rel` both work);
    `option` names where the URL was given, in the errors."""
    if not url.startswith("sqlite:///"):
        raise ConfigError(f"{option}: {logs.redact_url(url)!r} is not sqlite:///PATH or postgresql://...")
    path = url[len("sqlite:///"):]
    if not path:
        raise ConfigError(f"{option}: sqlite:/// needs a file path")
    if path == ":memory:":
        raise ConfigError(f"{option}: an in-memory database would lose every booking; give a file")
    if not path.startswith("/") and url.startswith("sqlite:////"):
        path = "/" + path
    return path


@dataclass
class Config:
    db: str = field(default_factory=default_db_url)
    bootstrap: str | None = None
    clock: Clock = field(default_factory=Clock)
    synchronous: str = "FULL"
    authzen: str | None = None  # base URL of a remote AuthZEN decision service, instead of embedded Cedar
    authzen_timeout_s: float = 2.0
    reconcile: bool = True  # run the reconciler loop (tests of a fake clock may drive passes themselves)
    node_grace_s: float = 30.0  # a node silent for longer is lost
    commit_wait_s: float = COMMIT_WAIT_S  # PostgreSQL: a change not committed by then: PROVIDER_UNAVAILABLE
    freeze_memory: bool = False  # a memory built whole is frozen out of the collector's reach (collector_paused)
    db_source: str = "--db"  # where db was given (--db, BERTH_DB, the default), as its errors name it


def open_store(config: Config) -> Store:
    """The engine the URL names: PostgreSQL (several replicas may share it) or a SQLite file."""
    if is_postgresql(config.db):
        from controlplane.store.postgres import PgStore

        problem = postgresql_url_problem(config.db)
        if problem is not None:
            raise ConfigError(f"{config.db_source} {logs.redact_url(config.db)}: {problem}")
        try:
            return PgStore(config.db, commit_wait_s=config.commit_wait_s)
        except StoreError as exc:
            raise ConfigError(f"{config.db_source} {logs.redact_url(config.db)}: {exc}") from None
    try:
        return SqliteStore(sqlite_path(config.db, config.db_source), config.synchronous)
    except StoreError as exc:
        raise ConfigError(f"{config.db_source} {logs.redact_url(config.db)}: {exc}") from None


def replicas_of(store: Store):
    """How this control plane shares its database: with other replicas (PostgreSQL), or not at all."""
    from controlplane.replicas import Shared, Solo
    from controlplane.store.postgres import PgStore

    return Shared(store) if isinstance(store, PgStore) else Solo(store)


class ControlPlane:
    """Every part of the control plane, built in dependency order; `open()` loads the store and the bootstrap."""

    def __init__(self, config: Config):
        self.config = config
        self.clock = config.clock
        self.store = open_store(config)
        self.catalog = CatalogRef(Catalog())
        self.state = WriterState()
        self.tokens = Tokens()
        self.moves = Transitions(self.clock, self.catalog, self.state)
        self.billing = Billing(self.store, self.clock, self.state)
        self.quotes = Quotes(self.store, self.clock, self.catalog, self.state)
        self.reconciler = Reconciler(self.store, self.clock, self.state, self.moves)
        self.confirmations = ConfirmationService(self.store, self.clock, self.moves)
        self.authorizer = self._authorizer()
        self.reservations = ReservationService(self.store, self.authorizer, self.clock, self.catalog, self.state,
                                               self.moves, self.billing, self.quotes, self.reconciler)
        self.operations = OperationService(self.store, self.moves, self.reservations)
        self.cleaner = Cleaner(self.store, self.clock, self.catalog, self.moves, self.reconciler)
        self.nodes = NodeService(self.store, self.clock, self.catalog, self.state, self.moves, self.tokens,
                                 self.reconciler, grace_s=config.node_grace_s, cleaner=self.cleaner)
        self.fleet = FleetService(self.store, self.clock, self.catalog, self.state, self.moves, self.nodes,
                                  self.authorizer, self.reconciler, self.billing)
        self.metrics = ControlPlaneMetrics()
        self.reconciler.pass_took = self.metrics.passed
        self.metrics.watch(self)
        self.replicas = replicas_of(self.store)
        self.reconciler.leads = self.nodes.leads = self.replicas.leads
        self.nodes.heard = self.replicas.heard
        self.nodes.heard_elsewhere = self.replicas.heard_elsewhere
        self.nodes.caught_up = self.replicas.caught_up
        self._refreshing: asyncio.Future | None = None
        self._refresh_again = False

    def open(self) -> "ControlPlane":
        self.store.start(self._read_memory, self.metrics.group_committed, self._changed, self.clock.compute_now)
        self.store.call_sync(self._load)
        if self.config.bootstrap:
            self.apply_bootstrap(self.config.bootstrap)
        self._load_policies()
        if hasattr(self.clock, "on_advance"):
            self.clock.on_advance(lambda _now: self.reconciler.wake())
        return self

    def close(self) -> None:
        self.store.close()

    async def start_replica(self) -> None:
        """Join the other replicas on the database (nothing to join on SQLite): lead when nobody does, and hear
        their writes."""
        await self.replicas.start(self.refresh, self._took_the_lead)

    def _took_the_lead(self) -> None:
        """This replica leads now: its reconciler passes at once, and what a leader that died left unasked of a
        node's BMC is asked again; the nodes' grace counts from now."""
        self.nodes.took_the_lead()
        self.reconciler.wake()
        self.cleaner.resume()

    async def stop_replica(self) -> None:
        await self.replicas.stop()

    def refresh(self) -> None:
        """Another replica wrote: bring the memory up to the database now (the store reads what moved, without
        the write lock), at most one at a time, and once more if told again meanwhile."""
        if self._refreshing is not None and not self._refreshing.done():
            self._refresh_again = True
            return
        self._refresh_again = False
        self._refreshing = asyncio.ensure_future(self.store.refresh())
        self._refreshing.add_done_callback(self._refreshed)

    def _refreshed(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("could not refresh from the database", error=str(fut.exception()))
        if self._refresh_again:
            self.refresh()

    # ---- catalog and memory ----------------------------------------------------
    def _load(self, tx: Tx) -> None:
        """The writer's memory from the database, read and put in place at once (at start)."""
        self._read_memory(tx)()

    def _read_memory(self, tx: Tx) -> Callable[[], None]:
        """The writer's memory read whole from the database (at start, after a failover, a migrate's copy or a
        job that failed midway), built apart from the one in use: returned as the step that puts it in place,
        after which whatever reads memory (watches, long polls, the timers) hears of the change. Reading touches
        nothing else, so an engine may read on another thread while the API's loop serves from the memory in use
        (store/port.py, on_reset)."""
        with collector_paused(freeze=self.config.freeze_memory):
            docs = {kind: tx.catalog_docs(kind) for kind in catalog_mod.KINDS}
            catalog = catalog_mod.load(docs, b"".join(tx.catalog_docs("policies")).decode())
            tokens = tx.tokens()
            now = self.clock.compute_now()
            live = tx.live_reservations(now)
            state = WriterState()
            state.rebuild(catalog, live, tx.live_bookings(now), now)
            bindings = {res.id: wanted_of(res, catalog) for res in live}  # for the nodes' watches (resync compares)

        def put_in_place() -> None:
            before = self.catalog.current.policies
            self.catalog.current = catalog
            self.tokens.rows = tokens
            self.state.replace(state)
            self.nodes.resync(bindings)
            self.reservations.wake_all(live)
            if catalog.policies != before and self.store.groups:
                self._load_policies()
            self.reconciler.wake()

        return put_in_place

    def _changed(self, tx, changed: list, now: int, dropped: Collection[str] = (),
                 catalog: CatalogChanges | None = None) -> None:
        """Other replicas changed these reservations, and the catalog and tokens where `catalog` says so: each
        reservation replaces its old self in memory with its bookings live at `now` (the store's reading of this
        clock), and whatever reads memory hears of it, as after this replica's own commits. `dropped`: creates this
        replica ran whose commit did not land, forgotten first (no one heard of them: their hooks run only once a
        commit lands)."""
        if catalog is not None:
            self._catalog_changed(catalog)
        for reservation_id in dropped:
            self.state.forget(reservation_id)
        self.state.apply(changed, tx.live_bookings_of([res.id for res in changed], now), now)
        for res in changed:
            self.moves.notify(res)  # watches of the nodes it is on, long polls on its tenant's events and on it
        self.reconciler.wake()

    def _catalog_changed(self, changes: CatalogChanges) -> None:
        """Another replica changed the catalog or the tokens: the rows it wrote over this replica's snapshot, the
        tokens as they are, its nodes' devices and cleanings in the writer's memory, and the policies where they
        changed; as that replica's own memory took them, without rebuilding this one whole."""
        before = self.catalog.current
        self.catalog.current = catalog_mod.with_rows(before, changes.rows)
        self.tokens.rows = changes.tokens
        self.state.nodes_changed(self.catalog.current.nodes[ident] for kind, ident, _ in changes.rows
                                 if kind == "node")
        if self.catalog.current.policies != before.policies:
            self._load_policies()

    def apply_bootstrap(self, path: str) -> None:
        """Apply the bootstrap file at start (no event loop yet)."""
        try:
            declared, tokens, admin = bootstrap_file.read(path)  # its Cedar policies validated too
        except (bootstrap_file.BootstrapError, ValueError) as exc:
            raise ConfigError(f"--bootstrap {exc}") from None
        declare_secrets(tokens, admin)
        try:
            self.store.call_sync(self._bootstrap_job(declared, tokens, admin))
        except DomainError as exc:  # a token another caller already holds, or the database failing the write
            if exc.code == PROVIDER_UNAVAILABLE:  # not the file's fault: say where to look
                raise ConfigError(f"--db: the bootstrap file {path} is valid, but the database could not take it "
                                  f"({exc.message}): see to the database (a full disk, a PostgreSQL that is down or "
                                  "read-only) and start again") from None
            raise ConfigError(f"--bootstrap {exc}") from None
        self._log_applied(str(path))

    async def apply_bootstrap_doc(self, raw: bytes) -> dict:
        """Apply a bootstrap document at run time (the admin API); policies take effect at once."""
        try:
            declared, tokens, admin = bootstrap_file.parse(raw)
        except (bootstrap_file.BootstrapError, ValueError) as exc:
            where, _, rule = str(exc).partition(": ")  # the file's messages start with the field's path
            field = where if rule and " " not in where else "body"
            raise DomainError(INVALID_INPUT, f"bootstrap: {exc}", {"field": field, "rule": rule if field != "body"
                                                                   else str(exc)}) from None
        declare_secrets(tokens, admin)
        before = self.catalog.current.policies
        await self.store.call(self._bootstrap_job(declared, tokens, admin))
        if self.catalog.current.policies != before:
            self._load_policies()
        self._log_applied("admin API")
        c = self.catalog.current
        return {"tenants": len(c.tenants), "principals": len(c.principals), "pools": len(c.pools), "nodes": len(c.nodes)}

    async def set_budget(self, tenant_id: str, budget) -> None:
        def job(tx: Tx) -> None:
            catalog = self.catalog.current
            tenant = catalog.tenants.get(tenant_id)
            if tenant is None:
                raise not_found("tenant", tenant_id, field="tenantId")
            tenant = dataclasses.replace(tenant, budget_usd=budget)
            tx.put_catalog("tenant", tenant_id, catalog_mod.encode_item(tenant))
            self.catalog.current = catalog.with_changes(tenants={**catalog.tenants, tenant_id: tenant})

        await self.store.call(job)
        log.info("budget set", tenant_id=tenant_id, budget_usd=str(budget))

    def _log_applied(self, source: str) -> None:
        c = self.catalog.current
        log.info("bootstrap applied", file=source, tenants=len(c.tenants), principals=len(c.principals),
                 pools=len(c.pools), nodes=len(c.nodes))

    def _bootstrap_job(self, declared: Catalog, tokens: dict, admin: str | None):
        def job(tx: Tx) -> None:
            merged = bootstrap_file.merge(self.catalog.current, declared)
            broken = bootstrap_file.broken_delegation(merged, declared)
            if broken is not None:
                raise invalid(*broken)
            why = bootstrap_file.stranded(self.catalog.current, merged, self.state.calendar)
            if why is not None:  # before any write: a refusal changes nothing
                raise DomainError(INVALID_STATE, f"bootstrap: {why}", {"field": "nodes"})
            rows = dict(self.tokens.rows)
            named = {(kind, subject) for kind, pairs in tokens.items() for _, subject in pairs}
            if admin:
                named.add(("admin", "admin"))
            kept = {h: ks for h, ks in rows.items() if ks not in named}  # a named subject's tokens are replaced
            declared_tokens = [(t, k, s) for k, pairs in tokens.items() for t, s in pairs]
            if admin:
                declared_tokens.append((admin, "admin", "admin"))
            fields = {"principal": "principals[{}].token", "node-bootstrap": "nodeTokens[{}].token"}
            for kind, pairs in tokens.items():  # before any write: a refusal changes nothing
                for i, (token, subject) in enumerate(pairs):  # in the document's order: its index
                    self._refuse_a_held_token(kept, token, kind, subject, fields[kind].format(i))
            if admin:
                self._refuse_a_held_token(kept, admin, "admin", "admin", "adminToken")
            for kind, items in (("tenant", merged.tenants), ("principal", merged.principals),
                                ("pool", merged.pools), ("node", merged.nodes)):
                for ident, item in items.items():
                    tx.put_catalog(kind, ident, catalog_mod.encode_item(item))
            tx.put_catalog("policies", "default", merged.policies.encode())
            rows = kept
            for kind, subject in named:
                tx.delete_tokens(kind, subject)
            for token, kind, subject in declared_tokens:
                tx.put_token(token_hash(token), kind, subject)
                rows[token_hash(token)] = (kind, subject)
            tx.touch()
            self.catalog.current = merged
            self.tokens.rows = rows
            self.state.add_nodes(merged.nodes.values())

        return job

    @staticmethod
    def _refuse_a_held_token(kept: dict[str, tuple[str, str]], token: str, kind: str, subject: str,
                             field: str) -> None:
        held = kept.get(token_hash(token))
        if held is not None:  # it would silently become another caller's token
            raise invalid(field, f"a token declared for {kind} {subject} is already the token of {held[0]} "
                          f"{held[1]}, which this document does not name: give {subject} a new token")

    def _authorizer(self) -> Authorizer:
        if self.config.authzen:
            from controlplane.iam.authzen import AuthZenAuthorizer

            return AuthZenAuthorizer(self.config.authzen, timeout_s=self.config.authzen_timeout_s)
        return CedarAuthorizer("", lambda pid: self.catalog.current.principals.get(pid))

    def _load_policies(self) -> None:
        """The embedded authorizer takes the catalog's policies (parsed once per change); a remote one has its own."""
        if not isinstance(self.authorizer, CedarAuthorizer):
            return
        policies = self.catalog.current.policies
        if not policies.strip():
            log.warning("no Cedar policies: every request is denied until a bootstrap declares some")
        self.authorizer.load(policies)
