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
