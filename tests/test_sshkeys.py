"""common.sshkeys: keys made by the real ssh-keygen are accepted with its fingerprints; every rule refuses by name."""
from __future__ import annotations

import base64
import dataclasses
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from common.sshkeys import (ALLOWED_TYPES, MAX_COMMENT_CHARS, MAX_LINE_BYTES, PublicKey, SshKeyError,
                            fingerprint_of_file, parse_public_key)

# (name, ssh-keygen arguments, the type the .pub line carries)
KEYGEN = [
    ("ed25519", ["-t", "ed25519"], "ssh-ed25519"),
    ("ecdsa256", ["-t", "ecdsa", "-b", "256"], "ecdsa-sha2-nistp256"),
    ("ecdsa384", ["-t", "ecdsa", "-b", "384"], "ecdsa-sha2-nistp384"),
    ("ecdsa521", ["-t", "ecdsa", "-b", "521"], "ecdsa-sha2-nistp521"),
    ("rsa2048", ["-t", "rsa", "-b", "2048"], "ssh-rsa"),
    ("rsa3072", ["-t", "rsa", "-b", "3072"], "ssh-rsa"),
    ("rsa1024", ["-t", "rsa", "-b", "1024"], "ssh-rsa"),
]


def keygen_fingerprint(path: Path) -> str:
    """The fingerprint `ssh-keygen -lf` prints for a public key file (its second field)."""
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[1]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """name -> the .pub file of a key freshly made by ssh-keygen, one per row of KEYGEN."""
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen (openssh-client) is not installed")
    d = tmp_path_factory.mktemp("sshkeys")
    made = {}
    for name, args, _ in KEYGEN:
        subprocess.run(["ssh-keygen", "-q", *args, "-N", "", "-C", f"tenant@example {name}", "-f", str(d / name)],
                       check=True, capture_output=True, timeout=60)
        made[name] = d / f"{name}.pub"
    return made


def line_of(path: Path) -> str:
    return path.read_text().strip()


def wire(*parts: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def blob_of(line: str) -> bytes:
    return base64.b64decode(line.split()[1])


def strings_of(blob: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(blob):
        (n,) = struct.unpack_from(">I", blob, at)
        out.append(blob[at + 4:at + 4 + n])
        at += 4 + n
    return out


def b64(blob: bytes) -> str:
    return base64.b64encode(blob).decode()


# -- accepted ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,key_type", [(n, t) for n, _, t in KEYGEN if n != "rsa1024"])
def test_a_key_made_by_ssh_keygen_is_accepted_with_its_fingerprint(keys, name, key_type):
    """Type, comment, canonical line and fingerprint equal what ssh-keygen wrote and prints."""
    line = line_of(keys[name])
    key = parse_public_key(line)
    expected = (key_type, f"tenant@example {name}", line, keygen_fingerprint(keys[name]), blob_of(line))
    assert expected == (key.type, key.comment, key.line(), key.fingerprint, key.blob)


@pytest.mark.parametrize("key_type", ["sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com"])
def test_a_security_key_is_accepted_with_the_fingerprint_ssh_keygen_prints(keys, tmp_path, key_type):
    """An sk- key (built from a real key's point and the 'ssh:' application) parses; ssh-keygen agrees on it."""
    if key_type.startswith("sk-ssh-ed25519"):
        _, point = strings_of(blob_of(line_of(keys["ed25519"])))
        blob = wire(key_type.encode(), point, b"ssh:")
    else:
        _, curve, point = strings_of(blob_of(line_of(keys["ecdsa256"])))
        blob = wire(key_type.encode(), curve, point, b"ssh:")
    line = f"{key_type} {b64(blob)} yubikey"
    (tmp_path / "sk.pub").write_text(line + "\n")
    key = parse_public_key(line)
    assert (key_type, keygen_fingerprint(tmp_path / "sk.pub"), line) == (key.type, key.fingerprint, key.line())


def test_surrounding_blanks_and_runs_of_spaces_give_the_canonical_line(keys):
    line = line_of(keys["ed25519"])
    kind, data, comment = line.split(" ", 2)
    key = parse_public_key(f"  {kind} \t {data}   {comment}\t ")
    assert line == key.line()


def test_a_key_without_comment_prints_without_trailing_space(keys):
    kind, data, _ = line_of(keys["ed25519"]).split(" ", 2)
    key = parse_public_key(f"{kind} {data}")
    assert (f"{kind} {data}", "") == (key.line(), key.comment)


def test_line_with_a_comment_replaces_the_keys_own(keys):
    kind, data, _ = line_of(keys["ed25519"]).split(" ", 2)
    assert f"{kind} {data} berth:r-1" == parse_public_key(line_of(keys["ed25519"])).line("berth:r-1")


def test_a_public_key_is_frozen(keys):
    key = parse_public_key(line_of(keys["ed25519"]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.comment = "changed"  # type: ignore[misc]
    assert isinstance(key, PublicKey)


def test_every_allowed_type_is_in_the_list():
    expected = {"ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
                "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com"}
    assert expected == set(ALLOWED_TYPES)


# -- refused, one case per rule -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Parts:
    """Pieces of real keys to build broken ones from."""

    ed: str  # a whole ed25519 line
    ed_type: str
    ed_data: str
    ed_blob: bytes
    ed_point: bytes
    curve: bytes
    ec_point: bytes
    rsa_e: bytes
    rsa_n: bytes
    rsa1024: str


@pytest.fixture(scope="module")
def parts(keys) -> Parts:
    ed = line_of(keys["ed25519"])
    ed_type, ed_data, _ = ed.split(" ", 2)
    _, ed_point = strings_of(blob_of(ed))
    _, curve, ec_point = strings_of(blob_of(line_of(keys["ecdsa256"])))
    _, e, n = strings_of(blob_of(line_of(keys["rsa2048"])))
    return Parts(ed, ed_type, ed_data, blob_of(ed), ed_point, curve, ec_point, e, n, line_of(keys["rsa1024"]))


EC = b"ecdsa-sha2-nistp256"
SK = b"sk-ssh-ed25519@openssh.com"

# (what is wrong, how to build it from Parts, the rule named)
BROKEN = [
    ("a trailing newline", lambda p: p.ed + "\n", "one-line"),
    ("two keys on two lines", lambda p: p.ed + "\n" + p.ed, "one-line"),
    ("a carriage return", lambda p: p.ed + "\r", "one-line"),
    ("a NUL byte", lambda p: p.ed.replace(" ", "\0", 1), "one-line"),
    ("longer than the bound", lambda p: f"{p.ed_type} {p.ed_data} " + "c" * MAX_LINE_BYTES, "length"),
    ("empty", lambda p: "", "empty"),
    ("only blanks", lambda p: " \t ", "empty"),
    ("not a string", lambda p: p.ed.encode(), "format"),
    ("a type without base64", lambda p: "ssh-ed25519", "format"),
    ("an options prefix word", lambda p: f"no-pty {p.ed}", "options"),
    ("an options prefix with a value", lambda p: f'command="/bin/true" {p.ed}', "options"),
    ("an options list", lambda p: f"no-pty,no-agent-forwarding {p.ed}", "options"),
    ("an unknown type", lambda p: f"ssh-foo {p.ed_data}", "type"),
    ("a DSA key", lambda p: f"ssh-dss {p.ed_data}", "type"),
    ("a certificate", lambda p: f"ssh-ed25519-cert-v01@openssh.com {p.ed_data}", "type"),
    ("characters outside base64", lambda p: f"{p.ed_type} {p.ed_data[:-4]}!!!! x", "base64"),
    ("base64 without its padding", lambda p: f"{p.ed_type} {b64(p.ed_blob + b'xy').rstrip('=')}", "base64"),
    ("base64 with stray padding bits", lambda p: f"{p.ed_type} {b64(p.ed_blob + b'xy')[:-2]}B=", "base64"),
    ("an outer type that is not the inner one", lambda p: f"ecdsa-sha2-nistp256 {p.ed_data}", "inner-type"),
    ("an Ed25519 point of 31 bytes", lambda p: f"{p.ed_type} {b64(wire(p.ed_type.encode(), p.ed_point[:31]))}",
     "material"),
    ("bytes after the key material", lambda p: f"{p.ed_type} {b64(p.ed_blob + bytes(1))}", "material"),
    ("a blob cut short", lambda p: f"{p.ed_type} {b64(p.ed_blob[:20])}", "material"),
    ("a string longer than the blob", lambda p: f"{p.ed_type} {b64(p.ed_blob[:-1])}", "material"),
    ("the wrong curve name", lambda p: f"{EC.decode()} {b64(wire(EC, b'nistp384', p.ec_point))}", "material"),
    ("a compressed point", lambda p: f"{EC.decode()} {b64(wire(EC, p.curve, bytes([2]) + p.ec_point[1:33]))}",
     "material"),
    ("a point off the curve",
     lambda p: f"{EC.decode()} {b64(wire(EC, p.curve, p.ec_point[:-1] + bytes([p.ec_point[-1] ^ 1])))}", "material"),
    ("an RSA key of 1024 bits", lambda p: p.rsa1024, "rsa-size"),
    ("an even RSA exponent", lambda p: f"ssh-rsa {b64(wire(b'ssh-rsa', bytes([2]), p.rsa_n))}", "material"),
    ("a negative RSA modulus", lambda p: f"ssh-rsa {b64(wire(b'ssh-rsa', p.rsa_e, bytes([0xFF]) + p.rsa_n[1:]))}",
     "material"),
    ("a security key with an empty application", lambda p: f"{SK.decode()} {b64(wire(SK, p.ed_point, b''))}",
     "material"),
    ("a security key without application", lambda p: f"{SK.decode()} {b64(wire(SK, p.ed_point))}", "material"),
    ("a comment longer than the bound", lambda p: f"{p.ed_type} {p.ed_data} " + "c" * (MAX_COMMENT_CHARS + 1),
     "comment"),
    ("a comment with an escape character", lambda p: f"{p.ed_type} {p.ed_data} evil\x1b[2J", "comment"),
]


@pytest.mark.parametrize("build,rule", [(b, r) for _, b, r in BROKEN], ids=[name for name, _, _ in BROKEN])
def test_a_key_breaking_one_rule_is_refused_naming_that_rule(parts, build, rule):
    with pytest.raises(SshKeyError) as err:
        parse_public_key(build(parts))
    assert (rule, True) == (err.value.rule, str(err.value).startswith(f"{rule}: "))
    if rule == "material":  # a key that decodes but is not one: says what to send instead
        assert err.value.detail.endswith("copy the whole line of your .pub file again (or print it afresh: "
                                         "ssh-keygen -y -f PRIVATE_KEY)"), err.value.detail


def test_the_rsa_size_refusal_says_what_to_generate_instead(keys):
    with pytest.raises(SshKeyError) as err:
        parse_public_key(line_of(keys["rsa1024"]))
    assert (True, True) == ("1024 bits" in str(err.value), "ssh-keygen -t ed25519" in str(err.value))


# -- host key files -----------------------------------------------------------------------------------------------


def test_fingerprint_of_a_host_key_file_equals_ssh_keygen(keys, tmp_path):
    path = tmp_path / "ssh_host_ed25519_key.pub"
    path.write_text("# a comment line first\n\n" + line_of(keys["ed25519"]) + "\n")
    assert keygen_fingerprint(keys["ed25519"]) == fingerprint_of_file(path)


@pytest.mark.parametrize("content,what", [(None, "cannot read"), ("", "holds no public key"),
                                          ("ssh-foo AAAA\n", "unsupported key type")])
def test_a_missing_empty_or_bad_host_key_file_is_an_error_naming_the_file(tmp_path, content, what):
    path = tmp_path / "ssh_host_x_key.pub"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SshKeyError) as err:
        fingerprint_of_file(path)
    assert (True, True) == (str(path) in str(err.value), what in str(err.value))
