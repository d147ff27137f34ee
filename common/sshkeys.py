"""OpenSSH public keys as a tenant sends them: parse one line, check every rule, print it back canonically.

Owns the one definition of "an SSH public key Berth accepts" (for
`access.sshKeys[i]` of a node binding, and for host keys the agent reports):

- the line is `TYPE BASE64 [COMMENT]`, with no options prefix (Berth writes
  the options itself), no newline, CR or NUL, at most `MAX_LINE_BYTES` bytes
  and a printable comment of at most `MAX_COMMENT_CHARS` characters;
- TYPE is one of `ALLOWED_TYPES` (no DSA, no certificates);
- the base64 is canonical and decodes to the SSH wire form whose inner type
  string equals TYPE, followed by key material of the right shape: a 32-byte
  Ed25519 point; an uncompressed ECDSA point on the named NIST curve; an RSA
  modulus of at least `MIN_RSA_BITS` bits and an odd public exponent; for
  security keys (FIDO) also a non-empty application string; nothing after.

Every refusal is one `SshKeyError` whose `rule` names the rule broken and
whose message says what to send instead. The fingerprint is what
`ssh-keygen -l` prints: `SHA256:` and the unpadded base64 of the blob's
SHA-256. Standard library only: this module sits at the bottom of the import
graph.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_LINE_BYTES = 16 * 1024
MAX_COMMENT_CHARS = 1024
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 16384  # OpenSSH's own limit (OPENSSH_RSA_MAX_MODULUS_SIZE)
MAX_APPLICATION_BYTES = 1024

ED25519 = "ssh-ed25519"
RSA = "ssh-rsa"
SK_ED25519 = "sk-ssh-ed25519@openssh.com"
SK_ECDSA_P256 = "sk-ecdsa-sha2-nistp256@openssh.com"
ECDSA = {"ecdsa-sha2-nistp256": "nistp256", "ecdsa-sha2-nistp384": "nistp384", "ecdsa-sha2-nistp521": "nistp521"}

ALLOWED_TYPES: tuple[str, ...] = (ED25519, *ECDSA, RSA, SK_ED25519, SK_ECDSA_P256)

# NIST curves (FIPS 186-4, D.1.2): y^2 = x^3 - 3x + b (mod p), and the byte length of a coordinate.
_CURVES: dict[str, tuple[int, int, int]] = {
    "nistp256": (2**256 - 2**224 + 2**192 + 2**96 - 1,
                 0x5AC635D8AA3A93E7B3EBBD55769886BC651D06B0CC53B0F63BCE3C3E27D2604B, 32),
    "nistp384": (2**384 - 2**128 - 2**96 + 2**32 - 1,
                 0xB3312FA7E23EE7E4988E056BE3F82D19181D9C6EFE8141120314088F5013875AC656398D8A2ED19D2A85C8EDD3EC2AEF,
                 48),
    "nistp521": (2**521 - 1,
                 int("051953EB9618E1C9A1F929A21A0B68540EEA2DA725B99B315F3B8B489918EF10"
                     "9E156193951EC7E937B1652C0BD3BB1BF073573DF883D2C34F1EF451FD46B503F00", 16),
                 66),
}

_OPTION_WORDS = frozenset({
    "agent-forwarding", "cert-authority", "command", "environment", "expiry-time", "from", "no-agent-forwarding",
    "no-port-forwarding", "no-pty", "no-user-rc", "no-x11-forwarding", "no-touch-required", "permitlisten",
    "permitopen", "port-forwarding", "principals", "pty", "restrict", "tunnel", "user-rc", "verify-required",
    "x11-forwarding",
})
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class SshKeyError(ValueError):
    """A public key line breaks one rule; `rule` names it (type, base64, inner-type, material, ...)."""

    def __init__(self, rule: str, message: str) -> None:
        if rule == "material":  # the blob decodes but is not a key: the line was cut or altered on its way
            message += ("; the key was cut or altered: copy the whole line of your .pub file again (or print it "
                        "afresh: ssh-keygen -y -f PRIVATE_KEY)")
        super().__init__(f"{rule}: {message}")
        self.rule = rule
        self.detail = message


@dataclass(frozen=True)
class PublicKey:
    """One checked public key: its type, the decoded wire blob, the comment and the SHA256 fingerprint."""

    type: str
    blob: bytes
    comment: str
    fingerprint: str

    def base64(self) -> str:
        return base64.b64encode(self.blob).decode("ascii")

    def line(self, comment: str | None = None) -> str:
        """`TYPE BASE64 [COMMENT]`, single spaces; `comment` replaces the key's own when given ("" drops it)."""
        text = self.comment if comment is None else comment
        return f"{self.type} {self.base64()}" + (f" {text}" if text else "")


def fingerprint(blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a key blob, as `ssh-keygen -l` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")


def parse_public_key(line: str) -> PublicKey:
    """The checked key of one OpenSSH public key line ("ssh-ed25519 AAAA... comment"); SshKeyError otherwise."""
    if not isinstance(line, str):
        raise SshKeyError("format", f"a key is a string, not {type(line).__name__}")
    for char, name in (("\n", "a newline"), ("\r", "a carriage return"), ("\0", "a NUL byte")):
        if char in line:
            raise SshKeyError("one-line", f"the key contains {name}: send one key per list item, as one line")
    size = len(line.encode("utf-8", errors="surrogatepass"))
    if size > MAX_LINE_BYTES:
        raise SshKeyError("length", f"the key line is {size} bytes, more than the {MAX_LINE_BYTES} allowed")
    fields = line.strip(" \t").split(None, 2)
    if not fields:
        raise SshKeyError("empty", "the key is empty: send 'TYPE BASE64 [COMMENT]', "
                                   "e.g. the contents of id_ed25519.pub")
    key_type = fields[0]
    if key_type not in ALLOWED_TYPES:
        raise _type_error(key_type, fields)
    if len(fields) < 2:
        raise SshKeyError("format", f"the key has no base64 part after {key_type!r}")
    encoded = fields[1]
    comment = fields[2].strip(" \t") if len(fields) > 2 else ""
    if len(comment) > MAX_COMMENT_CHARS:
        raise SshKeyError("comment", f"the comment is {len(comment)} characters, "
                                     f"more than the {MAX_COMMENT_CHARS} allowed")
    if comment and not comment.isprintable():
        raise SshKeyError("comment", "the comment contains a control character (tab, escape, ...): remove it")
    blob = _decode(encoded)
    _check_blob(key_type, blob)
    return PublicKey(type=key_type, blob=blob, comment=comment, fingerprint=fingerprint(blob))


def fingerprint_of_file(path: str | Path) -> str:
    """The SHA256 fingerprint of the public key in a .pub file (e.g. a host key); SshKeyError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SshKeyError("file", f"cannot read the public key file {path}: {exc}") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise SshKeyError("file", f"{path} holds no public key: regenerate it (ssh-keygen -y -f PRIVATE_KEY > {path})")
    try:
        return parse_public_key(lines[0]).fingerprint
    except SshKeyError as exc:
        raise SshKeyError(exc.rule, f"{path}: {exc.detail}") from None


# -- the rules -------------------------------------------------------------------------------------------------


def _type_error(key_type: str, fields: list[str]) -> SshKeyError:
    allowed = ", ".join(ALLOWED_TYPES)
    word = key_type.split("=", 1)[0].split(",", 1)[0].lower()
    if "=" in key_type or "," in key_type or word in _OPTION_WORDS:
        return SshKeyError("options", f"the key starts with options ({key_type[:40]!r}): send the key alone, "
                                      "'TYPE BASE64 [COMMENT]'; Berth sets the options itself")
    if key_type.endswith("-cert-v01@openssh.com"):
        return SshKeyError("type", f"certificates ({key_type}) are not accepted: send the plain public key")
    if key_type == "ssh-dss":
        return SshKeyError("type", f"DSA keys (ssh-dss) are not accepted: generate an ed25519 key "
                                   f"(ssh-keygen -t ed25519); allowed types: {allowed}")
    return SshKeyError("type", f"unsupported key type {key_type[:60]!r}: allowed types are {allowed}")


def _decode(encoded: str) -> bytes:
    if not _BASE64.fullmatch(encoded) or len(encoded) % 4:
        raise SshKeyError("base64", "the key's second field is not base64: copy the whole .pub line unchanged")
    try:
        blob = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SshKeyError("base64", "the key's second field is not base64: "
                                    "copy the whole .pub line unchanged") from None
    if base64.b64encode(blob).decode("ascii") != encoded:
        raise SshKeyError("base64", "the key's base64 is not canonical (stray bits in the padding): "
                                    "copy the .pub line unchanged")
    return blob


class _Reader:
    """The SSH wire format (RFC 4251 section 5): uint32-length-prefixed strings and mpints."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.at = 0

    def string(self, what: str) -> bytes:
        if len(self.blob) - self.at < 4:
            raise SshKeyError("material", f"the key blob ends before its {what}")
        (n,) = struct.unpack_from(">I", self.blob, self.at)
        self.at += 4
        if n > len(self.blob) - self.at:
            raise SshKeyError("material", f"the key blob's {what} is longer than the blob")
        value = self.blob[self.at:self.at + n]
        self.at += n
        return value

    def mpint(self, what: str) -> int:
        raw = self.string(what)
        if raw and raw[0] & 0x80:
            raise SshKeyError("material", f"the RSA {what} is negative")
        return int.from_bytes(raw, "big")

    def end(self) -> None:
        if self.at != len(self.blob):
            raise SshKeyError("material", f"the key blob has {len(self.blob) - self.at} bytes after the key material")


def _check_blob(key_type: str, blob: bytes) -> None:
    r = _Reader(blob)
    inner = r.string("type string")
    if inner != key_type.encode("ascii"):
        shown = inner[:60].decode("ascii", errors="replace")
        raise SshKeyError("inner-type", f"the line says {key_type!r} but the key blob says {shown!r}: "
                                        "the type or the base64 was changed; copy the .pub line unchanged")
    if key_type in (ED25519, SK_ED25519):
        point = r.string("Ed25519 public key")
        if len(point) != 32:
            raise SshKeyError("material", f"an Ed25519 public key is 32 bytes, this one is {len(point)}")
    elif key_type in ECDSA or key_type == SK_ECDSA_P256:
        curve = ECDSA.get(key_type, "nistp256")
        name = r.string("curve name")
        if name != curve.encode("ascii"):
            raise SshKeyError("material", f"a {key_type} key names the curve {curve!r}, "
                                          f"this one {name[:20].decode('ascii', errors='replace')!r}")
        _check_point(curve, r.string("ECDSA point"))
    elif key_type == RSA:
        e = r.mpint("exponent")
        n = r.mpint("modulus")
        bits = n.bit_length()
        if bits < MIN_RSA_BITS:
            raise SshKeyError("rsa-size", f"the RSA key has {bits} bits, fewer than the {MIN_RSA_BITS} required: "
                                          "generate a new one (ssh-keygen -t ed25519, or -t rsa -b 3072)")
        if bits > MAX_RSA_BITS:
            raise SshKeyError("rsa-size", f"the RSA key has {bits} bits, more than the {MAX_RSA_BITS} OpenSSH accepts")
        if e < 3 or e % 2 == 0 or e >= n or n % 2 == 0:
            raise SshKeyError("material", "the RSA public exponent or modulus is not valid (even, or too small)")
    if key_type in (SK_ED25519, SK_ECDSA_P256):
        app = r.string("security key application")
        if not app or len(app) > MAX_APPLICATION_BYTES:
            raise SshKeyError("material", "a security-key (sk-) key needs a non-empty application string, e.g. 'ssh:'")
        try:
            app.decode("utf-8")
        except UnicodeDecodeError:
            raise SshKeyError("material", "the security key's application string is not UTF-8") from None
    r.end()


def _check_point(curve: str, point: bytes) -> None:
    p, b, size = _CURVES[curve]
    if len(point) != 1 + 2 * size or point[0] != 0x04:
        raise SshKeyError("material", f"a {curve} public key is an uncompressed point of {1 + 2 * size} bytes "
                                      f"starting with 0x04; this one has {len(point)} bytes")
    x = int.from_bytes(point[1:1 + size], "big")
    y = int.from_bytes(point[1 + size:], "big")
    if x >= p or y >= p or (y * y - (x * x * x - 3 * x + b)) % p != 0:
        raise SshKeyError("material", f"the ECDSA public key is not a point on the {curve} curve")
