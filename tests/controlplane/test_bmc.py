"""controlplane.bmc against the real sushy-tools Redfish emulator (its fake driver), on a free loopback port.

The emulator runs with its own config file, an htpasswd file (bcrypt) and its
state in tmp_path; it is stopped by pid after each test, also on failure.
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog

pytest.importorskip("sushy", reason="sushy (the Redfish client) is not installed")
pytest.importorskip("sushy_tools", reason="sushy-tools (the Redfish emulator) is not installed")
bcrypt = pytest.importorskip("bcrypt", reason="bcrypt (for the emulator's htpasswd file) is not installed")

from controlplane.bmc import Bmc, BmcError, BmcResult, read_credentials  # noqa: E402

USER = "berth-admin"
PASSWORD = "pw-Zq8x!never-logged-7731"
RUNNING = "5c6f3a52-0d8e-4b8e-9d0e-000000000001"
STOPPED = "5c6f3a52-0d8e-4b8e-9d0e-000000000002"


@dataclass
class Emulator:
    url: str
    pid: int
    log: Path
    ca_file: Path | None = None  # https: the CA that signed its certificate

    def system(self, system_id: str) -> dict:
        """The emulator's own view of a system (GET with the right credentials)."""
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        req = urllib.request.Request(f"{self.url}/redfish/v1/Systems/{system_id}",
                                     headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(req, timeout=5, context=_client_tls(self.ca_file)) as resp:
            return json.loads(resp.read())

    def wait_power(self, system_id: str, state: str, timeout: float = 20.0) -> str:
        """Poll until the system's PowerState is `state` (the fake driver applies power changes after 1-11 s)."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.system(system_id)["PowerState"]
            if seen == state:
                return seen
            time.sleep(0.2)
        return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_tls(ca_file: Path | None) -> ssl.SSLContext | None:
    return ssl.create_default_context(cafile=str(ca_file)) if ca_file else None


def _ready(url: str, ca_file: Path | None = None) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/redfish/v1", timeout=1, context=_client_tls(ca_file)) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture
def emulator(tmp_path) -> Emulator:
    """A sushy-emulator --fake with one system on (RUNNING) and one off (STOPPED), basic auth USER/PASSWORD."""
    with running_emulator(tmp_path) as emu:
        yield emu


@pytest.fixture
def tls_emulator(tmp_path):
    """The same emulator over https, its certificate (for 127.0.0.1) signed by a private CA; and that CA."""
    pki = pytest.importorskip("tests.pki", reason="cryptography (for a throwaway CA) is not installed")
    authority = pki.Authority(tmp_path, "bmc")
    with running_emulator(tmp_path, authority.issue("bmc", hosts=("127.0.0.1",)), authority.ca_file) as emu:
        yield emu, authority


@contextlib.contextmanager
def running_emulator(tmp_path: Path, tls=None, ca_file: Path | None = None):
    """The emulator as a process, over http, or over https with tls (a tests.pki.Issued); stopped by pid after."""
    (tmp_path / "htpasswd").write_text(f"{USER}:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt()).decode()}\n")
    systems = [{"uuid": RUNNING, "name": "node-running", "power_state": "On", "nics": []},
               {"uuid": STOPPED, "name": "node-stopped", "power_state": "Off", "nics": []}]
    (tmp_path / "emulator.conf").write_text(
        f"SUSHY_EMULATOR_FAKE_DRIVER = True\n"
        f"SUSHY_EMULATOR_STATE_DIR = {str(tmp_path / 'emulator-state')!r}\n"
        f"SUSHY_EMULATOR_AUTH_FILE = {str(tmp_path / 'htpasswd')!r}\n"
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}\n")
    log_path = tmp_path / "emulator.log"
    proc = None
    try:
        for _ in range(3):  # a port taken between free_port() and the bind: try another
            port = free_port()
            url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
            certificate = ["--ssl-certificate", str(tls.cert), "--ssl-key", str(tls.key)] if tls else []
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sushy_tools.emulator.main", "--config", str(tmp_path / "emulator.conf"),
                     "--fake", "-i", "127.0.0.1", "-p", str(port), *certificate],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=tmp_path,
                    env={**os.environ, "TMPDIR": str(tmp_path)})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None and not _ready(url, ca_file):
                time.sleep(0.1)
            if proc.poll() is None and _ready(url, ca_file):
                break
            _stop(proc)
            proc = None
        if proc is None:
            pytest.fail(f"sushy-emulator did not start:\n{log_path.read_text()[-3000:]}")
        yield Emulator(url=url, pid=proc.pid, log=log_path, ca_file=ca_file)
    finally:
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def credentials(tmp_path) -> Path:
    path = tmp_path / "bmc-credentials.json"
    path.write_text(json.dumps({"username": USER, "password": PASSWORD}))
    path.chmod(0o600)
    return path


def wrong_credentials(tmp_path: Path) -> Path:
    path = tmp_path / "wrong-credentials.json"
    path.write_text(json.dumps({"username": USER, "password": PASSWORD + "-wrong"}))
    path.chmod(0o600)
    return path


# -- resets ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_reset_with_a_pxe_override_sets_the_boot_source_and_restarts_a_running_system(emulator, credentials):
    result = Bmc(emulator.url, RUNNING, credentials).reset(boot_override="Pxe")
    expected = BmcResult(emulator.url, RUNNING, "Pxe", "ForceRestart", "On", result.power_after)
    seen = emulator.system(RUNNING)
    assert (expected, "Pxe") == (result, seen["Boot"]["BootSourceOverrideTarget"])
    assert result.power_after in ("Off", "On")  # read just after the reset: still off, or (a slow read) back on
    assert "On" == emulator.wait_power(RUNNING, "On")  # the restart completes


@pytest.mark.slow
def test_reset_of_a_system_that_is_off_powers_it_on_without_touching_the_boot_source(emulator, credentials):
    before = emulator.system(STOPPED)["Boot"].get("BootSourceOverrideTarget")
    result = Bmc(emulator.url, STOPPED, credentials).reset()
    assert ((None, "On", "Off"), before) == ((result.boot_override, result.reset, result.power_before),
                                             emulator.system(STOPPED)["Boot"].get("BootSourceOverrideTarget"))
    assert "On" == emulator.wait_power(STOPPED, "On")


async def test_reset_async_issues_the_reset_from_a_thread(emulator, credentials):
    result = await Bmc(emulator.url, RUNNING, credentials).reset_async("Pxe")
    assert ("ForceRestart", "Pxe") == (result.reset, emulator.system(RUNNING)["Boot"]["BootSourceOverrideTarget"])


def test_a_redfish_url_with_the_service_root_path_is_accepted(emulator, credentials):
    assert "ForceRestart" == Bmc(emulator.url + "/redfish/v1/", RUNNING, credentials).reset().reset


# -- errors ----------------------------------------------------------------------------------------------------


def test_a_wrong_system_id_names_it_and_lists_the_systems_the_bmc_has(emulator, credentials):
    with pytest.raises(BmcError) as err:
        Bmc(emulator.url, "no-such-system", credentials).reset()
    text = str(err.value)
    assert (True, True, True) == ("'no-such-system'" in text, f"lists: {RUNNING}, {STOPPED}" in text,
                                  emulator.url in text)


def test_a_wrong_password_says_to_check_the_credentials_file(emulator, tmp_path):
    path = wrong_credentials(tmp_path)
    with pytest.raises(BmcError) as err:
        Bmc(emulator.url, RUNNING, path).reset()
    text = str(err.value)
    assert (True, True, True) == (f"refused the credentials of {path}" in text, "HTTP 401" in text,
                                  emulator.url in text)
    assert "Off" != emulator.system(RUNNING)["PowerState"]  # nothing was issued


def test_an_unknown_boot_source_lists_the_ones_the_bmc_offers(emulator, credentials):
    with pytest.raises(BmcError) as err:
        Bmc(emulator.url, RUNNING, credentials).reset(boot_override="Floppy")
    assert "offers no boot source 'Floppy': it offers Cd, Hdd, Pxe, UefiHttp" in str(err.value)


def test_an_unreachable_bmc_names_its_url_and_what_to_check(credentials):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(BmcError) as err:
        Bmc(url, RUNNING, credentials, timeout_s=5).reset()
    assert (True, True) == (f"cannot reach the BMC at {url}" in str(err.value), "bmc.redfishUrl" in str(err.value))


# -- https ------------------------------------------------------------------------------------------------------


def test_an_https_bmc_signed_by_a_private_ca_is_reset_with_that_ca_in_ca_file(tls_emulator, credentials):
    emulator, authority = tls_emulator
    result = Bmc(emulator.url, RUNNING, credentials, ca_file=authority.ca_file).reset("Pxe")
    assert ("https", "ForceRestart", "Pxe") == (result.redfish_url.split(":")[0], result.reset, result.boot_override)
    assert "Pxe" == emulator.system(RUNNING)["Boot"]["BootSourceOverrideTarget"]


def test_an_https_bmc_whose_ca_is_not_given_is_refused_before_the_credentials_are_sent(tls_emulator, credentials,
                                                                                       tmp_path):
    emulator, _ = tls_emulator
    stranger = pytest.importorskip("tests.pki").Authority(tmp_path, "stranger")
    for ca_file, trusted in ((None, "the system's CAs"), (stranger.ca_file, f"the CA bundle {stranger.ca_file}")):
        with pytest.raises(BmcError) as err:
            Bmc(emulator.url, RUNNING, credentials, ca_file=ca_file, timeout_s=5).reset()
        text = str(err.value)
        assert (True, True, True) == (f"its certificate is not trusted by {trusted}" in text,
                                      "in bmc.caFile" in text, emulator.url in text), text
    # the TLS handshake failed, so no request reached the emulator (its log has one line per request)
    assert "POST /redfish/v1/Systems" not in emulator.log.read_text()
    assert "Off" != emulator.system(RUNNING)["PowerState"]


def test_a_bad_ca_file_is_refused_when_the_bmc_is_declared(credentials, tmp_path):
    not_pem = tmp_path / "not-a-ca.pem"
    not_pem.write_text("hello\n")
    for url, ca_file, expected in (
            ("https://bmc.example", tmp_path / "absent.pem", "does not exist"),
            ("https://bmc.example", not_pem, "is not a PEM bundle of CA certificates (no certificate or crl found)"),
            ("https://bmc.example", tmp_path, "is not a PEM bundle"),
            ("http://bmc.example", not_pem, "bmc.caFile is for an https BMC")):
        with pytest.raises(BmcError) as err:
            Bmc(url, "1", credentials, ca_file=ca_file)
        assert expected in str(err.value), str(err.value)


def test_the_password_is_in_no_log_line_no_error_and_no_repr(emulator, credentials, tmp_path, caplog):
    """Every log record (sushy, requests and urllib3 at DEBUG), every structlog event, the emulator's own log,
    every error text and the reprs are free of the password, for a good reset and for refused ones."""
    caplog.set_level(logging.DEBUG)
    texts = []
    with structlog.testing.capture_logs() as events:
        bmc = Bmc(emulator.url, RUNNING, credentials)
        texts += [repr(bmc), repr(read_credentials(credentials)), repr(bmc.reset("Pxe"))]
        for make in (lambda: Bmc(emulator.url, RUNNING, wrong_credentials(tmp_path)),
                     lambda: Bmc(emulator.url, "no-such-system", credentials),
                     lambda: Bmc(f"http://127.0.0.1:{free_port()}", RUNNING, credentials, timeout_s=5)):
            with pytest.raises(BmcError) as err:
                make().reset("Pxe")
            texts.append(str(err.value))
    lines = [r.getMessage() for r in caplog.records] + [repr(e) for e in events] + texts
    lines += emulator.log.read_text().splitlines()
    assert (True, []) == (len(caplog.records) > 0, [ln for ln in lines if PASSWORD in ln])


# -- the declaration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content,mode,expected", [
    (None, 0o600, "does not exist: create it"),
    ('{"username": "a", "password": "b"}', 0o644, "chmod 600"),
    ('{"username": "a", "password": "b"}', 0o640, "chmod 600"),
    ("username=a", 0o600, "is not JSON"),
    ('{"username": "a"}', 0o600, 'needs non-empty string fields "username" and "password"'),
    ('{"username": "a", "password": ""}', 0o600, 'needs non-empty string fields "username" and "password"'),
], ids=["missing", "world-readable", "group-readable", "not-json", "no-password", "empty-password"])
def test_a_bad_credentials_file_is_refused_saying_what_to_fix(tmp_path, content, mode, expected):
    path = tmp_path / "creds.json"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(BmcError) as err:
        Bmc("https://bmc.example", "1", path)
    assert (True, True) == (expected in str(err.value), str(path) in str(err.value))


@pytest.mark.parametrize("url,expected", [
    ("https://admin:secret@bmc.example", "put them in bmc.credentialsFile"),
    ("ftp://bmc.example", "is not an http(s) URL"),
    ("bmc.example", "is not an http(s) URL"),
    ("https://bmc.example/redfish/v1/Systems/1", "give the BMC's address only"),
])
def test_a_bad_redfish_url_is_refused_saying_what_to_write(credentials, url, expected):
    with pytest.raises(BmcError) as err:
        Bmc(url, "1", credentials)
    assert expected in str(err.value)


def test_a_system_path_is_taken_as_its_id(credentials):
    assert "/redfish/v1/Systems/abc" == Bmc("https://bmc.example", "/redfish/v1/Systems/abc", credentials).system_path
