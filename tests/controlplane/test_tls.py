"""TLS end to end, with a CA made here: `berth controlplane serve --tls-cert --tls-key [--tls-client-ca]` as a real
process, the tenant CLI verifying it with --ca-file (or saying what to do when it cannot), plain HTTP refused,
mutual TLS for the agent's node API calls, and every unusable file a one-line start-up error with exit code 2."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agent.checkpoint import StateDir
from agent.link import ControlPlaneLink
from agent.metrics import AgentMetrics
from agent.nodeclient import NodeClient, Unreachable
from common import tls
from common.inventory import Inventory
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.pki import Authority
from tests.serverproc import ServerProcess

NODE_BOOT = "node-token-h100-000001"
HOSTS = ("localhost", "127.0.0.1")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The control plane's CA (its server certificate, a node's client certificate) and a stranger's CA."""
    d = tmp_path_factory.mktemp("pki")
    ca, stranger = Authority(d, "berth"), Authority(d, "stranger")
    (d / "b.json").write_text(json.dumps(bootstrap_doc()))
    return {"dir": d, "ca": ca, "server": ca.issue("controlplane", hosts=HOSTS),
            "node": ca.issue("node-h1", client=True), "stranger": stranger,
            "stranger_node": stranger.issue("node-x", client=True)}


def start(pki, name: str, extra: list[str], context: ssl.SSLContext | None) -> ServerProcess:
    d: Path = pki["dir"]
    return ServerProcess(d / f"{name}.db", d / "b.json", ["--synchronous", "NORMAL", *extra], context=context).start()


@pytest.fixture(scope="module")
def server(pki):
    """TLS, no client certificates asked; the metrics listener serves TLS as well."""
    proc = start(pki, "tls", ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                              "--metrics-listen", "127.0.0.1:0"], tls.client_context(str(pki["ca"].ca_file)))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def mutual(pki):
    """Mutual TLS: every client must show a certificate the control plane's CA signed."""
    node = pki["node"]
    proc = start(pki, "mtls", ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                               "--tls-client-ca", str(pki["ca"].ca_file)],
                 tls.client_context(str(pki["ca"].ca_file), str(node.cert), str(node.key)))
    yield proc
    proc.stop()


def berth(*argv: str, env: dict | None = None, xdg: Path | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    environ.update({"XDG_CONFIG_HOME": str(xdg or "/nonexistent"), "BERTH_TOKEN": TOKENS["alice"], **(env or {})})
    return subprocess.run([sys.executable, "-m", "berth", *argv], capture_output=True, text=True, env=environ,
                          timeout=60)


def listening(server: ServerProcess) -> dict:
    return next(json.loads(line) for line in server.lines if '"listening"' in line)


# ---- the listener -------------------------------------------------------------------------------------------

def test_the_listening_line_says_https_for_the_api_and_the_metrics_listener(server):
    line = listening(server)
    assert (line["address"].startswith("https://127.0.0.1:"), line["metrics"].startswith("https://127.0.0.1:"),
            line["mutual_tls"]) == (True, True, False)
    with urllib.request.urlopen(line["metrics"], context=server.context, timeout=10) as resp:
        assert "berth_" in resp.read().decode()


def test_plain_http_to_the_tls_port_gets_no_answer(server):
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(server.url.replace("https://", "http://") + "/healthz", timeout=10)


def test_a_client_that_never_starts_its_handshake_is_closed_at_the_request_timeout(pki):
    proc = start(pki, "slow", ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                               "--request-timeout", "1"], tls.client_context(str(pki["ca"].ca_file)))
    try:
        host, port = proc.url.removeprefix("https://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            began = time.monotonic()
            assert b"" == sock.recv(1)  # closed by the server, not by our timeout
            assert 0.5 < time.monotonic() - began < 5
    finally:
        proc.stop()


def test_connections_still_in_their_handshake_count_under_the_cap_and_the_oldest_makes_room(pki):
    """A TLS listener handed connections to the guard only once their handshakes were done: connections that never
    sent a ClientHello were outside --max-connections and were never closed to make room, so a few hundred of them
    (open until the request timeout, and opened again) took every descriptor and real clients timed out."""
    proc = start(pki, "cap", ["--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                              "--max-connections", "4", "--request-timeout", "60"],
                 tls.client_context(str(pki["ca"].ca_file)))
    host, port = proc.url.removeprefix("https://").split(":")
    silent = []
    try:
        for _ in range(6):  # none sends a byte: each would wait out the 60 s handshake limit
            silent.append(socket.create_connection((host, int(port)), timeout=10))
            time.sleep(0.2)
        for sock in silent[:2]:  # at the cap, the longest-waiting made room for the newest
            sock.settimeout(5)
            assert b"" == sock.recv(1)
        with urllib.request.urlopen(proc.url + "/healthz", context=proc.context, timeout=10) as resp:
            assert 200 == resp.status  # served: a handshaking one made room for it too
        silent[2].settimeout(5)
        assert b"" == silent[2].recv(1)
    finally:
        for sock in silent:
            sock.close()
        proc.stop()


# ---- the tenant CLI -------------------------------------------------------------------------------------------

def test_the_cli_with_the_ca_file_lists_reservations(server, pki):
    out = berth("reservations", "list", "--json", "--url", server.url, "--ca-file", str(pki["ca"].ca_file))
    assert (0, []) == (out.returncode, json.loads(out.stdout)["reservations"]), out.stderr


def test_the_host_name_in_the_url_may_be_any_the_certificate_holds(server, pki):
    url = server.url.replace("127.0.0.1", "localhost")
    out = berth("reservations", "list", "--json", "--url", url, env={"BERTH_CA_FILE": str(pki["ca"].ca_file)})
    assert 0 == out.returncode, out.stderr


def test_the_ca_file_may_come_from_the_config_file_relative_to_it(server, pki, tmp_path):
    (tmp_path / "xdg" / "berth").mkdir(parents=True)
    (tmp_path / "xdg" / "berth" / "ca.pem").write_bytes(pki["ca"].ca_file.read_bytes())
    (tmp_path / "xdg" / "berth" / "config.json").write_text(json.dumps({"url": server.url, "caFile": "ca.pem"}))
    out = berth("reservations", "list", "--json", xdg=tmp_path / "xdg")
    assert 0 == out.returncode, out.stderr


def test_without_the_ca_file_the_cli_says_to_pass_it_and_sends_nothing(server):
    out = berth("reservations", "list", "--url", server.url)
    assert 2 == out.returncode
    assert "the server's certificate is not trusted" in out.stderr
    assert "pass --ca-file (env BERTH_CA_FILE) with the CA that signed it" in out.stderr
    assert "retrying" not in out.stderr and "Traceback" not in out.stderr


def test_a_ca_that_did_not_sign_the_server_is_refused_the_same_way(server, pki):
    out = berth("reservations", "list", "--url", server.url, "--ca-file", str(pki["stranger"].ca_file))
    assert (2, True) == (out.returncode, "the server's certificate is not trusted" in out.stderr), out.stderr


def test_plain_http_to_the_tls_port_says_the_url_must_be_https(server):
    out = berth("reservations", "list", "--retries", "0", "--url", server.url.replace("https://", "http://"))
    assert 5 == out.returncode
    assert "if the control plane serves TLS (--tls-cert), the URL must start with https://" in out.stderr


@pytest.mark.parametrize("args, env, said", [
    (["--ca-file", "/nonexistent/ca.pem"], {}, "--ca-file /nonexistent/ca.pem: cannot read it"),
    ([], {"BERTH_CA_FILE": "/nonexistent/ca.pem"}, "BERTH_CA_FILE /nonexistent/ca.pem: cannot read it"),
    (["--client-cert", "/x.pem"], {}, "--client-cert and --client-key go together"),
])
def test_an_unusable_tls_file_exits_2_naming_where_it_came_from(server, args, env, said):
    out = berth("reservations", "list", "--url", server.url, *args, env=env)
    assert (2, True) == (out.returncode, said in out.stderr), out.stderr


@pytest.mark.parametrize("flag, env, in_file, expected, source", [
    ("/flag/ca.pem", "/env/ca.pem", "ca.pem", "/flag/ca.pem", "flag"),
    (None, "/env/ca.pem", "ca.pem", "/env/ca.pem", "env BERTH_CA_FILE"),
    (None, None, "ca.pem", "{dir}/ca.pem", "file {dir}/config.json"),
    (None, None, "/abs/ca.pem", "/abs/ca.pem", "file {dir}/config.json"),
])
def test_the_ca_file_comes_from_the_flag_then_the_environment_then_the_file(tmp_path, flag, env, in_file, expected,
                                                                            source):
    from berth.client import resolve_settings

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"token": "t", "caFile": in_file}))
    settings = resolve_settings(config_path=config, environ={"BERTH_CA_FILE": env} if env else {}, ca_file=flag)
    assert (expected.format(dir=tmp_path), source.format(dir=tmp_path)) == (settings.ca_file,
                                                                             settings.sources["ca_file"])
    with pytest.raises(tls.TlsError) as caught:
        settings.tls_context()
    named = {"flag": "--ca-file ", "env BERTH_CA_FILE": "BERTH_CA_FILE "}.get(source, f"caFile (config file {config}) ")
    assert str(caught.value).startswith(named + expected.format(dir=tmp_path) + ": cannot read it")


def test_a_server_certificate_that_has_expired_is_said_at_start(pki, server):
    """The standard library checks a peer's dates, not its own: without this line the first sign would be every
    client's refusal."""
    from tests.pki import DAY

    expired = pki["ca"].issue("expired", hosts=HOSTS, valid=(-10 * DAY, -DAY))
    proc = start(pki, "expired", ["--tls-cert", str(expired.cert), "--tls-key", str(expired.key)], None)
    try:
        said = [json.loads(line) for line in proc.lines if "TLS certificate" in line]
        assert [("error", "the server's TLS certificate is refused by its peers")] == [
            (line["level"], line["event"]) for line in said], proc.lines
        assert f"--tls-cert {expired.cert}: the certificate expired on " in said[0]["why"]
        out = berth("reservations", "list", "--retries", "0", "--url", proc.url, "--ca-file", str(pki["ca"].ca_file))
        assert (2, True) == (out.returncode, "expired" in out.stderr), out.stderr
    finally:
        proc.stop()
    assert not [line for line in server.lines if "TLS certificate" in line], "a certificate good for a year"


# ---- mutual TLS ---------------------------------------------------------------------------------------------------

def test_with_a_client_ca_a_client_without_a_certificate_is_refused(mutual, pki):
    out = berth("reservations", "list", "--retries", "0", "--url", mutual.url, "--ca-file", str(pki["ca"].ca_file))
    assert 5 == out.returncode
    assert "give --client-cert and --client-key with a certificate its client CA signed" in out.stderr
    anonymous = tls.client_context(str(pki["ca"].ca_file))
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        urllib.request.urlopen(mutual.url + "/healthz", context=anonymous, timeout=10).read()


def test_with_a_client_ca_the_cli_with_a_signed_certificate_is_served(mutual, pki):
    node = pki["node"]
    out = berth("reservations", "list", "--json", "--url", mutual.url, "--ca-file", str(pki["ca"].ca_file),
                env={"BERTH_CLIENT_CERT": str(node.cert), "BERTH_CLIENT_KEY": str(node.key)})
    assert 0 == out.returncode, out.stderr


def node_client(mutual, pki, cert) -> NodeClient:
    ctx = tls.client_context(str(pki["ca"].ca_file), str(cert.cert), str(cert.key)) if cert else \
        tls.client_context(str(pki["ca"].ca_file))
    return NodeClient(mutual.url, ssl_context=ctx, timeout_s=10)


def inventory(hostname: str) -> Inventory:
    from tests.controlplane.test_nodes import inventory as wire_inventory

    return Inventory.from_wire(wire_inventory(hostname))


class NoBindings:
    """The link's view of the binding controller, reduced to what register touches (no cgroups here)."""

    class binder:
        @staticmethod
        def forget_reports() -> None:
            pass


def test_the_agent_link_with_its_client_certificate_registers_and_heartbeats(mutual, pki, tmp_path):
    inv = inventory("h1.test")
    node = pki["node"]
    with StateDir(tmp_path / "state") as state:
        link = ControlPlaneLink(mutual.url, NODE_BOOT, state, state.load_checkpoint(boot_id="b", cgroup_root="/x"),
                                NoBindings(), AgentMetrics(), inventory=lambda: inv, agent_version="test",
                                wall_ms=lambda: 0, on_node=lambda node_id: None, backoff_max_s=0.2,
                                ssl_context=tls.client_context(str(pki["ca"].ca_file), str(node.cert), str(node.key)))

        async def go():
            try:
                await asyncio.wait_for(link.register(), 20)
                return await link.client.heartbeat()
            finally:
                await link.close()

        beat = asyncio.run(go())
        assert (link.identity.controlPlane, beat is not None) == (mutual.url, True)
        assert link.identity.nodeId == state.read_identity().nodeId


@pytest.mark.parametrize("cert", [None, "stranger_node"])
def test_the_agent_without_a_certificate_the_client_ca_signed_is_unreachable_and_told_why(mutual, pki, cert):
    async def go():
        client = node_client(mutual, pki, pki[cert] if cert else None)
        try:
            await client.heartbeat()
        finally:
            await client.close()

    with pytest.raises(Unreachable) as caught:
        asyncio.run(go())
    assert caught.value.tls is not None and "--client-cert and --client-key" in caught.value.tls


# ---- start-up errors --------------------------------------------------------------------------------------------

def serve(pki, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    d: Path = pki["dir"]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    return subprocess.run([sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0",
                           "--db", f"sqlite:///{d / 'never.db'}", "--bootstrap", str(d / "b.json"), *args],
                          capture_output=True, text=True, timeout=60, env={**environ, **(env or {})})


@pytest.mark.parametrize("pick, said", [
    (lambda p: (p["server"].cert, p["node"].key),
     lambda p: f"--tls-key {p['node'].key} is not the key of the certificate in --tls-cert {p['server'].cert}"),
    (lambda p: ("/nonexistent.pem", p["server"].key),
     lambda p: "--tls-cert /nonexistent.pem: cannot read it: No such file or directory"),
    (lambda p: (p["server"].key, p["server"].key), lambda p: f"--tls-cert {p['server'].key}: holds no PEM certificate"),
    (lambda p: (p["server"].cert, p["server"].cert),
     lambda p: f"--tls-key {p['server'].cert}: holds no PEM private key"),
], ids=["mismatched", "missing", "not-a-certificate", "not-a-key"])
def test_an_unusable_certificate_or_key_stops_the_start_naming_the_option(pki, pick, said):
    cert, key = pick(pki)
    out = serve(pki, "--tls-cert", str(cert), "--tls-key", str(key))
    assert (2, True, False) == (out.returncode, said(pki) in out.stderr, "Traceback" in out.stderr), out.stderr


@pytest.mark.parametrize("args, said", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key (env BERTH_TLS_CERT, BERTH_TLS_KEY) go together"),
    (["--tls-key", "k.pem"], "--tls-cert and --tls-key (env BERTH_TLS_CERT, BERTH_TLS_KEY) go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca (env BERTH_TLS_CLIENT_CA) needs --tls-cert and --tls-key"),
])
def test_tls_options_without_their_partner_are_a_usage_error(pki, args, said):
    out = serve(pki, *args)
    assert (2, True) == (out.returncode, said in out.stderr), out.stderr


def test_an_unusable_client_ca_stops_the_start_naming_it(pki):
    out = serve(pki, "--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                "--tls-client-ca", str(pki["server"].key))
    assert (2, True) == (out.returncode, f"--tls-client-ca {pki['server'].key}: holds no PEM CA" in out.stderr)


def test_the_environment_the_units_set_turns_tls_on(pki, monkeypatch):
    """BERTH_TLS_CERT and BERTH_TLS_KEY (the unit's environment file) stand for the flags."""
    monkeypatch.setenv("BERTH_TLS_CERT", str(pki["server"].cert))
    monkeypatch.setenv("BERTH_TLS_KEY", str(pki["server"].key))
    proc = start(pki, "env", [], tls.client_context(str(pki["ca"].ca_file)))
    try:
        assert proc.url.startswith("https://")
        with urllib.request.urlopen(proc.url + "/healthz", context=proc.context, timeout=10) as resp:
            assert 200 == resp.status
    finally:
        proc.stop()
