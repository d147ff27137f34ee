"""The systemd units: `systemd-analyze verify` accepts both without a warning, and the agent's unit says what
the agent relies on (notify + watchdog, delegation, workloads left alone on stop/restart, locked memory for eBPF)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
NAMES = ("berth-agent.service", "berth-controlplane.service")
BINARY = "/usr/bin/berth"


def service(name: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, paths)], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def analyzer():
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (CI installs it: apt-get install systemd)")


def test_systemd_analyze_verify_accepts_both_units_without_a_warning(analyzer, tmp_path):
    """ExecStart names /usr/bin/berth, which verify checks exists; where it does not (a source checkout), the
    units are verified as copies whose ExecStart names this Python instead, everything else unchanged."""
    paths = []
    for name in NAMES:
        text = (UNITS / name).read_text()
        if not Path(BINARY).exists():
            assert f"ExecStart={BINARY} " in text
            text = text.replace(f"ExecStart={BINARY} ", f"ExecStart={sys.executable} ")
        (tmp_path / name).write_text(text)
        paths.append(tmp_path / name)
    out = verify(paths)
    assert (0, "") == (out.returncode, out.stderr.strip()), out.stderr


def test_verify_of_the_units_as_shipped_complains_only_about_a_missing_binary(analyzer):
    out = verify([UNITS / n for n in NAMES])
    if Path(BINARY).exists():
        assert (0, "") == (out.returncode, out.stderr.strip())
        return
    complaints = [line for line in out.stderr.splitlines() if line.strip()]
    assert complaints and all(f"Command {BINARY} is not executable" in line for line in complaints), out.stderr


def test_verify_catches_a_broken_unit(analyzer, tmp_path):
    bad = tmp_path / "berth-agent.service"
    bad.write_text((UNITS / NAMES[0]).read_text().replace("Type=notify", "Type=notifyy")
                   .replace(f"ExecStart={BINARY} ", f"ExecStart={sys.executable} "))
    out = verify([bad])
    assert "Failed to parse service type" in out.stderr, "the first test must be able to fail"


def test_the_agent_unit_is_a_notify_service_with_a_watchdog_restarted_always():
    s = service(NAMES[0])
    assert (["notify"], ["always"]) == (s["Type"], s["Restart"])
    assert s["WatchdogSec"] and s["ExecStart"][0].startswith(f"{BINARY} agent")


def test_the_agent_unit_delegates_its_cgroup_and_never_kills_workloads_on_stop_or_restart():
    s = service(NAMES[0])
    assert (["yes"], ["process"]) == (s["Delegate"], s["KillMode"])
    assert "DevicePolicy" not in s and "DeviceAllow" not in s, "an ancestor's device filter would narrow every GPU"
    assert "daemon-reload" in (UNITS / NAMES[0]).read_text(), "the unit says why reloads leave workloads alone"


def test_the_agent_unit_lifts_the_locked_memory_limit_for_ebpf_and_keeps_its_state_dir():
    s = service(NAMES[0])
    assert ["infinity"] == s["LimitMEMLOCK"]
    assert ["berth/agent"] == s["StateDirectory"] and ["0711"] == s["StateDirectoryMode"]


def test_the_control_plane_unit_serves_the_pinned_command_unprivileged():
    s = service(NAMES[1])
    assert s["ExecStart"][0].startswith(f"{BINARY} controlplane serve --listen ")
    assert "--bootstrap" in s["ExecStart"][0]
    # the database from BERTH_DB, which the command reads itself: a PostgreSQL password in it stays out of the
    # command line every local user can read (tests/controlplane/test_pg_tls.py serves so)
    assert "--db" not in s["ExecStart"][0]
    assert "BERTH_DB=sqlite:////var/lib/berth/controlplane/controlplane.db" in s["Environment"]
    assert (["berth"], ["yes"]) == (s["User"], s["NoNewPrivileges"])


@pytest.mark.parametrize("name", NAMES)
def test_both_units_start_again_after_every_failed_start_for_ever(name):
    """docs/operations.md: 2 s after any failed start, with no start limit (systemd's default stops at five starts
    in ten seconds, and a database failing over may take longer)."""
    s = service(name)
    assert (["0"], ["2s"]) == (s["StartLimitIntervalSec"], s["RestartSec"])
    assert s["Restart"][0] in ("always", "on-failure")
