"""The agent's state directory: one lock, the node identity, and a checkpoint of every binding it makes.

Everything a restarted agent needs besides cgroupfs lives here:

- `lock`: `fcntl.flock` held for the agent's life, so two agents never run
  on one state directory (the second fails at once, naming the holder's pid).
- `node.json` (mode 0600): node id and node token from register. It survives
  a reboot; the control plane re-issues the token on a new register anyway.
- `checkpoint.json` (mode 0600): per binding `started` (about to be made),
  `completed` (made and recorded) or `removing`, with what was applied; the
  reports not yet accepted by the control plane; the last resource version;
  the boot id it was written in. The cgroups of a checkpoint from another boot
  died with that boot: its hold bindings and its reports of what is gone are
  kept (the first pass makes again those still wanted and reports the others
  unbound), the rest starts afresh. The file is
  versioned and checksummed (sha256 of the canonical data) and always written
  whole to a temporary file, fsynced and renamed over the old one.

A missing checkpoint is a fresh start. A corrupt one, or one written for a
different cgroup root, is `CheckpointError` with what the operator should do:
the agent does not guess about state it cannot trust.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Literal

import msgspec

from agent.errors import AgentError
from common import pidlock
from common.nodewire import Report

CHECKPOINT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.json"
IDENTITY_FILE = "node.json"
LOCK_FILE = "lock"
EXEC_SOCKET = "exec.sock"
DEFAULT_STATE_DIR = "/var/lib/berth/agent"


class CheckpointError(AgentError):
    """The checkpoint cannot be trusted or contradicts the configuration; the message says what to do."""


class StateDirError(AgentError):
    """The state directory cannot be used as given; the message names --state-dir and what to give."""


class StateLocked(AgentError):
    """Another agent holds the state directory's lock."""


BindingState = Literal["started", "completed", "removing"]


class BindingEntry(msgspec.Struct, forbid_unknown_fields=True):
    reservationId: str
    state: BindingState
    spec: str  # fingerprint of the share and rules applied (agent.bindspec.Want.fingerprint)
    cgroup: str  # "" for a kubernetes binding (its pods run in the kubelet's cgroups)
    kind: str = "hold"
    tenantId: str = ""
    parts: list[str] = []  # its directories in the cgroup v1 hierarchies (berth exec joins them too)
    principalId: str = ""
    devices: list[str] = []
    unenforced: list[str] = []
    oomKills: int = 0  # the OOM kill count last seen in its cgroup (a restarted agent does not report it again)
    updatedAtMs: int = 0


class CheckpointData(msgspec.Struct, forbid_unknown_fields=True):
    bootId: str
    cgroupRoot: str
    nodeId: str | None = None
    resourceVersion: int = 0
    bindings: dict[str, BindingEntry] = {}
    pendingReports: list[Report] = []  # not yet accepted by the control plane (an unbound must reach it)


class _File(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    checksum: str
    data: msgspec.Raw


_encoder = msgspec.json.Encoder(order="sorted")


def checksum_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write data to path so a reader sees the old file or the new one, never a part: temp file in the same
    directory, fsync, rename over, fsync the directory."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None  # the file meant, not a temporary name
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.errno is not None:  # a write's error names no file: name the one meant
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_boot_id(proc: Path | str = "/proc") -> str:
    """/proc/sys/kernel/random/boot_id: a new value on every boot."""
    return (Path(proc) / "sys/kernel/random/boot_id").read_text().strip()


class Checkpoint:
    """The bindings this agent made, written through to checkpoint.json by `save()`."""

    def __init__(self, path: Path, data: CheckpointData) -> None:
        self.path = Path(path)
        self.data = data
        self.note = ""  # why it is fresh, for the start-up log

    @classmethod
    def load(cls, path: Path | str, *, boot_id: str, cgroup_root: str) -> "Checkpoint":
        """The checkpoint at path for this boot and cgroup root: fresh when missing or from another boot."""
        path = Path(path)
        fresh = CheckpointData(bootId=boot_id, cgroupRoot=cgroup_root)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            cp = cls(path, fresh)
            cp.note = "no checkpoint: a fresh start (cgroups found are adopted or removed as the control plane says)"
            return cp
        data = decode(raw, path)
        if data.bootId != boot_id:
            # The cgroups died with that boot, but what the control plane must hear of them did not: each hold
            # binding stays listed, without its cgroup, so the first pass makes again the ones still wanted and
            # reports `unbound` for the rest (a release made while the host was down completes), and reports not
            # yet accepted are still sent.
            died = {rid: msgspec.structs.replace(e, oomKills=0) for rid, e in data.bindings.items() if e.kind == "hold"}
            # of the reports not sent, those of what is gone still hold; a `bound` (or failed, held, waiting) one
            # speaks of the old boot's cgroups: the first pass reports what it makes again
            gone = [r for r in data.pendingReports if r.status in ("unbound", "cleaned")]
            cp = cls(path, msgspec.structs.replace(fresh, nodeId=data.nodeId, bindings=died, pendingReports=gone))
            cp.note = (f"checkpoint is from boot {data.bootId}, this is boot {boot_id}: its {len(died)} binding(s) "
                       "died with that boot; those still wanted are made again, the others reported unbound")
            return cp
        if data.cgroupRoot != cgroup_root:
            raise CheckpointError(
                f"{path} was written for cgroup root {data.cgroupRoot}, but the agent now runs with {cgroup_root}; "
                f"its {len(data.bindings)} binding(s) live there. Start the agent with --cgroup-root "
                f"{data.cgroupRoot}, or remove those cgroups and move {path} away to start afresh")
        cp = cls(path, data)
        cp.note = f"checkpoint of boot {boot_id}: {len(data.bindings)} binding(s), resource version {data.resourceVersion}"
        return cp

    @classmethod
    def read(cls, path: Path | str) -> CheckpointData | None:
        """The data as stored, or None if there is none (for `berth exec`, which takes no lock)."""
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        return decode(raw, Path(path))

    def encode(self) -> bytes:
        body = _encoder.encode(self.data)
        return _encoder.encode(_File(CHECKPOINT_VERSION, checksum_of(body), msgspec.Raw(body)))

    def save(self) -> None:
        write_atomic(self.path, self.encode())

    # -- bindings ---------------------------------------------------------

    @property
    def bindings(self) -> dict[str, BindingEntry]:
        return self.data.bindings

    def set(self, entry: BindingEntry) -> None:
        self.data.bindings[entry.reservationId] = entry

    def mark(self, reservation_id: str, state: BindingState, now_ms: int) -> None:
        entry = self.data.bindings.get(reservation_id)
        if entry is not None:
            self.data.bindings[reservation_id] = msgspec.structs.replace(entry, state=state, updatedAtMs=now_ms)

    def forget(self, reservation_id: str) -> None:
        self.data.bindings.pop(reservation_id, None)

    # -- reports and versions -----------------------------------------------

    def queue_report(self, report: Report) -> None:
        """Keep the latest report per reservation until the control plane accepts it. A node binding's `cleaned`
        is kept beside it, after it: the control plane takes the hand-back (`unbound`) before the clean check."""
        cleaned = report.status == "cleaned"
        kept = [r for r in self.data.pendingReports
                if r.reservationId != report.reservationId or (r.status == "cleaned") != cleaned]
        at = len(kept) if cleaned else next((i for i, r in enumerate(kept) if r.reservationId == report.reservationId
                                              and r.status == "cleaned"), len(kept))
        kept.insert(at, report)
        self.data.pendingReports = kept

    def reports_done(self, reservation_ids: set[str]) -> None:
        self.data.pendingReports = [r for r in self.data.pendingReports if r.reservationId not in reservation_ids]

    def set_version(self, resource_version: int) -> None:
        self.data.resourceVersion = resource_version

    def set_node(self, node_id: str) -> None:
        self.data.nodeId = node_id


def decode(raw: bytes, path: Path) -> CheckpointData:
    what_to_do = (f"the agent can rebuild its bindings from cgroupfs and the control plane: move {path} away "
                  f"(e.g. to {path}.bad) and start it again")
    try:
        outer = msgspec.json.decode(raw, type=_File)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path} is not a checkpoint ({exc}); {what_to_do}") from None
    if outer.version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {outer.version}, this agent reads version "
                              f"{CHECKPOINT_VERSION}; {what_to_do}")
    body = bytes(outer.data)
    try:
        data = msgspec.json.decode(body, type=CheckpointData)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path}: {exc}; {what_to_do}") from None
    # The checksum covers the canonical encoding, so re-encode rather than trusting the file's whitespace.
    if checksum_of(_encoder.encode(data)) != outer.checksum:
        raise CheckpointError(f"{path} fails its checksum (written partly, or edited by hand); {what_to_do}")
    return data


class Identity(msgspec.Struct, forbid_unknown_fields=True):
    nodeId: str
    nodeToken: str
    controlPlane: str
    poolId: str = ""
    hostname: str = ""
    registeredAtMs: int = 0
    heartbeatSeconds: float = 5.0


class StateDir:
    """The state directory and its lock. `open()` creates it (mode 0711: others may reach the exec socket,
    not list or read) and takes the lock; `close()` lets it go."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    @property
    def checkpoint_path(self) -> Path:
        return self.path / CHECKPOINT_FILE

    @property
    def identity_path(self) -> Path:
        return self.path / IDENTITY_FILE

    @property
    def exec_socket(self) -> Path:
        return self.path / EXEC_SOCKET

    def open(self) -> "StateDir":
        """Make the directory (0711) if it is not there, and take its lock. An existing one keeps its mode (the
        unit's StateDirectoryMode makes it 0711; a directory named by mistake is not changed), but one that another
        user, or its group, may write to is refused: they could put their own files where the agent keeps its
        identity."""
        where = f"--state-dir {self.path}"
        try:
            self.path.mkdir(parents=True)
            os.chmod(self.path, 0o711)  # mkdir's own mode is narrowed by the umask
        except FileExistsError:
            if not self.path.is_dir():
                raise StateDirError(f"{where}: is a file, not a directory: give a directory of the agent's own "
                                    "(default /var/lib/berth/agent)") from None
            st = self.path.stat()
            if st.st_mode & 0o022 or st.st_uid != os.geteuid():  # its group or another owner may write there too
                who = "others may write to it" if st.st_mode & 0o002 else "its group may write to it" \
                    if st.st_mode & 0o020 else f"it belongs to uid {st.st_uid}, not to the agent's {os.geteuid()}"
                raise StateDirError(f"{where}: {who} (mode {stat.filemode(st.st_mode)}): give a directory of the "
                                    "agent's own (default /var/lib/berth/agent)") from None
        except OSError as exc:  # a parent that is a file, a read-only file system
            raise StateDirError(f"{where}: cannot make it ({exc.strerror}): give a directory the agent may "
                                "create") from None
        try:
            self._lock_fd = pidlock.hold(self.path / LOCK_FILE)
        except pidlock.Held as held:
            raise StateLocked(f"{self.path} is in use by another agent (pid {held.holder}); two agents must never "
                              "share a state directory: stop the other one or give --state-dir") from None
        except OSError as exc:  # a read-only file system, a full one: the directory cannot be the agent's
            raise StateDirError(f"{where}: cannot write its lock ({exc.strerror}): give a directory on a writable "
                                "file system with space") from None
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor drops the flock
            self._lock_fd = None

    def __enter__(self) -> "StateDir":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def read_identity(self) -> Identity | None:
        try:
            raw = self.identity_path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return msgspec.json.decode(raw, type=Identity)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{self.identity_path}: {exc}; move it away and the agent registers anew "
                                  "(it keeps its node id: the control plane knows it by hostname)") from None

    def write_identity(self, identity: Identity) -> None:
        write_atomic(self.identity_path, msgspec.json.encode(identity), mode=0o600)

    def load_checkpoint(self, *, boot_id: str, cgroup_root: str) -> Checkpoint:
        return Checkpoint.load(self.checkpoint_path, boot_id=boot_id, cgroup_root=cgroup_root)
