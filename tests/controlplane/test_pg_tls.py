"""PostgreSQL a network away, as production runs it: over TCP with TLS only (verified against the CA that signed the
server's certificate: sslmode=verify-full) and a password (SCRAM), the password kept out of the command line every
local user can read: in PGPASSWORD, in a passfile, or in the whole URL in BERTH_DB (the unit's environment file).
A password given in --db works but is warned of, and shown in no line; each way a connection is refused exits 2
with one line saying what to change (docs/scale-out.md, "PostgreSQL a network away")."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.pgcluster import ClusterError, throwaway_cluster
from tests.pki import Authority
from tests.serverproc import ServerProcess

PASSWORD = "pw-for-berth-7f3a"  # the role's; no line any process writes may show it
BERTH = "berth_tls"  # a role of its own: the cluster's OS user keeps the socket (trust) for the checks


@pytest.fixture(scope="module")
def network_db(tmp_path_factory):
    """A throwaway cluster on 127.0.0.1 with TLS only and SCRAM over TCP (its certificate names `localhost`
    only), a role with a password, and the CA that signed the certificate and one that did not."""
    d = tmp_path_factory.mktemp("pg-tls")
    d.chmod(0o755)  # the CA files are read by the server processes (root) and the cluster's files copied
    ca, stranger = Authority(d, "pg"), Authority(d, "stranger")
    server = ca.issue("postgres", hosts=("localhost",))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        with throwaway_cluster() as cluster:
            cluster.serve_tls(server.cert, server.key, port)
            cluster.psql(f"CREATE ROLE {BERTH} LOGIN PASSWORD '{PASSWORD}'")
            yield {"cluster": cluster, "port": port, "ca": ca.ca_file, "stranger": stranger.ca_file, "dir": d}
    except ClusterError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def database(network_db):
    name = f"berth_{uuid.uuid4().hex[:12]}"
    network_db["cluster"].psql(f'CREATE DATABASE "{name}" OWNER {BERTH}')
    return name


@pytest.fixture
def bootstrap(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bootstrap_doc()))
    return path


def url(db: dict, name: str, host: str = "localhost", ca: str = "ca", extra: str = "", password: str = "") -> str:
    auth = f"{BERTH}:{password}" if password else BERTH
    return f"postgresql://{auth}@{host}:{db['port']}/{name}?sslmode=verify-full&sslrootcert={db[ca]}{extra}"


def books(server: ServerProcess) -> None:
    status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"], {
        "poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1})
    assert (202, "placed") == (status, doc["reservation"]["state"]), doc


def berths_connections(db: dict, name: str) -> list[tuple[bool, str]]:
    """(over TLS, application_name) of each session Berth holds on the database."""
    rows = db["cluster"].psql(
        "SELECT s.ssl, a.application_name FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
        f"WHERE a.datname = '{name}' AND a.application_name LIKE 'berth-controlplane%' ORDER BY 2")
    return [(ssl == "t", app) for ssl, app in (line.split("|") for line in rows.splitlines())]


def command_line(server: ServerProcess) -> str:
    return Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.parametrize("how", ["PGPASSWORD", "PGPASSFILE", "BERTH_DB"])
def test_over_tls_with_the_password_out_of_the_command_line(network_db, database, bootstrap, tmp_path, how):
    if how == "PGPASSFILE":
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"localhost:{network_db['port']}:{database}:{BERTH}:{PASSWORD}\n")
        passfile.chmod(0o600)  # libpq's rule, which asyncpg keeps: a passfile others may read is ignored
        db, env = url(network_db, database), {"PGPASSFILE": str(passfile)}
    elif how == "PGPASSWORD":
        db, env = url(network_db, database), {"PGPASSWORD": PASSWORD}
    else:  # the whole URL, password and all, as the unit's environment file gives it
        db, env = None, {"BERTH_DB": url(network_db, database, password=PASSWORD)}
    with ServerProcess(db, bootstrap, env={"PGPASSFILE": "/nonexistent", **env}) as server:
        books(server)
        sessions = berths_connections(network_db, database)
        assert len(sessions) >= 3 and all(tls for tls, _ in sessions), sessions  # writer, reads, the listener
        assert PASSWORD not in command_line(server)
        assert not any("holds a password" in line for line in server.lines)
        assert not any(PASSWORD in line for line in server.lines)


def test_a_password_in_the_db_option_works_is_warned_of_and_shown_nowhere(network_db, database, bootstrap):
    given = url(network_db, database, extra=f"&password={PASSWORD}")  # libpq's parameter form
    with ServerProcess(given, bootstrap, env={"PGPASSFILE": "/nonexistent"}) as server:
        books(server)
        warning = [line for line in server.lines if "holds a password" in line]
        assert len(warning) == 1 and "PGPASSWORD" in warning[0] and "BERTH_DB" in warning[0], server.lines
        listening = [json.loads(line) for line in server.lines if '"listening"' in line]
        assert listening[0]["db"].endswith("&password=[REDACTED]"), listening
        assert not any(PASSWORD in line for line in server.lines)


@pytest.mark.parametrize("host, ca, extra, env, says", [
    ("localhost", "stranger", "", {"PGPASSWORD": PASSWORD},
     "not signed by a CA the URL trusts: give sslrootcert="),
    ("127.0.0.1", "ca", "", {"PGPASSWORD": PASSWORD},
     "does not name the host in the URL: connect by a name (or address) the certificate holds"),
    ("localhost", "ca", "&sslmode=disable", {"PGPASSWORD": PASSWORD},
     "no encryption; this server takes only TLS connections from here: give sslmode=verify-full"),
    ("localhost", "ca", "", {"PGPASSWORD": "not-" + PASSWORD}, "password authentication failed for user"),
    ("localhost", "ca", "", {}, "check the password: PGPASSWORD, the passfile (PGPASSFILE"),
], ids=["untrusted CA", "another host", "without TLS", "wrong password", "no password"])
def test_each_refused_connection_exits_2_saying_what_to_change(network_db, database, bootstrap, host, ca, extra,
                                                             env, says):
    out = subprocess.run(
        [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0", "--db",
         url(network_db, database, host, ca, extra), "--bootstrap", str(bootstrap)],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "PGPASSFILE": "/nonexistent", "HOME": str(network_db["dir"]), **env})
    assert 2 == out.returncode, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("berth controlplane: --db postgresql://"), out.stderr
    assert says in lines[0]
    assert PASSWORD not in out.stderr
    assert [] == berths_connections(network_db, database)


@pytest.mark.parametrize("query, said", [
    ("?host={tmp}/no-socket-here", "no PostgreSQL socket is there: check the URL's host"),
    ("?host=127.0.0.1&port={port}&sslmode=verify-full&sslrootcert={tmp}/gone-ca.pem",
     "the URL names a file that is not there: sslrootcert={tmp}/gone-ca.pem"),
])
def test_a_url_naming_a_file_or_socket_that_is_not_there_says_which(tmp_path, query, said):
    """No server is needed to hear it: a missing file or socket is named, not left as a bare FileNotFoundError."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    url = "postgresql://berth@/berth" + query.format(tmp=tmp_path, port=port)
    out = subprocess.run([sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0",
                          "--db", url], capture_output=True, text=True, timeout=60)
    assert (2, True) == (out.returncode, said.format(tmp=tmp_path) in out.stderr), out.stderr
