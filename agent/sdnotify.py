"""systemd's notify protocol, spoken directly: one datagram per message on the $NOTIFY_SOCKET unix socket.

`Notifier.from_env()` reads `NOTIFY_SOCKET` (a path, or `@name` for the
abstract namespace) and the watchdog settings (`WATCHDOG_USEC`, and
`WATCHDOG_PID`, which must be this process when set). Without the
variable every call is a no-op returning False, so the agent runs the same
outside systemd. `ready()` sends `READY=1`, `watchdog()` `WATCHDOG=1`,
`status(text)` `STATUS=...`, `stopping()` `STOPPING=1`. No dependency on
libsystemd: the protocol is a newline-separated `KEY=VALUE` datagram
(sd_notify(3)).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping


@dataclass
class Notifier:
    address: str | None  # a filesystem path, or "\0name" for the abstract namespace; None: not under systemd
    watchdog_usec: int | None = None
    last_error: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET") or None
        address = None
        if raw:
            address = "\0" + raw[1:] if raw.startswith("@") else raw
        usec: int | None = None
        try:
            usec = int(env.get("WATCHDOG_USEC", "")) or None
        except ValueError:
            usec = None
        pid = env.get("WATCHDOG_PID")
        if usec and pid and pid != str(os.getpid()):
            usec = None  # the watchdog is meant for another process of the unit
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the watchdog timeout, as sd_watchdog_enabled(3) advises."""
        return None if not self.watchdog_usec else self.watchdog_usec / 2e6

    def notify(self, **fields: str | int) -> bool:
        """Send one message; True when it was sent. Keys are sd_notify's (READY, STATUS, WATCHDOG, ...)."""
        if self.address is None:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(payload, self.address)
        except OSError as exc:  # systemd went away or the socket is not ours: never fatal for the agent
            self.last_error = f"sd_notify to {self.address!r}: {exc}"
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        fields: dict[str, str | int] = {"READY": 1}
        if status:
            fields["STATUS"] = status
        return self.notify(**fields)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def status(self, text: str) -> bool:
        return self.notify(STATUS=text)

    def stopping(self) -> bool:
        return self.notify(STOPPING=1)
