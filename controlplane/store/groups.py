"""What every engine's writer shares: what a job's transaction keeps of its outcome, the rows a group appends,
how its callers are answered, and the PROVIDER_UNAVAILABLE a store failure becomes (store/sqlite.py,
store/postgres.py)."""
from __future__ import annotations

import time
from typing import Any, Callable

import structlog

from controlplane.domain.errors import PROVIDER_UNAVAILABLE, DomainError

log = structlog.get_logger("berth.store")

# How long a request's caller waits for its commit before it hears PROVIDER_UNAVAILABLE (`--commit-wait`), where an
# engine's commits can be held (PostgreSQL's, by a synchronous standby away or a replica stuck with the write lock).
COMMIT_WAIT_S = 30.0


class WriterFront:
    """What both engines' stores answer from their writer (set by `start`): a job run at once, and its counts."""

    writer: Any = None

    def call_sync(self, job: Callable[[Any], Any]) -> Any:
        assert self.writer is not None, "start() the store first"
        return self.writer.call_sync(job)

    @property
    def groups(self) -> int:
        return self.writer.groups if self.writer else 0

    @property
    def jobs(self) -> int:
        return self.writer.jobs if self.writer else 0


class JobOutcome:
    """What a job's transaction (port.Tx) keeps for its writer: whether it changed the memory, its on-commit
    hooks, and the refusal it answers with once committed."""

    __slots__ = ("dirty", "committed", "refused")

    def __init__(self) -> None:
        self.dirty = False
        self.committed: list[Callable[[], None]] = []
        self.refused: DomainError | None = None

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.committed.append(fn)

    def touch(self) -> None:
        self.dirty = True

    def refuse(self, error: DomainError) -> None:
        self.refused = error


class Appends:
    """Rows only ever appended and never read back inside a group (reservations, bookings, events), written
    together: at the group's end, or at once before a statement that must see them. Each engine files them by
    kind (SQLite: the statement that inserts them; PostgreSQL: the row's class) and writes them with its own
    driver (`by_kind`)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[Any, Any]] = []  # (kind, row), in order

    def add(self, kind: Any, row: Any) -> None:
        self.rows.append((kind, row))

    def extend(self, other: "Appends") -> None:
        self.rows.extend(other.rows)

    def take(self) -> "Appends":
        taken = type(self)()
        taken.rows, self.rows = self.rows, taken.rows
        return taken

    def by_kind(self) -> dict[Any, list]:
        grouped: dict[Any, list] = {}
        for kind, row in self.rows:
            grouped.setdefault(kind, []).append(row)
        return grouped

    def __bool__(self) -> bool:
        return bool(self.rows)


def run_hooks(hooks: list[Callable[[], None]]) -> None:
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - a listener's failure is not the store's
            log.exception("on-commit hook failed")


def resolve(items) -> None:
    """Answer each (future, value, error) not yet answered."""
    for fut, value, error in items:
        if fut is None or fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


def unavailable(message: str) -> DomainError:
    """A store failure as callers hear it: the platform's doing, with a reference for the logs."""
    return DomainError(PROVIDER_UNAVAILABLE, message, {"actor": "platform", "reference": f"ref-{time.time_ns():x}"})


def log_pass_failure(logger: Any, what: str, exc: BaseException) -> None:
    """A background pass (the reconciler's, the node monitor's) that failed: the database away (an outage, a
    failover) is its state, a warning without a traceback; anything else a fault, with one."""
    if isinstance(exc, DomainError) and exc.code == PROVIDER_UNAVAILABLE:
        logger.warning(f"{what} put off: the database is unavailable", error=exc.message)
    else:
        logger.error(f"{what} failed", exc_info=exc)
