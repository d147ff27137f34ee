"""What a node binding tells the tenant about reaching the node: the `ssh` endpoint and its host key fingerprints.

Owns `--ssh-host-keys GLOB` (default `/etc/ssh/ssh_host_*_key.pub`): the
SHA256 fingerprints of the host's public host keys, sorted, as
`ssh-keygen -l` prints them, so a tenant can check the first connection
(or build a known_hosts line) instead of trusting on first use; and
`--ssh-endpoint HOST:PORT` (default the node's hostname and port 22): the
`{host, port, user, hostKeys}` the `bound` report carries as `ssh` (the
reservation's `bound[].ssh`).
"""
from __future__ import annotations

import glob
import ipaddress
import re
import socket
from dataclasses import dataclass

import structlog

from common.sshkeys import SshKeyError, fingerprint_of_file

log = structlog.get_logger("berth.agent.tenantroot")

DEFAULT_HOST_KEYS = "/etc/ssh/ssh_host_*_key.pub"
DEFAULT_PORT = 22
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


class HostKeysError(Exception):
    """The host keys or the endpoint cannot be reported; the message says what to fix."""


@dataclass(frozen=True)
class SshEndpoint:
    """Where the tenant logs in: host, port, user and the host key fingerprints to expect."""

    host: str
    port: int
    user: str
    host_keys: tuple[str, ...]

    def wire(self) -> dict:
        """The binding's `ssh` object: `{host, port, user, hostKeys}`."""
        return {"host": self.host, "port": self.port, "user": self.user, "hostKeys": list(self.host_keys)}


def host_key_fingerprints(pattern: str = DEFAULT_HOST_KEYS) -> list[str]:
    """The sorted, distinct SHA256 fingerprints of the public keys matching `pattern`; HostKeysError if none."""
    paths = sorted(glob.glob(pattern))
    if not paths:
        raise HostKeysError(f"no SSH host public keys match {pattern!r}: generate them (`ssh-keygen -A`) or point "
                            "--ssh-host-keys at the ones sshd uses (its HostKey lines, with .pub)")
    try:
        prints = sorted({fingerprint_of_file(p) for p in paths})
    except SshKeyError as exc:
        raise HostKeysError(f"a host key matching --ssh-host-keys cannot be read: {exc.detail}") from None
    log.debug("ssh_host_keys.read", pattern=pattern, files=paths, fingerprints=prints)
    return prints


def parse_endpoint(value: str) -> tuple[str, int]:
    """`HOST:PORT`, `HOST` (port 22), `[V6]:PORT` or `[V6]` -> (host, port); HostKeysError naming --ssh-endpoint."""
    text = value.strip()
    port_text: str | None = None
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or not (text[close + 1:] == "" or text[close + 1:].startswith(":")):
            raise HostKeysError(f"--ssh-endpoint {value!r}: write an IPv6 address as [ADDRESS]:PORT")
        host = text[1:close]
        if text[close + 1:]:
            port_text = text[close + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise HostKeysError(f"--ssh-endpoint {value!r}: {host!r} is not an IPv6 address") from None
    else:
        if text.count(":") > 1:
            raise HostKeysError(f"--ssh-endpoint {value!r}: write an IPv6 address as [ADDRESS]:PORT")
        host, sep, rest = text.partition(":")
        if sep:
            port_text = rest
        if not _valid_host(host):
            raise HostKeysError(f"--ssh-endpoint {value!r}: {host!r} is neither a host name nor an IPv4 address")
    if port_text is None:
        return host, DEFAULT_PORT
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise HostKeysError(f"--ssh-endpoint {value!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(host)) and not host.replace(".", "").isdigit()


def ssh_endpoint(user: str, *, endpoint: str | None = None, host_keys: str = DEFAULT_HOST_KEYS,
                 hostname: str | None = None) -> SshEndpoint:
    """The endpoint a binding reports: --ssh-endpoint (default `hostname`, else this host's name, and port 22),
    the pool's user, and the host key fingerprints of --ssh-host-keys."""
    if endpoint:
        host, port = parse_endpoint(endpoint)
    else:
        host, port = hostname or socket.gethostname(), DEFAULT_PORT
    return SshEndpoint(host=host, port=port, user=user, host_keys=tuple(host_key_fingerprints(host_keys)))
