"""The writer's memory rebuilt whole (ControlPlane._load) with the cyclic garbage collector paused: every object
a rebuild makes is kept, and with the collector's default thresholds (at start) rescanning the growing heap
doubled a rebuild's time. The collector is back as it was after, also when the rebuild fails."""
from __future__ import annotations

import gc

import pytest

from controlplane import wiring


async def test_the_memory_is_rebuilt_with_the_collector_paused_and_the_collector_is_back_after(api):
    cp = api.cp
    seen, rebuild = [], cp.state.rebuild

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return rebuild(*args, **kwargs)

    cp.state.rebuild = watched
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
