"""Node bindings (`binding: "node"`, tenant root on bare metal): the node handed over to the tenant and taken back.

`NodeBindings.reconcile(wanted)` is called with every node binding the
control plane wants here, after each watch answer, and returns the reports
to send:

- **Hand-over** (a wanted binding not handed over yet): the baseline of the
  pool user's processes and the node's inventory are recorded first (in
  `<state-dir>/node-bindings.json`, written atomically, so a restarted agent
  still knows what to take back and what to compare with), then the tenant's
  keys go into the agent-owned keys file with `expiry-time` at the window's
  end (agent/tenantroot/authorized_keys.py), and `bound` is reported with
  `ssh: {host, port, user, hostKeys}`. Keys that cannot be installed (no such
  user, an unsafe keys directory, a window already over) are a `failed`
  report naming why, and nothing is recorded. A moved end (an extension)
  installs the keys again with the new expiry and reports `bound` with it. When the binding turns `ending`
  (reservation.ending), the warning is written to the tenant's login terminals (agent/tenantroot/notice.py).
- **Hand-back** (a recorded binding no longer wanted: released, ended, lease
  lapsed): the keys are removed, every session and process that came from
  them is ended (agent/tenantroot/sessions.py), and `unbound` is reported.
  With `cleaning: inband` the agent then cleans: it empties each scratch path
  the node declares (`--scratch-path`), puts the 1 GiB hugepage count back to
  what it was at the hand-over, puts each GPU back as the recorded inventory
  has it (NVML, agent/nvml.clean_gpus: a GPU still held by compute processes
  is left and named; the MIG mode and layout, instances the tenant made
  destroyed and recorded ones it destroyed recreated at their placement; the
  clocks and power limit to their defaults), discovers the node again, and
  reports `cleaned` with the differences from the recorded inventory (none:
  the node is as it was; MIG devices are compared by position, since a
  recreated one has a new UUID). With `cleaning: redfish` the control plane resets the node
  through its BMC, so the agent cleans nothing.

Nothing here limits the host: a node binding has no cgroup share and no
device program; the whole host is the tenant's.
"""
from __future__ import annotations

import os
import pwd
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import msgspec
import structlog

from agent.errors import AgentError
from agent.tenantroot import notice
from agent.tenantroot.authorized_keys import KeysDir, KeysDirError
from agent.tenantroot.hostkeys import DEFAULT_HOST_KEYS, HostKeysError, ssh_endpoint
from agent.tenantroot.sessions import SessionsError, baseline, end_sessions
from common.inventory import Inventory, differences
from common.nodewire import Binding, CleanCheck, Report, SshAccess
from common.sshkeys import SshKeyError, parse_public_key
from common.times import iso

log = structlog.get_logger("berth.agent.node")

RECORDS_FILE = "node-bindings.json"
NOT_CLEAN_FILE = "node-not-clean.json"  # the last cleaning found the node not clean: checked again before a hand-over
DEFAULT_KEYS_DIR = "/var/lib/berth/ssh-keys"
HUGEPAGES_1G = "kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"


class Handed(msgspec.Struct):
    """What the agent recorded at a hand-over, to take the node back and check it."""

    user: str
    uid: int
    end: int
    baseline: list[tuple[int, int]]
    inventory: dict  # the node's inventory (wire form) at the hand-over
    hugepages1G: int | None = None  # nr_hugepages of 1 GiB at the hand-over (None: the host has none)
    cleaning: str = "inband"
    warned: int = 0  # the end the tenant's sessions were told about (reservation.ending), once per end


class NotClean(msgspec.Struct):
    """The node may not go to the next tenant yet: an in-band cleaning found it not as the hand-over's record (no
    one is handed it until a cleaning against that record passes: an operator mends it, then the next hand-over
    checks again), or, with `cleaning: redfish`, the control plane's reset has not happened yet (`resetFrom`: the
    boot the hand-back was made in; a hand-over waits for another boot)."""

    after: str  # the reservation whose hand-back it followed
    handed: Handed
    differences: list[str]
    resetFrom: str | None = None
    # the control plane took the node out of placement since (cleaning, maintenance): once it puts it back (an
    # operator's `clear`, or its reset done) the node goes to the next tenant as the control plane decided
    outSeen: bool = False


@dataclass
class TenantRootConfig:
    """The agent's settings for node bindings (its --ssh-* and --scratch-path options)."""

    keys_dir: str = DEFAULT_KEYS_DIR
    host_keys: str = DEFAULT_HOST_KEYS
    endpoint: str | None = None
    scratch: tuple[str, ...] = ()
    hostname: str | None = None
    strict_keys_dir: bool = True  # sshd's StrictModes chain check (off only in tests with a private sshd)


@dataclass
class NodeBindings:
    state_dir: Path
    config: TenantRootConfig
    inventory: Callable[[], Inventory | None]  # the last discovery
    rediscover: Callable[[], Inventory]  # discover the node now (after a clean)
    sys_root: str = "/sys"
    simulated_hugepages: bool = False  # --simulate: hugepages are the topology's, never written
    # every GPU back as the recorded inventory has it: MIG mode and layout, clocks, power limits (nvml.clean_gpus)
    reset_gpus: Callable[[Inventory], list[str]] | None = None
    protect: set[int] = field(default_factory=lambda: {os.getpid()})
    states: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = KeysDir(self.config.keys_dir, strict=self.config.strict_keys_dir)
        self.records: dict[str, Handed] = self._load()
        self.handed_back: set[str] = set()  # handed back by the last pass, their records kept until forgotten
        self.to_clean: set[str] = set()  # of those, the ones whose in-band cleaning is still to run
        self._marking = threading.RLock()  # the heartbeat's thread and the pass's change the mark
        self.not_clean: NotClean | None = self._load_not_clean()
        self.deferred = False  # the last pass left a hand-over for later: a hand-back or cleaning came first

    # ---- the records ----------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return Path(self.state_dir) / RECORDS_FILE

    def _load(self) -> dict[str, Handed]:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=dict[str, Handed])
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as exc:
            raise NodeRecordsError(self.path, exc) from None

    def _save(self) -> None:
        _write_atomic(self.path, msgspec.json.encode(self.records))

    def _load_not_clean(self) -> NotClean | None:
        path = Path(self.state_dir) / NOT_CLEAN_FILE
        try:
            return msgspec.json.decode(path.read_bytes(), type=NotClean)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as exc:
            raise NodeRecordsError(path, exc) from None

    def _set_not_clean(self, found: NotClean | None) -> None:
        path = Path(self.state_dir) / NOT_CLEAN_FILE
        with self._marking:
            if found is None:
                path.unlink(missing_ok=True)
            else:
                _write_atomic(path, msgspec.json.encode(found))
            self.not_clean = found

    def heard_node_state(self, state: str) -> None:
        """The node's state as the control plane has it (each heartbeat's answer). After a cleaning that failed (or
        a hand-back awaiting its reset) the control plane takes the node out of placement; once it puts it back
        (an operator mended and cleared it: what was changed while mending is the operator's to judge), the mark
        goes, and hand-overs follow the control plane's word again."""
        with self._marking:
            found = self.not_clean
            if found is None:
                return
            if state in ("cleaning", "maintenance"):
                if not found.outSeen:
                    self._set_not_clean(msgspec.structs.replace(found, outSeen=True))
            elif found.outSeen:
                log.info("node back in placement after the last tenant: hand-overs go on", after=found.after,
                         state=state)
                self._set_not_clean(None)

    # ---- the pass -------------------------------------------------------------------------------
    def reconcile(self, wanted: Sequence[Binding]) -> list[Report]:
        """Hand over what is newly wanted, keep what is, take back what is no longer wanted (blocking: run it in a
        worker thread)."""
        reports: list[Report] = []
        by_id = {b.reservationId: b for b in wanted}
        for rid in [r for r in self.records if r not in by_id and r not in self.handed_back and r not in self.to_clean]:
            reports += self._hand_back(rid)
        # The node goes to the next tenant only once the last one's hand-back and cleaning are done (an agent down
        # past a turnaround finds both to do in one pass): a hand-over waits for the pass after them.
        busy = bool(self.to_clean or self.handed_back or any(r not in by_id for r in self.records))
        self.deferred = False
        for b in wanted:
            handed = self.records.get(b.reservationId)
            if handed is None and busy:
                if not self.deferred:
                    log.info("node hand-over waits for the last tenant's hand-back and cleaning",
                             reservation_id=b.reservationId)
                self.deferred = True
            elif handed is None:
                reports += self._hand_over(b)
            elif handed.end != b.end or b.awaitingBound:
                # a moved end; or a hand-over whose `bound` the control plane never heard (this agent killed
                # before it went out, even before the keys went in; a restored database): the keys again, idempotent
                reports += self._extend(b, handed)
            handed = self.records.get(b.reservationId)
            if handed is not None and b.ending and handed.warned != b.end:
                self._warn(b, handed)
        for rid in [r for r in self.states if r not in by_id and r not in self.records]:
            del self.states[rid]  # a refused hand-over the control plane no longer wants: forget it
        return reports

    def _warn(self, b: Binding, handed: Handed) -> None:
        """reservation.ending, on the tenant's login terminals (once per end; an extension re-arms it)."""
        minutes = max(0, (b.end - int(time.time() * 1000)) // 60_000)
        told = notice.tell(handed.user, handed.uid, notice.ending_message(b.reservationId, iso(b.end), minutes))
        log.info("node binding ending: sessions told", reservation_id=b.reservationId, terminals=len(told))
        handed.warned = b.end
        self._save()

    def _fail(self, b: Binding, why: str) -> list[Report]:
        log.warning("node hand-over failed", reservation_id=b.reservationId, reason=why)
        self.states[b.reservationId] = {"state": "failed", "message": why}
        return [Report(reservationId=b.reservationId, status="failed", message=why[:2000])]

    def _hand_over(self, b: Binding) -> list[Report]:
        rid, user = b.reservationId, b.user or "root"
        if self.states.get(rid, {}).get("state") == "failed":
            return []  # reported once; the control plane decides what follows
        try:
            keys = [parse_public_key(k) for k in b.sshKeys]
            if not keys:
                return self._fail(b, "the binding carries no ssh keys")
            uid = pwd.getpwnam(user).pw_uid
        except SshKeyError as exc:
            return self._fail(b, f"a tenant key was refused on the node: {exc}")
        except KeyError:
            return self._fail(b, f"there is no user {user!r} on this node (the pool's policy.tenantRoot.user)")
        inv = self.inventory()
        if inv is None:
            return []  # no discovery yet: the next pass hands over
        found = self.not_clean
        if found is not None and found.resetFrom is not None:  # cleaning: redfish, the control plane's reset
            if found.resetFrom == inv.bootId:
                if not self.deferred:
                    log.info("node hand-over waits for the reset after the last tenant (cleaning: redfish)",
                             reservation_id=rid, after=found.after, boot_id=inv.bootId)
                self.deferred = True
                return []
            log.info("node reset since the last tenant", after=found.after, boot_id=inv.bootId)
            self._set_not_clean(None)
        elif found is not None:  # the last cleaning failed: only a node clean again goes to anyone
            check = self._clean(found.after, found.handed)
            if not check.ok:
                return self._fail(b, f"the node is not clean since reservation {found.after} ended ("
                                     f"{'; '.join(check.differences[:5])}): an operator mends it, then clears it "
                                     "(berth admin nodes clear); the next hand-over checks it again")
            log.info("node clean again", after=found.after)
            self._set_not_clean(None)
            inv = self.inventory() or inv
        try:
            access = ssh_endpoint(user, endpoint=self.config.endpoint, host_keys=self.config.host_keys,
                                  hostname=self.config.hostname)
        except HostKeysError as exc:
            return self._fail(b, str(exc))
        # The record first: a crash between it and the keys leaves a hand-back to do, never keys nobody removes.
        self.records[rid] = Handed(user=user, uid=uid, end=b.end, baseline=sorted(baseline(uid)),
                                   inventory=inv.to_wire(), hugepages1G=self._hugepages(),
                                   cleaning=b.cleaning or "inband")
        self._save()
        try:
            self.keys.install(user, rid, keys, b.end)
        except (KeysDirError, OSError) as exc:
            del self.records[rid]
            self._save()
            return self._fail(b, f"the keys could not be installed: {exc}")
        log.info("node handed over", reservation_id=rid, user=user, keys=len(keys), until=b.end)
        self.states[rid] = {"state": "bound", "user": user, "keys": len(keys)}
        return [self._bound(b, access)]

    def _extend(self, b: Binding, handed: Handed) -> list[Report]:
        try:
            self.keys.install(handed.user, b.reservationId, [parse_public_key(k) for k in b.sshKeys], b.end)
            access = ssh_endpoint(handed.user, endpoint=self.config.endpoint, host_keys=self.config.host_keys,
                                  hostname=self.config.hostname)
        except (KeysDirError, SshKeyError, HostKeysError, OSError) as exc:
            log.warning("node keys not extended", reservation_id=b.reservationId, error=str(exc))
            return []
        handed.end = b.end
        self._save()
        return [self._bound(b, access)]

    @staticmethod
    def _bound(b: Binding, access) -> Report:
        return Report(reservationId=b.reservationId, status="bound", end=b.end,
                      ssh=SshAccess(host=access.host, port=access.port, user=access.user,
                                    hostKeys=tuple(access.host_keys)))

    def _hand_back(self, rid: str) -> list[Report]:
        handed = self.records[rid]
        try:
            removed = self.keys.remove(handed.user, rid)
            ended = end_sessions(handed.user, frozenset(map(tuple, handed.baseline)), protect=self.protect,
                                 uid=handed.uid)
        except (KeysDirError, SessionsError, OSError) as exc:
            log.error("node hand-back failed; retried at the next pass", reservation_id=rid, error=str(exc))
            self.states[rid] = {"state": "removing", "message": str(exc)}
            return []
        log.info("node taken back", reservation_id=rid, user=handed.user, keys_removed=removed,
                 ended=[f"{e.pid} {e.comm} ({e.rule})" for e in ended][:50])
        # The record stays until the caller has kept the reports (forget_handed_back): an agent killed before
        # finds it again and hands the node back again (each step is idempotent), so the hand-back is never lost,
        # nor the cleaning, nor, for redfish, the reset it leads to. An in-band cleaning comes after the `unbound`
        # report is sent (clean_handed_back), so the node shows `cleaning` while it is emptied.
        (self.to_clean if handed.cleaning == "inband" else self.handed_back).add(rid)
        boot = (self.inventory() or Inventory.from_wire(handed.inventory)).bootId
        if handed.cleaning != "inband" and boot:  # the control plane resets the node: nobody gets it before a boot
            self._set_not_clean(NotClean(rid, handed, ["awaiting the node's reset (cleaning: redfish)"], boot))
        return [Report(reservationId=rid, status="unbound")]

    def clean_handed_back(self) -> list[Report]:
        """The in-band cleanings of the nodes just handed back (blocking: run it in a worker thread, once their
        `unbound` reports are on their way): each one's clean check, as `cleaned`."""
        reports = []
        for rid in sorted(self.to_clean):
            handed = self.records.get(rid)
            if handed is not None:
                check = self._clean(rid, handed)
                reports.append(Report(reservationId=rid, status="cleaned", clean=check))
                if not check.ok:  # kept (a restart too) until a cleaning against this record passes
                    self._set_not_clean(NotClean(rid, handed, list(check.differences)))
            self.handed_back.add(rid)
        self.to_clean.clear()
        return reports

    def forget_handed_back(self) -> None:
        """The reports of the hand-backs just made are kept (the checkpoint is saved): their records go."""
        if not self.handed_back:
            return
        for rid in self.handed_back:
            self.records.pop(rid, None)
            self.states.pop(rid, None)
        self.handed_back.clear()
        self._save()

    # ---- cleaning in band -----------------------------------------------------------------------
    def _clean(self, rid: str, handed: Handed) -> CleanCheck:
        problems: list[str] = []
        for path in self.config.scratch:
            problems += wipe(Path(path))
        problems += self._restore_hugepages(handed.hugepages1G)
        recorded = Inventory.from_wire(handed.inventory)
        if self.reset_gpus is not None:
            try:
                problems += self.reset_gpus(recorded)
            except Exception as exc:  # noqa: BLE001 - NVML unreachable: the node is not proven clean
                problems.append(f"GPU settings not reset: {exc}")
        try:
            after = self.rediscover()
        except Exception as exc:  # noqa: BLE001 - a failed discovery is an unclean node, said so
            problems.append(f"discovery after cleaning failed: {exc}")
            return CleanCheck(ok=False, differences=tuple(problems[:64]))
        problems += differences(recorded, after)
        check = CleanCheck(ok=not problems, differences=tuple(p[:2000] for p in problems[:64]))
        (log.info if check.ok else log.warning)("node cleaned" if check.ok else "node not clean",
                                                reservation_id=rid, differences=list(check.differences) or None)
        return check

    def _hugepages(self) -> int | None:
        if self.simulated_hugepages:
            return None
        try:
            return int((Path(self.sys_root) / HUGEPAGES_1G).read_text())
        except (OSError, ValueError):
            return None

    def _restore_hugepages(self, count: int | None) -> list[str]:
        """Put the 1 GiB hugepage count back to the hand-over's (the tenant, as root, may have changed it)."""
        if count is None:
            return []
        path = Path(self.sys_root) / HUGEPAGES_1G
        try:
            if int(path.read_text()) != count:
                path.write_text(str(count))
                if int(path.read_text()) != count:
                    return [f"1 GiB hugepages: {path.read_text().strip()} after writing {count} to {path}"]
        except (OSError, ValueError) as exc:
            return [f"1 GiB hugepages: cannot restore {count} in {path}: {exc}"]
        return []


class NodeRecordsError(AgentError):
    """A node-binding record file that cannot be read: the agent cannot know what to take back."""

    def __init__(self, path: Path, exc: BaseException) -> None:
        super().__init__(f"{path} cannot be read ({exc}): it records the node bindings handed over on this host. "
                         "Restore it from a backup, or, once you have checked by hand that no tenant's keys are left "
                         "in the keys directory and no tenant process runs, remove it and start the agent again")
        self.path = path


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def wipe(path: Path) -> list[str]:
    """Empty a scratch directory (its entries go; the directory stays); what could not be removed."""
    if not path.is_dir() or path.is_symlink():
        return [f"scratch path {path} is not a directory"]
    problems = []
    for entry in path.iterdir():
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError as exc:
            problems.append(f"scratch path {path}: {entry.name} not removed: {exc.strerror}")
    return problems


