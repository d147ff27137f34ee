"""`berth controlplane serve` as a process: the listening line, SIGTERM, and start-up errors that say what to fix."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import smallfs
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess


def serve_once(*args: str, **run) -> subprocess.CompletedProcess:
    """`berth controlplane serve ARGS` run to its end (the starts that are refused); run: subprocess.run's env, cwd."""
    return subprocess.run([sys.executable, "-m", "berth", "controlplane", "serve", *args], capture_output=True,
                          text=True, timeout=30, **run)


def on_file(tmp_path, db: str | None = None, doc: dict | None = None) -> list[str]:
    """serve's arguments for a bootstrap file in tmp_path (`doc`, else the tests' one) and a database."""
    (tmp_path / "b.json").write_text(json.dumps(doc or bootstrap_doc()))
    return ["--listen", "127.0.0.1:0", "--db", db or f"sqlite:///{tmp_path / 'cp.db'}", "--bootstrap",
            str(tmp_path / "b.json")]


def test_serve_logs_its_address_answers_and_stops_cleanly_on_sigterm(tmp_path, db_url):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    server = ServerProcess(db_url, tmp_path / "b.json").start()
    status, doc = server.post("/api/compute/reservations/list", TOKENS["alice"], {})
    assert (status, doc["reservations"]) == (200, [])
    assert server.stop() == 0
    assert any('"stopping"' in line for line in server.lines)


def test_sigterm_answers_the_waits_in_flight_at_once(tmp_path, db_url):
    """An operation's wait (up to 60 s) and a create held while pending (up to 30 s) held a SIGTERM up to their
    timeouts: the port closed and nothing served (past the unit's TimeoutStopSec, systemd killed it), and on
    PostgreSQL the lead stayed with the stopping replica. Each answers at once, as the long polls do."""
    import threading
    import time

    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    server = ServerProcess(db_url, tmp_path / "b.json").start()
    shape = {"poolId": "h100", "gpuModel": "H100_80GB", "durationHours": 1}
    status, _ = server.post("/api/compute/reservations/create", TOKENS["alice"],
                            {**shape, "gpuCount": 8, "nodeCount": 2, "idempotencyKey": "full"})
    assert 202 == status
    status, queued = server.post("/api/compute/reservations/create", TOKENS["alice"],
                                 {**shape, "gpuCount": 1, "idempotencyKey": "queued"})
    assert (202, "pending") == (status, queued["reservation"]["state"]), queued
    answers: dict[str, tuple[int, dict]] = {}

    def call(name: str, path: str, body: dict) -> None:
        answers[name] = server.post(path, TOKENS["alice"], body, timeout=90)

    waits = [threading.Thread(target=call, args=args) for args in [
        ("operation", "/api/compute/operations/wait",
         {"operationId": queued["reservation"]["operation"]["id"], "timeoutMs": 60_000}),
        ("create", "/api/compute/reservations/create",
         {**shape, "gpuCount": 1, "idempotencyKey": "held", "wait": {"timeoutMs": 30_000}})]]
    for t in waits:
        t.start()
    time.sleep(1.5)  # both held
    assert not answers
    began = time.monotonic()
    assert 0 == server.stop()
    stopped = time.monotonic() - began
    for t in waits:
        t.join(30)
    assert stopped < 10, stopped
    assert (200, False) == (answers["operation"][0], answers["operation"][1].get("done")), answers
    assert (202, "pending") == (answers["create"][0], answers["create"][1]["reservation"]["state"]), answers


def test_bootstrap_is_applied_idempotently_across_restarts(tmp_path, db_url):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(db_url, tmp_path / "b.json") as server:
        status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"],
                                  {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, "idempotencyKey": "a"})
        assert status == 202
    with ServerProcess(db_url, tmp_path / "b.json") as server:
        status, doc = server.post("/api/compute/reservations/list", TOKENS["alice"], {})
        assert [r["state"] for r in doc["reservations"]] in (["placed"], ["binding"])  # its window started


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["pools"][0].update(owner="nobody"), "pools[0].owner: no tenant 'nobody'"),
        (lambda d: d["nodes"][0].update(pool="nope"), "nodes[0].pool: no pool 'nope'"),
        (lambda d: d["tenants"][0]["quota"].update({"disk": 1}), "tenants[0].quota.disk"),
        (lambda d: d.update(policies="permit (principal, action, resource) when { resource.colour == 1 };"), "policies"),
        (lambda d: d["principals"][0].update(token="short"), "principals[0].token: must be a string of length >= 16"),
        (lambda d: d.update(colour="blue"), "colour: is not a field of a bootstrap document"),
    ],
)
def test_a_bad_bootstrap_stops_the_start_naming_the_field(tmp_path, change, message):
    doc = bootstrap_doc()
    change(doc)
    out = serve_once(*on_file(tmp_path, doc=doc))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_a_policies_file_that_does_not_parse_is_named_with_its_line(tmp_path):
    doc = bootstrap_doc()
    doc.pop("policies", None)
    doc["policiesFile"] = "policies.cedar"
    (tmp_path / "policies.cedar").write_text("// ours\npermit (principal, action, resource)\n  when { principal.tenant == };\n")
    out = serve_once(*on_file(tmp_path, doc=doc))
    assert (2, True) == (out.returncode, f"policiesFile {tmp_path / 'policies.cedar'}: line 2 ('permit (principal"
                         in out.stderr), out.stderr


def test_an_unsupported_database_url_says_what_to_use(tmp_path):
    out = serve_once("--db", "mysql://x")
    assert out.returncode == 2 and "sqlite:///PATH" in out.stderr
    import os
    env = {**os.environ, "BERTH_DB": "mysql://x"}
    out = serve_once(env=env)
    assert (2, True) == (out.returncode, "BERTH_DB: 'mysql://x' is not sqlite:///PATH" in out.stderr), out.stderr
    out = serve_once("--db", "", cwd=tmp_path)  # not the default database by surprise
    assert (2, True) == (out.returncode, "--db: empty" in out.stderr), out.stderr
    for port in ("notaport", "99999"):  # one line, not the driver's traceback
        out = serve_once("--db", f"postgresql://berth@127.0.0.1:{port}/berth")
        assert (2, True, False) == (out.returncode, f"the port '{port}' of host" in out.stderr,
                                    "Traceback" in out.stderr), out.stderr


@pytest.mark.parametrize("url", ["postgresql+asyncpg://berth:S3cretPW@db.example/berth",
                                 "POSTGRESQL://berth:S3cretPW@db.example/berth",
                                 " postgresql://berth:S3cretPW@db.example/berth"])
@pytest.mark.parametrize("command", [["serve"], ["backup", "--to", "copy.db"], ["restore", "--from", "copy.db"]])
def test_a_database_url_refused_from_berth_db_keeps_its_password_out_of_the_message(tmp_path, url, command):
    """BERTH_DB is where the unit keeps a password out of the command line; a URL the command did not take was
    printed whole, password and all (into the journal, every 2 s), and backup and restore named --db for it."""
    import os

    out = subprocess.run([sys.executable, "-m", "berth", "controlplane", *command], capture_output=True, text=True,
                         timeout=30, cwd=tmp_path,
                         env={**os.environ, "BERTH_DB": url, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert 2 == out.returncode, out.stderr
    assert "S3cretPW" not in out.stderr and "[REDACTED]" in out.stderr, out.stderr
    assert "BERTH_DB" in out.stderr and "--db" not in out.stderr.split("is not")[0], out.stderr


async def test_admin_sets_a_budget_and_applies_a_bootstrap_at_run_time(api):
    admin = "admin-token-for-tests-0001"
    status, doc = await api.post("/api/admin/tenants/budget", admin, {"tenantId": "globex", "budgetUsd": "50.000000"})
    assert (status, doc["budgetUsd"]) == (200, "50.000000")
    status, doc = await api.create("carol", key="g")  # globex's offer checks budgets; it now has 50 USD
    assert status == 202
    status, doc = await api.post("/api/admin/tenants/budget", "alice", {"tenantId": "globex", "budgetUsd": "1"})
    assert (403, "ACCESS_DENIED") == (status, doc["error"]["code"])  # a valid token, but not the admin token
    status, doc = await api.post("/api/admin/tenants/budget", admin, {"tenantId": "nope", "budgetUsd": "1"})
    assert status == 404
    for bad in ("-1", "1e3", "+3"):
        status, doc = await api.post("/api/admin/tenants/budget", admin, {"tenantId": "globex", "budgetUsd": bad})
        assert (status, doc["error"]["details"]["field"]) == (400, "budgetUsd")
    boot = bootstrap_doc()
    boot["policies"] = 'permit (principal, action, resource) when { principal.tenant == resource.tenant && resource.tenant != "acme" };'
    status, doc = await api.post("/api/admin/bootstrap", admin, boot)
    assert status == 200 and doc["applied"]["pools"] == 7
    status, doc = await api.create("alice", key="now-refused")  # the new policy took effect at once
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")
    status, doc = await api.post("/api/admin/bootstrap", admin, {"pools": [{"id": "x"}]})
    assert status == 400 and doc["error"]["code"] == "INVALID_INPUT"


async def test_a_posted_bootstrap_names_its_files_by_absolute_path(api, tmp_path, monkeypatch):
    """A posted document has no directory: a relative policiesFile would be read from the server's working
    directory, whatever lies there."""
    admin = "admin-token-for-tests-0001"
    policies = tmp_path / "policies.cedar"
    policies.write_text('permit (principal, action, resource) when { principal.tenant == resource.tenant };')
    monkeypatch.chdir(tmp_path)  # where a relative path would have been found
    boot = {**bootstrap_doc(), "policiesFile": "policies.cedar"}
    boot.pop("policies", None)
    status, doc = await api.post("/api/admin/bootstrap", admin, boot)
    assert (400, "policiesFile") == (status, doc["error"]["details"]["field"]), doc  # the field, not "body"
    assert "give the absolute path" in doc["error"]["message"]
    status, doc = await api.post("/api/admin/bootstrap", admin, {**boot, "policiesFile": str(policies)})
    assert 200 == status, doc
    status, doc = await api.post("/api/admin/bootstrap", admin, {**boot, "policiesFile": str(tmp_path / "gone")})
    assert (400, True) == (status, "cannot read" in doc["error"]["message"]), doc


async def test_a_budget_set_at_run_time_outlives_the_bootstrap_applied_again_until_the_file_declares_another(api):
    """Every replica applies the bootstrap file at its start: a budget set through the admin API stays while the
    file declares the budget it declared before, and the file's wins once it declares another."""
    admin = "admin-token-for-tests-0001"

    async def budget() -> str:
        status, doc = await api.post("/api/admin/tenants/get", admin, {"tenantId": "acme"})
        assert status == 200, doc
        return doc["tenant"]["budgetUsd"]

    assert await budget() == "100.000000"  # the file's
    status, doc = await api.post("/api/admin/tenants/budget", admin, {"tenantId": "acme", "budgetUsd": "250"})
    assert status == 200, doc
    boot = bootstrap_doc()
    status, doc = await api.post("/api/admin/bootstrap", admin, boot)  # as a replica's start applies it
    assert status == 200, doc
    assert await budget() == "250.000000"
    next(t for t in boot["tenants"] if t["id"] == "acme")["budgetUsd"] = "80"
    status, doc = await api.post("/api/admin/bootstrap", admin, boot)
    assert status == 200, doc
    assert await budget() == "80.000000"


def test_a_second_control_plane_on_a_served_sqlite_file_is_refused_naming_the_first(tmp_path):
    """Two processes on one file would each place from their own memory: the same GPUs booked twice."""
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json") as first:
        second = serve_once(*on_file(tmp_path, f"sqlite:///{tmp_path / 'cp.db'}"))
        assert 2 == second.returncode, second.stderr
        assert f"is served by another control plane (pid {first.proc.pid})" in second.stderr
        assert "PostgreSQL" in second.stderr and "Traceback" not in second.stderr
        status, _ = first.post("/api/compute/reservations/list", TOKENS["alice"], {})
        assert 200 == status  # the first goes on
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json") as again:  # the first stopped: its lock went with it
        assert 200 == again.post("/api/compute/reservations/list", TOKENS["alice"], {})[0]


@pytest.mark.parametrize("what, said", [
    ("directory", "is a directory: give the database file's path"),
    ("not a database", "as a SQLite database (file is not a database)"),
    ("under a file", "notes.txt is a file, not a directory"),
])
def test_a_db_path_that_is_no_database_stops_the_start_saying_what_to_give(tmp_path, what, said):
    (tmp_path / "notes.txt").write_text("not a database, but long enough to have a header's worth of bytes " * 10)
    path = {"directory": tmp_path, "not a database": tmp_path / "notes.txt",
            "under a file": tmp_path / "notes.txt" / "cp.db"}[what]
    out = serve_once(*on_file(tmp_path, f"sqlite:///{path}"))
    assert (2, True, False) == (out.returncode, said in out.stderr, "Traceback" in out.stderr), out.stderr
    assert "--db" in out.stderr


@pytest.mark.parametrize("flags, said", [
    (["--authzen", "notaurl"], "argument --authzen: 'notaurl': give the URL, http(s)://HOST[:PORT]"),
    (["--authzen", "http://pdp.example:99999"], "argument --authzen"),
    (["--node-grace", "-5"], "argument --node-grace: '-5': give seconds above 0"),
    (["--authzen-timeout", "0"], "argument --authzen-timeout"),
    (["--log-level", "LOUD"], "argument --log-level: invalid choice: 'loud'"),
])
def test_a_flag_value_that_cannot_work_stops_the_start_naming_the_flag(tmp_path, flags, said):
    """Checked at start: a --authzen typo would otherwise answer every create PROVIDER_UNAVAILABLE, as an outage."""
    out = serve_once("--listen", "127.0.0.1:0", "--db", f"sqlite:///{tmp_path / 'cp.db'}", *flags)
    assert (2, True) == (out.returncode, said in out.stderr), out.stderr
    assert not (tmp_path / "cp.db").exists()  # refused before anything was opened


def test_a_commit_the_disk_refuses_is_answered_503_counted_as_no_commit_and_the_next_one_lands(tmp_path):
    """A real write failure (the server's file-size limit lowered below its WAL: EFBIG, SQLite's disk I/O error):
    the create is PROVIDER_UNAVAILABLE, /metrics counts no committed group for it and one rebuild of the memory,
    and once the disk takes writes again the same key books."""
    import os
    import resource
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def store_counters(server) -> dict[str, float]:
        req = urllib.request.Request(server.url + "/metrics",
                                     headers={"Authorization": "Bearer admin-token-for-tests-0001"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name in ("berth_store_groups_total", "berth_store_jobs_total", "berth_store_rebuilds_total")}

    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    import time
    later = (int(time.time()) + 86_400) * 1000  # a window ahead
    body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": later, "end": later + 3_600_000}
    with ServerProcess(tmp_path / "cp.db", tmp_path / "b.json", ["--synchronous", "NORMAL"]) as server:
        assert 202 == server.post("/api/compute/reservations/create", TOKENS["alice"], {**body, "idempotencyKey": "a"})[0]
        before = store_counters(server)
        wal = os.path.getsize(f"{tmp_path / 'cp.db'}-wal")
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (wal, resource.RLIM_INFINITY))
        try:
            status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"], {**body, "idempotencyKey": "b"})
        finally:
            resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert (503, "PROVIDER_UNAVAILABLE") == (status, doc["error"]["code"]), doc
        after = store_counters(server)
        moved = {name: after[name] - before[name] for name in after}
        # the failed group's job ran, but no transaction committed for it (other groups may commit meanwhile)
        assert moved["berth_store_jobs_total"] - moved["berth_store_groups_total"] >= 1, moved
        assert 1 == moved["berth_store_rebuilds_total"], moved
        status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"], {**body, "idempotencyKey": "b"})
        assert 202 == status, doc
        listed = server.post("/api/compute/reservations/list", TOKENS["alice"], {})[1]["reservations"]
        assert 2 == len(listed)


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs of the test's own, and what fills it."""
    with smallfs.small_fs(tmp_path, "2m") as point:
        yield point, lambda: smallfs.fill(point)


def test_a_database_on_a_full_disk_stops_the_start_saying_the_disk_is_full(tmp_path, full_disk):
    """A full disk was blamed on the file (`cannot open it as a SQLite database (disk I/O error): give the control
    plane's database file`), and a bootstrap the database could not take on the bootstrap file (`--bootstrap the
    store could not commit`): both say where to look now."""
    point, fill = full_disk
    db = f"sqlite:///{point / 'cp.db'}"
    fill()
    out = serve_once(*on_file(tmp_path, db))  # a new database, on a disk with no room for it
    assert 2 == out.returncode, out.stderr
    assert f"the file system holding it is full (0 bytes free): free space there (df -h {point})" in out.stderr
    assert "Traceback" not in out.stderr
    (point / "filler").unlink()
    for name in ("cp.db", "cp.db-wal", "cp.db-shm"):
        (point / name).unlink(missing_ok=True)
    server = ServerProcess(point / "cp.db", tmp_path / "b.json").start()
    server.kill()
    fill()
    doc = bootstrap_doc()
    doc["tenants"] += [{"id": f"tenant-{i:04d}-{'x' * 40}", "quota": {"gpu:H100_80GB": 1}} for i in range(300)]
    out = serve_once(*on_file(tmp_path, db, doc))
    assert 2 == out.returncode, out.stderr
    assert f"--db: the bootstrap file {tmp_path / 'b.json'} is valid, but the database could not take it" in out.stderr
    assert "--bootstrap" not in out.stderr and "Traceback" not in out.stderr
    (point / "filler").unlink()
    with ServerProcess(point / "cp.db", tmp_path / "b.json") as again:  # space again: the same file starts
        assert 200 == again.post("/api/compute/reservations/list", TOKENS["alice"], {})[0]


def test_a_database_the_control_planes_user_cannot_write_says_so_not_that_it_is_no_database(tmp_path):
    import sqlite3

    from controlplane.store.sqlite import cannot_open

    path = tmp_path / "cp.db"
    sqlite3.connect(path).execute("CREATE TABLE t (x)").connection.close()
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # as a file the user may only read opens
    with pytest.raises(sqlite3.OperationalError) as caught:
        conn.execute("INSERT INTO t VALUES (1)")
    said = cannot_open(str(path), caught.value)
    assert f"the control plane's user must be able to write it and create files beside it in {tmp_path}" in said
    (tmp_path / "notes.txt").write_text("not a database " * 100)
    with pytest.raises(sqlite3.DatabaseError) as caught:
        sqlite3.connect(tmp_path / "notes.txt").execute("SELECT * FROM sqlite_master")
    assert "as a SQLite database (file is not a database): give the control plane's database file" in \
        cannot_open(str(tmp_path / "notes.txt"), caught.value)


@pytest.mark.parametrize("url", ["postgresql://berth:S3cretPW/S3cretPW@127.0.0.1:5432/berth",  # a base64 password
                                 "postgresql://berth:S3cretPW@S3cretPW@127.0.0.1:1/berth",
                                 "postgresql://berth@myserver:S3cretPW@127.0.0.1:1/berth"])  # Azure's user@server
@pytest.mark.parametrize("command", ["serve", "migrate"])
def test_a_slash_or_an_at_left_in_a_database_urls_password_is_said_without_showing_it(tmp_path, url, command):
    """The URL was shown whole (the password's '/' ended the redaction's match), or in part, and a user with an
    '@' ended in the driver's traceback (exit 1)."""
    import os

    args = ["--to", url, "--from", f"sqlite:///{tmp_path / 'none.db'}"] if command == "migrate" else ["--db", url]
    out = subprocess.run([sys.executable, "-m", "berth", "controlplane", command, *args], capture_output=True,
                         text=True, timeout=30, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert (2, False, False) == (out.returncode, "S3cretPW" in out.stderr, "Traceback" in out.stderr), out.stderr
    assert "percent-encode them in the URL (%2F and %40)" in out.stderr, out.stderr
