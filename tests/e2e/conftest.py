"""End-to-end harness: the real control plane (in this process, on its own event loop thread), real `berth agent`
processes in cgroups below the test's own, network namespaces joined by veth pairs, and a tenant over HTTP.

Everything made here is removed in the fixtures' teardown, also on failure: agents (by pid), the test cgroup
tree (`own_cgroup2` kills and removes what is below it), namespaces (their veths go with them).
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.waiting import stop_process, wait_for

from tests.netns import Namespaces
from tests.cgroups.conftest import (bpf_works, hugetlb_for_own_cgroup, join_script,  # noqa: F401 (fixtures)
                                    own_cgroup2, reserved_1g_hugepages)

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = REPO / "examples" / "topologies"
ALICE = "acme-alice-token-0001"
BOB = "acme-bob-token-000001"
H100_TOKEN = "node-bootstrap-h100-0001"
MIG_TOKEN = "node-bootstrap-mig-00001"
NODE_TOKEN = "node-bootstrap-node-001"
K8S_TOKEN = "node-bootstrap-k8s-0001"
K8S_RESOURCE = "berth.dev/h100"
# The unprivileged user acme's workloads run as on the test agents (--exec-tenant-user acme=64123): a uid with no
# passwd entry, so nothing on the machine is changed for it. Workloads run the distribution's python, which that
# uid can reach (this interpreter may live below a root-only home).
WORKLOAD_UID = 64123
SYSTEM_PYTHON = "/usr/bin/python3"



def bootstrap_doc() -> dict:
    return {
        "adminToken": "admin-token-e2e-00000001",
        "tenants": [{"id": "acme", "budgetUsd": "100000", "quota": {
            "gpu:H100_80GB": 64, "gpu:A100_80GB:1g.10gb": 112, "vcpu": 4096, "memoryGiB": 65536}}],
        "principals": [{"id": "alice", "tenant": "acme", "token": ALICE},
                       {"id": "bob", "tenant": "acme", "token": BOB}],
        "pools": [
            {"id": "h100", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "pricePerGpuHourUsd": "1"},
            {"id": "mig", "owner": "acme", "region": "eu", "gpuModel": "A100_80GB", "sharing": "mig",
             "pricePerGpuHourUsd": "0.1"},
            {"id": "metal", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "pricePerGpuHourUsd": "1",
             "policy": {"tenantRoot": True}},
            {"id": "k8s", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB", "pricePerGpuHourUsd": "1",
             "policy": {"kubernetes": {"cluster": "prod", "resourceName": K8S_RESOURCE}}},
        ],
        "nodeTokens": [{"pool": "h100", "token": H100_TOKEN}, {"pool": "mig", "token": MIG_TOKEN},
                       {"pool": "metal", "token": NODE_TOKEN}, {"pool": "k8s", "token": K8S_TOKEN}],
        "policies": "permit (principal, action, resource) when { principal.tenant == resource.tenant };",
    }


def topology(kind: str, hostname: str, into: Path) -> Path:
    """An 8-GPU simulated host: 'h100' (8 x H100 on 2 NUMA nodes) or 'mig' (8 x A100, 7 x 1g.10gb each)."""
    if kind == "h100":
        doc = json.loads((TOPOLOGIES / "h100x8.json").read_text())
    else:
        doc = {"driver": {"version": "535.161.08", "cuda": 12020},
               "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "memoryMiB": 81920, "count": 8,
                         "numaNodes": [0, 0, 0, 0, 1, 1, 1, 1], "mig": {"profile": "1g.10gb", "count": 7}}],
               "host": {"cpus": 128, "numaNodes": 2, "memoryGiB": 1024, "hugepages1G": {"0": 16, "1": 16}}}
    doc["hostname"] = hostname
    path = into / f"{hostname}.json"
    path.write_text(json.dumps(doc))
    return path


def require_kernel() -> None:
    if os.geteuid() != 0:
        pytest.skip("end-to-end agent tests need root (cgroups, eBPF device programs, network namespaces)")


# -- network namespaces --------------------------------------------------------------------------------------


class NetLab:
    """A namespace for the control plane and one per agent, each agent joined to it by a veth pair (/30)."""

    def __init__(self) -> None:
        self.spaces = Namespaces()
        self.tag = self.spaces.tag
        self.cp_ns = self.spaces.add("cp")
        self.links: dict[str, tuple[str, str, str]] = {}  # agent -> (agent ns, agent ifname, control plane address)

    def add_agent(self, role: str) -> str:
        """A namespace for one agent and its link to the control plane's; returns the control plane's address."""
        n = len(self.links) + 1
        ns = self.spaces.add(role)
        cp_if, ag_if = f"bt{self.tag}c{n}", f"bt{self.tag}a{n}"
        cp_addr, ag_addr = f"10.200.{n}.1", f"10.200.{n}.2"
        self.spaces.link(self.cp_ns, cp_if, cp_addr, ns, ag_if, ag_addr)
        self.links[role] = (ns, ag_if, cp_addr)
        return cp_addr

    def ns_path(self, name: str) -> str:
        return self.spaces.path(name)

    def cut(self, role: str) -> None:
        ns, ifname, _ = self.links[role]
        self.spaces.set_link(ns, ifname, up=False)

    def restore(self, role: str) -> None:
        ns, ifname, _ = self.links[role]
        self.spaces.set_link(ns, ifname, up=True)

    def listen(self, ns: str, host: str = "0.0.0.0"):
        return self.spaces.listen(ns, host)

    def close(self) -> None:
        self.spaces.close()


@pytest.fixture
def netlab():
    require_kernel()
    if shutil.which("nsenter") is None:
        pytest.skip("util-linux (nsenter) is needed to start agents in network namespaces")
    try:
        lab = NetLab()
    except OSError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        yield lab
    finally:
        lab.close()
        assert lab.spaces.left() == []


# -- the control plane ---------------------------------------------------------------------------------------


class ControlPlane:
    """create_app(Config(...)) served from a thread of this process: one loopback site for the tenant, plus
    a site on each socket given (e.g. one listening inside a network namespace)."""

    def __init__(self, workdir: Path, *, grace_s: float = 30.0, sockets: list[socket.socket] = (),
                 bootstrap: dict | None = None) -> None:
        self.workdir = workdir
        self.grace_s = grace_s
        self.sockets = list(sockets)
        self.bootstrap = bootstrap or bootstrap_doc()
        self.url = ""
        self.ports: list[int] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.app = None

    def start(self, port: int = 0, timeout: float = 20) -> "ControlPlane":
        from aiohttp import web

        from controlplane.api.app import create_app
        from controlplane.wiring import Config

        boot = self.workdir / "bootstrap.json"
        boot.write_text(json.dumps(self.bootstrap))
        started = threading.Event()

        async def main() -> None:
            self._stop = asyncio.Event()
            config = Config(db=f"sqlite:///{self.workdir / 'cp.db'}", bootstrap=str(boot), synchronous="NORMAL",
                            node_grace_s=self.grace_s)
            self.app = create_app(config)
            runner = web.AppRunner(self.app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port, reuse_address=True)
            await site.start()
            for s in self.sockets:
                await web.SockSite(runner, s).start()
            self.ports = [a[1] for a in runner.addresses]
            self.url = f"http://127.0.0.1:{self.ports[0]}"
            started.set()
            await self._stop.wait()
            await runner.cleanup()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(main())
            except BaseException as exc:  # noqa: BLE001
                self._error = exc
                started.set()
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name="control-plane", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or self._error is not None:
            raise RuntimeError(f"control plane did not start: {self._error!r}")
        return self

    def port_of(self, sock: socket.socket) -> int:
        return sock.getsockname()[1]

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(20)

    def post(self, path: str, body: dict, token: str = ALICE, timeout: float = 10) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def call(self, method: str, body: dict, token: str = ALICE) -> dict:
        status, doc = self.post(f"/api/compute/reservations/{method}", body, token)
        assert status in (200, 202), (method, status, doc)
        return doc["reservation"] if "reservation" in doc else doc

    def create(self, **fields) -> dict:
        body = {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "durationHours": 1, **fields}
        return self.call("create", {k: v for k, v in body.items() if v is not None})  # None: leave the field out

    def get(self, rid: str) -> dict:
        return self.call("get", {"reservationId": rid})

    def release(self, rid: str) -> dict:
        return self.call("release", {"reservationId": rid})

    def wait_state(self, rid: str, state: str, timeout: float = 5.0) -> dict:
        box: dict = {}

        def check():
            box["r"] = self.get(rid)
            return box["r"]["state"] == state

        try:
            wait_for(check, timeout, f"{rid} to be {state}")
        except AssertionError:
            raise AssertionError(f"{rid} is {box.get('r', {}).get('state')}, not {state}: {box.get('r')}") from None
        return box["r"]


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path


# -- agents ----------------------------------------------------------------------------------------------------


class AgentProc:
    """One `berth agent` process, started the way systemd starts its unit (and in a network namespace, when given).

    layout "scope" (production): the agent's unit cgroup `<base>/agent.service` and, beside it, the workloads
    scope `<base>/workloads.scope/workloads` (the tests' stand-in for berth.slice/berth-workloads.scope).
    layout "delegated": the agent starts in `<base>` itself, workloads go to `<base>/workloads`, so the agent
    moves itself into the leaf `<base>/agent` first (a fresh start only: a restart into `<base>` is refused by the
    kernel once `<base>` passes controllers down, which is why production uses the scope).
    """

    def __init__(self, name: str, *, url: str, token: str, topology: Path, base: Path, state_dir: Path,
                 enable_from: Path | None = None, netns: str | None = None, extra: list[str] = (),
                 log_dir: Path, env: dict | None = None, layout: str = "scope",
                 machine_id: str | None = None, nvml_library: Path | None = None) -> None:
        self.name = name
        self.machine_id = machine_id or uuid.uuid4().hex  # each test agent is a host of its own
        self.url = url
        self.token = token
        self.topology = topology
        self.base = base
        self.layout = layout
        if layout == "scope":
            self.delegated = base / "agent.service"
            self.root = base / "workloads.scope" / "workloads"
        else:
            self.delegated = base
            self.root = base / "workloads"
        self.state_dir = state_dir
        self.enable_from = enable_from
        self.netns = netns
        self.extra = list(extra)
        self.env = dict(env or {})
        # with a stand-in NVML (tests/agent/fake_nvml) instead of --simulate: `topology` is the stand-in's file,
        # the host's CPUs, memory and hugepages are this machine's, and the calls that change a GPU land in `calls`
        self.nvml_library = nvml_library
        self.calls = state_dir.parent / f"{state_dir.name}.nvml-calls"
        if nvml_library is not None:
            from tests.agent import fake_nvml

            self.env.update({fake_nvml.TOPOLOGY_ENV: str(topology), fake_nvml.CALLS_ENV: str(self.calls)})
        self.log_path = log_dir / f"agent-{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        token_file = self.state_dir.parent / f"{self.state_dir.name}.token"
        token_file.write_text(self.token + "\n")
        os.chmod(token_file, 0o600)
        machine_id_file = self.state_dir.parent / f"{self.state_dir.name}.machine-id"
        machine_id_file.write_text(self.machine_id + "\n")
        gpus = (["--nvml-library", str(self.nvml_library)] if self.nvml_library is not None else
                ["--simulate", str(self.topology)])
        cmd = [sys.executable, "-m", "berth", "agent", "--control-plane", self.url,
               "--bootstrap-token-file", str(token_file), *gpus, "--cgroup-root", str(self.root),
               "--state-dir", str(self.state_dir), "--log-format", "json", "--backoff-max-seconds", "0.5",
               "--exec-tenant-user", f"acme={WORKLOAD_UID}", "--machine-id-file", str(machine_id_file), *self.extra]
        if self.enable_from is not None:
            cmd += ["--cgroup-enable-from", str(self.enable_from)]
        if self.netns:
            cmd = ["nsenter", f"--net={self.netns}", "--", *cmd]
        return cmd

    def start(self) -> "AgentProc":
        self.delegated.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"--- start {self.starts}\n")
        log.flush()
        # The shell puts itself in the delegated cgroup (as systemd does for a Delegate=yes unit), then execs.
        script = f'{join_script(self.delegated)} && exec "$@"'
        self.proc = subprocess.Popen(["/bin/sh", "-c", script, "sh", *self.command()], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, cwd=str(REPO),
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env})
        log.close()
        return self

    def lines(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def events(self, event: str, start: int | None = None) -> list[dict]:
        """Log lines with this event, of the given start (1-based) or all."""
        out, n = [], 0
        for line in self.log_path.read_text().splitlines():
            if line.startswith("--- start "):
                n = int(line.split()[-1])
            elif line.startswith("{") and (start is None or n == start):
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                if doc.get("event") == event:
                    out.append(doc)
        return out

    def wait_event(self, event: str, timeout: float = 10.0, start: int | None = None) -> dict:
        return wait_for(lambda: (self.events(event, start or self.starts) or [None])[-1], timeout,
                        f"agent {self.name} to log {event!r}\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        return stop_process(self.proc, 10)


@pytest.fixture
def agents(own_cgroup2, workdir):
    """make(name, url, token, kind, netns=None, extra=()) -> a started AgentProc; all stopped after, by pid."""
    made: list[AgentProc] = []

    def make(name: str, url: str, token: str, kind: str = "h100", *, netns: str | None = None,
             extra: list[str] = (), start: bool = True, env: dict | None = None,
             state_dir: Path | None = None, layout: str = "scope", hostname: str | None = None,
             machine_id: str | None = None, nvml: tuple[Path, dict] | None = None) -> AgentProc:
        """nvml: (the stand-in library, a topology dict) to run the agent over NVML instead of --simulate."""
        host = hostname or f"{name}-{uuid.uuid4().hex[:4]}"
        if nvml is None:
            path, library = topology(kind, host, workdir), None
        else:
            from tests.agent import fake_nvml

            library, path = nvml[0], fake_nvml.write(workdir / f"{host}.nvml", nvml[1])
        a = AgentProc(name, url=url, token=token, topology=path,
                      base=own_cgroup2 / name, state_dir=state_dir or workdir / f"state-{name}",
                      enable_from=own_cgroup2, netns=netns, extra=list(extra), log_dir=workdir, env=env,
                      layout=layout, machine_id=machine_id, nvml_library=library)
        made.append(a)
        return a.start() if start else a

    try:
        yield make
    finally:
        for a in made:
            a.stop()


@pytest.fixture
def device_nodes():
    """A directory (world-readable) with character nodes c 195:0..7 named nvidia0..7, as on a GPU host."""
    d = Path(f"/tmp/berth-test-dev-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    try:
        for minor in range(8):
            os.mknod(d / f"nvidia{minor}", 0o666 | 0o020000, os.makedev(195, minor))
            os.chmod(d / f"nvidia{minor}", 0o666)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


PROBE = ("import errno, os, sys\n"
         "for p in sys.argv[1:]:\n"
         "    try:\n"
         "        os.close(os.open(p, os.O_RDWR)); print(p, 'OK')\n"
         "    except OSError as e:\n"
         "        print(p, errno.errorcode[e.errno])\n")


def exec_open(state_dir: Path, rid: str, paths: list[Path], python: str = SYSTEM_PYTHON,
              timeout: float = 20) -> dict[str, str]:
    """`berth exec RID -- python -c PROBE paths...`: what opening each path gave inside the reservation."""
    out = subprocess.run([sys.executable, "-m", "berth", "exec", "--state-dir", str(state_dir), rid, "--",
                          python, "-c", PROBE, *map(str, paths)], capture_output=True, text=True, timeout=timeout,
                         cwd=str(REPO))
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def spawn_in(state_dir: Path, rid: str, *command: str) -> subprocess.Popen:
    """A long-running `berth exec RID -- command` (the caller ends it, or the release does)."""
    return subprocess.Popen([sys.executable, "-m", "berth", "exec", "--state-dir", str(state_dir), rid,
                             "--", *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=str(REPO))


def pids_of(cgroup: Path) -> list[int]:
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False

