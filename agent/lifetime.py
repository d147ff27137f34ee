"""What a workload can read about its reservation's end: one file per bound hold reservation on this node.

`<state-dir>/reservations/<reservation id>/end.json` (the directory 0755, the
file 0644; `berth exec` names it in `BERTH_END_FILE`):

    {"reservationId": "rsv-...", "end": "2026-12-03T12:00:00.000Z", "endMs": 1796299200000,
     "warningAt": "2026-12-03T11:30:00.000Z", "warningAtMs": 1796297400000, "ending": false}

`ending` turns true when the control plane emits `reservation.ending` for this
end (the pool's `endingWarningMinutes` before it); an extension moves `end`
and `warningAt` and turns it false again. `warningAt` is null where the pool
gives no warning. Each change is a new file renamed over the old one, so a
reader never sees half a file and an inotify watch on the directory
(IN_MOVED_TO) or a poll of the file's mtime sees every change. The directory
goes when the reservation is unbound here. The files are rewritten from the
wanted set after every pass, so they survive an agent restart.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import structlog

from common.nodewire import Binding
from common.times import iso

log = structlog.get_logger("berth.agent")

DIR = "reservations"
END_FILE = "end.json"


def end_file(state_dir: Path | str, reservation_id: str) -> Path:
    return Path(state_dir) / DIR / reservation_id / END_FILE


def environment(state_dir: Path | str, reservation_id: str) -> dict[str, str]:
    """What `berth exec` adds to a command's environment: the reservation and its end file."""
    return {"BERTH_RESERVATION_ID": reservation_id, "BERTH_END_FILE": str(end_file(state_dir, reservation_id))}


def document(b: Binding) -> dict:
    return {"reservationId": b.reservationId, "end": iso(b.end), "endMs": b.end,
            "warningAt": iso(b.endingAt) if b.endingAt else None, "warningAtMs": b.endingAt or None,
            "ending": b.ending}


class Lifetimes:
    """Keeps one end.json per bound hold reservation, written only when its content changes."""

    def __init__(self, state_dir: Path | str) -> None:
        self.root = Path(state_dir) / DIR
        self._written: dict[str, dict] = {}

    def sync(self, bound: Iterable[Binding]) -> None:
        """`bound`: the hold bindings made on this node now; the others' files go."""
        wanted = {b.reservationId: document(b) for b in bound}
        try:
            self.root.mkdir(mode=0o755, exist_ok=True)
            for rid, doc in wanted.items():
                if self._written.get(rid) != doc:
                    self._write(rid, doc)
            for entry in self.root.iterdir():
                if entry.name not in wanted:
                    shutil.rmtree(entry, ignore_errors=True)
                    self._written.pop(entry.name, None)
        except OSError as exc:  # a full disk must not stop binding: the workload loses a notice, not its devices
            log.warning("reservation end files not written", error=str(exc), path=str(self.root))

    def _write(self, rid: str, doc: dict) -> None:
        d = self.root / rid
        d.mkdir(mode=0o755, exist_ok=True)
        tmp = d / f".{END_FILE}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, d / END_FILE)
        if doc["ending"] and not self._written.get(rid, {}).get("ending"):
            log.info("reservation ending", reservation_id=rid, end=doc["end"])
        self._written[rid] = doc
