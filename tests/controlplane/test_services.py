"""The services without HTTP: commands in, results out, through the store port on a real SQLite file (fast)."""
from __future__ import annotations

import pytest

from controlplane.commands import Create, Extend, ListQuery
from controlplane.domain.admission import CreateRequest
from controlplane.domain.clock import FakeClock
from controlplane.domain.errors import DomainError
from controlplane.wiring import Config, ControlPlane
from tests.controlplane.conftest import HOUR, T0


@pytest.fixture
def cp(tmp_path, bootstrap_file):
    plane = ControlPlane(Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(), clock=FakeClock(T0),
                                synchronous="OFF", reconcile=False)).open()
    yield plane
    plane.close()


def create(key: str | None, fingerprint: str = "f1", **fields) -> Create:
    request = CreateRequest(**{"pool_id": "h100", "gpu_model": "H100_80GB", "gpu_count": 1, "duration_ms": HOUR,
                               **fields})
    return Create(request, fingerprint, key)


async def test_a_create_is_placed_charged_and_replayed_by_its_key(cp):
    alice = cp.catalog.current.principals["alice"]
    first = await cp.reservations.create(alice, create("k"))
    again = await cp.reservations.create(alice, create("k"))
    assert ("placed", first.reservation.id, first.operation.id) == (
        again.reservation.state, again.reservation.id, again.operation.id)
    assert {"gpu:H100_80GB": 1} == dict(cp.state.ledger.usage("acme"))
    with pytest.raises(DomainError) as refused:
        await cp.reservations.create(alice, create("k", fingerprint="another request"))
    assert ("CONFLICT", first.reservation.id) == (refused.value.code, refused.value.details["reservationId"])


async def test_a_refused_create_stores_a_denied_draft_and_charges_nothing(cp):
    robot = cp.catalog.current.principals["robot"]  # an agent acting for nobody; policy: agents at most 2 GPUs
    with pytest.raises(DomainError) as refused:
        await cp.reservations.create(robot, create("big", gpu_count=4))
    assert "ACCESS_DENIED" == refused.value.code
    assert {} == dict(cp.state.ledger.usage("acme"))
    with pytest.raises(DomainError) as again:
        await cp.reservations.create(robot, create("big", gpu_count=4))
    assert "ACCESS_DENIED" == again.value.code  # a refused key stays refused


async def test_release_extend_and_list_speak_commands(cp):
    alice = cp.catalog.current.principals["alice"]
    made = await cp.reservations.create(alice, create(None, start=T0 + HOUR, end=T0 + 2 * HOUR, duration_ms=None))
    extended = await cp.reservations.extend(alice, Extend(made.reservation.id, by_ms=HOUR))
    assert (True, T0 + 3 * HOUR) == (extended.extended, extended.reservation.end)
    listed, cursor = await cp.reservations.list(alice, ListQuery())
    assert ([made.reservation.id], None) == ([a.reservation.id for a in listed], cursor)
    released = await cp.reservations.release(alice, made.reservation.id)
    assert ("released", "release") == (released.reservation.state, released.operation.kind)
    assert {} == dict(cp.state.ledger.usage("acme"))
