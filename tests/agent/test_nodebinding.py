"""agent.nodebinding against a real sshd (in a network namespace) and the real ssh client: a node binding handed
over (keys valid until the window's end, the ssh endpoint and host keys reported), used (a login and a
long-running process), and taken back (session closed, process gone, new logins refused, scratch emptied, the
node checked against its inventory at the hand-over)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import msgspec
import pytest

from agent.discovery import Discovery
from agent.host import KernelHost
from agent.nodebinding import RECORDS_FILE, NodeBindings, TenantRootConfig, wipe
from agent.simulate import SimulatedGpus, SimulatedHost
from common.inventory import Inventory, MigMode, differences
from common.nodewire import Binding
from tests.agent.test_tenantroot import keygen_fingerprint, login, make_key
from tests.e2e.sshd import gone, read_line, sshd_server, starttime_of, tenant_user  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
HOUR_MS = 3_600_000


def discovered(topology: str = "h100x8.json") -> Inventory:
    gpus = SimulatedGpus(ROOT / "examples" / "topologies" / topology)
    return Discovery(gpus=gpus, host=SimulatedHost(gpus, fallback=KernelHost())).discover()


def node_binding(rid: str, pub: Path, user: str, end: int, cleaning: str = "inband") -> Binding:
    return Binding(reservationId=rid, kind="node", tenantId="acme", principalId="alice", start=end - HOUR_MS,
                   end=end, sshKeys=(pub.read_text().strip(),), user=user, cleaning=cleaning)


@pytest.fixture
def tenant_key(tmp_path):
    return make_key(tmp_path / "tenant")


@pytest.fixture
def handover(tmp_path, sshd_server):
    """NodeBindings over the test sshd's keys directory, host keys and address; `after` is what the next
    discovery finds (the recorded inventory unless a test changes it)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    inv = discovered()
    box = {"after": inv}
    nodes = NodeBindings(state, TenantRootConfig(keys_dir=str(sshd_server.keys_dir),
                                                 host_keys=sshd_server.host_keys_glob,
                                                 endpoint=f"{sshd_server.host}:{sshd_server.port}",
                                                 scratch=(str(scratch),)),
                         inventory=lambda: inv, rediscover=lambda: box["after"], simulated_hugepages=True)
    nodes.box, nodes.scratch_dir, nodes.state_path = box, scratch, state
    return nodes


def test_a_node_is_handed_over_used_over_ssh_and_taken_back_clean(handover, sshd_server, tenant_key):
    end = int(time.time() * 1000) + HOUR_MS
    wanted = [node_binding("rsv-n1", tenant_key[1], sshd_server.user, end)]
    [bound] = handover.reconcile(wanted)
    assert ("bound", end) == (bound.status, bound.end)
    fingerprints = sorted(keygen_fingerprint(p) for p in sshd_server.host_keys)
    assert (sshd_server.host, sshd_server.port, sshd_server.user, fingerprints) == (
        bound.ssh.host, bound.ssh.port, bound.ssh.user, sorted(bound.ssh.hostKeys))
    assert [] == handover.reconcile(wanted)  # already handed over: nothing to report
    assert "rsv-n1" in json.loads((handover.state_path / RECORDS_FILE).read_text())  # a restart knows it

    out = login(sshd_server, tenant_key[0])
    assert (0, sshd_server.user) == (out.returncode, out.stdout.strip()), out.stderr
    session = sshd_server.spawn(tenant_key[0], "echo $$; exec sleep 300")
    (handover.scratch_dir / "dataset").mkdir()
    (handover.scratch_dir / "dataset" / "part-0").write_text("tenant data")
    try:
        shell = int(read_line(session))
        mark = starttime_of(shell)
        reports = handover.reconcile([])  # released: no longer wanted here
        assert ["unbound"] == [r.status for r in reports]  # sent first: the node shows `cleaning` while emptied
        session.wait(10)  # the tenant's session was closed
        assert gone(shell, mark)
        again = login(sshd_server, tenant_key[0])
        assert (255, True) == (again.returncode, "Permission denied" in again.stderr)
        assert ["dataset"] == [p.name for p in handover.scratch_dir.iterdir()]  # not emptied yet
        [cleaned] = handover.clean_handed_back()
        assert ("cleaned", True, ()) == (cleaned.status, cleaned.clean.ok, cleaned.clean.differences)
        assert [] == list(handover.scratch_dir.iterdir())
        # the record stays until the reports are kept (the agent's checkpoint): killed now, an agent hands the
        # node back again (idempotent steps), so the hand-back, and a redfish reset after it, is never lost
        assert "rsv-n1" in json.loads((handover.state_path / RECORDS_FILE).read_text())
        assert [] == handover.reconcile([])  # in this agent: reported once
        restarted = NodeBindings(handover.state_path, handover.config, inventory=handover.inventory,
                                 rediscover=handover.rediscover, simulated_hugepages=True)
        assert ["unbound"] == [r.status for r in restarted.reconcile([])]
        assert ["cleaned"] == [r.status for r in restarted.clean_handed_back()]
        restarted.forget_handed_back()
        assert {} == json.loads((handover.state_path / RECORDS_FILE).read_text())
        assert [] == NodeBindings(handover.state_path, handover.config, inventory=handover.inventory,
                                  rediscover=handover.rediscover, simulated_hugepages=True).reconcile([])
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(5)


def test_an_extension_moves_the_keys_expiry_and_reports_the_new_end(handover, sshd_server, tenant_key):
    end = int(time.time() * 1000) + HOUR_MS
    handover.reconcile([node_binding("rsv-n2", tenant_key[1], sshd_server.user, end)])
    [again] = handover.reconcile([node_binding("rsv-n2", tenant_key[1], sshd_server.user, end + HOUR_MS)])
    assert ("bound", end + HOUR_MS) == (again.status, again.end)
    [entry] = handover.keys.listed(sshd_server.user)
    assert (end + HOUR_MS) // 1000 * 1000 == entry.expires_at_ms
    handover.reconcile([])


def test_a_hand_over_the_control_plane_never_heard_is_reported_again_with_its_keys_in_place(
        handover, sshd_server, tenant_key):
    """An agent killed between recording a hand-over and sending its `bound` (here: before the keys even went in)
    came back to a record it never reported: the reservation stayed binding for good, the tenant logging in
    unbilled. The control plane now says it has not heard `bound` (awaitingBound), and the holder reports again,
    the keys installed first (idempotent)."""
    end = int(time.time() * 1000) + HOUR_MS
    wanted = node_binding("rsv-n6", tenant_key[1], sshd_server.user, end)
    [bound] = handover.reconcile([wanted])
    assert "bound" == bound.status
    handover.keys.remove(sshd_server.user, "rsv-n6")  # as if killed after the record, before the keys
    restarted = NodeBindings(handover.state_path, handover.config, inventory=handover.inventory,
                             rediscover=handover.rediscover, simulated_hugepages=True)
    assert [] == restarted.reconcile([wanted])  # the control plane heard it (or does not say): nothing
    awaiting = msgspec.structs.replace(wanted, awaitingBound=True)
    [again] = restarted.reconcile([awaiting])
    assert ("bound", end, sshd_server.user) == (again.status, again.end, again.ssh.user)
    assert [end // 1000 * 1000] == [e.expires_at_ms for e in restarted.keys.listed(sshd_server.user)]
    out = login(sshd_server, tenant_key[0])
    assert 0 == out.returncode, out.stderr
    restarted.reconcile([])
    restarted.clean_handed_back()
    restarted.forget_handed_back()


def test_the_next_tenant_gets_the_node_only_after_the_last_ones_hand_back_and_cleaning(handover, sshd_server,
                                                                                        tenant_key):
    """An agent down past a turnaround found, in one pass, the last tenant's hand-back and the next one's
    hand-over to do: it handed over first and cleaned after, the new tenant logged in before the scratch was
    emptied. A hand-over now waits for the pass after the hand-back and its cleaning."""
    end = int(time.time() * 1000) + HOUR_MS
    handover.reconcile([node_binding("rsv-a", tenant_key[1], sshd_server.user, end)])
    (handover.scratch_dir / "left-by-a").write_text("secret")
    nxt = [node_binding("rsv-b", tenant_key[1], sshd_server.user, end + HOUR_MS)]
    reports = handover.reconcile(nxt)  # a gone, b wanted, in one pass
    assert [("rsv-a", "unbound")] == [(r.reservationId, r.status) for r in reports] and handover.deferred
    assert "rsv-b" not in handover.records
    [cleaned] = handover.clean_handed_back()
    assert ("cleaned", True) == (cleaned.status, cleaned.clean.ok) and not list(handover.scratch_dir.iterdir())
    handover.forget_handed_back()
    [bound] = handover.reconcile(nxt)
    assert ("rsv-b", "bound") == (bound.reservationId, bound.status) and not handover.deferred
    handover.reconcile([])
    handover.clean_handed_back()
    handover.forget_handed_back()


def test_a_node_not_clean_is_handed_to_no_one_until_a_cleaning_passes_even_across_a_restart(handover, sshd_server,
                                                                                            tenant_key):
    end = int(time.time() * 1000) + HOUR_MS
    handover.reconcile([node_binding("rsv-c", tenant_key[1], sshd_server.user, end)])
    recorded = handover.inventory()
    handover.box["after"] = msgspec.structs.replace(recorded, gpus=recorded.gpus[1:])  # a GPU off the bus
    handover.reconcile([])
    [report] = handover.clean_handed_back()
    handover.forget_handed_back()
    assert not report.clean.ok
    restarted = NodeBindings(handover.state_path, handover.config, inventory=handover.inventory,
                             rediscover=handover.rediscover, simulated_hugepages=True)
    [refused] = restarted.reconcile([node_binding("rsv-d", tenant_key[1], sshd_server.user, end + HOUR_MS)])
    assert ("failed", True) == (refused.status, "not clean since reservation rsv-c ended" in refused.message), refused
    assert "berth admin nodes clear" in refused.message and not restarted.keys.listed(sshd_server.user)
    restarted.reconcile([])  # no longer wanted: forgotten
    handover.box["after"] = recorded  # an operator mended it
    [bound] = restarted.reconcile([node_binding("rsv-e", tenant_key[1], sshd_server.user, end + HOUR_MS)])
    assert "bound" == bound.status and restarted.not_clean is None
    assert not (handover.state_path / "node-not-clean.json").exists()
    restarted.reconcile([])
    restarted.clean_handed_back()
    restarted.forget_handed_back()


def test_a_node_the_control_plane_took_out_and_put_back_goes_to_the_next_tenant_though_it_changed(
        handover, sshd_server, tenant_key):
    """A node mended and cleared by an operator (a driver upgraded while mending) was refused to every tenant for
    good: the re-check compared it with the last tenant's record. The control plane's word (its node state, on
    each heartbeat's answer) decides: out of placement (maintenance) and back (clear), the mark goes."""
    end = int(time.time() * 1000) + HOUR_MS
    handover.reconcile([node_binding("rsv-m1", tenant_key[1], sshd_server.user, end)])
    recorded = handover.inventory()
    handover.box["after"] = msgspec.structs.replace(recorded, gpus=recorded.gpus[1:])
    handover.reconcile([])
    [report] = handover.clean_handed_back()
    handover.forget_handed_back()
    assert not report.clean.ok
    handover.heard_node_state("ready")  # (a heartbeat answered before the cleaned report was heard: nothing)
    assert handover.not_clean is not None
    handover.heard_node_state("maintenance")
    restarted = NodeBindings(handover.state_path, handover.config, inventory=handover.inventory,
                             rediscover=handover.rediscover, simulated_hugepages=True)
    assert restarted.not_clean is not None and restarted.not_clean.outSeen  # kept across a restart
    restarted.heard_node_state("ready")  # the operator mended (differently) and cleared it
    assert restarted.not_clean is None and not (handover.state_path / "node-not-clean.json").exists()
    [bound] = restarted.reconcile([node_binding("rsv-m2", tenant_key[1], sshd_server.user, end + HOUR_MS)])
    assert "bound" == bound.status  # no re-check against the last tenant's record any more
    restarted.reconcile([])
    restarted.clean_handed_back()
    restarted.forget_handed_back()


def test_with_redfish_cleaning_the_next_tenant_waits_for_the_nodes_reset_another_boot(handover, sshd_server,
                                                                                      tenant_key):
    """cleaning: redfish is the control plane's BMC reset after it hears `unbound`: the agent handed the next
    tenant the node in the same pass as the hand-back (and the reset then came under that tenant). A hand-over now
    waits for another boot than the hand-back's, across a restart too."""
    end = int(time.time() * 1000) + HOUR_MS
    handover.reconcile([node_binding("rsv-r1", tenant_key[1], sshd_server.user, end, cleaning="redfish")])
    nxt = [node_binding("rsv-r2", tenant_key[1], sshd_server.user, end + HOUR_MS, cleaning="redfish")]
    assert [("rsv-r1", "unbound")] == [(r.reservationId, r.status) for r in handover.reconcile(nxt)]
    handover.forget_handed_back()
    assert [] == handover.reconcile(nxt) and handover.deferred  # the same boot: no reset yet
    assert not handover.keys.listed(sshd_server.user)
    before = handover.inventory()
    rebooted = msgspec.structs.replace(before, bootId="0" * 32 if before.bootId != "0" * 32 else "1" * 32)
    restarted = NodeBindings(handover.state_path, handover.config, inventory=lambda: rebooted,
                             rediscover=lambda: rebooted, simulated_hugepages=True)
    [bound] = restarted.reconcile(nxt)  # the agent of the new boot hands it over
    assert ("rsv-r2", "bound") == (bound.reservationId, bound.status) and restarted.not_clean is None
    restarted.reconcile([])
    restarted.forget_handed_back()


def test_a_damaged_record_file_stops_the_agent_naming_the_file_and_what_to_do(tmp_path):
    from agent.nodebinding import NodeRecordsError

    (tmp_path / RECORDS_FILE).write_text('{"rsv-x": {"user": "ten')
    with pytest.raises(NodeRecordsError) as err:
        NodeBindings(tmp_path, TenantRootConfig(keys_dir=str(tmp_path / "keys")), inventory=lambda: None,
                     rediscover=discovered)
    assert str(tmp_path / RECORDS_FILE) in str(err.value) and "Restore it from a backup" in str(err.value)


def test_a_node_left_changed_is_not_clean_and_says_how(handover, sshd_server, tenant_key):
    end = int(time.time() * 1000) + HOUR_MS
    handover.reset_gpus = lambda recorded: ["GPU 3: power limit not reset: no permission"]
    handover.reconcile([node_binding("rsv-n3", tenant_key[1], sshd_server.user, end)])
    before = handover.inventory()
    # the tenant left a GPU off the bus, and another in MIG mode
    gpus = list(before.gpus)
    assert gpus[1].migMode is not None and not gpus[1].migMode.current
    left = msgspec.structs.replace(gpus[1], migMode=MigMode(current=True, pending=True))
    handover.box["after"] = msgspec.structs.replace(before, gpus=(left, *gpus[2:]))
    handover.reconcile([])
    [report] = handover.clean_handed_back()
    clean = report.clean
    assert ("cleaned", False) == (report.status, clean.ok)
    assert any(f"gpus[{gpus[0].uuid}] removed" in d for d in clean.differences), clean.differences
    assert "GPU 3: power limit not reset: no permission" in clean.differences  # what the reset hook said
    assert f"gpus[{gpus[1].uuid}].migMode.current: False -> True" in clean.differences


def test_a_hand_over_that_cannot_install_the_keys_fails_once_and_records_nothing(handover, sshd_server, tenant_key):
    end = int(time.time() * 1000) + HOUR_MS
    [failed] = handover.reconcile([node_binding("rsv-n4", tenant_key[1], "no-such-user-xyz", end)])
    assert ("failed", True) == (failed.status, "no user 'no-such-user-xyz'" in failed.message)
    assert [] == handover.reconcile([node_binding("rsv-n4", tenant_key[1], "no-such-user-xyz", end)])
    assert "rsv-n4" not in handover.records
    handover.reconcile([])  # no longer wanted: the refusal is forgotten
    assert "rsv-n4" not in handover.states
    [over] = handover.reconcile([node_binding("rsv-n5", tenant_key[1], sshd_server.user, int(time.time() * 1000) - 1)])
    assert "failed" == over.status and "keys could not be installed" in over.message


def test_differences_ignore_the_boot_id_and_hostname_and_wipe_empties_a_directory(tmp_path):
    inv = discovered()
    assert [] == differences(inv, msgspec.structs.replace(inv, bootId="other", hostname="h2"))
    d = tmp_path / "s"
    (d / "a" / "b").mkdir(parents=True)
    (d / "f").write_text("x")
    os.symlink("/etc/passwd", d / "link")
    assert [] == wipe(d) and [] == list(d.iterdir()) and Path("/etc/passwd").exists()
    assert ["scratch path /nonexistent-berth is not a directory"] == wipe(Path("/nonexistent-berth"))


def test_the_ending_warning_reaches_the_tenants_login_terminal_once_per_end(handover, sshd_server, tenant_key):
    import select
    import subprocess
    end = int(time.time() * 1000) + HOUR_MS
    b = node_binding("rsv-n6", tenant_key[1], sshd_server.user, end)
    handover.reconcile([b])
    command = sshd_server.ssh_command(tenant_key[0], "tty; exec sleep 60")
    command.insert(1, "-tt")
    session = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.PIPE)
    try:
        lines = []
        while len(lines) < 3 and not (lines and lines[-1].startswith("/dev/pts/")):
            lines.append(session.stdout.readline().decode().strip())
        assert lines[-1].startswith("/dev/pts/"), lines
        handover.reconcile([msgspec.structs.replace(b, ending=True)])
        got = b""
        while b"--by 1h`. ***" not in got:  # the terminal turns each \n into \r\n
            ready, _, _ = select.select([session.stdout], [], [], 5)
            assert ready, got
            got += os.read(session.stdout.fileno(), 4096)
        assert "reservation rsv-n6 ends at" in got.decode() and "extend rsv-n6" in got.decode()
        assert end == handover.records["rsv-n6"].warned
        handover.reconcile([msgspec.structs.replace(b, ending=True)])  # told once for this end
        ready, _, _ = select.select([session.stdout], [], [], 0.3)
        assert not ready
    finally:
        session.kill()
        session.wait(5)
        handover.reconcile([])
