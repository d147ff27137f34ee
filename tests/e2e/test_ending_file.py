"""The workload's view of its reservation's end on a real agent: the end file of a hold binding, turned to
`ending` when the control plane emits reservation.ending, moved by an extension, gone at release; and `berth
exec` naming it in the command's environment."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent.lifetime import end_file
from tests.e2e.conftest import H100_TOKEN, REPO, SYSTEM_PYTHON, ControlPlane, bootstrap_doc
from tests.waiting import wait_for

pytestmark = pytest.mark.kernel
FAST = ["--watch-timeout-ms", "1500", "--request-timeout-seconds", "1.5", "--reconcile-seconds", "3600"]
WARNING_MIN = 90  # longer than the booking: the warning is due as soon as it is active


@pytest.fixture
def cp(workdir):
    doc = bootstrap_doc()
    doc["pools"][0]["policy"] = {"endingWarningMinutes": WARNING_MIN}
    plane = ControlPlane(workdir, grace_s=30, bootstrap=doc).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def reachable_dir():
    """A directory the workload user can traverse, as /var/lib/berth is (pytest's own temporary root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="berth-ending-"))
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read(path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_hold_workload_sees_its_end_the_warning_and_an_extension(cp, agents, bpf_works, reachable_dir):
    a = agents("e", cp.url, H100_TOKEN, extra=FAST, state_dir=reachable_dir / "state")
    a.wait_event("reconciled")
    rid = cp.create(gpuCount=1, durationHours=1)["id"]
    res = cp.wait_state(rid, "active", timeout=3)
    path = end_file(a.state_dir, rid)
    wait_for(lambda: (read(path) or {}).get("ending"), 5, what="end.json to say ending")
    doc = read(path)
    end = res["end"]
    assert (rid, end, end - WARNING_MIN * 60_000, True) == (doc["reservationId"], doc["endMs"], doc["warningAtMs"],
                                                         doc["ending"])
    assert doc["end"].endswith("Z") and 0o644 == path.stat().st_mode & 0o777
    _, events = cp.post("/api/compute/events/list", {"limit": 500})
    assert ["reservation.ending"] == [e["type"] for e in events["events"]
                                      if e["reservationId"] == rid and e["type"] == "reservation.ending"]

    probe = "import os; p = os.environ['BERTH_END_FILE']; print(os.environ['BERTH_RESERVATION_ID'], p, open(p).read())"
    out = subprocess.run([sys.executable, "-m", "berth", "exec", "--state-dir", str(a.state_dir), rid, "--",
                          SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=20, cwd=str(REPO))
    assert 0 == out.returncode, out.stderr
    seen_rid, seen_path, body = out.stdout.split(" ", 2)
    assert (rid, str(path), True) == (seen_rid, seen_path, json.loads(body)["ending"])

    # two more hours: the new end is beyond the warning time, so the file says not ending, with the new end
    cp.call("extend", {"reservationId": rid, "by": 2 * 3_600_000})
    wait_for(lambda: (read(path) or {}).get("endMs") == end + 2 * 3_600_000, 5, what="end.json to move")
    assert (False, end + 2 * 3_600_000 - WARNING_MIN * 60_000) == (read(path)["ending"], read(path)["warningAtMs"])

    cp.release(rid)
    wait_for(lambda: not path.parent.exists(), 5, what="the end file removed after release")
