"""No token reaches the server's log: a real server gets malformed, oversized, non-UTF-8 and unauthorised requests
carrying each kind of token (a tenant's, the admin's, a pool's node bootstrap token, a node token from a register),
and its whole stderr is scanned for every one of them."""
from __future__ import annotations

import json
import socket

import pytest

from common import logs
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

BOOT = bootstrap_doc()
ADMIN, NODE_BOOTSTRAP = BOOT["adminToken"], BOOT["nodeTokens"][0]["token"]
LIST, CREATE = b"/api/compute/reservations/list", b"/api/compute/reservations/create"


def bad_requests(token: bytes) -> list[bytes]:
    """Requests that aiohttp or the API refuse, each with the token somewhere in what is refused."""
    close = b"Host: berth\r\nConnection: close\r\n"
    head = b"POST " + LIST + b" HTTP/1.1\r\n" + close + b"Content-Type: application/json\r\n"
    auth = b"Authorization: Bearer " + token
    body = b'{"poolId": "' + token + b'", '
    return [
        head + auth + b"\x00\r\nContent-Length: 2\r\n\r\n{}",  # a NUL in the header value
        head + b"Authorization Bearer " + token + b"\r\n\r\n",  # no colon
        head + b"Authorization" + token + b"\r\n\r\n",  # no colon, no space
        head + b"authorization:" + token + b"\x01\r\n\r\n",  # no scheme, a control character
        head + auth + b"x" * 9_000 + b"\r\n\r\n",  # a header line past aiohttp's limit (it shows 100 bytes)
        head + b"X-Pad: " + b"a" * 84 + token + b"b" * 9_000 + b"\r\n\r\n",  # ... the token cut at the 100th byte
        head + b"X-" + token + b"\x7f: 1\r\n\r\n",  # the token in a header name
        b"GET /" + token + b"\x01 HTTP/1.1\r\n" + close + b"\r\n",  # ... in a path with a control character
        b"GET /" + token + b"c" * 9_000 + b" HTTP/1.1\r\n" + close + b"\r\n",  # ... in a request line too long
        head + auth + b"\r\nContent-Length: " + token + b"\r\n\r\n",  # ... as a Content-Length
        head + auth + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + token + b"\r\n",  # ... as a chunk size
        head + b"Authorization: Bearer \xff" + token + b"\r\nContent-Length: 2\r\n\r\n{}",  # not UTF-8
        head + auth + b"\xfe\r\nContent-Length: 2\r\n\r\n{}",
        head + auth + b"-wrong\r\nContent-Length: 2\r\n\r\n{}",  # an unknown token
        head + auth + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,  # a bad body
        head.replace(LIST, CREATE) + auth + b"\r\nIdempotency-Key: \xff" + token + b"\r\nContent-Length: 2\r\n\r\n{}",
        head + auth + b"\r\n Folded: " + token + b"\r\n\r\n",  # an obsolete line folding
    ]


def send(server: ServerProcess, raw: bytes) -> bytes:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(raw)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionError:  # the server closed first (it refused the request before reading it all)
            data = b""
    return data


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_no_token_reaches_the_log(tmp_path, fmt):
    from tests.controlplane.test_nodes import inventory

    (tmp_path / "b.json").write_text(json.dumps(BOOT))
    # the fixture's --log-format json comes first: the last one given wins
    server = ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--synchronous", "NORMAL", "--log-format", fmt])
    server.start()
    try:
        status, doc = server.post("/api/nodes/register", NODE_BOOTSTRAP,
                                  {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, doc
        secrets = [TOKENS["alice"], ADMIN, NODE_BOOTSTRAP, doc["nodeToken"]]
        answers = [send(server, raw) for token in secrets for raw in bad_requests(token.encode())]
        assert all(a.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")) for a in answers), [a[:40] for a in answers]
    finally:
        assert server.stop() == 0
    log = "".join(server.lines)
    # aiohttp's refusals of malformed requests are one rate-limited line (api/guard.py), not a traceback each
    assert (0, True) == (log.count("Error handling request"), "refused a malformed HTTP request" in log)
    assert "[REDACTED]" in log
    for secret in secrets:
        assert secret not in log and secret[:logs.SECRET_PREFIX] not in log, f"{secret[:4]}... is in the log"
    if fmt == "json":
        assert all(json.loads(line)["event"] for line in server.lines)  # aiohttp's lines are JSON too
    else:
        assert all(line.startswith("timestamp=") for line in server.lines), server.lines[:3]


async def test_tokens_a_bootstrap_applied_at_run_time_declares_are_redacted_too(api):
    doc = bootstrap_doc()
    fresh = "runtime-principal-token-0042"
    doc["principals"].append({"id": "late", "tenant": "acme", "token": fresh})
    status, _ = await api.post("/api/admin/bootstrap", "admin-token-for-tests-0001", raw=json.dumps(doc).encode())
    assert status == 200
    assert fresh not in logs.redact(f"a line that quotes {fresh} somewhere")


def test_a_token_with_a_quote_a_backslash_or_a_space_is_redacted_whole_and_named_at_start(tmp_path):
    """The Bearer pattern ran first and stopped at the odd character, and the token's whole form then no longer
    matched: aiohttp's line for `Bearer <token>\\x01` showed everything after the quote, the backslash or the space
    (a backslash doubled in repr never matched at all). Such a token is said at start, by whose it is."""
    odd = {"quote": "QUOTE'TOKENPARTtwoLEAKS01", "slash": "BSLASH\\TOKENPARTtwoLEAKS02",
           "space": "SPACE TOKENPARTtwoLEAKS03", "both": "Q\"U'O\\TE TOKENPARTtwoLEAKS04"}
    boot = bootstrap_doc()
    boot["principals"] += [{"id": name, "tenant": "acme", "token": token} for name, token in odd.items()]
    (tmp_path / "b.json").write_text(json.dumps(boot))
    server = ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--synchronous", "NORMAL"]).start()
    try:
        for name, token in odd.items():
            status, doc = server.post("/api/iam/whoami", token, {})
            assert (200, name) == (status, doc.get("principal", {}).get("id", doc.get("id"))), doc
            close = b"Host: berth\r\nConnection: close\r\n"
            head = b"POST " + LIST + b" HTTP/1.1\r\n" + close + b"Content-Type: application/json\r\n"
            for raw in (head + b"Authorization: Bearer " + token.encode() + b"\x01\r\n\r\n",
                        head + b"X-" + token.encode() + b"\x7f: 1\r\n\r\n",
                        head + b"Authorization: Bearer " + token.encode() + b"-wrong\r\nContent-Length: 2\r\n\r\n{}"):
                assert send(server, raw).startswith((b"HTTP/1.1 4", b"HTTP/1.0 4"))
    finally:
        assert server.stop() == 0
    log = "".join(server.lines)
    assert "[REDACTED]" in log
    for name, token in odd.items():
        assert "TOKENPARTtwoLEAKS" not in log, log[-3000:]
    said = [json.loads(line) for line in server.lines if "a token holds a space, a quote or a backslash" in line]
    assert sorted(name for name in odd) == sorted(line["of"] for line in said)
