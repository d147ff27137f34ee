"""Binding reconciliation: what the control plane wants against what cgroupfs has, and making the difference real.

`plan(desired, actual)` is the decision, a pure function: for each
reservation, `create` (wanted, no cgroup), `update` (wanted, cgroup with a
different share or rules, or without a usable record), `keep` (wanted and
matching), `remove` (a cgroup nobody wants), `fail` (wanted, cannot be made
here) or `refuse` (a binding kind this agent does not make).

`Binder` carries a plan out on a `cgroups.Subtree` and writes it through to
the checkpoint: `started` before a cgroup is made, `completed` after,
`removing` before one is killed and removed; apply is idempotent, so a crash
anywhere is finished by the next pass. A kept binding gets a drift check
and repair (the daemon-reload lesson: a device program re-applied or
detached behind our back is put back). Each step returns the report for the
control plane. Kernel calls block: the runtime runs `Binder.run` in a worker
thread, one pass at a time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal, Mapping

import msgspec
import structlog

from agent.bindspec import BindError, Want
from agent.checkpoint import BindingEntry, Checkpoint
from cgroups import CgroupShare, DeviceRule, Subtree
from cgroups.errors import CgroupError
from common.nodewire import Report

log = structlog.get_logger("berth.agent.binder")

MAX_MESSAGE = 2000  # what the node API takes in a report's message
ActionKind = Literal["create", "update", "keep", "remove", "fail", "refuse"]


@dataclass(frozen=True)
class Have:
    """A reservation cgroup as found in cgroupfs."""

    reservation_id: str
    path: Path
    share: CgroupShare | None = None
    rules: tuple[DeviceRule, ...] | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reservation_id: str
    want: Want | None = None
    have: Have | None = None
    reason: str = ""


@dataclass(frozen=True)
class Refused:
    """A wanted binding this agent will not make (kind), as opposed to one it cannot make (BindError)."""

    message: str


def plan(desired: Mapping[str, Want | BindError | Refused], actual: Mapping[str, Have]) -> list[Action]:
    """The actions that turn `actual` into `desired`, in a stable order (removals first: they free devices)."""
    out: list[Action] = []
    for rid in sorted(set(actual) - set(desired)):
        out.append(Action("remove", rid, have=actual[rid], reason="not wanted by the control plane"))
    for rid in sorted(desired):
        want, have = desired[rid], actual.get(rid)
        if isinstance(want, Refused):
            out.append(Action("refuse", rid, have=have, reason=want.message))
        elif isinstance(want, BindError):
            out.append(Action("fail", rid, have=have, reason=str(want)))
        elif have is None:
            out.append(Action("create", rid, want=want))
        elif have.share is None:
            out.append(Action("update", rid, want=want, have=have, reason=have.problem or "no record"))
        elif have.share != want.share or have.rules != want.rules:
            out.append(Action("update", rid, want=want, have=have, reason="share or device rules changed"))
        else:
            out.append(Action("keep", rid, want=want, have=have))
    return out


@dataclass(frozen=True)
class Outcome:
    action: Action
    report: Report | None  # None: nothing to tell the control plane
    seconds: float
    ok: bool = True
    repaired: tuple[str, ...] = ()


class Binder:
    """Carries out plans on one Subtree, writing each step through to the checkpoint."""

    def __init__(self, subtree: Subtree, checkpoint: Checkpoint, *,
                 wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
        self.subtree = subtree
        self.checkpoint = checkpoint
        self.wall_ms = wall_ms
        self.reported: dict[str, str] = {}  # reservation id -> what was last reported (status + fingerprint)
        # reservation id -> OOM kills seen in its cgroup (sent in bound reports; kept in the checkpoint)
        self.oom_kills: dict[str, int] = {rid: e.oomKills for rid, e in checkpoint.bindings.items() if e.oomKills}
        self.log = log  # the runtime binds node_id once it is known

    def key_of(self, name: str) -> str:
        return name[len(self.subtree.prefix):]

    def actual(self) -> dict[str, Have]:
        """Every reservation cgroup in the subtree, from cgroupfs alone (the records beside them)."""
        return {self.key_of(c.name): Have(self.key_of(c.name), c.path, c.share, c.rules, c.problem)
                for c in self.subtree.list()}

    def run(self, actions: Iterable[Action]) -> list[Outcome]:
        actions = list(actions)
        now = self.wall_ms()
        starting = [a for a in actions if a.kind in ("create", "update")]
        removing = [a for a in actions if a.kind == "remove"]
        for a in starting:
            assert a.want is not None
            self.checkpoint.set(self._entry(a.want, "started", now))
        for a in removing:
            self.checkpoint.mark(a.reservation_id, "removing", now)
        if starting or removing:
            self.checkpoint.save()  # before touching the kernel: a crash from here on is finished next time
        outcomes = [self._one(a) for a in actions]
        for o in outcomes:
            if o.report is not None:
                self.checkpoint.queue_report(o.report)
        self.checkpoint.save()
        return outcomes

    def _entry(self, want: Want, state, now: int) -> BindingEntry:
        return BindingEntry(reservationId=want.reservation_id, state=state, spec=want.fingerprint,
                            cgroup=str(self.cgroup_of(want.reservation_id)),
                            parts=[str(d) for d in self.parts_of(want.reservation_id)], tenantId=want.tenant_id,
                            principalId=want.principal_id, devices=list(want.devices),
                            unenforced=list(want.unenforced), oomKills=self.oom_kills.get(want.reservation_id, 0),
                            updatedAtMs=now)

    def _report_once(self, rid: str, report: Report, tag: str) -> Report | None:
        if report.message is not None and len(report.message) > MAX_MESSAGE:
            report = msgspec.structs.replace(report, message=report.message[:MAX_MESSAGE - 1] + "…")
        if self.reported.get(rid) == tag:
            return None
        self.reported[rid] = tag
        return report

    def _one(self, a: Action) -> Outcome:
        t0 = time.monotonic()
        rid = a.reservation_id
        blog = self.log.bind(reservation_id=rid)
        try:
            if a.kind in ("create", "update"):
                assert a.want is not None
                self.subtree.apply(self.subtree.name_for(rid), a.want.share, a.want.rules)
                self.checkpoint.set(self._entry(a.want, "completed", self.wall_ms()))
                blog.info("bound" if a.kind == "create" else "re-applied", action=a.kind, reason=a.reason or None,
                          share=a.want.share.to_dict(), devices=list(a.want.devices),
                          unenforced=list(a.want.unenforced) or None, notes=list(a.want.notes) or None)
                self.reported.pop(rid, None)
                return Outcome(a, self._bound(a.want), time.monotonic() - t0)
            if a.kind == "keep":
                assert a.want is not None
                repaired = tuple(f"{d.what}: want {d.want}, got {d.got}"
                                 for d in self.subtree.repair(self.subtree.name_for(rid)))
                if repaired:
                    blog.warning("drift repaired", drift=list(repaired))
                entry = self.checkpoint.bindings.get(rid)
                if entry is None or entry.state != "completed" or entry.spec != a.want.fingerprint:
                    self.checkpoint.set(self._entry(a.want, "completed", self.wall_ms()))
                return Outcome(a, self._bound(a.want), time.monotonic() - t0, repaired=repaired)
            if a.kind == "remove":
                self.subtree.remove(self.subtree.name_for(rid))
                self.checkpoint.forget(rid)
                blog.info("unbound", reason=a.reason)
                self.reported.pop(rid, None)
                return Outcome(a, self._report_once(rid, Report(rid, "unbound"), "unbound"),
                               time.monotonic() - t0)
            # fail, refuse: nothing is made; an existing cgroup is left as it is (its work keeps running)
            blog.warning("binding refused" if a.kind == "refuse" else "binding failed", message=a.reason)
            return Outcome(a, self._report_once(rid, Report(rid, "failed", message=a.reason),
                                                f"failed:{a.reason}"), time.monotonic() - t0)
        except (CgroupError, OSError) as exc:
            message = str(exc)
            if a.kind == "remove":
                blog.error("removal failed; will retry", error=message)
                return Outcome(a, None, time.monotonic() - t0, ok=False)
            blog.error("binding failed", action=a.kind, error=message)
            if not self.subtree.path(self.subtree.name_for(rid)).exists():
                self.checkpoint.forget(rid)  # nothing was made (e.g. a share the host cannot give)
            return Outcome(a, self._report_once(rid, Report(rid, "failed", message=message),
                                                f"failed:{message}"), time.monotonic() - t0, ok=False)

    def _bound(self, want: Want) -> Report | None:
        rid = want.reservation_id
        if want.awaiting:  # the control plane never heard it (a report lost with a killed agent, a restore): again
            self.reported.pop(rid, None)
        ooms = self.oom_kills.get(rid, 0)
        return self._report_once(rid, Report(rid, "bound", cgroup=str(self.cgroup_of(rid)), devices=want.devices,
                                             unenforced=want.unenforced, end=want.end, oomKills=ooms),
                                 f"bound:{want.fingerprint}:{want.end}:{ooms}")

    def count_oom_kills(self, reservation_ids) -> dict[str, int]:
        """Read each bound reservation's OOM kill count (memory.events or v1 memory.oom_control); the ones that
        grew since the last read, with their new totals (remembered for the next bound report)."""
        grown: dict[str, int] = {}
        for rid in reservation_ids:
            try:
                memory = self.subtree.stat(self.subtree.name_for(rid)).memory
            except CgroupError:
                continue  # removed meanwhile
            if memory is not None and memory.oom_kills > self.oom_kills.get(rid, 0):
                grown[rid] = self.oom_kills[rid] = memory.oom_kills
                entry = self.checkpoint.bindings.get(rid)
                if entry is not None:
                    self.checkpoint.set(msgspec.structs.replace(entry, oomKills=memory.oom_kills))
        for rid in set(self.oom_kills) - set(reservation_ids):
            del self.oom_kills[rid]
        if grown:
            self.checkpoint.save()
        return grown

    def cgroup_of(self, reservation_id: str) -> Path:
        """The one place a reservation's cgroup path is made."""
        return self.subtree.path(self.subtree.name_for(reservation_id))

    def parts_of(self, reservation_id: str) -> list[Path]:
        """Its directories in the cgroup v1 hierarchies the subtree enforces on (none on a cgroup2-only host)."""
        name = self.subtree.name_for(reservation_id)
        return list(dict.fromkeys(root / name for root in self.subtree.v1_roots.values()))

    def forget_reports(self) -> None:
        """After a new register the control plane may know nothing of what was told: tell it everything again."""
        self.reported.clear()
