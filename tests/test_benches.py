"""Every bench under bench/ runs to its figures: each one, at the smallest size it takes, ends without a
traceback and prints its last line of figures.

The benches measure what tests do not (they print ratios, and are read by people), so nothing else runs them,
and two of them had stopped working unnoticed: bench/booked_devices.py passed the store's statement the
parameters of an older shape, and bench/fleet.py's create lacked the Content-Type the body reader requires.
These runs check that each still works, not its figures: at these sizes a ratio is noise, so a bench that exits
1 for a target it missed passes here once it printed the line that says so.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cgroups import host
from tests.pgcluster import binaries

ROOT = Path(__file__).resolve().parent.parent
NOT_ROOT = os.geteuid() != 0

# (the bench and its smallest arguments, what it needs, a pattern of its last line, whether it has targets that
# make it exit 1 when missed)
BENCHES = [
    (["bench/bind.py", "--count", "20"], "root cgroup2", r"^apply median, first 10 .* ratio \d", False),
    (["bench/discovery.py", "--runs", "2"], "", r"^stand-in libnvidia-ml\.so\.1 via pynvml +8 +56 ", False),
    (["bench/reconciler.py", "--live", "500", "--changes", "20"], "", r"^cost ratio 500 live / 20 live: ", True),
    (["bench/create_throughput.py", "--seconds", "0.5", "--prefill", "200", "--latency-seconds", "0.5"], "",
     r"^latency ratio full/empty: [\d.]+x", True),
    (["bench/fleet.py", "--agents", "5", "--creates", "3", "--idle-seconds", "0.5", "--real-seconds", "0.5"], "",
     r"^real agent idle CPU +\d", False),
    (["bench/booked_devices.py", "--bookings", "240"], "pg", r"^schema \d+ +[\d.]+ us per booking", False),
    (["bench/replicas.py", "--seconds", "0.5", "--rounds", "1", "--watches", "1"], "pg",
     r"^one replica / baseline: [\d.]+x .*two replicas errors: 0 ", True),
    (["bench/replica_stalls.py", "--fill-seconds", "0.5", "--times", "1"], "pg",
     r"^both replicas rebuilding at once: ", False),
    (["bench/ab.py", str(ROOT), str(ROOT), "--pairs", "1", "--seconds", "0.5"], "pg", r"^B +[\d,]+ +\d+ ", False),
    (["bench/token_flood.py", "--seconds", "0.5", "--rounds", "1"], "pg",
     r"^with the flood / alone, median of 1: postgresql [\d.]+x, sqlite [\d.]+x ", False),
    (["bench/rebuild.py", "--ended", "2000", "--live", "20", "--rounds", "1"], "pg",
     r"^rebuild reads / every reservation read once, with 2,000 ended and 20 live: sqlite [\d.]+x, postgresql ", False),
    (["bench/create_cost.py", "--creates", "60", "--connections", "6"], "pg valgrind",
     r"^\(per create, in the server's process; 60 creates", False),
]


def _missing(needs: str) -> str | None:
    for need in needs.split():
        if need == "root" and NOT_ROOT:
            return "needs root"
        if need == "cgroup2" and host.cgroup2_mount() is None:
            return "needs cgroup2 mounted"
        if need == "pg" and (NOT_ROOT or binaries() is None):
            return "needs root and PostgreSQL (apt-get install postgresql)"
        if need == "valgrind" and shutil.which("callgrind_control") is None:
            return "needs valgrind (apt-get install valgrind)"
    return None


@pytest.mark.parametrize("argv,needs,last_line,has_targets", BENCHES, ids=[b[0][0] for b in BENCHES])
def test_the_bench_runs_to_its_figures(argv, needs, last_line, has_targets):
    missing = _missing(needs)
    if missing:
        pytest.skip(missing)
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    printed = out.stdout + out.stderr
    assert "Traceback" not in printed, printed[-4000:]
    assert out.returncode in ((0, 1) if has_targets else (0,)), printed[-4000:]
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines and re.search(last_line, lines[-1]), printed[-4000:]
