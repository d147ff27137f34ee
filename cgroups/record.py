"""The recovery record kept beside each cgroup: its share and device rules, versioned and checksummed.

Where it lives: by default an extended attribute on the cgroup directory
itself (`trusted.berth.record`, or `user.berth.record` where trusted.* is
refused), so that cgroupfs alone is enough to recover after a crash and the
record disappears with the cgroup. cgroupfs accepts no regular files inside a
cgroup, which rules out a file there. Hosts whose cgroupfs takes no xattrs
(before Linux 5.7 for user.*) use `DirRecords` under a state directory.
The record is kept once, beside the cgroup2 directory, also on a hybrid
host: the cgroup's directories in the v1 hierarchies carry none and are
found again by name below the subtree's v1 roots.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .devices import DeviceRule
from .errors import CgroupError, RecordCorrupt
from .share import CgroupShare

VERSION = 1


@dataclass(frozen=True)
class Record:
    name: str
    share: CgroupShare
    rules: tuple[DeviceRule, ...] | None  # None: devices are not filtered for this cgroup

    def encode(self) -> bytes:
        body = {"v": VERSION, "name": self.name, "share": self.share.to_dict(),
                "rules": None if self.rules is None else [str(r) for r in self.rules]}
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["sum"] = hashlib.sha256(canon.encode()).hexdigest()[:16]
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, where: Path) -> Record:
        try:
            body = json.loads(data)
            got = body.pop("sum")
            canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
            if hashlib.sha256(canon.encode()).hexdigest()[:16] != got:
                raise RecordCorrupt(f"record at {where}: checksum mismatch (edited by hand or truncated)", path=where)
            if body["v"] != VERSION:
                raise RecordCorrupt(f"record at {where}: version {body['v']}, this code reads {VERSION}", path=where)
            rules = None if body["rules"] is None else tuple(DeviceRule.parse(r) for r in body["rules"])
            return cls(body["name"], CgroupShare.from_dict(body["share"]), rules)
        except RecordCorrupt:
            raise
        except (ValueError, KeyError, TypeError, CgroupError) as exc:
            raise RecordCorrupt(f"record at {where}: unreadable ({exc})", path=where) from None


class RecordStore(Protocol):
    def read(self, cgroup: Path) -> Record | None: ...
    def read_raw(self, cgroup: Path) -> bytes | None: ...
    def write(self, cgroup: Path, record: Record) -> None: ...
    def delete(self, cgroup: Path) -> None: ...


class XattrRecords:
    """Records as an extended attribute of the cgroup directory."""

    def __init__(self, attr: str = "trusted.berth.record") -> None:
        self.attr = attr

    @classmethod
    def probe(cls, dir: Path) -> XattrRecords | None:
        """The first namespace (trusted, then user) that dir's filesystem accepts; None if neither."""
        for attr in ("trusted.berth.record", "user.berth.record"):
            probe = attr.rsplit(".", 1)[0] + ".probe"
            try:
                os.setxattr(dir, probe, b"1")
                os.removexattr(dir, probe)
                return cls(attr)
            except OSError:
                continue
        return None

    def read(self, cgroup: Path) -> Record | None:
        data = self.read_raw(cgroup)
        return None if data is None else Record.decode(data, cgroup)

    def read_raw(self, cgroup: Path) -> bytes | None:
        try:
            return os.getxattr(cgroup, self.attr)
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOENT):
                return None
            raise CgroupError(f"reading xattr {self.attr} of {cgroup}: [Errno {exc.errno}] {exc.strerror}",
                              path=cgroup, errno=exc.errno) from None

    def write(self, cgroup: Path, record: Record) -> None:
        data = record.encode()
        try:
            os.setxattr(cgroup, self.attr, data)
        except OSError as exc:
            raise CgroupError(f"writing xattr {self.attr} of {cgroup} ({len(data)} bytes): [Errno {exc.errno}] "
                              f"{exc.strerror}", path=cgroup, value=data.decode(), errno=exc.errno) from None

    def delete(self, cgroup: Path) -> None:
        """Nothing to do: the attribute goes with the directory."""


class DirRecords:
    """Records as <state_dir>/<name>.json, written atomically (temp file, fsync, rename)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)

    def _path(self, cgroup: Path) -> Path:
        return self.state_dir / f"{cgroup.name}.json"

    def read(self, cgroup: Path) -> Record | None:
        data = self.read_raw(cgroup)
        return None if data is None else Record.decode(data, self._path(cgroup))

    def read_raw(self, cgroup: Path) -> bytes | None:
        path = self._path(cgroup)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CgroupError(f"reading {path}: {exc.strerror}", path=path, errno=exc.errno) from None

    def write(self, cgroup: Path, record: Record) -> None:
        path = self._path(cgroup)
        tmp = path.with_suffix(".tmp")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, record.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise CgroupError(f"writing {path}: {exc.strerror}", path=path, errno=exc.errno) from None

    def delete(self, cgroup: Path) -> None:
        try:
            self._path(cgroup).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CgroupError(f"removing {self._path(cgroup)}: {exc.strerror}", errno=exc.errno) from None
