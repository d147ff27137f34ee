"""TLS, once: the SSL contexts of the control plane's listeners and of its clients, and what a failed handshake means.

`server_context(cert, key, client_ca)` is what `berth controlplane serve
--tls-cert --tls-key [--tls-client-ca]` listens with; `client_context(ca_file,
cert, key)` is what the agent and the tenant client verify the server with
(the system trust store when no CA file is given) and, for mutual TLS, show
their own certificate with. Both refuse anything older than TLS 1.2. A file
that cannot be used is a `TlsError` whose message names the option, the file
and the reason, found before anything listens or connects. `explain(exc)`
turns a failed connection into a sentence saying what to change.
`validity_warning(path, flag)` says, at start, that a certificate has expired,
is not valid yet or expires within 30 days: the standard library checks a
peer's dates, not our own, so the first sign would otherwise be every
client's refusal.
"""
from __future__ import annotations

import base64
import binascii
import datetime
import errno
import re
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


# ---- a certificate's dates ------------------------------------------------------------------------------------

EXPIRY_WARNING = datetime.timedelta(days=30)
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----", re.S)


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, where its content starts, where it ends) of the DER element at `at`."""
    tag, length, start = der[at], der[at + 1], at + 2
    if length & 0x80:
        n = length & 0x7F
        length, start = int.from_bytes(der[start:start + n], "big"), start + n
    if start + length > len(der):
        raise ValueError("truncated")
    return tag, start, start + length


def _time(der: bytes, at: int) -> tuple[datetime.datetime, int]:
    tag, start, end = _element(der, at)
    text = der[start:end].decode("ascii")
    if tag == 0x17:  # UTCTime, YYMMDDHHMMSSZ: years 50-99 are 19xx (RFC 5280)
        text = ("19" if int(text[:2]) >= 50 else "20") + text
    elif tag != 0x18:  # GeneralizedTime, YYYYMMDDHHMMSSZ
        raise ValueError("not a time")
    return datetime.datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.timezone.utc), end


def validity(pem: str) -> tuple[datetime.datetime, datetime.datetime]:
    """(notBefore, notAfter) of the first certificate in a PEM text; ValueError if it holds none that reads."""
    m = _PEM.search(pem)
    if m is None:
        raise ValueError("no PEM certificate")
    try:
        der = base64.b64decode("".join(m.group(1).split()), validate=True)
        _, cert, _ = _element(der, 0)  # Certificate ::= SEQUENCE { tbsCertificate, ... }
        _, at, _ = _element(der, cert)  # TBSCertificate ::= SEQUENCE { [0] version?, serial, signature, issuer,
        if der[at] == 0xA0:  # validity, ... }
            at = _element(der, at)[2]
        for _ in range(3):  # serialNumber, signature, issuer
            at = _element(der, at)[2]
        tag, at, _ = _element(der, at)  # Validity ::= SEQUENCE { notBefore, notAfter }
        if tag != 0x30:
            raise ValueError("no validity")
        not_before, at = _time(der, at)
        return not_before, _time(der, at)[0]
    except (IndexError, ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the certificate's dates ({exc})") from None


def validity_warning(path: str, flag: str, now: datetime.datetime | None = None) -> tuple[str, str] | None:
    """(log level, sentence) when the certificate in `path` has expired, is not valid yet, or expires within
    EXPIRY_WARNING; None when it is good for longer (or its dates cannot be read: loading it decides that)."""
    try:
        not_before, not_after = validity(_read(path, flag))
    except ValueError:
        return None
    now = now or datetime.datetime.now(datetime.timezone.utc)
    when = f"{not_after:%Y-%m-%d %H:%M} UTC"
    if now >= not_after:
        return "error", (f"{flag} {path}: the certificate expired on {when}; every peer that checks it refuses "
                         "the connection: renew it and restart")
    if now < not_before:
        return "error", (f"{flag} {path}: the certificate is not valid until {not_before:%Y-%m-%d %H:%M} UTC; "
                         "peers refuse it until then (is this host's clock right?)")
    if not_after - now < EXPIRY_WARNING:
        days = (not_after - now) // datetime.timedelta(days=1)
        within = f"in {days} day{'s' if days > 1 else ''}" if days else "within a day"
        return "warning", (f"{flag} {path}: the certificate expires on {when}, {within}: renew it before then "
                           "and restart")
    return None


def log_validity(log, path: str, flag: str, whose: str) -> None:
    """At start: log validity_warning's sentence, if any, at its level (`whose`: "the server's", "the agent's")."""
    said = validity_warning(path, flag)
    if said is not None:
        level, why = said
        getattr(log, level)(f"{whose} TLS certificate " + ("needs renewing" if level == "warning" else
                                                           "is refused by its peers"), why=why)


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
