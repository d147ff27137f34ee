"""A real OpenSSH server for tests, in a network namespace of its own, and a throwaway tenant user to log in as.

`sshd_server` starts `/usr/sbin/sshd -D -e -f CONFIG` inside a namespace made
for it (tests/netns.py: a veth pair to the root namespace with a 169.254.x.y/30
on each end, nothing else), with its own config, freshly generated host keys
and PidFile in tmp_path, `AuthorizedKeysFile <keys_dir>/%u` (below a
root-owned directory in /run, since StrictModes refuses keys below /tmp),
`AllowUsers` only the throwaway user, no passwords, no PAM, StrictModes yes,
`PermitRootLogin prohibit-password`. It is stopped by pid, with every
per-connection process it left (sshd keeps sessions when the listener
stops), and the namespace, the /run directory and (if the fixture made it)
/run/sshd are removed, also on failure.

`tenant_user` is `useradd --system --no-create-home --shell /bin/sh
berth-t-XXXX`, its password field set to `*` (no password, but not the `!`
of a locked account, which sshd refuses without PAM); its leftover
processes are killed by pid and it is removed with `userdel` after, also on
failure. So no test logs in as, or kills the processes of, a real user.

Import the fixtures into a test module (`from tests.e2e.sshd import
sshd_server, tenant_user`); they need root, iproute2, util-linux (nsenter)
and openssh-server/openssh-client, and skip with the reason otherwise.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import random
import re
import select
import shutil
import signal
import subprocess
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.netns import Namespaces
from tests.waiting import wait_for

SSHD = "/usr/sbin/sshd"
RUN_PRIVSEP = Path("/run/sshd")  # sshd's compiled-in privilege separation directory (Debian)
# Held shared by every test sshd that runs (in any pytest worker) and exclusive by the last to stop; it reads
# "made" when tests made RUN_PRIVSEP, which the last one then removes, the lock file with it.
PRIVSEP_LOCK = Path("/run/berth-test-sshd-privsep.lock")
SSHD_DROP_IN = Path(__file__).resolve().parents[2] / "examples" / "sshd-berth.conf"  # what berth-agent ships


def _run(*cmd: str, timeout: float = 20) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _stat_of(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, starttime) of a pid, or None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def gone(pid: int, starttime: int | None = None) -> bool:
    """No such process any more (absent, a zombie, or the pid now names a process started later)."""
    st = _stat_of(pid)
    return st is None or st[1] in ("Z", "X") or (starttime is not None and st[2] != starttime)


def starttime_of(pid: int) -> int:
    st = _stat_of(pid)
    assert st is not None, f"process {pid} is not there"
    return st[2]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat_of(int(entry))
            if st is not None:
                children.setdefault(st[0], []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            out.append(child)
            stack.append(child)
    return out


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            m = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, re.M)
            if m and uid in (int(m.group(1)), int(m.group(2))):
                out.append(int(entry))
    return out


def _kill_all(pids: list[int], timeout: float = 10) -> None:
    """SIGKILL these pids (ours: children of our sshd or processes of our throwaway user) and wait until gone."""
    marks = {pid: _stat_of(pid) for pid in pids}
    for pid, st in marks.items():
        if st is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wait_for(lambda: all(st is None or gone(pid, st[2]) for pid, st in marks.items()), timeout,
               f"processes {sorted(pids)} to go")


def require_root_tools(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, useradd, sshd)")
    missing = [t for t in tools if shutil.which(t) is None and not Path(t).exists()]
    if missing:
        pytest.skip(f"missing {', '.join(missing)} (apt-get install openssh-server openssh-client iproute2 "
                    "util-linux passwd)")


# -- the throwaway user ----------------------------------------------------------------------------------------


@pytest.fixture
def tenant_user():
    """A fresh system user berth-t-XXXX (no home, /bin/sh); yields its pwd entry; removed after, also on failure."""
    require_root_tools("useradd", "userdel", "usermod")
    name = f"berth-t-{uuid.uuid4().hex[:6]}"
    _run("useradd", "--system", "--no-create-home", "--shell", "/bin/sh", name)
    try:
        _run("usermod", "-p", "*", name)
        yield pwd.getpwnam(name)
    finally:
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            uid = None
        if uid is not None:
            from agent.tenantroot.sessions import sweep

            sweep(uid)  # kill(-1) as the user: what forks faster than a scan goes too
            _kill_all(_pids_of_uid(uid))
        subprocess.run(["userdel", name], capture_output=True, timeout=20)
        try:
            pwd.getpwnam(name)
            left = True
        except KeyError:
            left = False
        assert not left, f"userdel {name} failed: the user is still there"


# -- the server ------------------------------------------------------------------------------------------------


@dataclass
class Sshd:
    """A running sshd: where it listens, its host keys, pid, the keys directory it reads and its log."""

    host: str
    port: int
    host_keys: list[Path]  # the public halves, ssh_host_<type>_key.pub
    pid: int
    keys_dir: Path
    config: Path
    log: Path
    netns: str
    workdir: Path
    user: str
    _known_hosts: Path | None = field(default=None, repr=False)

    @property
    def host_keys_glob(self) -> str:
        return str(self.workdir / "hostkeys" / "ssh_host_*_key.pub")

    def known_hosts(self) -> Path:
        """A known_hosts file with this server's host keys, for StrictHostKeyChecking yes."""
        if self._known_hosts is None:
            path = self.workdir / "known_hosts"
            lines = []
            for pub in self.host_keys:
                kind, data = pub.read_text().split()[:2]
                lines.append(f"[{self.host}]:{self.port} {kind} {data}")
            path.write_text("\n".join(lines) + "\n")
            self._known_hosts = path
        return self._known_hosts

    def ssh_command(self, identity: Path, command: str, user: str | None = None) -> list[str]:
        return ["ssh", "-F", "/dev/null", "-i", str(identity), "-p", str(self.port),
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts()}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "UpdateHostKeys=no", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=1",
                "-o", "ServerAliveCountMax=5", "-o", "LogLevel=ERROR",
                f"{user or self.user}@{self.host}", command]

    def ssh(self, identity: Path, command: str, *, user: str | None = None,
            timeout: float = 20) -> subprocess.CompletedProcess:
        """Run one command over ssh with the real client; the CompletedProcess (255 when refused)."""
        return subprocess.run(self.ssh_command(identity, command, user), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def spawn(self, identity: Path, command: str, *, user: str | None = None) -> subprocess.Popen:
        """A long-running ssh session (the caller ends it, or end_sessions does); stdout is a text pipe."""
        return subprocess.Popen(self.ssh_command(identity, command, user), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def read_line(proc: subprocess.Popen, timeout: float = 10) -> str:
    """The next line of a spawned session's stdout, waiting at most timeout seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output from {proc.args[-1]!r} within {timeout}s")
    return proc.stdout.readline().strip()


def _lock_privsep(mode: int) -> int:
    """PRIVSEP_LOCK opened and flocked in `mode`; again if the last user removed the file meanwhile."""
    while True:
        fd = os.open(PRIVSEP_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, mode)
        try:
            if os.fstat(fd).st_ino == os.stat(PRIVSEP_LOCK).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def _privsep_dir():
    """RUN_PRIVSEP, which sshd chroots its pre-authentication child into, for as long as the caller's sshd runs.

    Test sshds in several pytest workers share it: one that removed it while another still ran had that one
    reset every new connection. The directory is made when missing (under the lock held exclusively), and
    removed, when tests made it, by the last test to stop."""
    while True:
        fd = _lock_privsep(fcntl.LOCK_SH)
        if RUN_PRIVSEP.is_dir():
            break
        os.close(fd)
        fd = _lock_privsep(fcntl.LOCK_EX)
        try:
            if not RUN_PRIVSEP.exists():
                RUN_PRIVSEP.mkdir(mode=0o755)
                os.write(fd, b"made")
        finally:
            os.close(fd)
    try:
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only the last user gets it
        except BlockingIOError:
            pass
        else:
            if os.pread(fd, 4, 0) == b"made":
                try:
                    RUN_PRIVSEP.rmdir()
                except OSError:
                    pass  # something else was put there meanwhile: leave it
            PRIVSEP_LOCK.unlink()
        finally:
            os.close(fd)


def _free_link_net() -> tuple[str, str]:
    """Two addresses of a /30 in 169.254.0.0/16 (not 169.254.169.x) that no interface here uses."""
    used = Namespaces.addresses_in_use()
    for _ in range(50):
        a, b = random.randint(100, 199), random.randrange(0, 256, 4)
        host, ns = f"169.254.{a}.{b + 1}", f"169.254.{a}.{b + 2}"
        if not any(u.startswith(f"169.254.{a}.") for u in used):
            return host, ns
    raise RuntimeError("no free 169.254.x.y/30 found for the test link")


def _write_config(path: Path, *, listen: str, port: int, host_keys: list[Path], keys_dir: Path, pid_file: Path,
                  user: str, extra: list[str]) -> None:
    # The test's own settings first (for sshd the first value read wins: its keys directory, no PAM in a test
    # machine's container), then the drop-in the agent package ships, so the tests run sshd as a node would.
    lines = [f"ListenAddress {listen}:{port}", *(f"HostKey {k}" for k in host_keys),
             f"PidFile {pid_file}", f"AuthorizedKeysFile {keys_dir}/%u", "UsePAM no", f"AllowUsers {user}",
             "AllowTcpForwarding no", "AllowAgentForwarding no", "X11Forwarding no", "PrintMotd no",
             "UseDNS no", "LogLevel DEBUG1", "MaxStartups 100:30:200", *extra, f"Include {SSHD_DROP_IN}"]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def sshd_server(tmp_path, tenant_user):
    """A started Sshd for `tenant_user`, in its own network namespace; everything it made is gone after."""
    require_root_tools(SSHD, "ssh", "ssh-keygen", "nsenter")
    with _privsep_dir():
        yield from _started_sshd(tmp_path, tenant_user)


def _started_sshd(tmp_path: Path, tenant_user: pwd.struct_passwd):
    spaces = Namespaces("berth-ssh")
    tag = spaces.tag
    work = tmp_path / "sshd"
    (work / "hostkeys").mkdir(parents=True)
    run_dir = Path(f"/run/berth-test-{tag}")
    pid: int | None = None
    started: int | None = None
    try:
        run_dir.mkdir(mode=0o755)
        os.chmod(run_dir, 0o755)
        keys_dir = run_dir / "ssh-keys"
        host_keys = []
        for kind in ("ed25519", "ecdsa", "rsa"):
            key = work / "hostkeys" / f"ssh_host_{kind}_key"
            _run("ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"berth-test-{tag}", "-f", str(key), timeout=60)
            host_keys.append(key)
        host_addr, ns_addr = _free_link_net()
        netns = spaces.add("sshd")
        spaces.link(None, f"bsh{tag}h", host_addr, netns, f"bsh{tag}n", ns_addr)
        port = random.randint(20000, 29999)  # the namespace is new: every port in it is free
        config = work / "sshd_config"
        extra = ["PerSourcePenalties no"]  # OpenSSH >= 9.8 would slow down the refused logins the tests make
        kwargs = dict(listen=ns_addr, port=port, host_keys=host_keys, keys_dir=keys_dir,
                      pid_file=work / "sshd.pid", user=tenant_user.pw_name)
        _write_config(config, extra=extra, **kwargs)
        check = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True, timeout=20)
        if check.returncode != 0 and "PerSourcePenalties" in check.stderr:
            _write_config(config, extra=[], **kwargs)
            check = subprocess.run([SSHD, "-t", "-f", str(config)], capture_output=True, text=True, timeout=20)
        assert check.returncode == 0, f"sshd -t refused the test config: {check.stderr}"
        log_path = work / "sshd.log"
        pid_file = work / "sshd.pid"
        # `setsid -f` detaches sshd from this process (as on a node, where the agent is not sshd's ancestor:
        # end_sessions spares everything below the pids it protects, and tests protect their own pid)
        with open(log_path, "wb") as log:
            subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "--", "setsid", "-f", SSHD, "-D", "-e", "-f",
                            str(config)], stdout=log, stderr=log, stdin=subprocess.DEVNULL, check=True, timeout=20)
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip()
                   or "fatal" in log_path.read_text(errors="replace"), 15, "sshd to write its PidFile")
        assert pid_file.exists(), f"sshd did not start: {log_path.read_text(errors='replace')[-3000:]}"
        pid = int(pid_file.read_text().strip())
        started = starttime_of(pid)
        wait_for(lambda: gone(pid, started) or f"Server listening on {ns_addr} port {port}"
                   in log_path.read_text(errors="replace"), 15, "sshd to listen")
        assert not gone(pid, started), f"sshd exited: {log_path.read_text(errors='replace')[-3000:]}"
        yield Sshd(host=ns_addr, port=port, host_keys=[Path(f"{k}.pub") for k in host_keys], pid=pid,
                   keys_dir=keys_dir, config=config, log=log_path, netns=netns, workdir=work,
                   user=tenant_user.pw_name)
    finally:
        if pid is not None and not gone(pid, started):
            left = _descendants(pid)  # per-connection processes outlive the listener
            os.kill(pid, signal.SIGTERM)
            try:
                wait_for(lambda: gone(pid, started), 10, "sshd to stop")
            except AssertionError:
                _kill_all([pid])
            _kill_all(left)
        spaces.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        assert spaces.left() == [], f"namespaces {spaces.left()} are still there"
        assert not run_dir.exists(), f"{run_dir} is still there"
