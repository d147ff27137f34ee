"""The agent-owned keys directory that sshd reads (`AuthorizedKeysFile <--ssh-keys-dir>/%u`).

Owns the files `DIR/<user>`: one line per tenant key,

    expiry-time="YYYYMMDDHHMMSSZ" ssh-ed25519 AAAA... berth:<reservation id>

where the time is the window's end in UTC (sshd reads a trailing `Z` as UTC,
see sshd(8), AUTHORIZED_KEYS FILE FORMAT) rounded down to the second, so
sshd refuses the key by itself once the window is over, even if the agent
is dead. The key's own comment is replaced by the reservation tag, which is
how the lines of two reservations in one file are kept apart; lines that
are not Berth's are kept as they are.

Every change rewrites the file atomically (a temporary file in the same
directory, fsync, rename, fsync of the directory) under a lock
(`DIR/.berth.lock`), so sshd reads either the old or the new file, never a
torn one. sshd opens the file with the user's privileges and, with
StrictModes, refuses it unless it and every directory above it are owned by
root and not group or world writable; so the file is `root:<user's group>`
mode 0640 and the directory root-owned mode 0711, and `KeysDir` checks the
whole chain up to `/` and says what to fix (`strict=False` skips the chain
check, for tests in a temporary directory only).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import stat
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Sequence

import structlog

from common.sshkeys import PublicKey, SshKeyError, parse_public_key

log = structlog.get_logger("berth.agent.tenantroot")

FILE_MODE = 0o640
DIR_MODE = 0o711
LOCK_NAME = ".berth.lock"
TAG = "berth:"
# POSIX portable user names ([A-Za-z0-9._-], not starting with '-'), at most 32 (the utmp limit); not '.'-led
# (so no '.', '..' or our own dot files) and not all digits (a name that reads as a uid).
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,31}")
_RESERVATION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_LINE = re.compile(r'expiry-time="(\d{14})Z" (\S+ \S+) berth:(\S+)')


class KeysDirError(Exception):
    """The keys directory cannot be used or changed as asked; the message says what to fix."""


@dataclass(frozen=True)
class Entry:
    """One Berth line of a user's file: whose reservation, which key (without its comment: the line's comment is
    the reservation tag), until when (epoch ms, whole seconds)."""

    reservation_id: str
    key: PublicKey
    expires_at_ms: int

    def line(self) -> str:
        return f'expiry-time="{expiry_time(self.expires_at_ms)}" {self.key.line(TAG + self.reservation_id)}'


def expiry_time(epoch_ms: int) -> str:
    """sshd's expiry-time value for an instant: `YYYYMMDDHHMMSS` in UTC plus `Z`, rounded down to the second."""
    return datetime.fromtimestamp(epoch_ms // 1000, tz=timezone.utc).strftime("%Y%m%d%H%M%S") + "Z"


def parse_expiry_time(value: str) -> int:
    """Epoch ms of an expiry-time value written by `expiry_time`."""
    return int(datetime.strptime(value, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()) * 1000


def check_user(user: str) -> str:
    """The user name, if it is a POSIX portable name (no slash, no leading '.' or '-', <= 32 characters)."""
    if not isinstance(user, str) or not _USER.fullmatch(user) or user.isdigit():
        raise KeysDirError(f"{user!r} is not a user name sshd and Berth accept: use a POSIX portable name "
                           "([A-Za-z0-9._-], not starting with '.' or '-', not all digits, at most 32 characters) "
                           "in the pool's policy.tenantRoot.user")
    return user


def check_reservation_id(reservation_id: str) -> str:
    if not isinstance(reservation_id, str) or not _RESERVATION.fullmatch(reservation_id):
        raise KeysDirError(f"{reservation_id!r} is not a reservation id this file can tag "
                           "([A-Za-z0-9._:-], at most 128 characters)")
    return reservation_id


def check_secure_chain(path: Path) -> None:
    """What sshd's StrictModes demands of the directories above an AuthorizedKeysFile outside a home directory:
    each one, up to `/`, owned by root and not group or world writable. KeysDirError naming the first that is not."""
    d = Path(os.path.realpath(path))
    for directory in (d, *d.parents):
        try:
            st = os.stat(directory)
        except OSError as exc:
            raise KeysDirError(f"cannot check {directory} (above the ssh keys directory): {exc}") from None
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise KeysDirError(
                f"sshd (StrictModes) refuses keys below {directory}: it is owned by uid {st.st_uid} with mode "
                f"{stat.filemode(st.st_mode)}; every directory above --ssh-keys-dir must be root-owned and not "
                f"group/world writable: `chown root {directory} && chmod go-w {directory}`, or choose another "
                "--ssh-keys-dir (e.g. /var/lib/berth/ssh-keys)")


class KeysDir:
    """`DIR/<user>` files of tenant keys: install, remove and list one reservation's lines."""

    def __init__(self, path: str | Path, *, strict: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_absolute():
            raise KeysDirError(f"--ssh-keys-dir must be an absolute path (sshd's AuthorizedKeysFile is), "
                               f"not {str(path)!r}")
        self.strict = strict

    def __repr__(self) -> str:
        return f"KeysDir({str(self.path)!r})"

    # -- reading -----------------------------------------------------------------------------------------------

    def file_of(self, user: str) -> Path:
        return self.path / check_user(user)

    def listed(self, user: str) -> list[Entry]:
        """Berth's entries in the user's file, in file order (an absent file lists nothing)."""
        return [e for e in (self._entry(line) for line in self._lines(self.file_of(user))) if e is not None]

    def _lines(self, file: Path) -> list[str]:
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise KeysDirError(f"cannot read {file}: {exc}") from None
        with os.fdopen(fd, encoding="utf-8", errors="surrogateescape") as f:
            return [line.rstrip("\n") for line in f if line.strip()]

    @staticmethod
    def _entry(line: str) -> Entry | None:
        m = _LINE.fullmatch(line)
        if m is None:
            return None
        try:
            key = parse_public_key(m.group(2))
        except SshKeyError:
            return None
        return Entry(reservation_id=m.group(3), key=key, expires_at_ms=parse_expiry_time(m.group(1) + "Z"))

    # -- changing ----------------------------------------------------------------------------------------------

    def install(self, user: str, reservation_id: str, keys: Sequence[PublicKey], expires_at_ms: int, *,
                now_ms: int | None = None) -> list[Entry]:
        """Make the reservation's lines in DIR/<user> exactly these keys until expires_at_ms (idempotent)."""
        check_user(user)
        check_reservation_id(reservation_id)
        if not keys or not all(isinstance(k, PublicKey) for k in keys):
            raise KeysDirError("install needs at least one checked key (common.sshkeys.parse_public_key)")
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        if expires_at_ms // 1000 * 1000 <= now_ms:
            raise KeysDirError(f"the window of {reservation_id} ends at {expiry_time(expires_at_ms)}, which has "
                               "passed: there is nothing to install (remove the reservation's keys instead)")
        try:
            account = pwd.getpwnam(user)
        except KeyError:
            raise KeysDirError(f"there is no user {user!r} on this node: create it, or fix the pool's "
                               "policy.tenantRoot.user") from None
        seen: set[bytes] = set()
        entries = []
        for key in keys:
            if key.blob not in seen:
                seen.add(key.blob)
                entries.append(Entry(reservation_id, replace(key, comment=""), expires_at_ms // 1000 * 1000))
        with self._locked():
            file = self.file_of(user)
            kept = [ln for ln in self._lines(file) if not self._is_of(ln, reservation_id)]
            self._write(user, file, kept + [e.line() for e in entries], account.pw_gid)
        log.info("ssh_keys.installed", reservation_id=reservation_id, user=user, file=str(file),
                 fingerprints=[e.key.fingerprint for e in entries], expiry_time=expiry_time(expires_at_ms))
        return entries

    def remove(self, user: str, reservation_id: str) -> int:
        """Drop the reservation's lines from DIR/<user> (the file goes once nothing is left); how many went."""
        check_user(user)
        check_reservation_id(reservation_id)
        if not self.path.exists():
            return 0
        with self._locked():
            file = self.file_of(user)
            lines = self._lines(file)
            kept = [ln for ln in lines if not self._is_of(ln, reservation_id)]
            removed = len(lines) - len(kept)
            if removed:
                try:
                    gid = pwd.getpwnam(user).pw_gid
                except KeyError:
                    gid = 0
                self._write(user, file, kept, gid)
        log.info("ssh_keys.removed", reservation_id=reservation_id, user=user, file=str(file), lines=removed)
        return removed

    @staticmethod
    def _is_of(line: str, reservation_id: str) -> bool:
        m = _LINE.fullmatch(line)
        return m is not None and m.group(3) == reservation_id

    def _ensure_dir(self) -> None:
        if not self.path.is_dir():
            try:
                self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                os.chmod(self.path, DIR_MODE)
            except OSError as exc:
                raise KeysDirError(f"cannot create the ssh keys directory {self.path}: {exc}") from None
        if self.strict:
            check_secure_chain(self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure_dir()
        try:
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise KeysDirError(f"cannot open the lock file in {self.path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, user: str, file: Path, lines: list[str], gid: int) -> None:
        """Replace `file` by `lines` atomically (or unlink it when there are none), then fsync the directory."""
        for stale in self.path.glob(f".{user}.*.tmp"):  # left by a crash; we hold the lock, so nobody writes them
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            if lines:
                fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{user}.", suffix=".tmp")
                try:
                    os.fchmod(fd, FILE_MODE)
                    self._own(fd, gid)
                    os.write(fd, ("\n".join(lines) + "\n").encode("utf-8", errors="surrogateescape"))
                    os.fsync(fd)
                    os.close(fd)
                    fd = -1
                    os.rename(tmp, file)
                except BaseException:
                    if fd >= 0:
                        os.close(fd)
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(file)
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except KeysDirError:
            raise
        except OSError as exc:
            raise KeysDirError(f"cannot write {file}: {exc}") from None

    def _own(self, fd: int, gid: int) -> None:
        try:
            os.fchown(fd, 0, gid)
        except PermissionError:
            if self.strict:
                raise KeysDirError(f"cannot make the keys file in {self.path} root-owned: the agent must run as "
                                   "root for sshd (StrictModes) to accept the keys it writes") from None
