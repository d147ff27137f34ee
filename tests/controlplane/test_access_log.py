"""The access log of a real `berth controlplane serve`: one JSON line per request with method, path, status,
duration, tenant, principal and the reservation named, never a token; `sample:N` keeps 1 in N and every error;
a bad option is refused with the rule."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess
from tests.waiting import wait_for


def access_lines(proc: ServerProcess) -> list[dict]:
    out = []
    for line in list(proc.lines):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == "request":
            out.append(doc)
    return out


def start(tmp_path, option: str) -> ServerProcess:
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    return ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--access-log", option, "--synchronous", "NORMAL"])


def test_every_request_is_one_line_with_who_and_what_and_no_token(tmp_path):
    with start(tmp_path, "all") as proc:
        status, doc = proc.post("/api/compute/reservations/create", TOKENS["alice"],
                                {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1,
                                 "idempotencyKey": "log-1"})
        assert status == 202, doc
        rid = doc["reservation"]["id"]
        assert 200 == proc.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": rid})[0]
        assert 401 == proc.post("/api/compute/reservations/get", "not-a-token-000000000", {"reservationId": rid})[0]
        wait_for(lambda: len(access_lines(proc)) >= 3)
        create, get, refused = access_lines(proc)[:3]
    assert ("POST", "/api/compute/reservations/create", 202, "acme", "alice", rid) == (
        create["method"], create["path"], create["status"], create["tenant"], create["principal"],
        create["reservation_id"])
    assert (200, rid) == (get["status"], get["reservation_id"]) and get["duration_ms"] >= 0
    assert 401 == refused["status"] and "tenant" not in refused
    text = "".join(proc.lines)
    assert TOKENS["alice"] not in text and "not-a-token-000000000" not in text


def test_sampling_keeps_one_in_n_and_every_error(tmp_path):
    with start(tmp_path, "sample:5") as proc:
        for _ in range(10):
            assert 200 == proc.post("/api/compute/reservations/list", TOKENS["alice"], {})[0]
        for _ in range(3):
            assert 400 == proc.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": 7})[0]
        wait_for(lambda: len(access_lines(proc)) >= 5)
        lines = access_lines(proc)
    assert [200, 200, 400, 400, 400] == [line["status"] for line in lines]


def test_a_bad_option_is_refused_with_the_rule():
    out = subprocess.run([sys.executable, "-m", "berth", "controlplane", "serve", "--access-log", "sample:0"],
                         capture_output=True, text=True, timeout=60)
    assert 2 == out.returncode
    assert "sample:N (N from 1 to 1000000)" in out.stderr


def test_an_operators_request_names_the_operator_and_the_admin_tokens_names_admin(tmp_path):
    """The admin API's lines named nobody: only tenants' tokens were put on the request."""
    from tests.controlplane.test_fleet import OPERATOR_POLICIES, OPERATORS
    doc = bootstrap_doc()
    doc["principals"] += OPERATORS
    doc["policies"] += OPERATOR_POLICIES
    (tmp_path / "b.json").write_text(json.dumps(doc))
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--access-log", "all"]) as proc:
        olga, otto = (op["token"] for op in OPERATORS)
        assert 200 == proc.post("/api/admin/nodes/list", olga, {})[0]
        assert 200 == proc.post("/api/admin/nodes/list", otto, {})[0]
        assert 200 == proc.post("/api/admin/nodes/list", doc["adminToken"], {})[0]
        assert 403 == proc.post("/api/admin/bootstrap", olga, doc)[0]  # the admin token's alone: who was refused
        wait_for(lambda: len(access_lines(proc)) >= 4)
        lines = access_lines(proc)[:4]
    assert [(line.get("principal"), line.get("tenant"), line["status"]) for line in lines] == [
        ("olga", None, 200), ("otto", "acme", 200), ("admin", None, 200), (None, None, 403)]
    text = "".join(proc.lines)
    assert not any(op["token"] in text for op in OPERATORS) and doc["adminToken"] not in text
