"""TLS, once: the SSL contexts of the control plane's listeners and of its clients, and what a failed handshake means.

`server_context(cert, key, client_ca)` is what `berth controlplane serve
--tls-cert --tls-key [--tls-client-ca]` listens with; `client_context(ca_file,
cert, key)` is what the agent and the tenant client verify the server with
(the system trust store when no CA file is given) and, for mutual TLS, show
their own certificate with. Both refuse anything older than TLS 1.2. A file
that cannot be used is a `TlsError` whose message names the option, the file
and the reason, found before anything listens or connects. `explain(exc)`
turns a failed connection into a sentence saying what to change.
"""
from __future__ import annotations

import errno
import ssl
from typing import Iterator, NamedTuple

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


class TlsError(ValueError):
    """A certificate, key or CA file cannot be used: the message names the option, the file and why."""


class Flags(NamedTuple):
    """The names the files were given under, for messages (flags, or where a config file keeps them)."""

    cert: str
    key: str
    ca: str


SERVER_FLAGS = Flags("--tls-cert", "--tls-key", "--tls-client-ca")
CLIENT_FLAGS = Flags("--client-cert", "--client-key", "--ca-file")


def server_context(cert: str, key: str, client_ca: str | None = None, *,
                   flags: Flags = SERVER_FLAGS) -> ssl.SSLContext:
    """A listener's context: this certificate chain and key; with client_ca, every client must present a
    certificate that CA signed (mutual TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MINIMUM_VERSION
    _load_chain(ctx, cert, key, flags)
    if client_ca:
        _load_ca(ctx, client_ca, flags.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca_file: str | None = None, cert: str | None = None, key: str | None = None, *,
                   flags: Flags = CLIENT_FLAGS) -> ssl.SSLContext:
    """A client's context: the server is verified against ca_file alone (default: the system trust store) and
    must be named by its certificate; cert and key, given together, are shown to a server that asks (mutual TLS)."""
    if bool(cert) != bool(key):
        raise TlsError(f"{flags.cert} and {flags.key} go together: give both or neither")
    if ca_file:
        # Only the given CA, not the system store as well: no public CA may vouch for a private control plane.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name, as the default does
        _load_ca(ctx, ca_file, flags.ca)
    else:
        ctx = ssl.create_default_context()
    ctx.minimum_version = MINIMUM_VERSION
    if cert and key:
        _load_chain(ctx, cert, key, flags)
    return ctx


def _read(path: str, flag: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError as exc:
        raise TlsError(f"{flag} {path}: cannot read it: {exc.strerror}") from None


def _no_password() -> bytes:
    # load_cert_chain would otherwise ask on the terminal, and a service has none
    raise TlsError("encrypted")


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, flags: Flags) -> None:
    if "-----BEGIN CERTIFICATE-----" not in _read(cert, flags.cert):
        raise TlsError(f"{flags.cert} {cert}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    key_text = _read(key, flags.key)
    if "PRIVATE KEY-----" not in key_text:
        raise TlsError(f"{flags.key} {key}: holds no PEM private key (-----BEGIN PRIVATE KEY-----)")
    if "ENCRYPTED" in key_text:
        raise TlsError(f"{flags.key} {key}: the key is encrypted; give it unencrypted, readable only by the service")
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except TlsError:
        raise TlsError(f"{flags.key} {key}: the key is encrypted; give it unencrypted, readable only by the "
                       "service") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"{flags.key} {key} is not the key of the certificate in {flags.cert} {cert}: give the "
                           "key the certificate was issued for") from None
        raise TlsError(f"{flags.cert} {cert} with {flags.key} {key}: cannot load them ({exc.reason or exc})") from None


def _load_ca(ctx: ssl.SSLContext, path: str, flag: str) -> None:
    if "-----BEGIN CERTIFICATE-----" not in _read(path, flag):
        raise TlsError(f"{flag} {path}: holds no PEM CA certificate (-----BEGIN CERTIFICATE-----)")
    try:
        ctx.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TlsError(f"{flag} {path}: cannot load the CA certificates ({exc.reason or exc})") from None


# ---- a failed connection, in words ---------------------------------------------------------------------------

_HOST_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_EXPIRED = {9, 10}  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
_CLIENT_CERT_REFUSED = {"TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE",
                        "TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "SSLV3_ALERT_HANDSHAKE_FAILURE"}


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def explain(exc: BaseException, url: str, *, disconnected: bool = False, flags: Flags = CLIENT_FLAGS,
            ca_env: str = "BERTH_CA_FILE") -> str | None:
    """What a failed connection to url means for TLS, saying what to change; None when TLS is not the matter.

    disconnected: the server closed the connection before answering, which is
    how a TLS 1.3 server's refusal of a client certificate reaches an HTTP
    client (its alert comes after the handshake), and how a TLS listener
    answers plain http://; a connection reset counts as one.
    """
    for cause in reversed(list(_chain(exc))):  # the innermost first: aiohttp's wrappers subclass ssl's errors bare
        if isinstance(cause, ssl.SSLCertVerificationError):
            why = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or str(cause)
            code = getattr(cause, "verify_code", None)
            if code in _HOST_MISMATCH:
                return (f"the server's certificate is not for the host in {url} ({why}): connect by a name the "
                        "certificate holds, or have it issued with this name")
            if code in _EXPIRED:
                return f"the server's certificate is not valid now ({why}): the operator must renew it"
            return (f"the server's certificate is not trusted ({why}): pass {flags.ca} (env {ca_env}) with the CA "
                    "that signed it")
        if isinstance(cause, ssl.SSLError):
            reason = getattr(cause, "reason", None)
            if reason == "WRONG_VERSION_NUMBER":
                return (f"the server at {url} does not speak TLS there: use http://, or the port where the control "
                        "plane serves TLS")
            if reason in _CLIENT_CERT_REFUSED:
                return _client_cert_advice(flags)
        if isinstance(cause, OSError) and cause.errno == errno.ECONNRESET:
            disconnected = True
    if disconnected and url.startswith("http://"):
        return ("the server closed the connection without answering: if the control plane serves TLS "
                "(--tls-cert), the URL must start with https://")
    if disconnected and url.startswith("https://"):
        return "the server closed the connection without answering: " + _client_cert_advice(flags)
    return None


def _client_cert_advice(flags: Flags) -> str:
    return (f"if the control plane requires client certificates (--tls-client-ca), give {flags.cert} and "
            f"{flags.key} with a certificate its client CA signed")
