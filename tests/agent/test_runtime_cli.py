"""`berth agent` runs the runtime (and `berth agent discover` is unchanged): usage errors name what is missing and
exit 2, a bad topology names the field, an unusable layout is one line and exit 1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent import cli

REPO = Path(__file__).resolve().parents[2]


def berth(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "berth", *args], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO), env=env)


def test_bare_berth_agent_asks_for_the_control_plane_and_token_and_points_at_discover():
    out = berth("agent", env={"PATH": "/usr/bin:/bin"})
    assert 2 == out.returncode
    assert "--control-plane and --bootstrap-token-file (or --bootstrap-token) required" in out.stderr
    assert "`berth agent discover` prints this host's inventory" in out.stderr


def test_help_lists_the_pinned_flags(capsys):
    assert 0 == cli.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--control-plane", "--bootstrap-token-file", "--bootstrap-token", "--simulate", "--cgroup-root", "--state-dir",
                 "--metrics-listen", "--exec-allow-uid", "--cgroup-enable-from", "--ca-file", "--client-cert",
                 "--client-key"):
        assert flag in text


@pytest.mark.parametrize("args, message", [
    (["--metrics-listen", "9100"], "give HOST:PORT"),
    (["--metrics-listen", "127.0.0.1:99999"], "give HOST:PORT"),
    (["--reserve-memory-gib", "inf"], "argument --reserve-memory-gib: 'inf': give a number of at least 0"),
    (["--reserve-vcpu", "nan"], "argument --reserve-vcpu: 'nan'"),
    (["--heartbeat-seconds", "0"], "argument --heartbeat-seconds: '0': give seconds above 0"),
    (["--gpu-health-quiet-minutes", "0"], "argument --gpu-health-quiet-minutes: '0': give minutes above 0"),
    (["--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
    (["--nvml-library", "/etc/hostname"], "/etc/hostname: not a shared library"),
    (["--nvml-library", "/nonexistent/libnvidia-ml.so.1"], "No such file or directory: give the path"),
    (["--device-classes", "/nonexistent/classes.json"], "--device-classes device class rules /nonexistent/classes.json"),
    (["--exec-tenant-uid", "acme"], "expected TENANT=UID"),
    (["--exec-allow-group", "x-no-such-group-x"], "no such group"),
    (["--exec-tenant-user", "acme"], "expected TENANT=USER"),
    (["--exec-tenant-user", "acme=root"], "a tenant's workload user must not be root"),
    (["--exec-tenant-user", "acme=64123:0"], "a tenant's workload user must not be root"),
    (["--exec-tenant-user", "acme=x-no-such-user-x"], "no such user"),
    (["--exec-tenant-user", "acme=64123", "--exec-tenant-user", "acme=64124"], "is given twice"),
    (["--ca-file", "/nonexistent/ca.pem"], "--ca-file /nonexistent/ca.pem: cannot read it"),
    (["--client-cert", "/nonexistent/node.pem"], "--client-cert and --client-key go together"),
    (["--ca-file", "/proc/version"], "--ca-file /proc/version: holds no PEM CA certificate"),
    # a file where the kubelet's root goes stopped the agent at the first kubernetes booking
    (["--kubelet-root", "/etc/hostname"], "--kubelet-root /etc/hostname: /etc/hostname is not a directory"),
])
def test_bad_options_exit_2_naming_the_option(capsys, args, message):
    assert 2 == cli.main(["--control-plane", "http://127.0.0.1:1", "--bootstrap-token", "t", *args])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://127.0.0.1:1"])
def test_a_control_plane_url_that_is_not_http_exits_2_before_anything_is_touched(capsys, tmp_path, url):
    state = tmp_path / "state"  # not made: the refusal comes before the state directory, the lock and the cgroups
    assert 2 == cli.main(["--control-plane", url, "--bootstrap-token", "t", "--state-dir", str(state)])
    assert "argument --control-plane" in capsys.readouterr().err and not state.exists()


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("", "must hold exactly one token on one line"),
    ("one\ntwo\n", "must hold exactly one token on one line"),
])
def test_a_bad_token_file_exits_2_naming_the_file(capsys, tmp_path, content, message):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)
    assert 2 == cli.main(["--control-plane", "http://127.0.0.1:1", "--bootstrap-token-file", str(path)])
    err = capsys.readouterr().err
    assert f"--bootstrap-token-file {path}" in err and message in err


def test_the_token_file_is_read_and_never_needs_the_command_line(tmp_path):
    path = tmp_path / "token"
    path.write_text("  node-bootstrap-token-0001\n")
    path.chmod(0o600)
    assert "node-bootstrap-token-0001" == cli.read_token_file(str(path))
    path.chmod(0o644)  # readable by every user of the host: refused, saying how to mend it
    with pytest.raises(ValueError, match=f"mode -rw-r--r-- lets others read the token: `chmod 600 {path}`"):
        cli.read_token_file(str(path))


def test_a_bad_topology_names_the_field(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [{"name": "NVIDIA H100", "memoryMiB": "lots"}]}))
    assert 2 == cli.main(["--control-plane", "http://127.0.0.1:1", "--bootstrap-token", "t", "--simulate", str(bad)])
    assert "gpus[0].memoryMiB" in capsys.readouterr().err


def test_a_cgroup_root_outside_cgroupfs_is_one_line_and_exit_1(tmp_path):
    out = berth("agent", "--control-plane", "http://127.0.0.1:1", "--bootstrap-token", "t", "--cgroup-root",
                str(tmp_path / "cg"), "--state-dir", str(tmp_path / "state"), "--log-format", "json")
    assert 1 == out.returncode
    assert out.stderr.strip().splitlines()[-1].startswith("berth agent: ")
    assert "not below the cgroup2 mount" in out.stderr or "cgroup2 is not mounted" in out.stderr


def test_discover_is_unchanged(capsys):
    assert 0 == cli.main(["discover", "--simulate", str(REPO / "examples/topologies/h100x8.json"), "--json"])
    assert 8 == len(json.loads(capsys.readouterr().out)["gpus"])


def test_device_classes_that_are_not_a_list_say_the_form_to_write(capsys, tmp_path):
    rules = tmp_path / "classes.json"
    rules.write_text('{"match": "H100", "class": "H100_80GB"}')
    assert 2 == cli.main(["--control-plane", "http://127.0.0.1:1", "--bootstrap-token", "t", "--device-classes",
                          str(rules)])
    assert f"--device-classes {rules}: must be a JSON list of rules" in capsys.readouterr().err


def test_a_first_discovery_the_control_plane_would_refuse_stops_the_agent_with_one_line(tmp_path):
    """Before: the agent registered it, got 400 and retried for ever. Now the first discovery raises, which stops the
    start (exit 1, `berth agent: <this line>`), and nothing is ever registered."""
    from agent.discovery import InventoryInvalid
    from agent.runtime import Agent, AgentConfig, describe_error

    top = tmp_path / "top.json"
    top.write_text(json.dumps({"hostname": "long-name", "gpus": [{"name": "N" * 95, "memoryMiB": 1000}]}))
    agent = Agent(AgentConfig(control_plane="http://127.0.0.1:1", bootstrap_token="t", state_dir=tmp_path / "state",
                              simulate=str(top)))
    agent._build_discovery()
    with pytest.raises(InventoryInvalid) as err:
        agent.refresh_inventory()
    assert agent.inventory is None
    line = describe_error(err.value)
    assert "gpus[0].deviceClass" in line and "--device-classes" in line and "\n" not in line
