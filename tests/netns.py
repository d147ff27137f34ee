"""Network namespaces for tests, through iproute2's `ip`: several hosts on one machine, joined by veth pairs.

Namespaces made here carry the caller's tag in their name and are removed by
`close()` (their veth ends go with them). Only addresses on the links made
here are used; nothing leaves the machine.

`ip` runs as a child process on purpose: pyroute2 forks the test process to
enter a namespace, and a fork that runs Python (its garbage collector) while
gRPC's threads live in the parent crashed the child (CI, after the kubelet
plugin's tests). A fork straight into exec runs no Python in the child.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import threading
import uuid

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _ip(*args: str, netns: str | None = None) -> str:
    """Run `ip [-n netns] args...`; a failure raises with ip's own message."""
    command = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _up(ifname: str, address: str | None = None, prefixlen: int = 30, netns: str | None = None) -> None:
    if address is not None:
        _ip("addr", "add", f"{address}/{prefixlen}", "dev", ifname, netns=netns)
    _ip("link", "set", ifname, "up", netns=netns)


class Namespaces:
    """Named network namespaces (`<prefix>-<tag>-<role>`), the veth pairs between them, and their removal."""

    def __init__(self, prefix: str = "berth-test") -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.prefix = prefix
        self.names: list[str] = []

    def add(self, role: str) -> str:
        name = f"{self.prefix}-{self.tag}-{role}"
        _ip("netns", "add", name)
        self.names.append(name)
        _up("lo", netns=name)
        return name

    def link(self, a: str | None, a_if: str, a_addr: str, b: str, b_if: str, b_addr: str, prefixlen: int = 30) -> None:
        """A veth pair a_if (in namespace a, or the root namespace when a is None) <-> b_if (in namespace b), up."""
        _ip("link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", b)
        if a is not None:
            _ip("link", "set", a_if, "netns", a)
        _up(a_if, a_addr, prefixlen, netns=a)
        _up(b_if, b_addr, prefixlen, netns=b)

    def set_link(self, name: str, ifname: str, up: bool) -> None:
        """Bring an interface inside a namespace up or down (cutting a link is how a partition is tested)."""
        _ip("link", "set", ifname, "up" if up else "down", netns=name)

    @staticmethod
    def path(name: str) -> str:
        return f"/run/netns/{name}"

    def listen(self, name: str, host: str = "0.0.0.0", port: int = 0) -> socket.socket:
        """A listening TCP socket made inside namespace `name` (setns in a short-lived thread: it is per thread)."""
        box: dict = {}

        def inside() -> None:
            try:
                fd = os.open(self.path(name), os.O_RDONLY)
                try:
                    if _libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns")
                finally:
                    os.close(fd)
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen(1024)
                s.setblocking(False)
                box["sock"] = s
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        t = threading.Thread(target=inside)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["sock"]

    def close(self) -> None:
        for name in reversed(self.names):
            try:
                _ip("netns", "delete", name)
            except OSError:
                pass
        self.names.clear()

    def left(self) -> list[str]:
        """Namespaces of this tag still there (a check after close)."""
        listed = (line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip())
        return [n for n in listed if n.startswith(f"{self.prefix}-{self.tag}")]

    @staticmethod
    def addresses_in_use() -> set[str]:
        return {a["local"] for link in json.loads(_ip("-j", "addr", "show") or "[]")
                for a in link.get("addr_info", ()) if "local" in a}
