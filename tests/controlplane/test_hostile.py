"""Hostile clients against a real server process: bytes that are not UTF-8 in headers, bodies that are not JSON
objects or nest without end, repeated keys, wrong media types, values past every bound. Each is a 4xx naming the
field, never a 5xx, and changes nothing."""
from __future__ import annotations

import json
import socket

import pytest

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

POST_ROUTES = [
    "/api/compute/reservations/create", "/api/compute/reservations/get", "/api/compute/reservations/list",
    "/api/compute/reservations/release", "/api/compute/reservations/cancel", "/api/compute/reservations/extend",
    "/api/compute/reservations/renew", "/api/compute/reservations/quote", "/api/compute/events/list",
    "/api/compute/operations/get", "/api/compute/operations/wait", "/api/compute/usage/list",
    "/api/iam/confirmations/list", "/api/iam/confirmations/get", "/api/iam/confirmations/approve",
    "/api/iam/confirmations/deny", "/api/nodes/register", "/api/nodes/heartbeat", "/api/nodes/watch",
    "/api/nodes/report", "/api/admin/bootstrap", "/api/admin/tenants/budget", "/api/admin/nodes/release-identity",
    "/api/admin/nodes/list", "/api/admin/nodes/get", "/api/admin/nodes/cordon", "/api/admin/nodes/uncordon",
    "/api/admin/nodes/drain", "/api/admin/nodes/clear", "/api/admin/pools/list", "/api/admin/pools/get",
    "/api/admin/tenants/list", "/api/admin/tenants/get", "/api/admin/events/list", "/api/compute/pools/list",
    "/api/compute/pools/get", "/api/iam/whoami",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, module_db_url):
    path = tmp_path_factory.mktemp("hostile")
    (path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(module_db_url, path / "b.json", ["--synchronous", "NORMAL"]) as proc:
        from tests.controlplane.test_nodes import inventory

        status, doc = proc.post("/api/nodes/register", "node-token-h100-000001",
                                {"hostname": "h1.test", "inventory": inventory("h1.test")})
        assert status == 200, doc
        proc.node_token = doc["nodeToken"]
        yield proc


def raw_request(server, path: str, headers: list[bytes], body: bytes = b"{}",
                content_type: bytes | None = b"application/json") -> tuple[int, dict]:
    """One HTTP/1.1 request written byte for byte (so headers can carry any bytes); content_type None: no
    Content-Type header at all."""
    host, port = server.url.removeprefix("http://").split(":")
    head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: " + host.encode(), b"Connection: close",
            *([b"Content-Type: " + content_type] if content_type is not None else []),
            b"Content-Length: " + str(len(body)).encode(), *headers]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    payload = data.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(payload) if payload.startswith(b"{") else {}


def test_the_route_table_is_the_one_tested():
    from controlplane.api.app import create_app
    from controlplane.wiring import Config

    app = create_app(Config())
    registered = {r.resource.canonical for r in app.router.routes() if r.method == "POST"}
    assert set(POST_ROUTES) == registered


@pytest.mark.parametrize("path", POST_ROUTES)
def test_a_token_that_is_not_utf_8_is_401_on_every_route(server, path):
    status, doc = raw_request(server, path, [b"Authorization: Bearer token-\xff\xfe-acme"])
    assert (401, "UNAUTHENTICATED", "Authorization") == (status, doc["error"]["code"], doc["error"]["details"]["field"])


def test_two_authorization_headers_are_refused_not_one_of_them_taken(server):
    """A proxy that appends its own credentials and a server that reads the first disagree on who calls."""
    status, doc = raw_request(server, "/api/compute/reservations/list", [
        f"Authorization: Bearer {TOKENS['alice']}".encode(), f"Authorization: Bearer {TOKENS['carol']}".encode()])
    assert (401, "UNAUTHENTICATED", "Authorization") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
    assert "send one header" in doc["error"]["message"]


def test_two_idempotency_key_headers_are_refused_not_the_first_taken(server):
    body = json.dumps({"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}).encode()
    status, doc = raw_request(server, "/api/compute/reservations/create", [
        f"Authorization: Bearer {TOKENS['alice']}".encode(), b"Idempotency-Key: two-1", b"Idempotency-Key: two-2"],
        body)
    assert (400, "INVALID_INPUT", "Idempotency-Key") == (status, doc["error"]["code"],
                                                         doc["error"]["details"]["field"]), doc
    assert "send one header" in doc["error"]["message"]
    listed = server.post("/api/compute/reservations/list", TOKENS["alice"], {})[1]["reservations"]
    assert not [r for r in listed if r["idempotencyKey"].startswith("two-")]  # nothing was created


def test_malformed_requests_are_one_rate_limited_line_not_a_traceback_each(server):
    """Anyone can send a request aiohttp's parser refuses; ten of them must not write ten error tracebacks."""
    before = len(server.lines)
    for _ in range(10):
        status, _ = raw_request(server, "/api/compute/reservations/list", [b"X-Bad: a\x01b"])
        assert 400 == status
    assert 200 == server.post("/api/compute/reservations/list", TOKENS["alice"], {})[0]  # and it serves on
    lines = server.lines[before:]
    assert not [ln for ln in lines if "Traceback" in ln or "Error handling request" in ln], lines
    assert 1 == sum("refused a malformed HTTP request" in ln for ln in lines), lines


def test_an_idempotency_key_that_is_not_utf_8_is_400(server):
    body = json.dumps({"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}).encode()
    status, doc = raw_request(server, "/api/compute/reservations/create",
                              [f"Authorization: Bearer {TOKENS['alice']}".encode(), b"Idempotency-Key: k-\xff"], body)
    assert (400, "Idempotency-Key") == (status, doc["error"]["details"]["field"])
    listed = server.post("/api/compute/reservations/list", TOKENS["alice"], {})[1]["reservations"]
    assert [] == listed  # nothing was created


@pytest.mark.parametrize("body, rule", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32"),
    (b'{"poolId": "h100", "unknown": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "nested deeper than 32"),
    (b'{"poolId": "h100", "poolId": "mig"}', "appears twice"),
])
@pytest.mark.parametrize("path", ["/api/compute/reservations/create", "/api/nodes/heartbeat"])
def test_nesting_past_the_limit_and_repeated_keys_are_400_naming_the_body(server, path, body, rule):
    token = server.node_token if path.startswith("/api/nodes/") else TOKENS["alice"]
    status, doc = server.post(path, token, body)
    assert (400, "body") == (status, doc["error"]["details"]["field"]) and rule in doc["error"]["message"]


def test_a_body_that_is_not_json_is_415(server):
    status, doc = server.post("/api/compute/reservations/list", TOKENS["alice"], b"scope=all",
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert (415, "INVALID_INPUT", "Content-Type") == (status, doc["error"]["code"], doc["error"]["details"]["field"])
    # a body with no Content-Type at all is said to have none (aiohttp reads it as application/octet-stream)
    status, answer = raw_request(server, "/api/compute/reservations/list",
                                 [f"Authorization: Bearer {TOKENS['alice']}".encode()], content_type=None)
    assert (415, "Content-Type: none is not application/json") == (status, answer["error"]["message"]), answer


@pytest.mark.parametrize("path, body, field", [
    ("/api/compute/events/list", {"after": 2 ** 63}, "after"),
    ("/api/compute/reservations/create", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                          "durationHours": 1, "maxHourlyPrice": "9" * 29}, "maxHourlyPrice"),
])
def test_values_past_their_bounds_are_400(server, path, body, field):
    status, doc = server.post(path, TOKENS["alice"], body)
    assert (400, field) == (status, doc["error"]["details"]["field"])


NUL = "\u0000"


@pytest.mark.parametrize("path, body, field", [
    ("/api/compute/reservations/quote", {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1,
                                         "durationHours": 1, "quoteId": f"x{NUL}"}, "quoteId"),
    ("/api/compute/reservations/get", {"reservationId": f"rsv_{NUL}"}, "reservationId"),
    ("/api/compute/reservations/list", {"poolId": f"h100{NUL}"}, "poolId"),
    ("/api/compute/usage/list", {"reservationId": f"rsv_{NUL}"}, "reservationId"),
    ("/api/nodes/report", {"reports": [{"reservationId": f"rsv_{NUL}", "status": "bound"}]},
     "reports[0].reservationId"),
])
def test_a_nul_character_is_400_naming_the_field_and_fails_no_one_elses_request(server, path, body, field):
    """PostgreSQL's text cannot hold U+0000: such a value reached the database, failed its statement, and with it
    the transaction of every other request in the same group (503 for them). Refused at the body now, on both
    engines alike."""
    import concurrent.futures

    token = server.node_token if path.startswith("/api/nodes/") else TOKENS["alice"]
    quote = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # others' requests in the same groups
        others = [pool.submit(server.post, "/api/compute/reservations/quote", TOKENS["carol"],
                              {**quote, "poolId": "h100"}) for _ in range(16)]
        status, doc = server.post(path, token, body)
        answers = [f.result()[0] for f in others]
    assert (400, "INVALID_INPUT", field) == (status, doc["error"]["code"], doc["error"]["details"]["field"]), doc
    assert "NUL" in doc["error"]["message"]
    assert all(a < 500 for a in answers), answers  # (whatever carol's quote answers, never a 503)


@pytest.mark.parametrize("encoding, body", [
    (b"gzip", b"{}"), (b"deflate", b"0123456789"), (b"deflate", b'{"limit": 1}'), (b"br", b"{}"),
    (b"gzip", __import__("gzip").compress(b'{"limit": 1}')),
    (b"identity\r\nContent-Encoding: gzip", __import__("gzip").compress(b"{}"))])  # (two headers)
def test_a_compressed_body_is_415_naming_the_content_encoding_in_the_error_document(server, encoding, body):
    """aiohttp decoded bodies itself: one that was not what its header said was its plain-text 400 (deflate, br:
    Brotli is not installed) or a 400 with an error-level traceback and the connection closed (gzip). No body is
    taken compressed: each is 415 in the API's error document, and the server serves on."""
    before = len(server.lines)
    status, doc = raw_request(server, "/api/compute/reservations/list",
                              [f"Authorization: Bearer {TOKENS['alice']}".encode(), b"Content-Encoding: " + encoding],
                              body=body)
    assert (415, "INVALID_INPUT", "Content-Encoding") == (status, doc["error"]["code"],
                                                         doc["error"]["details"]["field"]), doc
    assert "send the body uncompressed" in doc["error"]["message"]
    assert 200 == server.post("/api/compute/reservations/list", TOKENS["alice"], {})[0]
    assert not [ln for ln in server.lines[before:] if "Traceback" in ln or "level='error'" in ln or "[error" in ln]
