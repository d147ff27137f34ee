"""agent.tenantroot: the keys directory, host keys and the end of sessions, against a real sshd and ssh client.

The end-to-end tests log in with the real `ssh` client (BatchMode, a
known_hosts made from the server's host keys, StrictHostKeyChecking yes) as a
throwaway user to a real sshd in a network namespace (tests/e2e/sshd.py);
the selection rules of sessions.py are tested on hand-made /proc trees.
"""
from __future__ import annotations

import dataclasses
import os
import pwd
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent.tenantroot.authorized_keys import Entry, KeysDir, KeysDirError, expiry_time
from agent.tenantroot import notice
from agent.tenantroot.hostkeys import HostKeysError, host_key_fingerprints, parse_endpoint, ssh_endpoint
from agent.tenantroot.sessions import (NEW_PROCESS, SSH_SESSION, SSHD_COMMS, Ended, SessionsError, baseline,
                                       end_sessions, plan)
from common.sshkeys import parse_public_key
from tests.e2e.sshd import gone, read_line, sshd_server, starttime_of, tenant_user  # noqa: F401
from tests.waiting import wait_for

HOUR_MS = 3_600_000


def now_ms() -> int:
    return int(time.time() * 1000)


def make_key(directory: Path, name: str = "id_ed25519") -> tuple[Path, Path]:
    """A fresh ed25519 key pair made by ssh-keygen: (private key, public key)."""
    directory.mkdir(parents=True, exist_ok=True)
    private = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"tenant {name}", "-f", str(private)],
                   check=True, capture_output=True, timeout=30)
    return private, Path(f"{private}.pub")


def key_of(pub: Path):
    return parse_public_key(pub.read_text().strip())


def keygen_fingerprint(path: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[1]


@pytest.fixture
def tenant_key(tmp_path) -> tuple[Path, Path]:
    if subprocess.run(["which", "ssh-keygen"], capture_output=True).returncode != 0:
        pytest.skip("ssh-keygen (openssh-client) is not installed")
    return make_key(tmp_path / "tenant")


# -- the keys directory on its own ---------------------------------------------------------------------------


@pytest.fixture
def me() -> pwd.struct_passwd:
    """An existing user to write files for (this process's), since install looks the user up."""
    return pwd.getpwuid(os.geteuid())


@pytest.fixture
def loose_dir(tmp_path) -> KeysDir:
    """A keys directory under tmp_path (below the world-writable /tmp, so without the StrictModes chain check)."""
    return KeysDir(tmp_path / "ssh-keys", strict=False)


def test_an_installed_line_has_the_expiry_the_key_and_the_reservation_tag(loose_dir, tenant_key, me):
    key = key_of(tenant_key[1])
    expires = 1_900_000_000_123  # 2030-03-17 17:46:40.123 UTC
    loose_dir.install(me.pw_name, "r-1", [key], expires, now_ms=expires - HOUR_MS)
    expected = f'expiry-time="20300317174640Z" {key.type} {key.base64()} berth:r-1\n'
    assert expected == (loose_dir.path / me.pw_name).read_text()


def test_the_file_and_directory_have_the_owner_and_modes_strictmodes_accepts(loose_dir, tenant_key, me):
    if os.geteuid() != 0:
        pytest.skip("root-owned files need root")
    loose_dir.install(me.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    f, d = os.stat(loose_dir.path / me.pw_name), os.stat(loose_dir.path)
    assert ((0, me.pw_gid, 0o640), (0, 0o711)) == ((f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode)),
                                                   (d.st_uid, stat.S_IMODE(d.st_mode)))


def test_listed_gives_back_what_was_installed(loose_dir, tenant_key, me):
    key = key_of(tenant_key[1])
    expires = now_ms() + HOUR_MS
    loose_dir.install(me.pw_name, "r-1", [key, key], expires)  # the same key twice is one line
    installed = loose_dir.install(me.pw_name, "r-1", [key], expires)
    expected = [Entry("r-1", dataclasses.replace(key, comment=""), expires // 1000 * 1000)]
    assert (expected, expected) == (installed, loose_dir.listed(me.pw_name))


def test_installing_again_replaces_the_reservations_lines_and_keeps_the_others(loose_dir, tmp_path, me):
    a, b, c = (key_of(make_key(tmp_path / "k", n)[1]) for n in ("a", "b", "c"))
    t = now_ms() + HOUR_MS
    (loose_dir.path).mkdir(mode=0o711)
    (loose_dir.path / me.pw_name).write_text("# an operator's note\n")
    loose_dir.install(me.pw_name, "r-1", [a], t)
    loose_dir.install(me.pw_name, "r-2", [b], t + 1000)
    loose_dir.install(me.pw_name, "r-1", [c], t + 2000)
    lines = (loose_dir.path / me.pw_name).read_text().splitlines()
    assert (["# an operator's note", "berth:r-2", "berth:r-1"], [("r-2", b.blob), ("r-1", c.blob)]) == (
        [lines[0]] + [ln.rsplit(" ", 1)[1] for ln in lines[1:]],
        [(e.reservation_id, e.key.blob) for e in loose_dir.listed(me.pw_name)])


def test_removing_the_last_reservation_removes_the_file(loose_dir, tenant_key, me):
    loose_dir.install(me.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    assert (1, 0, False, []) == (loose_dir.remove(me.pw_name, "r-1"), loose_dir.remove(me.pw_name, "r-1"),
                                 (loose_dir.path / me.pw_name).exists(),
                                 [p.name for p in loose_dir.path.iterdir() if p.name != ".berth.lock"])


def test_a_rewrite_is_a_rename_and_readers_never_see_a_torn_file(loose_dir, tmp_path, me):
    keys = [key_of(make_key(tmp_path / "k", f"k{i}")[1]) for i in range(3)]
    loose_dir.install(me.pw_name, "r-0", keys, now_ms() + HOUR_MS)
    file = loose_dir.path / me.pw_name
    original = file.read_text()
    old = open(file)  # a rename leaves the old file as it was (unlinked); a rewrite in place would change it
    bad: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            text = file.read_text()
            if not text.endswith("\n") or len(text.splitlines()) not in (3, 6):
                bad.append(text)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(100):
            loose_dir.install(me.pw_name, "r-1", keys, now_ms() + HOUR_MS + i * 1000)
    finally:
        stop.set()
        reader.join(10)
        old_text, old_links = old.read(), os.fstat(old.fileno()).st_nlink
        old.close()
    assert ([], original, 0, []) == (bad, old_text, old_links, list(loose_dir.path.glob(".*.tmp")))


@pytest.mark.parametrize("user", ["", "../etc", "a/b", ".hidden", "-rf", "12345", "x" * 33, "a b", "a@b", None])
def test_a_user_name_that_is_not_posix_portable_is_refused(loose_dir, tenant_key, user):
    with pytest.raises(KeysDirError) as err:
        loose_dir.install(user, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    assert "POSIX portable" in str(err.value)


def test_a_user_that_does_not_exist_is_refused_naming_the_pool_setting(loose_dir, tenant_key):
    with pytest.raises(KeysDirError) as err:
        loose_dir.install("berth-nobody-here", "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    assert "policy.tenantRoot.user" in str(err.value)


def test_a_window_that_has_ended_is_not_installed(loose_dir, tenant_key, me):
    with pytest.raises(KeysDirError) as err:
        loose_dir.install(me.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() - 1000)
    assert (True, False) == ("has passed" in str(err.value), (loose_dir.path / me.pw_name).exists())


@pytest.mark.parametrize("rid", ["", "r 1", 'r"1', "r\n1", "-r", "r" * 129])
def test_a_reservation_id_that_cannot_tag_a_line_is_refused(loose_dir, tenant_key, me, rid):
    with pytest.raises(KeysDirError):
        loose_dir.install(me.pw_name, rid, [key_of(tenant_key[1])], now_ms() + HOUR_MS)


def test_the_strict_check_names_the_world_writable_directory_above(tmp_path, tenant_key, me):
    """pytest's tmp_path lies below /tmp (mode 1777): sshd would ignore the keys, and KeysDir says why."""
    with pytest.raises(KeysDirError) as err:
        KeysDir(tmp_path / "ssh-keys").install(me.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    assert (True, True) == ("refuses keys below /tmp:" in str(err.value), "chmod go-w /tmp" in str(err.value))


def test_a_relative_keys_dir_is_refused():
    with pytest.raises(KeysDirError):
        KeysDir("ssh-keys")


@pytest.mark.parametrize("ms,expected", [(0, "19700101000000Z"), (1_900_000_000_999, "20300317174640Z"),
                                         (1_704_067_199_000, "20231231235959Z")])
def test_expiry_time_is_utc_rounded_down_to_the_second(ms, expected):
    assert expected == expiry_time(ms)


# -- host keys and the endpoint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value,expected", [("node7:2222", ("node7", 2222)), ("node7", ("node7", 22)),
                                            ("10.1.2.3:22", ("10.1.2.3", 22)), ("[fd00::7]:2200", ("fd00::7", 2200)),
                                            ("[fd00::7]", ("fd00::7", 22))])
def test_an_ssh_endpoint_is_parsed_into_host_and_port(value, expected):
    assert expected == parse_endpoint(value)


@pytest.mark.parametrize("value", ["node7:", "node7:0", "node7:70000", "node7:x", "fd00::7:22", "[fd00::7",
                                   "[zz]:22", "bad host:22", "-node:22"])
def test_a_bad_ssh_endpoint_is_refused_naming_the_flag(value):
    with pytest.raises(HostKeysError) as err:
        parse_endpoint(value)
    assert str(err.value).startswith("--ssh-endpoint")


def test_no_host_keys_matching_is_an_error_saying_how_to_make_them(tmp_path):
    with pytest.raises(HostKeysError) as err:
        host_key_fingerprints(str(tmp_path / "ssh_host_*_key.pub"))
    assert "ssh-keygen -A" in str(err.value)


def test_without_endpoint_the_binding_reports_the_hostname_and_port_22(tmp_path, tenant_key):
    (tmp_path / "ssh_host_ed25519_key.pub").write_text(tenant_key[1].read_text())
    endpoint = ssh_endpoint("root", host_keys=str(tmp_path / "ssh_host_*_key.pub"), hostname="gpu-node-7")
    assert {"host": "gpu-node-7", "port": 22, "user": "root", "hostKeys": [keygen_fingerprint(tenant_key[1])]} == \
        endpoint.wire()


# -- sessions: the rules on hand-made /proc trees ----------------------------------------------------------------


class ProcTree:
    """A directory laid out like /proc: add(pid, ...) writes stat, status, cmdline and cgroup."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()

    def add(self, pid: int, *, ppid: int = 1, comm: str = "sleep", uid: int = 1001, euid: int | None = None,
            title: str | None = None, cgroup: str = "0::/system.slice/ssh.service", starttime: int | None = None,
            state: str = "S", flags: int = 0x400100) -> int:
        d = self.root / str(pid)
        d.mkdir()
        start = starttime if starttime is not None else 1000 + pid
        rest = [state, ppid, pid, pid, 0, -1, flags] + [0] * 12 + [start] + [0] * 32
        (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(map(str, rest)) + "\n")
        e = uid if euid is None else euid
        (d / "status").write_text(f"Name:\t{comm}\nState:\t{state}\nPPid:\t{ppid}\nUid:\t{uid}\t{e}\t{e}\t{e}\n"
                                  f"Gid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        (d / "cmdline").write_bytes(((title if title is not None else comm).replace(" ", "\0") + "\0").encode())
        (d / "cgroup").write_text(cgroup + "\n")
        return pid


@pytest.fixture
def tree(tmp_path) -> ProcTree:
    t = ProcTree(tmp_path / "proc")
    t.add(1, ppid=0, comm="systemd", uid=0, cgroup="0::/init.scope")
    t.add(2, ppid=0, comm="kthreadd", uid=0, cgroup="0::/", flags=0x208040)
    return t


def chosen(tree: ProcTree, user: str = "alice", uid: int = 1001, base=frozenset(), protect=frozenset()):
    return {(e.pid, e.rule) for e in plan(user, uid, frozenset(base), protect=set(protect), proc=tree.root)}


def test_rule_1_ends_the_users_sshd_processes_and_all_below_but_not_the_listener(tree):
    tree.add(100, comm="sshd", uid=0, title="sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups")
    tree.add(200, ppid=100, comm="sshd", uid=0, title="sshd: alice [priv]")
    tree.add(201, ppid=200, comm="sshd", title="sshd: alice@pts/0")
    tree.add(202, ppid=201, comm="bash", title="-bash")
    tree.add(203, ppid=202, comm="sudo", uid=0, title="sudo make install", cgroup="0::/system.slice/x.service")
    tree.add(300, ppid=100, comm="sshd", uid=0, title="sshd: bob [priv]")
    tree.add(301, ppid=100, comm="sshd", uid=0, title="sshd: alicex [priv]")
    tree.add(400, ppid=100, comm="sshd-session", uid=0, title="sshd-session: alice [priv]")
    tree.add(401, ppid=400, comm="sshd-session", title="sshd-session: alice@notty")
    tree.add(500, ppid=1, comm="bash", uid=0, title="sshd: alice [priv]")  # the title alone is not enough
    expected = {(200, SSH_SESSION), (201, SSH_SESSION), (202, SSH_SESSION), (203, SSH_SESSION),
                (400, SSH_SESSION), (401, SSH_SESSION)}
    baseline_now = baseline(1001, proc=tree.root)
    assert expected == chosen(tree, base=baseline_now)


def test_rule_2_ends_the_users_processes_started_after_the_baseline(tree):
    tree.add(600, title="sleep 300")  # there at the hand-over: a service of the user
    base = baseline(1001, proc=tree.root)
    tree.add(601, title="nohup miner")
    tree.add(602, uid=1001, euid=0, comm="passwd")  # setuid: real uid is the user's
    tree.add(603, uid=1002, comm="other")  # another user
    tree.add(604, uid=0, comm="vim", cgroup="0::/user.slice/user-1001.slice/session-4.scope")  # sudo in a session
    assert ({(600, 1600)}, {(601, NEW_PROCESS), (602, NEW_PROCESS), (604, NEW_PROCESS)}) == (
        set(base), chosen(tree, base=base))


def test_a_pid_reused_since_the_baseline_is_ended(tree):
    base = frozenset({(700, 5000)})  # pid 700 then: started at 5000
    tree.add(700, starttime=9000)  # pid 700 now: another process
    tree.add(701, starttime=6000)
    base |= {(701, 6000)}
    assert {(700, NEW_PROCESS)} == chosen(tree, base=base)


def test_protected_pids_their_children_and_their_ancestors_are_never_ended(tree):
    tree.add(800, ppid=1, comm="sshd", uid=0, title="sshd: alice [priv]")
    tree.add(801, ppid=800, comm="bash")
    tree.add(802, ppid=801, comm="berth", title="berth agent")  # an agent started from the session
    tree.add(803, ppid=802, comm="helper")
    tree.add(804, ppid=801, comm="sleep")
    assert {(804, SSH_SESSION)} == chosen(tree, protect={802})


def test_pid_1_kernel_threads_and_zombies_are_never_ended(tree):
    tree.add(900, ppid=2, comm="kworker/0:1", uid=1001, flags=0x04208060)
    tree.add(901, ppid=1, comm="defunct", state="Z")
    tree.add(902, ppid=1, comm="live")
    (tree.root / "1" / "status").write_text("Name:\tinit\nUid:\t1001\t1001\t1001\t1001\n")
    assert {(902, NEW_PROCESS)} == chosen(tree)


@pytest.mark.parametrize("cgroup,ended", [
    ("0::/system.slice/nginx.service", False),  # a service started after the hand-over: not the tenant's
    ("0::/user.slice/user-0.slice/session-3.scope", True),  # root's login session
    ("0::/user.slice/user-0.slice/user@0.service/app.slice/x.service", True),  # root's user manager
    ("1:name=systemd:/user.slice/user-0.slice/session-4.scope", True),  # a hybrid host's systemd hierarchy
    ("0::/user.slice/user-1001.slice/session-5.scope", False),  # another user's session
    ("0::/", False),
], ids=["service", "session", "user-manager", "hybrid", "other-user", "root-cgroup"])
def test_for_root_rule_2_ends_only_processes_in_user_0_slice(tree, cgroup, ended):
    tree.add(1000, uid=0, comm="proc", cgroup=cgroup)
    assert ({(1000, NEW_PROCESS)} if ended else set()) == chosen(tree, user="root", uid=0)


def test_for_root_the_baseline_spares_what_ran_in_user_0_slice_at_the_hand_over(tree):
    tree.add(1100, uid=0, comm="tmux", cgroup="0::/user.slice/user-0.slice/session-1.scope")
    tree.add(1101, uid=0, comm="cron", cgroup="0::/system.slice/cron.service")
    base = baseline(0, proc=tree.root)
    tree.add(1102, uid=0, comm="miner", cgroup="0::/user.slice/user-0.slice/session-1.scope")
    assert ({(1100, 2100)}, {(1102, NEW_PROCESS)}) == (set(base), chosen(tree, user="root", uid=0, base=base))


def test_end_sessions_refuses_to_signal_pids_from_a_hand_made_tree(tree):
    with pytest.raises(SessionsError) as err:
        end_sessions("alice", frozenset(), protect={os.getpid()}, proc=tree.root, uid=1001)
    assert "use plan()" in str(err.value)


# -- sessions: real processes of a throwaway user ----------------------------------------------------------------


def detached_as(user: pwd.struct_passwd, *command: str) -> tuple[int, int]:
    """(pid, starttime) of `command` run as the user and detached from this process (`setsid -f`), as a tenant's
    process is (end_sessions spares whatever is below the pids it protects, and the tests protect their own)."""
    out = subprocess.run(["setsid", "-f", "sh", "-c", 'echo $$; exec "$@" >/dev/null 2>&1', "sh", *command],
                         user=user.pw_uid, group=user.pw_gid, extra_groups=[], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10, check=True)
    pid = int(out.stdout.split()[0])
    wait_for(lambda: Path(f"/proc/{pid}/cmdline").read_bytes().startswith(command[0].encode()), 5, "the exec")
    return pid, starttime_of(pid)


def test_end_sessions_kills_real_processes_started_after_the_baseline_and_spares_the_rest(tenant_user):
    """Processes of the throwaway user: one before the baseline (spared), one after (ended, and gone)."""
    before = detached_as(tenant_user, "sleep", "300")
    base = baseline(tenant_user.pw_uid)
    after = detached_as(tenant_user, "sleep", "301")
    ended = end_sessions(tenant_user.pw_name, base, protect={os.getpid()})
    assert ([(after[0], "sleep", NEW_PROCESS, tenant_user.pw_uid)], {before}, False, True) == (
        [(e.pid, e.comm, e.rule, e.uid) for e in ended], set(base), gone(*before), gone(*after))
    # (tenant_user's teardown kills `before` by pid)


# A chain that forks its successor and exits every 10 ms (bounded: 3000 steps), each step in a session of its own
CHAIN = 'n=$1; [ "$n" -ge 3000 ] && exit 0; sleep 0.01; setsid -f sh -c "$0" "$0" $((n+1)) </dev/null >/dev/null 2>&1'


def test_a_process_chain_that_reforks_faster_than_a_scan_is_ended_too(tenant_user):
    """Each scan lists /proc once: a chain member listed was gone when read, its successor born after the listing,
    so a scan came back empty while the chain ran on (and the node was reported clean). The rounds now end with a
    sweep, kill(-1) as the user, which no fork escapes."""
    from tests.e2e.sshd import _pids_of_uid

    base = baseline(tenant_user.pw_uid)
    assert not base
    detached_as(tenant_user, "sh", "-c", CHAIN, CHAIN, "0")
    time.sleep(0.5)  # well under way
    end_sessions(tenant_user.pw_name, base, protect={os.getpid()})

    def alive() -> list[int]:  # (zombies are dead: this sandbox's pid 1 does not reap the chain's)
        out = []
        for pid in _pids_of_uid(tenant_user.pw_uid):
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
            except OSError:
                continue
        return out

    for _ in range(10):  # and it stays gone
        assert [] == alive()
        time.sleep(0.1)


def test_the_sweep_is_not_made_when_it_would_end_a_protected_process_of_the_user(tenant_user):
    """kill(-1) cannot leave a process out: a protected one of the user (an operator's session as the pool's
    account, from which the agent was started) would go with it, so then there is no sweep."""
    base = baseline(tenant_user.pw_uid)
    guarded = subprocess.Popen(["sleep", "300"], user=tenant_user.pw_uid, group=tenant_user.pw_gid, extra_groups=[])
    try:
        wait_for(lambda: Path(f"/proc/{guarded.pid}/cmdline").read_bytes().startswith(b"sleep"), 5, "the exec")
        later = detached_as(tenant_user, "sleep", "301")
        ended = end_sessions(tenant_user.pw_name, base, protect={os.getpid(), guarded.pid})
        assert [later[0]] == [e.pid for e in ended] and gone(*later)
        assert guarded.poll() is None  # spared, as protect promises
    finally:
        guarded.kill()
        guarded.wait()


# -- the real sshd ---------------------------------------------------------------------------------------------


def login(server, identity: Path, command: str = "id -un"):
    return server.ssh(identity, command)


def test_an_installed_key_logs_in_over_ssh_and_runs_a_command(sshd_server, tenant_key):
    KeysDir(sshd_server.keys_dir).install(sshd_server.user, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    out = login(sshd_server, tenant_key[0])
    assert (0, sshd_server.user) == (out.returncode, out.stdout.strip()), out.stderr + sshd_server.log_text()[-2000:]


def test_without_keys_the_login_is_refused(sshd_server, tenant_key):
    out = login(sshd_server, tenant_key[0])
    assert (255, True) == (out.returncode, "Permission denied" in out.stderr)


def test_end_sessions_and_remove_close_the_session_end_its_processes_and_refuse_new_logins(sshd_server, tenant_key):
    user = pwd.getpwnam(sshd_server.user)
    keys = KeysDir(sshd_server.keys_dir)
    base = baseline(user.pw_uid)
    keys.install(user.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    # a detached process (reparented away from sshd: only rule 2 finds it), then a session that stays open
    detached = login(sshd_server, tenant_key[0], "(setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $!)")
    assert 0 == detached.returncode, detached.stderr
    orphan = int(detached.stdout.strip())
    session = sshd_server.spawn(tenant_key[0], "echo $$; exec sleep 301")
    try:
        shell = int(read_line(session))
        marks = {orphan: starttime_of(orphan), shell: starttime_of(shell)}
        monitors = [e.pid for e in plan(user.pw_name, user.pw_uid, base, protect={os.getpid()})
                    if e.rule == SSH_SESSION and e.uid == 0]  # the session's `sshd: USER [priv]`
        removed = keys.remove(user.pw_name, "r-1")
        ended = end_sessions(user.pw_name, base, protect={os.getpid()})
        session.wait(10)  # the client sees its session closed
        rules = {e.pid: e.rule for e in ended}
        assert (1, NEW_PROCESS, SSH_SESSION, 1, SSH_SESSION) == (
            removed, rules.get(orphan), rules.get(shell), len(monitors), rules.get(monitors[0]))
        assert (True, False, False) == (all(gone(pid, start) for pid, start in marks.items()),
                                        sshd_server.pid in rules, gone(sshd_server.pid))  # the listener stays
        again = login(sshd_server, tenant_key[0])
        assert (255, True) == (again.returncode, "Permission denied" in again.stderr)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(5)


@pytest.mark.slow
def test_an_entry_past_its_expiry_time_is_refused_by_sshd_while_still_in_the_file(sshd_server, tenant_key):
    keys = KeysDir(sshd_server.keys_dir)
    expires = (now_ms() // 1000 + 3) * 1000
    keys.install(sshd_server.user, "r-1", [key_of(tenant_key[1])], expires)
    first = login(sshd_server, tenant_key[0])
    wait_for(lambda: time.time() * 1000 > expires + 1500, 10, "the expiry to pass")
    second = login(sshd_server, tenant_key[0])
    assert ((0, 255), ["r-1"], True) == (
        (first.returncode, second.returncode), [e.reservation_id for e in keys.listed(sshd_server.user)],
        "entry expired" in sshd_server.log_text()), second.stderr


def test_two_reservations_lines_in_one_file_are_kept_apart(sshd_server, tmp_path):
    keys = KeysDir(sshd_server.keys_dir)
    (a_priv, a_pub), (b_priv, b_pub) = make_key(tmp_path / "a"), make_key(tmp_path / "b")
    keys.install(sshd_server.user, "r-a", [key_of(a_pub)], now_ms() + HOUR_MS)
    keys.install(sshd_server.user, "r-b", [key_of(b_pub)], now_ms() + 2 * HOUR_MS)
    both = (login(sshd_server, a_priv).returncode, login(sshd_server, b_priv).returncode)
    keys.remove(sshd_server.user, "r-a")
    after = (login(sshd_server, a_priv).returncode, login(sshd_server, b_priv).returncode)
    assert ((0, 0), (255, 0), [("r-b", key_of(b_pub).blob)]) == (
        both, after, [(e.reservation_id, e.key.blob) for e in keys.listed(sshd_server.user)])


def test_the_host_key_fingerprints_equal_what_ssh_keygen_prints(sshd_server):
    expected = sorted(keygen_fingerprint(p) for p in sshd_server.host_keys)
    endpoint = ssh_endpoint(sshd_server.user, endpoint=f"{sshd_server.host}:{sshd_server.port}",
                            host_keys=sshd_server.host_keys_glob)
    assert {"host": sshd_server.host, "port": sshd_server.port, "user": sshd_server.user,
            "hostKeys": expected} == endpoint.wire()
    assert 3 == len(expected)


def test_the_key_file_is_readable_by_sshd_as_the_user_and_by_no_one_else(sshd_server, tenant_key):
    """sshd opens the file with the user's privileges: root:<user's group> 0640 in a 0711 directory."""
    KeysDir(sshd_server.keys_dir).install(sshd_server.user, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    f = os.stat(sshd_server.keys_dir / sshd_server.user)
    user = pwd.getpwnam(sshd_server.user)
    assert ((0, user.pw_gid, 0o640), 0o711) == ((f.st_uid, f.st_gid, stat.S_IMODE(f.st_mode)),
                                                stat.S_IMODE(os.stat(sshd_server.keys_dir).st_mode))


def test_the_ended_processes_are_reported_with_pid_comm_and_rule(sshd_server, tenant_key):
    user = pwd.getpwnam(sshd_server.user)
    base = baseline(user.pw_uid)
    KeysDir(sshd_server.keys_dir).install(user.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    session = sshd_server.spawn(tenant_key[0], "echo $$; exec sleep 302")
    try:
        shell = int(read_line(session))
        ended = end_sessions(user.pw_name, base, protect={os.getpid()})
        session.wait(10)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(5)
    comms = {e.comm for e in ended}
    assert (True, True, True, {SSH_SESSION}) == (
        shell in {e.pid for e in ended}, "sleep" in comms, bool(comms - {"sleep"}) and comms - {"sleep"} <= SSHD_COMMS,
        {e.rule for e in ended})  # sshd (OpenSSH < 9.8) or sshd-session, and the session's sleep
    assert all(isinstance(e, Ended) and e.starttime > 0 for e in ended)


# -- notice: a message to the user's login sessions ------------------------------------------------------------


def drain(fd: int, timeout: float = 5.0, until: bytes = b"***\r\n") -> bytes:
    """What arrives on a pty master within timeout (until `until` is seen)."""
    import select
    got = b""
    deadline = time.monotonic() + timeout
    while until not in got and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        got += os.read(fd, 4096)
    return got


def test_the_ending_message_reaches_roots_session_terminal_named_by_its_sshd_title(tree):
    master, slave = os.openpty()
    try:
        name = os.ttyname(slave)  # /dev/pts/N, a real pty owned by root (this process)
        n = name.rsplit("/", 1)[1]
        tree.add(300, comm="sshd-session", uid=0, title=f"sshd-session: root@pts/{n}")
        tree.add(301, comm="sshd-session", uid=0, title="sshd-session: bob@pts/999")  # another user's
        text = notice.ending_message("rsv-1", "2026-12-03T12:00:00.000Z", 30)
        assert [Path(name)] == notice.tell("root", 0, text, proc=tree.root)
        got = drain(master).decode()
        assert "reservation rsv-1 ends at 2026-12-03T12:00:00.000Z (in 30 min)" in got and "extend rsv-1" in got
    finally:
        os.close(master)
        os.close(slave)


def test_a_pty_of_another_user_is_never_written_even_when_a_title_names_it(tree, tenant_user):
    master, slave = os.openpty()  # owned by root, not by the tenant user
    try:
        n = os.ttyname(slave).rsplit("/", 1)[1]
        tree.add(300, comm="sshd", uid=0, title=f"sshd: {tenant_user.pw_name}@pts/{n}")
        assert [] == notice.tell(tenant_user.pw_name, tenant_user.pw_uid, "x", proc=tree.root)
        assert b"" == drain(master, timeout=0.2)
    finally:
        os.close(master)
        os.close(slave)


def test_the_message_reaches_a_real_ssh_login_terminal(sshd_server, tenant_key):
    user = pwd.getpwnam(sshd_server.user)
    KeysDir(sshd_server.keys_dir).install(user.pw_name, "r-1", [key_of(tenant_key[1])], now_ms() + HOUR_MS)
    command = sshd_server.ssh_command(tenant_key[0], "tty; exec sleep 60")
    command.insert(1, "-tt")  # a login with a terminal, as a tenant's interactive session has
    session = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        lines = []  # sshd may first say that the user has no home
        while len(lines) < 3 and not (lines and lines[-1].startswith("/dev/pts/")):
            lines.append(session.stdout.readline().decode().strip())
        tty = lines[-1]
        assert tty.startswith("/dev/pts/"), lines
        text = notice.ending_message("rsv-9", "2026-12-03T12:00:00.000Z", 29)
        assert [Path(tty)] == notice.tell(user.pw_name, user.pw_uid, text)
        got = drain(session.stdout.fileno()).decode()
        assert "*** Berth: reservation rsv-9 ends at 2026-12-03T12:00:00.000Z (in 29 min)" in got, got
    finally:
        session.kill()
        session.wait(5)
