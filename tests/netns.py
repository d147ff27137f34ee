"""Network namespaces for tests, through pyroute2: several hosts on one machine, joined by veth pairs.

Namespaces made here carry the caller's tag in their name and are removed by
`close()` (their veth ends go with them). Only addresses on the links made
here are used; nothing leaves the machine.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
import uuid

from pyroute2 import IPRoute, NetNS, netns

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _up(handle, ifname: str, address: str | None = None, prefixlen: int = 30) -> None:
    index = handle.link_lookup(ifname=ifname)[0]
    if address is not None:
        handle.addr("add", index=index, address=address, prefixlen=prefixlen)
    handle.link("set", index=index, state="up")


class Namespaces:
    """Named network namespaces (`<prefix>-<tag>-<role>`), the veth pairs between them, and their removal."""

    def __init__(self, prefix: str = "berth-test") -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.prefix = prefix
        self.names: list[str] = []

    def add(self, role: str) -> str:
        name = f"{self.prefix}-{self.tag}-{role}"
        netns.create(name)
        self.names.append(name)
        with NetNS(name) as ns:
            _up(ns, "lo")
        return name

    def link(self, a: str | None, a_if: str, a_addr: str, b: str, b_if: str, b_addr: str, prefixlen: int = 30) -> None:
        """A veth pair a_if (in namespace a, or the root namespace when a is None) <-> b_if (in namespace b), up."""
        with IPRoute() as ip:
            ip.link("add", ifname=a_if, kind="veth", peer={"ifname": b_if, "net_ns_fd": b})
            if a is not None:
                ip.link("set", index=ip.link_lookup(ifname=a_if)[0], net_ns_fd=a)
            else:
                _up(ip, a_if, a_addr, prefixlen)
        if a is not None:
            with NetNS(a) as ns:
                _up(ns, a_if, a_addr, prefixlen)
        with NetNS(b) as ns:
            _up(ns, b_if, b_addr, prefixlen)

    def set_link(self, name: str, ifname: str, up: bool) -> None:
        """Bring an interface inside a namespace up or down (cutting a link is how a partition is tested)."""
        with NetNS(name) as ns:
            ns.link("set", index=ns.link_lookup(ifname=ifname)[0], state="up" if up else "down")

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
                netns.remove(name)
            except OSError:
                pass
        self.names.clear()

    def left(self) -> list[str]:
        """Namespaces of this tag still there (a check after close)."""
        return [n for n in netns.listnetns() if n.startswith(f"{self.prefix}-{self.tag}")]

    @staticmethod
    def addresses_in_use() -> set[str]:
        with IPRoute() as ip:
            return {a.get_attr("IFA_ADDRESS") for a in ip.get_addr()}
