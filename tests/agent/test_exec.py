"""`berth exec`: refuses what is not bound here or not allowed, and runs a permitted command inside the
reservation's cgroup, where its GPU's device node opens (ENXIO: no driver behind it) and another GPU's does not
(EPERM). As root directly; as another uid through the agent's exec socket (SO_PEERCRED)."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from agent import exec as agent_exec
from agent.binder import Binder, plan
from agent.bindspec import want_of
from agent.checkpoint import Checkpoint, read_boot_id
from agent.execgate import ExecGate, ExecPolicy, Target
from common.nodewire import Binding, BindingShare, BindingUnit
from cgroups import Subtree
from tests.cgroups.conftest import bpf_works, own_cgroup2  # noqa: F401 (fixtures)
from tests.e2e.conftest import PROBE, device_nodes  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"


def berth_exec(*args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "berth", "exec", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


@pytest.mark.parametrize("args, code, message", [
    (["r1", "true"], 2, "put the command after `--`"),
    (["r1", "--"], 2, "no command after `--`"),
    (["--", "true"], 2, "the following arguments are required: reservation"),
])
def test_bad_usage_exits_2_and_says_how(args, code, message):
    out = berth_exec(*args)
    assert (code, True) == (out.returncode, message in out.stderr), out.stderr


def test_help_exits_0():
    out = berth_exec("--help")
    assert 0 == out.returncode and "RESERVATION -- COMMAND" in out.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="as root exec reads the checkpoint itself")
def test_a_reservation_not_bound_here_is_refused_with_exit_3(tmp_path):
    out = berth_exec("--state-dir", str(tmp_path), "rsv_nope", "--", "true")
    assert 3 == out.returncode and "nothing is bound here" in out.stderr
    cp = Checkpoint.load(tmp_path / "checkpoint.json", boot_id=read_boot_id(), cgroup_root="/sys/fs/cgroup/x")
    cp.save()
    out = berth_exec("--state-dir", str(tmp_path), "rsv_nope", "--", "true")
    assert 3 == out.returncode and "reservation rsv_nope is not bound on this node (not known" in out.stderr


def test_without_root_and_without_an_agent_exec_says_it_needs_one(tmp_path):
    with pytest.raises(agent_exec.ExecRefused) as err:
        agent_exec.ask_agent("r1", tmp_path / "exec.sock")
    assert agent_exec.EXIT_MOVE == err.value.code and "cannot reach the agent" in str(err.value)


# -- on the kernel ------------------------------------------------------------------------------------------------


@pytest.fixture
def bound(own_cgroup2, bpf_works, tmp_path, host):
    """A reservation r1 on GPU 0 of a simulated 4-GPU host, bound by the agent's binder; state dir reachable by
    other users (mode 0711, as the agent makes it) under /tmp."""
    state = Path(f"/tmp/berth-test-state-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    state.mkdir(mode=0o711)
    os.chmod(state, 0o711)
    inv = host.inventory
    root = own_cgroup2 / "workloads"
    binder = Binder(Subtree(root, controllers=()),
                    Checkpoint.load(state / "checkpoint.json", boot_id=read_boot_id(), cgroup_root=str(root)))
    b = Binding(reservationId="r1", kind="hold", tenantId="acme", principalId="alice", start=0, end=1,
                units=[BindingUnit(unit="gpu0", gpuIndex=0, uuid=inv.gpus[0].uuid)], share=BindingShare())
    [o] = binder.run(plan({"r1": want_of(b, host)}, binder.actual()))
    assert o.ok
    try:
        yield binder, state
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.kernel
def test_root_runs_the_command_inside_the_reservation_with_its_devices_only(bound, device_nodes):
    binder, state = bound
    out = berth_exec("--state-dir", str(state), "r1", "--", sys.executable, "-c",
                     PROBE + "print(open('/proc/self/cgroup').read().strip().splitlines()[-1])",
                     str(device_nodes / "nvidia0"), str(device_nodes / "nvidia1"), "/dev/null")
    assert 0 == out.returncode, out.stderr
    lines = out.stdout.splitlines()
    assert [f"{device_nodes}/nvidia0 ENXIO", f"{device_nodes}/nvidia1 EPERM", "/dev/null OK"] == lines[:3]
    assert lines[3].endswith("/workloads/rsv-r1")


@pytest.mark.kernel
def test_the_commands_exit_status_is_passed_through(bound):
    _, state = bound
    assert 7 == berth_exec("--state-dir", str(state), "r1", "--", "sh", "-c", "exit 7").returncode
    assert 127 == berth_exec("--state-dir", str(state), "r1", "--", "no-such-command-xyz").returncode


class GateThread:
    """The agent's exec socket served from a thread of this process."""

    def __init__(self, gate: ExecGate) -> None:
        self.gate = gate
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "GateThread":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.gate.start(), self.loop).result(5)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.gate.stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def as_nobody(argv: list[str]) -> tuple[int, str, str]:
    """Fork, drop to uid/gid 65534, and run agent.exec.main(argv) there (it execs the command)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but syscalls and agent.exec until it execs or exits
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            code = agent_exec.main(argv)
        except BaseException as exc:  # noqa: BLE001
            os.write(2, repr(exc).encode())
            code = 99
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with os.fdopen(out_r) as o, os.fdopen(err_r) as e:
        stdout, stderr = o.read(), e.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout, stderr


def gate_for(binder: Binder, state: Path, policy: ExecPolicy) -> ExecGate:
    def lookup(rid: str):
        entry = binder.checkpoint.bindings.get(rid)
        if entry is None or entry.state != "completed":
            return None
        return Target(entry.tenantId, f"rsv-{rid}", binder.subtree.root / f"rsv-{rid}")

    return ExecGate(state / "exec.sock", policy, lookup, binder.subtree.move)


@pytest.mark.kernel
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"{SYSTEM_PYTHON} is needed to run as another uid")
def test_an_allowed_uid_enters_through_the_agents_socket_and_sees_only_its_gpu(bound, device_nodes):
    binder, state = bound
    policy = ExecPolicy.from_options(tenant_uids=[f"acme={NOBODY}"])
    with GateThread(gate_for(binder, state, policy)):
        code, out, err = as_nobody(["--state-dir", str(state), "r1", "--", SYSTEM_PYTHON, "-c",
                                    PROBE + "import os; print('uid', os.getuid())",
                                    str(device_nodes / "nvidia0"), str(device_nodes / "nvidia2")])
    assert 0 == code, err
    assert [f"{device_nodes}/nvidia0 ENXIO", f"{device_nodes}/nvidia2 EPERM", f"uid {NOBODY}"] == out.splitlines()


@pytest.mark.kernel
def test_a_uid_not_allowed_is_refused_with_exit_4_and_an_unknown_reservation_with_exit_3(bound):
    binder, state = bound
    policy = ExecPolicy.from_options(tenant_uids=[f"globex={NOBODY}"])  # allowed elsewhere, not for acme
    with GateThread(gate_for(binder, state, policy)):
        code, _, err = as_nobody(["--state-dir", str(state), "r1", "--", "true"])
        assert (4, True) == (code, f"uid {NOBODY} may not run work in reservations of tenant 'acme'" in err), err
        code, _, err = as_nobody(["--state-dir", str(state), "r-other", "--", "true"])
        assert (3, True) == (code, "is not bound on this node" in err), err
    assert [] == binder.subtree.procs("rsv-r1")
