"""The one slow test: on the real clock, a window starting 2 s from now is bound on time and released on time."""
from __future__ import annotations

import json
import time

import pytest

from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess
from tests.waiting import wait_for


@pytest.mark.slow
def test_binding_within_a_second_of_start_and_released_within_a_second_of_end(tmp_path, db_url):
    (tmp_path / "b.json").write_text(json.dumps(bootstrap_doc()))
    with ServerProcess(db_url, tmp_path / "b.json", ["--synchronous", "NORMAL"]) as server:
        start = int(time.time() * 1000) + 2000
        end = start + 2000
        status, doc = server.post("/api/compute/reservations/create", TOKENS["alice"],
                                  {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": start, "end": end})
        assert status == 202 and doc["reservation"]["state"] == "placed"
        rid = doc["reservation"]["id"]

        def state() -> str:
            return server.post("/api/compute/reservations/get", TOKENS["alice"], {"reservationId": rid})[1]["reservation"]["state"]

        wait_for(lambda: state() == "binding", timeout=4, interval=0.02)
        assert time.time() * 1000 - start < 1000
        wait_for(lambda: state() == "released", timeout=4, interval=0.02)
        assert time.time() * 1000 - end < 1000
