"""agent.lifetime: the end.json files hold workloads read, on a real directory."""
from __future__ import annotations

import json

from agent.lifetime import Lifetimes, end_file, environment
from common.nodewire import Binding

END = 1_796_299_200_000


def binding(rid: str = "rsv-a", end: int = END, warn_min: int = 30, ending: bool = False) -> Binding:
    return Binding(reservationId=rid, kind="hold", tenantId="acme", principalId="alice", start=END - 3_600_000,
                   end=end, endingAt=end - warn_min * 60_000 if warn_min else 0, ending=ending)


def test_one_file_per_binding_rewritten_only_when_it_changes_and_removed_when_unbound(tmp_path):
    files = Lifetimes(tmp_path)
    files.sync([binding(), binding("rsv-b", warn_min=0)])
    a, b = end_file(tmp_path, "rsv-a"), end_file(tmp_path, "rsv-b")
    assert {"reservationId": "rsv-a", "end": "2026-12-03T12:00:00.000Z", "endMs": END,
            "warningAt": "2026-12-03T11:30:00.000Z", "warningAtMs": END - 1_800_000, "ending": False} == json.loads(
        a.read_text())
    assert (None, None) == (json.loads(b.read_text())["warningAt"], json.loads(b.read_text())["warningAtMs"])
    inode = a.stat().st_ino
    files.sync([binding(), binding("rsv-b", warn_min=0)])
    assert inode == a.stat().st_ino  # unchanged: not rewritten
    files.sync([binding(ending=True)])
    assert json.loads(a.read_text())["ending"] and inode != a.stat().st_ino  # a new file renamed over the old
    assert not b.parent.exists() and [] == [p.name for p in a.parent.iterdir() if p.name != "end.json"]


def test_an_unwritable_directory_is_logged_and_binding_goes_on(tmp_path):
    (tmp_path / "reservations").write_text("not a directory")
    Lifetimes(tmp_path).sync([binding()])  # no exception


def test_exec_names_the_reservation_and_its_file(tmp_path):
    assert {"BERTH_RESERVATION_ID": "rsv-a", "BERTH_END_FILE": str(tmp_path / "reservations/rsv-a/end.json")} == \
        environment(tmp_path, "rsv-a")
