"""The agent's state directory: checkpoint (atomic, checksummed, versioned, void after a reboot), node identity
(mode 0600) and the lock that keeps a second agent off the same directory."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from common.nodewire import Report
from tests import smallfs
from agent.checkpoint import (CHECKPOINT_VERSION, BindingEntry, Checkpoint, CheckpointError, Identity,
                              StateDir, StateDirError, StateLocked, read_boot_id, write_atomic)

BOOT = "6f1c2a3e-0000-4000-8000-000000000001"
ROOT = "/sys/fs/cgroup/berth.slice/berth-workloads.scope/workloads"


def entry(rid: str, state: str = "completed") -> BindingEntry:
    return BindingEntry(reservationId=rid, state=state, spec="abc", cgroup=f"{ROOT}/rsv-{rid}", tenantId="acme",
                        principalId="alice", devices=["/dev/nvidia0"], updatedAtMs=1)


def saved(tmp_path: Path, **kw) -> Checkpoint:
    cp = Checkpoint.load(tmp_path / "checkpoint.json", boot_id=BOOT, cgroup_root=ROOT)
    for rid, state in kw.items():
        cp.set(entry(rid, state))
    cp.set_version(42)
    cp.queue_report(Report("r9", "unbound"))
    cp.save()
    return cp


def test_a_missing_checkpoint_is_a_fresh_start(tmp_path):
    cp = Checkpoint.load(tmp_path / "checkpoint.json", boot_id=BOOT, cgroup_root=ROOT)
    assert ({}, 0, []) == (cp.bindings, cp.data.resourceVersion, cp.data.pendingReports)
    assert "fresh start" in cp.note


def test_what_is_saved_loads_back_equal_and_the_file_is_private(tmp_path):
    cp = saved(tmp_path, r1="completed", r2="started")
    again = Checkpoint.load(tmp_path / "checkpoint.json", boot_id=BOOT, cgroup_root=ROOT)
    assert cp.data == again.data
    assert 0o600 == stat.S_IMODE((tmp_path / "checkpoint.json").stat().st_mode)
    doc = json.loads((tmp_path / "checkpoint.json").read_text())
    assert CHECKPOINT_VERSION == doc["version"] and doc["checksum"].startswith("sha256:")


def test_a_checkpoint_from_another_boot_keeps_what_the_control_plane_must_still_hear(tmp_path):
    """The cgroups died with the boot, not the reports owed: a release made while the host was down completed only
    if the restarted agent reports the binding unbound, so its entry and the unsent reports stay (the first pass
    makes the still wanted ones again); the resource version starts afresh, the node id stays."""
    cp = saved(tmp_path, r1="completed")
    cp.set(msgspec.structs.replace(entry("r2"), oomKills=3))
    cp.set(msgspec.structs.replace(entry("k1"), kind="kubernetes", cgroup=""))
    cp.queue_report(Report("r1", "bound"))  # of a cgroup the reboot killed: the first pass reports it made again
    cp.set_node("n1")
    cp.save()
    after = Checkpoint.load(tmp_path / "checkpoint.json", boot_id="another-boot", cgroup_root=ROOT)
    assert ({"r1", "r2"}, [Report("r9", "unbound")], 0, "n1") == (
        set(after.bindings), after.data.pendingReports, after.data.resourceVersion, after.data.nodeId)
    assert 0 == after.bindings["r2"].oomKills  # a new cgroup counts from 0
    assert "died with that boot" in after.note


@pytest.mark.parametrize("damage, message", [
    (lambda d: d["data"]["bindings"]["r1"].update(state="started"), "fails its checksum"),
    (lambda d: d.update(version=99), "checkpoint version 99"),
    (lambda d: d["data"].update(bindings="nonsense"), "Expected `object`"),
])
def test_a_damaged_checkpoint_fails_loudly_and_says_what_to_do(tmp_path, damage, message):
    saved(tmp_path, r1="completed")
    path = tmp_path / "checkpoint.json"
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as err:
        Checkpoint.load(path, boot_id=BOOT, cgroup_root=ROOT)
    assert message in str(err.value) and "move" in str(err.value)


def test_a_truncated_checkpoint_fails_loudly(tmp_path):
    saved(tmp_path, r1="completed")
    path = tmp_path / "checkpoint.json"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        Checkpoint.load(path, boot_id=BOOT, cgroup_root=ROOT)


def test_a_checkpoint_for_another_cgroup_root_contradicts_the_configuration(tmp_path):
    saved(tmp_path, r1="completed")
    with pytest.raises(CheckpointError, match=f"written for cgroup root {ROOT}"):
        Checkpoint.load(tmp_path / "checkpoint.json", boot_id=BOOT, cgroup_root="/sys/fs/cgroup/other")


def test_an_atomic_write_leaves_the_old_file_whole_when_it_fails(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    write_atomic(path, b"old")

    def boom(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        write_atomic(path, b"new")
    assert b"old" == path.read_bytes()
    assert ["f.json"] == sorted(p.name for p in tmp_path.iterdir()), "no temporary file left behind"


def test_reports_are_kept_latest_per_reservation_until_done(tmp_path):
    cp = Checkpoint.load(tmp_path / "c.json", boot_id=BOOT, cgroup_root=ROOT)
    cp.queue_report(Report("r1", "bound", cgroup="/x"))
    cp.queue_report(Report("r2", "failed", message="no"))
    cp.queue_report(Report("r1", "unbound"))
    assert [("r2", "failed"), ("r1", "unbound")] == [(r.reservationId, r.status) for r in cp.data.pendingReports]
    cp.reports_done({"r1"})
    assert ["r2"] == [r.reservationId for r in cp.data.pendingReports]


def test_the_boot_id_is_this_kernels():
    assert read_boot_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def test_the_node_identity_is_kept_with_mode_0600(tmp_path):
    with StateDir(tmp_path / "state") as sd:
        assert sd.read_identity() is None
        ident = Identity(nodeId="h100-n1", nodeToken="nt_secret", controlPlane="http://cp:8080", poolId="h100")
        sd.write_identity(ident)
        assert ident == sd.read_identity()
        assert 0o600 == stat.S_IMODE(sd.identity_path.stat().st_mode)
        assert 0o711 == stat.S_IMODE(sd.path.stat().st_mode)


def test_a_state_dir_the_agent_did_not_make_keeps_its_mode_and_one_others_may_write_is_refused(tmp_path):
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    with StateDir(own):
        pass
    assert 0o755 == stat.S_IMODE(own.stat().st_mode)  # an existing directory named by --state-dir: not changed
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # /tmp, say
    with pytest.raises(StateDirError, match=f"--state-dir {shared}: others may write to it"):
        StateDir(shared).open()
    assert (0o1777, []) == (stat.S_IMODE(shared.stat().st_mode), list(shared.iterdir()))  # nothing changed, no lock
    group = tmp_path / "group"  # a group's members, or another owner, could write there as well
    group.mkdir()
    os.chmod(group, 0o770)
    with pytest.raises(StateDirError, match=f"--state-dir {group}: its group may write to it"):
        StateDir(group).open()
    assert [] == list(group.iterdir())
    if os.geteuid() == 0:  # only root gives a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chmod(theirs, 0o700)
        os.chown(theirs, 1, -1)
        with pytest.raises(StateDirError, match=f"--state-dir {theirs}: it belongs to uid 1, not to the agent's 0"):
            StateDir(theirs).open()
        assert [] == list(theirs.iterdir())
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(StateDirError, match=f"--state-dir {afile}: is a file, not a directory"):
        StateDir(afile).open()
    with pytest.raises(StateDirError, match=f"--state-dir {afile / 'sub'}: cannot make it"):
        StateDir(afile / "sub").open()


HOLD = """
import sys, time
from agent.checkpoint import StateDir
sd = StateDir(sys.argv[1]).open()
print("held", flush=True)
time.sleep(30)
"""


def test_a_second_agent_on_the_same_state_dir_fails_clearly_naming_the_holder(tmp_path):
    state = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert "held" == holder.stdout.readline().strip()
        with pytest.raises(StateLocked) as err:
            StateDir(state).open()
        assert f"in use by another agent (pid {holder.pid})" in str(err.value)
    finally:
        holder.kill()
        holder.wait(5)
    with StateDir(state):  # once the holder is gone the lock is free again (flock dies with the process)
        pass


def test_entries_decode_strictly(tmp_path):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"reservationId": "r", "state": "halfway", "spec": "", "cgroup": ""}, BindingEntry)


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs of the test's own: a file system to fill or make read-only."""
    with smallfs.small_fs(tmp_path, "64k", mode="0711") as point:
        yield point


def test_a_state_directory_on_a_read_only_file_system_is_a_bad_option_naming_it(small_fs):
    """It was OSError [Errno 30] and exit 1, where a directory that cannot be made is exit 2 naming the flag."""
    (small_fs / "state").mkdir(mode=0o711)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(StateDirError, match=r"^--state-dir .*/state: cannot write its lock \(Read-only file system\)"):
        StateDir(small_fs / "state").open()


def test_a_full_state_directory_says_what_to_do_and_leaves_no_half_written_file(small_fs):
    """The agent exited with a bare `OSError: [Errno 28] No space left on device`, and the exec policy it writes at
    start left an empty exec-policy.tmp, so it could not start again once space was freed either."""
    from agent.execgate import ExecPolicy
    from agent.runtime import describe_error

    smallfs.fill(small_fs)
    with pytest.raises(OSError) as full:
        ExecPolicy.from_options(["1000"]).write(small_fs)
    assert [] == sorted(p.name for p in small_fs.iterdir() if p.name != "filler")
    said = describe_error(full.value, str(small_fs))
    assert "(No space left on device)" in said and f"--state-dir {small_fs}; free space there" in said, said
    assert said.startswith(f"cannot write {small_fs / 'exec-policy.json'} ("), said  # the file, not the directory
