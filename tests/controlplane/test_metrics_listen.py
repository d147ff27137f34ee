"""/metrics is not public: on the API's listener it needs the admin token; `--metrics-listen HOST:PORT` serves it
without one on a listener of its own (and nothing else there); off by default."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess

ADMIN = bootstrap_doc()["adminToken"]


def get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def listening_line(server: ServerProcess) -> dict:
    return next(json.loads(line) for line in server.lines if '"listening"' in line)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics")
    (path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(path / "cp.db", path / "b.json", ["--synchronous", "NORMAL",
                                                         "--metrics-listen", "127.0.0.1:0"]) as proc:
        status, _ = proc.post("/api/compute/reservations/create", TOKENS["alice"], {
            "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, "idempotencyKey": "m"})
        assert status == 202
        proc.metrics_url = listening_line(proc)["metrics"]
        yield proc


@pytest.mark.parametrize("token", [None, TOKENS["alice"], "node-token-h100-000001", ADMIN + "x"])
def test_the_api_listener_answers_metrics_only_to_the_admin_token(server, token):
    status, body = get(server.url + "/metrics", token)
    doc = json.loads(body)
    known = token in (TOKENS["alice"], "node-token-h100-000001")  # valid, for another API: 403
    assert (status, doc["error"]["code"], doc["error"]["details"]["field"]) == (
        (403, "ACCESS_DENIED", "Authorization") if known else (401, "UNAUTHENTICATED", "Authorization"))
    assert "berth_" not in body
    if token:
        assert "admin token" in doc["error"]["message"] and "--metrics-listen" in doc["error"]["message"]


def test_the_admin_token_reads_the_same_metrics_as_the_metrics_listener(server):
    status, with_token = get(server.url + "/metrics", ADMIN)
    assert status == 200
    status, scraped = get(server.metrics_url)
    assert status == 200
    for text in (with_token, scraped):
        assert re.search(r'^berth_reservations\{pool="h100",state="(placed|binding)"\} 1\.0$', text, re.M)
        assert re.search(r'^berth_nodes\{pool="h100",state="\w+"\} \d', text, re.M)
        assert "# TYPE berth_store_jobs_total counter" in text
    assert re.match(r"http://127\.0\.0\.1:\d+/metrics$", server.metrics_url)
    assert server.metrics_url.rsplit(":", 1)[1] != server.url.rsplit(":", 1)[1]


@pytest.mark.parametrize("path", ["/healthz", "/api/openapi.json", "/api/compute/reservations/list"])
def test_the_metrics_listener_serves_nothing_else(server, path):
    base = server.metrics_url.removesuffix("/metrics")
    assert get(base + path, TOKENS["alice"])[0] == 404


def test_metrics_listen_is_off_by_default(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--synchronous", "NORMAL"]) as server:
        assert "metrics" not in listening_line(server)
        assert get(server.url + "/metrics")[0] == 401


def test_a_metrics_address_in_use_stops_the_start_naming_it(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0",
             "--db", f"sqlite:///{tmp_path / 'cp.db'}", "--bootstrap", str(tmp_path / "b.json"),
             "--metrics-listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30,
        )
    assert out.returncode == 1, out.stderr
    assert f"--metrics-listen 127.0.0.1:{port}: cannot listen (" in out.stderr  # the flag, and what to do
    assert "give --metrics-listen another port" in out.stderr and "Traceback" not in out.stderr


def test_the_metrics_on_the_api_s_own_address_is_refused_before_anything_binds(tmp_path):
    for api, metrics in (("127.0.0.1:18555", "127.0.0.1:18555"), ("0.0.0.0:18555", "127.0.0.1:18555")):
        out = subprocess.run(
            [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", api,
             "--db", f"sqlite:///{tmp_path / 'cp.db'}", "--metrics-listen", metrics],
            capture_output=True, text=True, timeout=30,
        )
        assert (2, True) == (out.returncode, "the API listens there (--listen)" in out.stderr), out.stderr
    assert not (tmp_path / "cp.db").exists()


def test_after_a_restart_a_node_whose_agent_stays_silent_shows_when_it_was_last_heard_from(tmp_path):
    """Heartbeat times lived in memory only: after a restart a node whose agent had died showed no last heartbeat
    and no heartbeat age (the documented alert on it never fired) until it was lost. They are kept in the file."""
    import datetime
    import time

    from tests.controlplane.test_nodes import inventory
    from tests.waiting import wait_for

    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--node-grace", "60"]) as first:
        status, reg = first.post("/api/nodes/register", "node-token-h100-000001",
                                 {"hostname": "h1.test", "inventory": inventory("h1.test"), "agentVersion": "0.1.0"})
        assert status == 200, reg
        assert 200 == first.post("/api/nodes/heartbeat", reg["nodeToken"], {})[0]
        heard = first.post("/api/admin/nodes/get", ADMIN, {"nodeId": "h1"})[1]["node"]["lastHeartbeat"]
        assert heard is not None
    time.sleep(1.5)
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--node-grace", "60"]) as second:
        def shown():
            node = second.post("/api/admin/nodes/get", ADMIN, {"nodeId": "h1"})[1]["node"]
            return node if node["lastHeartbeat"] is not None else None
        node = wait_for(shown, timeout=10)
        def at(iso: str) -> float:
            return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()

        # (to the millisecond: the time is kept as this process's monotonic clock, converted back and forth)
        assert abs(at(node["lastHeartbeat"]) - at(heard)) <= 0.002 and node["heartbeatAgeSeconds"] >= 1.5, node
        assert "ready" == node["state"]  # not lost: its agent has the grace from this start to speak again
        status, text = get(second.url + "/metrics", ADMIN)
        assert re.search(r'^berth_node_heartbeat_age_seconds\{node="h1",pool="h100"\} ([0-9.]+)$', text, re.M), text
