"""`berth exec`: refuses what is not bound here or not allowed, and runs a permitted command confined inside the
reservation: in its cgroup, where its GPU's device node opens (ENXIO: no driver behind it) and another GPU's does
not (EPERM); in its own cgroup namespace; as the tenant's workload user with no capabilities and no_new_privs,
so that it cannot move itself out, join another reservation or change any cgroup file. As root directly; as
another uid through the agent's exec socket (SO_PEERCRED, the caller's stdio passed with SCM_RIGHTS)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest

from agent import exec as agent_exec
from agent.binder import Binder, plan
from agent.bindspec import want_of
from agent.checkpoint import Checkpoint, read_boot_id
from agent.execgate import ExecGate, ExecPolicy, Target
from common.nodewire import Binding, BindingShare, BindingUnit
from cgroups import Subtree
from cgroups import host as host_mod
from tests.cgroups.conftest import bpf_works, own_cgroup2  # noqa: F401 (fixtures)
from tests.e2e.conftest import PROBE, SYSTEM_PYTHON, WORKLOAD_UID, device_nodes  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
# What the workload is: its cgroup line, ids and capabilities (one "key value" line each).
STATUS = ("import os\n"
          "print('cgroup', open('/proc/self/cgroup').read().splitlines()[-1])\n"
          "print('uid', *os.getresuid()); print('gid', *os.getresgid()); print('groups', *os.getgroups())\n"
          "for line in open('/proc/self/status'):\n"
          "    k, _, v = line.partition(':')\n"
          "    if k in ('CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs'): print(k, int(v.strip(), 16))\n")


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
    assert "see its state, window and nodes: berth reservations get rsv_nope" in out.stderr
def test_without_root_and_without_an_agent_exec_says_it_needs_one(tmp_path):
    with pytest.raises(agent_exec.ExecRefused) as err:
        agent_exec.through_agent("r1", tmp_path / "exec.sock", ["true"])
    assert agent_exec.EXIT_MOVE == err.value.code and "cannot reach the agent" in str(err.value)


# -- on the kernel ------------------------------------------------------------------------------------------------


@pytest.fixture
def bound(own_cgroup2, bpf_works, tmp_path, host):
    """Reservation r1 of acme on GPU 0 and r2 of globex on GPU 1 of a simulated 4-GPU host, bound by the agent's
    binder; acme's workload user is WORKLOAD_UID (globex has none); the state dir is reachable by other users
    (mode 0711, as the agent makes it) under /tmp."""
    state = Path(f"/tmp/berth-test-state-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    state.mkdir(mode=0o711)
    os.chmod(state, 0o711)
    root = own_cgroup2 / "workloads"
    binder = Binder(Subtree(root, controllers=()),
                    Checkpoint.load(state / "checkpoint.json", boot_id=read_boot_id(), cgroup_root=str(root)))
    wanted = {}
    for rid, tenant, gpu in (("r1", "acme", 0), ("r2", "globex", 1)):
        b = Binding(reservationId=rid, kind="hold", tenantId=tenant, principalId="p", start=0, end=1,
                    units=[BindingUnit(unit=f"gpu{gpu}", gpuIndex=gpu, uuid=host.inventory.gpus[gpu].uuid)],
                    share=BindingShare())
        wanted[rid] = want_of(b, host)
    assert all(o.ok for o in binder.run(plan(wanted, binder.actual())))
    ExecPolicy.from_options(tenant_users=[f"acme={WORKLOAD_UID}"]).write(state)
    try:
        yield binder, state
    finally:
        shutil.rmtree(state, ignore_errors=True)


def allow_root(state: Path) -> None:
    ExecPolicy.from_options(tenant_users=[f"acme={WORKLOAD_UID}"], allow_root=True).write(state)


@pytest.mark.kernel
def test_root_runs_the_command_confined_inside_the_reservation_with_its_devices_only(bound, device_nodes):
    binder, state = bound
    out = berth_exec("--state-dir", str(state), "r1", "--", SYSTEM_PYTHON, "-c", PROBE + STATUS,
                     str(device_nodes / "nvidia0"), str(device_nodes / "nvidia1"), "/dev/null")
    assert 0 == out.returncode, out.stderr
    lines = out.stdout.splitlines()
    assert [f"{device_nodes}/nvidia0 ENXIO", f"{device_nodes}/nvidia1 EPERM", "/dev/null OK"] == lines[:3]
    status = dict(line.split(" ", 1) for line in lines[3:])
    # its own cgroup namespace (rooted at the reservation), the tenant's user, no capabilities, no_new_privs
    assert {"cgroup": "0::/", "uid": f"{WORKLOAD_UID} {WORKLOAD_UID} {WORKLOAD_UID}",
            "gid": f"{WORKLOAD_UID} {WORKLOAD_UID} {WORKLOAD_UID}", "groups": str(WORKLOAD_UID), "CapPrm": "0",
            "CapEff": "0", "CapBnd": "0", "CapAmb": "0", "NoNewPrivs": "1"} == status


# What a root workload did to escape (issue: writes its pid into the parent's cgroup.procs, joins another tenant's
# reservation, creates child cgroups, writes cgroup.kill). Each attempt prints the errno it got, or ESCAPED.
ESCAPES = """
import errno, os, sys
own, top, other = sys.argv[1], sys.argv[2], sys.argv[3]
def attempt(what, fn):
    try:
        fn(); print(what, 'ESCAPED')
    except OSError as e:
        print(what, errno.errorcode[e.errno])
def write(path, text):
    with open(path, 'w') as f: f.write(text)
me = str(os.getpid())
attempt('parent-procs', lambda: write(os.path.join(os.path.dirname(own), 'cgroup.procs'), me))
attempt('top-procs', lambda: write(os.path.join(top, 'cgroup.procs'), me))
attempt('other-procs', lambda: write(os.path.join(other, 'cgroup.procs'), me))
attempt('own-procs', lambda: write(os.path.join(own, 'cgroup.procs'), me))
attempt('mkdir-child', lambda: os.mkdir(os.path.join(own, 'escape')))
attempt('own-kill', lambda: write(os.path.join(own, 'cgroup.kill'), '1'))
attempt('other-kill', lambda: write(os.path.join(other, 'cgroup.kill'), '1'))
attempt('own-subtree', lambda: write(os.path.join(own, 'cgroup.subtree_control'), '+memory'))
d, writable = own, []
while True:
    for name in sorted(os.listdir(d)):
        if name.startswith('cgroup.') and os.access(os.path.join(d, name), os.W_OK):
            writable.append(os.path.join(d, name))
    if d == top:
        break
    d = os.path.dirname(d)
print('writable', len(writable), *writable)
print('cgroup', open('/proc/self/cgroup').read().splitlines()[-1])
"""


@pytest.mark.kernel
def test_the_default_workload_cannot_leave_enter_another_reservation_or_change_any_cgroup(bound):
    binder, state = bound
    own, other = binder.cgroup_of("r1"), binder.cgroup_of("r2")
    mount = host_mod.cgroup2_mount()
    # every file of the reservation's cgroup is root's and not writable by others
    for f in own.iterdir():
        st = f.stat()
        assert (0, 0) == (st.st_uid, st.st_mode & 0o022), f
    out = berth_exec("--state-dir", str(state), "r1", "--", SYSTEM_PYTHON, "-c", ESCAPES, str(own), str(mount),
                     str(other))
    assert 0 == out.returncode, out.stderr
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    for what in ("parent-procs", "top-procs", "other-procs", "own-procs", "mkdir-child", "own-kill", "other-kill",
                 "own-subtree"):
        assert got[what] in ("EACCES", "EPERM", "ENOENT"), (what, got[what])
    assert ("0", "0::/") == (got["writable"], got["cgroup"].strip())
    assert not (own / "escape").exists() and [] == binder.subtree.procs("rsv-r2")


@pytest.mark.kernel
def test_as_root_is_refused_unless_the_node_allows_it_and_then_says_root_is_not_confined(bound):
    binder, state = bound
    out = berth_exec("--state-dir", str(state), "--as-root", "r1", "--", "id", "-u")
    assert (4, True) == (out.returncode, "--exec-allow-root" in out.stderr), out.stderr
    allow_root(state)
    out = berth_exec("--state-dir", str(state), "--as-root", "r1", "--", "sh", "-c",
                     "id -u; tail -n1 /proc/self/cgroup")
    assert 0 == out.returncode, out.stderr
    assert ["0", "0::/"] == out.stdout.split("\n")[:2]
    assert "WARNING" in out.stderr and "root is NOT confined" in out.stderr


@pytest.mark.kernel
def test_a_tenant_without_a_workload_user_cannot_run_work_and_is_told_how_to_map_one(bound):
    _, state = bound
    out = berth_exec("--state-dir", str(state), "r2", "--", "true")
    assert 4 == out.returncode
    assert "tenant 'globex' has no workload user on this node" in out.stderr
    assert "--exec-tenant-user globex=USER" in out.stderr


@pytest.mark.kernel
def test_the_commands_exit_status_is_passed_through(bound):
    _, state = bound
    assert 7 == berth_exec("--state-dir", str(state), "r1", "--", "sh", "-c", "exit 7").returncode
    assert 127 == berth_exec("--state-dir", str(state), "r1", "--", "no-such-command-xyz").returncode


@pytest.mark.kernel
def test_root_started_with_stdout_closed_runs_the_command_with_dev_null_there(bound):
    _, state = bound
    out = subprocess.run([sys.executable, "-m", "berth", "exec", "--state-dir", str(state), "r1", "--", "sh", "-c",
                          "exec 3>&1; readlink /proc/self/fd/3 >&2"], stderr=subprocess.PIPE, text=True, timeout=20,
                         cwd=str(REPO), preexec_fn=lambda: os.close(1))
    assert (0, "/dev/null") == (out.returncode, out.stderr.strip().splitlines()[-1]), out.stderr


# -- callers other than root, through the agent's socket -----------------------------------------------------


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


class AsNobody:
    """A forked child that drops to uid/gid 65534 and runs agent.exec.main(argv) (it returns the command's status)."""

    def __init__(self, argv: list[str], stdin: bytes = b"", close_stdin: bool = False) -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nothing but syscalls and agent.exec until it exits
            try:
                if close_stdin:  # started as `<&-` (or by a cron that closes it)
                    os.close(0)
                else:
                    os.dup2(in_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                    os.close(fd)
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
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        os.write(in_w, stdin)
        os.close(in_w)
        self.pid, self._out, self._err = pid, out_r, err_r

    def wait(self, timeout: float | None = None, workload: Callable[[], list[int]] = list) -> tuple[int, str, str]:
        """Its status and output; past `timeout` seconds it and the `workload()` pids (which hold its output pipes)
        are killed, so a hang fails the test instead of stopping the run."""
        def kill() -> None:
            for pid in [self.pid, *workload()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        guard = threading.Timer(timeout, kill) if timeout else None
        if guard is not None:
            guard.start()
        try:
            with os.fdopen(self._out) as o, os.fdopen(self._err) as e:
                stdout, stderr = o.read(), e.read()
            _, status = os.waitpid(self.pid, 0)
        finally:
            if guard is not None:
                guard.cancel()
        return os.waitstatus_to_exitcode(status), stdout, stderr


def as_nobody(argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    return AsNobody(argv, stdin).wait()


def gate_for(binder: Binder, state: Path, policy: ExecPolicy) -> ExecGate:
    def lookup(rid: str):
        entry = binder.checkpoint.bindings.get(rid)
        if entry is None or entry.state != "completed":
            return None
        name = f"rsv-{rid}"
        return Target(entry.tenantId, name, binder.subtree.root / name, tuple(binder.subtree.procs_paths(name)))

    return ExecGate(state / "exec.sock", policy, lookup)


NOBODY_MAY_ACME = ExecPolicy.from_options(tenant_uids=[f"acme={NOBODY}"], tenant_users=[f"acme={WORKLOAD_UID}"])


@pytest.mark.kernel
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"{SYSTEM_PYTHON} is needed to run as another uid")
def test_an_allowed_uid_starts_the_tenants_confined_workload_through_the_agents_socket(bound, device_nodes):
    binder, state = bound
    with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
        code, out, err = as_nobody(["--state-dir", str(state), "r1", "--", SYSTEM_PYTHON, "-c",
                                    PROBE + STATUS + "import sys; print('stdin', sys.stdin.read().strip())",
                                    str(device_nodes / "nvidia0"), str(device_nodes / "nvidia2")], stdin=b"hello\n")
    assert 0 == code, err
    lines = out.splitlines()
    assert [f"{device_nodes}/nvidia0 ENXIO", f"{device_nodes}/nvidia2 EPERM"] == lines[:2]
    status = dict(line.split(" ", 1) for line in lines[2:])
    # it runs as acme's workload user, not as the caller; the caller's stdin reached it
    assert {"cgroup": "0::/", "uid": f"{WORKLOAD_UID} {WORKLOAD_UID} {WORKLOAD_UID}", "CapEff": "0", "CapBnd": "0",
            "NoNewPrivs": "1", "stdin": "hello"}.items() <= status.items()


@pytest.mark.kernel
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"{SYSTEM_PYTHON} is needed to run as another uid")
def test_a_workload_does_not_inherit_the_agents_oom_score(bound):
    """The launcher is the agent's child, and the agent's unit sets OOMScoreAdjust=-900: workloads ran as protected
    as the agent. Shown with the agent at +300 (this host gives no CAP_SYS_RESOURCE to go below 0): they get 0."""
    binder, state = bound
    own = Path("/proc/self/oom_score_adj")
    own.write_text("300")
    try:
        with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
            code, out, err = as_nobody(["--state-dir", str(state), "r1", "--", SYSTEM_PYTHON, "-c",
                                        "print(open('/proc/self/oom_score_adj').read().strip())"])
    finally:
        own.write_text("0")
    assert (0, "0") == (code, out.strip()), err


@pytest.mark.kernel
def test_through_the_socket_the_exit_status_and_a_signal_come_back(bound):
    binder, state = bound
    with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
        assert 7 == as_nobody(["--state-dir", str(state), "r1", "--", "sh", "-c", "exit 7"])[0]
        code, _, err = as_nobody(["--state-dir", str(state), "r1", "--", "no-such-command-xyz"])
        assert (127, True) == (code, "command not found" in err), err
        caller = AsNobody(["--state-dir", str(state), "r1", "--", "sleep", "600"])
        cgroup = binder.cgroup_of("r1")
        deadline = time.monotonic() + 10
        while not binder.subtree.procs("rsv-r1") and time.monotonic() < deadline:
            time.sleep(0.02)
        [workload] = binder.subtree.procs("rsv-r1")
        assert caller.pid not in binder.subtree.procs("rsv-r1") and (cgroup / "cgroup.procs").exists()
        os.kill(caller.pid, signal.SIGTERM)  # forwarded to the workload's process group
        code, _, err = caller.wait()
    assert (128 + signal.SIGTERM, "") == (code, err)
    assert [] == binder.subtree.procs("rsv-r1")
    assert workload > 0


@pytest.mark.kernel
def test_a_caller_with_stdin_closed_gives_the_workload_dev_null_not_the_agents_socket(bound):
    """Else the socket to the agent takes fd 0 and is passed on as the workload's stdin: a `wc` reading it hangs,
    and the caller going away is not seen."""
    binder, state = bound
    with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
        code, out, err = AsNobody(["--state-dir", str(state), "r1", "--", "sh", "-c", "readlink /proc/self/fd/0; wc -c"],
                                  close_stdin=True).wait(timeout=20, workload=lambda: binder.subtree.procs("rsv-r1"))
    assert (0, ["/dev/null", "0"]) == (code, out.split()), err


@pytest.mark.kernel
def test_a_reservation_that_ends_under_the_command_is_said_to_have_ended(bound):
    """Its processes are killed when it is unbound: the caller is told why, so a 137 does not read as an OOM kill."""
    binder, state = bound
    with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
        caller = AsNobody(["--state-dir", str(state), "r1", "--", "sleep", "600"])
        deadline = time.monotonic() + 10
        while not binder.subtree.procs("rsv-r1") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert binder.subtree.procs("rsv-r1")
        assert all(o.ok for o in binder.run(plan({}, binder.actual())))  # its window is over: unbound
        code, _, err = caller.wait(timeout=20, workload=lambda: binder.subtree.procs("rsv-r1"))
    assert (128 + signal.SIGKILL, True) == (code, "reservation r1 ended while the command ran" in err), err


@pytest.mark.kernel
def test_a_uid_not_allowed_is_refused_with_exit_4_and_an_unknown_reservation_with_exit_3(bound):
    binder, state = bound
    policy = ExecPolicy.from_options(tenant_uids=[f"globex={NOBODY}"], tenant_users=[f"acme={WORKLOAD_UID}"])
    with GateThread(gate_for(binder, state, policy)):
        code, _, err = as_nobody(["--state-dir", str(state), "r1", "--", "true"])
        assert (4, True, False) == (code, f"uid {NOBODY} may not run work in reservation r1 on this node" in err,
                                    "acme" in err), err  # the tenant is the operator's to know (the log's)
        code, _, err = as_nobody(["--state-dir", str(state), "r2", "--", "true"])  # globex has no workload user
        assert (4, True) == (code, "--exec-tenant-user globex=USER" in err), err
        code, _, err = as_nobody(["--state-dir", str(state), "r-other", "--", "true"])
        assert (3, True) == (code, "is not bound on this node" in err and "berth reservations get r-other" in err), err
        code, _, err = as_nobody(["--state-dir", str(state), "--as-root", "r1", "--", "true"])
        assert (4, True) == (code, "only root may ask for root" in err), err
    assert [] == binder.subtree.procs("rsv-r1")


@pytest.mark.kernel
def test_the_socket_refuses_a_request_without_its_descriptors_or_malformed(bound):
    binder, state = bound
    with GateThread(gate_for(binder, state, NOBODY_MAY_ACME)):
        for payload in (b'{"reservationId": "r1", "argv": ["true"]}\n', b"not json\n",
                        b'{"reservationId": "r1", "argv": []}\n'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(str(state / "exec.sock"))
                s.sendall(payload)
                answer = json.loads(s.makefile().readline())
            assert (False, "INVALID_INPUT") == (answer["ok"], answer["code"]), answer
    assert [] == binder.subtree.procs("rsv-r1")
