"""The artefacts of packaging/deb/build.sh, for real: the wheel and sdist pass `twine check`; lintian finds no
error or warning in the three Debian packages and every override says why; dpkg installs them on this machine;
the installed `berth --version` runs from /opt/berth alone; `systemd-analyze verify` accepts the installed units;
the installed control plane, started as its unit would start it (as the user berth, with the unit's environment),
answers /healthz on a temporary port; and `dpkg --purge` leaves nothing behind.

The tests of the installation share one install (module scope); the last test purges it, and the fixture purges
whatever is left in any case.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.packaging.conftest import (PACKAGES, PLAIN_ENV, REPO, Installation, accounts_named, dpkg_status, run,
                                      unit_command, unit_settings)

pytestmark = pytest.mark.slow
UNITS = ("berth-agent.service", "berth-controlplane.service")
OVERRIDES = REPO / "packaging" / "deb" / "debian"


# -- the build ---------------------------------------------------------------------------------------------------


def test_the_wheel_and_the_sdist_carry_the_pyproject_version_and_pass_twine_check(built, builder):
    wheel = built.artefact("berth-*-py3-none-any.whl")
    sdist = built.artefact("berth-*.tar.gz")
    assert wheel.name == f"berth-{built.version}-py3-none-any.whl" and sdist.name == f"berth-{built.version}.tar.gz"
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(f"berth-{built.version}.dist-info/METADATA").decode()
        entry_points = z.read(f"berth-{built.version}.dist-info/entry_points.txt").decode()
    assert f"\nVersion: {built.version}\n" in metadata
    assert "berth = berth.main:main" in entry_points
    out = run([str(builder.tools / "twine"), "check", "--strict", str(wheel), str(sdist)])
    assert out.stdout.count("PASSED") == 2, out.stdout
    assert "twine check --strict" in built.log and "dpkg-buildpackage -b" in built.log


def test_lintian_finds_no_error_and_no_warning_and_every_override_says_why(built):
    """lintian on the .changes (the three packages): no error, no warning; an override that matches nothing is
    the warning unused-override, so every override is needed. (Not --show-overrides: with it, lintian 2.116
    exits 2 on --fail-on for tags that are overridden.)"""
    out = run(["lintian", "--fail-on", "error,warning", "--display-info", "--tag-display-limit", "0",
               str(built.changes)], check=False, timeout=300)
    tags = [line for line in out.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)]
    bad = [t for t in tags if t.startswith(("E:", "W:")) or "mismatched-override" in t]
    assert (0, []) == (out.returncode, bad), out.stdout[-4000:] + out.stderr[-2000:]
    overrides = sorted(OVERRIDES.glob("*.lintian-overrides"))
    assert overrides, "the overrides live in packaging/deb/debian/*.lintian-overrides"
    for path in overrides:
        reason = False
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                reason = reason or bool(line.strip("# "))
            elif line.strip():
                assert reason, f"{path.name}: the override {line!r} has no comment above it saying why"
            else:
                reason = False


def test_the_packages_hold_the_units_as_shipped_the_conffiles_and_the_python_they_need(built):
    debs = built.debs
    info = {p: run(["dpkg-deb", "-f", str(debs[p])]).stdout for p in PACKAGES}
    depends = {p: re.search(r"^Depends: (.*)$", info[p], re.M).group(1) for p in PACKAGES}
    assert re.search(r"\bpython3\.\d+ \(>= 3\.\d+\.\d+\)", depends["berth"]), depends["berth"]
    assert f"berth (= {built.deb_version})" in depends["berth-agent"]
    assert f"berth (= {built.deb_version})" in depends["berth-controlplane"] and "adduser" in depends["berth-controlplane"]

    with tempfile.TemporaryDirectory() as tmp:
        for p in ("berth-agent", "berth-controlplane"):
            dest = Path(tmp) / p
            run(["dpkg-deb", "-x", str(debs[p]), str(dest)])
            run(["dpkg-deb", "-e", str(debs[p]), str(dest / "DEBIAN")])
            unit = f"{p}.service"
            shipped = dest / "lib/systemd/system" / unit
            assert shipped.read_text() == (REPO / "systemd" / unit).read_text(), "the units are installed unchanged"
            env = p.removeprefix("berth-") + ".env"
            assert (dest / "DEBIAN/conffiles").read_text().split() == [f"/etc/berth/{env}"]
        example = Path(tmp) / "berth-controlplane/usr/share/doc/berth-controlplane/examples/haproxy.cfg"
        assert example.read_text() == (REPO / "examples/haproxy.cfg").read_text(), "the balancer's example, as tested"
        agent_env = (Path(tmp) / "berth-agent/etc/berth/agent.env").read_text()
        assert re.search(r"^BERTH_CONTROL_PLANE=", agent_env, re.M)
        assert re.search(r"^BERTH_BOOTSTRAP_TOKEN_FILE=/etc/berth/agent.token$", agent_env, re.M)
        assert not re.search(r"^BERTH_BOOTSTRAP_TOKEN=", agent_env, re.M), "never the token itself"
    listing = run(["dpkg-deb", "-c", str(debs["berth"])]).stdout
    assert "./usr/bin/berth -> /opt/berth/bin/berth" in listing
    assert "./usr/share/doc/berth/scale-out.md" in listing, "running several replicas, shipped with the guides"
    assert "./opt/berth/bin/python3" in listing and "/pip/" not in listing and "-> /usr/bin/python3." in listing


# -- installed ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(built):
    inst = Installation()
    try:
        inst.install(built)
        yield inst
    finally:
        inst.close()


def test_the_installed_berth_prints_its_version_from_opt_berth_alone(installed, built):
    for command in ("/usr/bin/berth", "/opt/berth/bin/berth"):
        out = run([command, "--version"], env=PLAIN_ENV, cwd="/")
        assert f"berth {built.version}\n" == out.stdout
    probe = ("import sys, agent, berth, cgroups, common, controlplane, aiohttp, cedarpy, grpc, kubernetes, "
             "msgspec, pynvml, structlog, sushy\n"
             "print(sys.prefix, sys.base_prefix, berth.__file__)\n"
             "print(*[p for p in sys.path if p], sep='\\n')")
    out = run(["/opt/berth/bin/python", "-c", probe], env=PLAIN_ENV, cwd="/").stdout.splitlines()
    prefix, base, module = out[0].split()
    assert (prefix, base) == ("/opt/berth", "/usr") and module.startswith("/opt/berth/lib/python3.")
    assert [p for p in out[1:] if not p.startswith(("/usr/lib/python3", "/opt/berth/lib/python3"))] == []
    assert not any("dist-packages" in p for p in out[1:]), "the system's Python packages are not seen"
    cfg = Path("/opt/berth/pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg and "home = /usr/bin" in cfg


def test_systemd_analyze_verify_accepts_the_installed_units(installed):
    paths = [f"/lib/systemd/system/{u}" for u in UNITS]
    out = run(["systemd-analyze", "verify", "--man=no", *paths], check=False, timeout=60)
    assert (0, "") == (out.returncode, out.stderr.strip()), out.stderr


def test_nothing_is_enabled_or_started_and_the_user_and_state_directories_exist(installed):
    wants = [p for p in Path("/etc/systemd/system").rglob("berth*")]
    assert wants == [], "the packages enable nothing"
    assert run(["pgrep", "-f", "^/usr/bin/python3[.0-9]* /usr/bin/berth"], check=False).stdout == ""
    entry = run(["getent", "passwd", "berth"]).stdout.strip().split(":")
    assert int(entry[2]) < 1000 and entry[5:] == ["/var/lib/berth", "/usr/sbin/nologin"], entry
    cp, agent = os.stat("/var/lib/berth/controlplane"), os.stat("/var/lib/berth/agent")
    assert (cp.st_mode & 0o7777, cp.st_uid) == (0o700, int(entry[2]))
    assert (agent.st_mode & 0o7777, agent.st_uid) == (0o711, 0)
    conffiles = run(["dpkg-query", "-W", "-f=${Conffiles}\\n", "berth-agent", "berth-controlplane"]).stdout.split()
    assert {"/etc/berth/agent.env", "/etc/berth/controlplane.env"} <= set(conffiles)
    env = os.stat("/etc/berth/controlplane.env")  # it may hold the database's password
    assert (env.st_mode & 0o7777, env.st_uid, env.st_gid) == (0o640, 0, int(entry[3])), oct(env.st_mode)


def test_the_installed_control_plane_started_as_its_unit_answers_healthz(installed):
    """ExecStart of the installed unit, with its Environment= and EnvironmentFile=, as its User=; a drop-in's
    worth of overrides puts it on a free loopback port with a test bootstrap (readable by berth only)."""
    unit = Path("/lib/systemd/system/berth-controlplane.service")
    user = unit_settings(unit)["User"][0]
    tmp = Path(tempfile.mkdtemp(prefix="berth-test-cp-"))
    proc = None
    try:
        os.chmod(tmp, 0o755)
        boot = tmp / "bootstrap.json"
        boot.write_text(json.dumps({
            "adminToken": "admin-token-packaging-01",
            "tenants": [{"id": "acme", "quota": {"gpu:H100_80GB": 8}}],
            "principals": [{"id": "alice", "tenant": "acme", "token": "acme-alice-token-0001"}],
            "policies": "permit (principal, action, resource) when { principal.tenant == resource.tenant };"}))
        os.chown(boot, 0, int(run(["getent", "group", user]).stdout.split(":")[2]))
        os.chmod(boot, 0o640)
        argv, env = unit_command(unit, {"BERTH_LISTEN": "127.0.0.1:0", "BERTH_BOOTSTRAP": str(boot)})
        assert argv[:3] == ["/usr/bin/berth", "controlplane", "serve"], argv
        assert env["BERTH_DB"] == "sqlite:////var/lib/berth/controlplane/controlplane.db"
        assert "--db" not in argv  # the command reads BERTH_DB: a database password stays out of its command line
        proc = subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *argv],
                                env={**PLAIN_ENV, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, cwd="/")
        lines: list[str] = []
        found = threading.Event()
        address: list[str] = []

        def pump() -> None:
            for line in proc.stderr:
                lines.append(line)
                m = re.search(r'"address":\s*"(http://[^"]+)"', line)
                if m and not found.is_set():
                    address.append(m.group(1))
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        assert found.wait(30), "no listening line:\n" + "".join(lines)
        with urllib.request.urlopen(address[0] + "/healthz", timeout=10) as resp:
            assert (200, {"status": "ok", "leads": True}) == (resp.status, json.loads(resp.read()))
        db = Path("/var/lib/berth/controlplane/controlplane.db")
        assert db.exists() and db.stat().st_uid == int(run(["id", "-u", user]).stdout)
        proc.send_signal(signal.SIGTERM)
        assert 0 == proc.wait(30), "".join(lines)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def test_purge_removes_everything_and_leaves_nothing_outside(installed):
    """Last of this module: `dpkg --purge` of the three, after an operator's files were added as the guide says
    (the agent's token file, the bootstrap file, agent state, the tenants' keys of node bindings in the
    directory the guide names, with the lock the agent leaves there); nothing is left in /etc, /opt, /usr, /lib or /var
    that was not there before (the state directory /var/lib/berth goes too), and no account is left."""
    token = Path("/etc/berth/agent.token")
    token.write_text("node-bootstrap-token-0001\n")
    token.chmod(0o600)
    Path("/etc/berth/bootstrap.json").write_text("{}\n")
    Path("/var/lib/berth/agent/node.json").write_text("{}\n")
    keys = Path("/var/lib/berth/ssh-keys")  # --ssh-keys-dir of docs/node-binding.md and examples/sshd-berth.conf
    (keys / "tenant-1").mkdir(parents=True)
    (keys / ".berth.lock").touch()
    installed.purge()
    assert [dpkg_status(p) for p in PACKAGES] == ["", "", ""]
    assert installed.leftovers() == []
    assert not Path("/var/lib/berth").exists() and not Path("/opt/berth").exists() and not Path("/etc/berth").exists()
    assert accounts_named("berth") == []
    assert "controlplane.env" not in run(["dpkg-statoverride", "--list"], check=False).stdout  # its mode, gone
