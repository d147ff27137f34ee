"""Upgrading the packages under a bound reservation: the installed agent (version A), started from its installed
unit's command line and environment (the operator's edited /etc/berth/agent.env, the token in /etc/berth/agent.token),
binds a hold reservation of a real control plane; a workload runs in it through the installed `berth exec`; then
`dpkg -i` installs version B (the same tree built with BERTH_VERSION_LOCAL) and the agent is restarted as
systemd's `try-restart` in the postinst would restart it. The workload survives with the same cgroup (inode and
device program), the reservation stays active and bound there, and the new agent adopts the binding from its
checkpoint without re-creating anything. Purge afterwards leaves nothing behind.

No systemd runs on CI machines, so the agent runs the way systemd would run its unit: in a delegated cgroup of its
own below the test's cgroup, with the workloads in a scope beside it (tests/e2e's layout), and the maintainer
scripts must do nothing that needs systemd there (their systemctl calls are guarded by /run/systemd/system).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cgroups import bpf
from tests.cgroups.conftest import join_script
from tests.e2e.conftest import H100_TOKEN, WORKLOAD_UID, ControlPlane, alive, pids_of, topology
from tests.packaging.conftest import (PACKAGES, PLAIN_ENV, accounts_named, dpkg_status, json_lines, run,
                                      unit_command)
from tests.waiting import stop_process, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.kernel]
AGENT_UNIT = Path("/lib/systemd/system/berth-agent.service")
STATE = Path("/var/lib/berth/agent")
FAST = "--watch-timeout-ms 1500 --request-timeout-seconds 1.5 --reconcile-seconds 3600 --backoff-max-seconds 0.5"


class InstalledAgent:
    """The installed unit's ExecStart, run in `<base>/agent.service` (what Delegate=yes gives the unit), its
    stdout and stderr (the journal) appended to one log with a marker per start."""

    def __init__(self, base: Path, log: Path) -> None:
        self.base = base
        self.unit_cgroup = base / "agent.service"
        self.root = base / "workloads.scope" / "workloads"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.unit_cgroup.mkdir(parents=True, exist_ok=True)
        argv, env = unit_command(AGENT_UNIT)
        assert argv[:2] == ["/usr/bin/berth", "agent"], argv
        self.starts += 1
        with open(self.log, "a") as log:
            log.write(f"--- start {self.starts}\n")
            log.flush()
            script = f'{join_script(self.unit_cgroup)} && exec "$@"'
            self.proc = subprocess.Popen(["/bin/sh", "-c", script, "sh", *argv], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, cwd="/", env={**PLAIN_ENV, **env})

    def events(self, event: str, start: int) -> list[dict]:
        text = self.log.read_text()
        part = text.split(f"--- start {start}\n", 1)[1].split(f"--- start {start + 1}\n", 1)[0]
        return [d for d in json_lines(part) if d.get("event") == event]

    def wait_event(self, event: str, timeout: float = 20) -> dict:
        return wait_for(lambda: (self.events(event, self.starts) or [None])[-1], timeout,
                        f"the agent to log {event!r}:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM to the main process only (KillMode=process), as `systemctl stop` sends it."""
        return stop_process(self.proc)


def checkpoint_binding(rid: str) -> dict:
    doc = json.loads((STATE / "checkpoint.json").read_text())
    return doc["data"]["bindings"][rid]


def test_an_upgrade_under_a_bound_reservation_keeps_the_workload_and_the_new_agent_adopts_it(
        built, built_upgrade, installation, own_cgroup2, bpf_works, tmp_path):
    a, b = built, built_upgrade
    assert a.deb_version != b.deb_version
    installation.install(a)
    assert run(["/usr/bin/berth", "--version"], env=PLAIN_ENV).stdout == f"berth {a.version}\n"

    plane = ControlPlane(tmp_path).start()
    agent = InstalledAgent(own_cgroup2 / "host", tmp_path / "agent.log")
    worker: subprocess.Popen | None = None
    try:
        # The operator's part of the guide: the token file and agent.env (plus this test's simulated host, its
        # cgroups below the test's own, and fast timers).
        token = Path("/etc/berth/agent.token")
        token.touch(mode=0o600)
        token.write_text(H100_TOKEN + "\n")
        topo = topology("h100", "pkg-upgrade-host", tmp_path)
        opts = (f"--simulate {topo} --cgroup-root {agent.root} --cgroup-enable-from {own_cgroup2} {FAST} "
                f"--exec-tenant-user acme={WORKLOAD_UID}")
        env_file = Path("/etc/berth/agent.env")
        edited = env_file.read_text().replace("BERTH_CONTROL_PLANE=\n", f"BERTH_CONTROL_PLANE={plane.url}\n")
        edited += f"BERTH_AGENT_OPTS={opts}\n"
        env_file.write_text(edited)

        agent.start()
        agent.wait_event("reconciled")
        rid = plane.create(gpuCount=1)["id"]
        res = plane.wait_state(rid, "active", timeout=5)
        cgroup = Path(res["bound"][0]["cgroup"])
        assert cgroup == agent.root / f"rsv-{rid}"
        before = (cgroup.stat().st_ino, tuple(bpf.query_ids(cgroup)))
        worker = subprocess.Popen(["/usr/bin/berth", "exec", rid, "--", "sleep", "600"], env=PLAIN_ENV, cwd="/",
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: worker.pid in pids_of(cgroup), 10, "the workload in the reservation's cgroup")
        old_agent = agent.proc.pid
        assert [e["action"] for e in agent.events("bound", 1)] == ["create"], "version A created the cgroup"

        # The upgrade. Without systemd the postinst's try-restart is a no-op: dpkg itself stops nothing.
        installation.dpkg("-i", *(str(b.debs[p]) for p in PACKAGES))
        assert [dpkg_status(p) for p in PACKAGES] == ["installed"] * 3
        assert run(["dpkg-query", "-W", "-f=${Version}", "berth"]).stdout == b.deb_version
        assert run(["/usr/bin/berth", "--version"], env=PLAIN_ENV).stdout == f"berth {b.version}\n"
        assert env_file.read_text() == edited, "the operator's agent.env is kept (a conffile)"
        assert alive(old_agent) and alive(worker.pid)

        # systemd's try-restart: stop (SIGTERM to the main process), start the unit again, on the new files.
        assert 0 == agent.stop()
        assert alive(worker.pid) and worker.pid in pids_of(cgroup), "stopping the agent left the workload alone"
        agent.start()
        first = agent.wait_event("reconciled")
        assert ("start-up pass", 1) == (first["why"], first.get("keep")), first
        assert agent.events("bound", 2) == [] and agent.events("re-applied", 2) == [], "nothing re-created"
        assert agent.events("cgroups found at start", 2)[0]["count"] == 1

        assert alive(worker.pid) and pids_of(cgroup) == [worker.pid]
        assert (cgroup.stat().st_ino, tuple(bpf.query_ids(cgroup))) == before, "the same cgroup and device program"
        res = plane.get(rid)
        assert res["state"] == "active" and Path(res["bound"][0]["cgroup"]) == cgroup
        entry = checkpoint_binding(rid)
        assert (entry["state"], Path(entry["cgroup"])) == ("completed", cgroup)
        site = sorted(Path("/opt/berth/lib").glob("python3.*/site-packages"))[0]
        assert (site / f"berth-{b.version}.dist-info").is_dir() and not (site / f"berth-{a.version}.dist-info").exists()
        with open(f"/proc/{agent.proc.pid}/cmdline", "rb") as f:
            assert b"/usr/bin/berth\0agent\0" in f.read(), "the new agent runs the installed command"

        # Release: the new agent ends the workload and removes the cgroup.
        plane.release(rid)
        wait_for(lambda: not cgroup.exists(), 10, "the released reservation's cgroup removed")
        assert worker.wait(10) is not None
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        agent.stop()
        plane.stop()

    installation.purge()
    assert installation.leftovers() == []
    assert not STATE.exists() and not Path("/etc/berth").exists() and accounts_named("berth") == []
