"""The writer's memory rebuilt whole (ControlPlane._load) with the cyclic garbage collector paused: every object
a rebuild makes is kept, and with the collector's default thresholds (at start) rescanning the growing heap
doubled a rebuild's time. The collector is back as it was after, also when the rebuild fails. In the server's
process (Config.freeze_memory) what a rebuild made is frozen out of the collector's reach after, so the first young
collection does not scan all of it at once; not what a failed one made."""
from __future__ import annotations

import dataclasses
import gc

import pytest

from controlplane import wiring
from controlplane.state import WriterState


async def test_the_memory_is_rebuilt_with_the_collector_paused_and_the_collector_is_back_after(api, monkeypatch):
    cp = api.cp
    seen, rebuild = [], WriterState.rebuild

    def watched(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return rebuild(self, *args, **kwargs)

    monkeypatch.setattr(WriterState, "rebuild", watched)
    assert gc.isenabled()
    await cp.store.call(cp._load)
    assert seen == [False] and gc.isenabled()


def test_the_collector_comes_back_after_a_failed_rebuild_and_one_that_was_off_stays_off():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with wiring.collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("the database went away mid-read")
    assert gc.isenabled()
    gc.disable()
    try:
        with wiring.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_in_the_servers_process_what_a_rebuild_made_is_frozen_out_of_the_collectors_reach(api, monkeypatch):
    cp = api.cp
    for key in ("a", "b", "c"):
        assert (await api.create(key=key))[0] == 202
    frozen = gc.get_freeze_count()
    await cp.store.call(cp._load)
    assert gc.get_freeze_count() == frozen  # (a process of many control planes, as the tests': off)
    monkeypatch.setattr(cp, "config", dataclasses.replace(cp.config, freeze_memory=True))
    try:
        await cp.store.call(cp._load)
        assert len(cp.state.calendar.by_reservation) == 3 and gc.get_freeze_count() > frozen
        young = gc.get_count()[0]
        assert young < 1000, young  # (what the rebuild made is not waiting for the first young collection)
    finally:
        gc.unfreeze()


def test_what_a_failed_rebuild_made_is_not_frozen():
    frozen = gc.get_freeze_count()
    with pytest.raises(RuntimeError):
        with wiring.collector_paused(freeze=True):
            made = [[i] for i in range(1000)]  # noqa: F841 - what a rebuild makes
            raise RuntimeError("the database went away mid-read")
    assert gc.get_freeze_count() == frozen
