"""The XID policy: application XIDs ignored, MIG devices marked by gi/ci, quiet-time recovery, operator reset."""
from __future__ import annotations

import pytest

from agent.health import APPLICATION_XIDS, HealthPolicy, ScriptedEvents, XidEvent, XidWatcher
from common.inventory import HEALTHY

GPU = "GPU-aaaa"
OTHER = "GPU-bbbb"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def policy(clock):
    return HealthPolicy(quiet_time_s=300, clock=clock, wall_ms=lambda: int(clock.now * 1000))


def xid(n, gpu=GPU, gi=None, ci=None):
    return XidEvent(gpu_uuid=gpu, kind="xid", xid=n, gpu_instance_id=gi, compute_instance_id=ci)


@pytest.mark.parametrize("n", sorted(APPLICATION_XIDS))
def test_application_xids_do_not_mark_the_gpu(policy, n):
    assert policy.observe(xid(n)) is None
    assert HEALTHY == policy.health_of(GPU)


def test_the_ignore_list_is_the_documented_one():
    assert frozenset({13, 31, 43, 45, 68, 109}) == APPLICATION_XIDS


@pytest.mark.parametrize("n, reason", [(79, "XID 79: GPU has fallen off the bus"), (48, "XID 48: double-bit ECC error"),
                                       (999, "XID 999")])
def test_a_critical_xid_marks_the_gpu_and_says_which(policy, n, reason):
    policy.observe(xid(n))
    health = policy.health_of(GPU)
    assert (False, n, reason, 1_000_000) == (health.healthy, health.xid, health.reason, health.sinceMs)
    assert HEALTHY == policy.health_of(OTHER)


def test_a_double_bit_ecc_event_marks_the_gpu(policy):
    policy.observe(XidEvent(gpu_uuid=GPU, kind="ecc-dbe"))
    assert (False, None, "double-bit ECC error") == (policy.health_of(GPU).healthy, policy.health_of(GPU).xid,
                                                     policy.health_of(GPU).reason)


def test_an_event_on_one_mig_device_marks_only_that_device(policy):
    policy.observe(xid(94, gi=2, ci=0))
    assert HEALTHY == policy.health_of(GPU)  # the GPU itself (and so its other instances) is fine
    assert not policy.health_of(GPU, 2, 0).healthy
    assert HEALTHY == policy.health_of(GPU, 2, 1)
    assert HEALTHY == policy.health_of(GPU, 3, 0)


def test_a_gpu_wide_event_marks_every_mig_device_on_it(policy):
    policy.observe(xid(79))
    assert not policy.health_of(GPU, 5, 0).healthy


def test_a_mark_lapses_after_the_quiet_time_and_a_new_event_restarts_it(policy, clock):
    policy.observe(xid(79))
    clock.now += 200
    policy.observe(xid(79))  # renewed: the quiet time counts from here
    clock.now += 200
    assert not policy.health_of(GPU).healthy
    assert 1_000_000 == policy.health_of(GPU).sinceMs  # since the first event
    clock.now += 100
    assert HEALTHY == policy.health_of(GPU)


def test_without_a_quiet_time_only_the_operator_clears_a_mark(clock):
    policy = HealthPolicy(quiet_time_s=None, clock=clock)
    policy.observe(xid(79))
    clock.now += 10 ** 9
    assert not policy.health_of(GPU).healthy
    assert 1 == policy.reset(GPU)
    assert HEALTHY == policy.health_of(GPU)


def test_operator_reset_of_one_mig_device_leaves_the_others(policy):
    policy.observe(xid(94, gi=1, ci=0))
    policy.observe(xid(94, gi=2, ci=0))
    assert 1 == policy.reset(GPU, 1, 0)
    assert (True, False) == (policy.health_of(GPU, 1, 0).healthy, policy.health_of(GPU, 2, 0).healthy)
    assert 1 == policy.reset(GPU)  # the whole GPU: every mark on it
    assert [] == policy.marks()


def test_the_ignore_list_is_configurable(clock):
    policy = HealthPolicy(ignored_xids={79}, clock=clock)
    assert policy.observe(xid(79)) is None
    assert policy.observe(xid(13)) is not None


def test_the_watcher_feeds_the_policy_and_calls_back_on_change(policy, clock):
    source = ScriptedEvents([xid(13), xid(79), xid(94, gi=1, ci=0)])
    calls = []
    watcher = XidWatcher(source, policy, on_change=lambda: calls.append(clock.now), timeout_ms=1)
    assert [False, True, True, False] == [watcher.poll() for _ in range(4)]
    clock.now += 301
    assert watcher.poll()  # both marks lapsed: a change
    assert 3 == len(calls)
    assert HEALTHY == policy.health_of(GPU)


def test_a_failing_wait_asks_for_rediscovery_instead_of_stopping(policy):
    class Broken:
        def wait(self, timeout_ms):
            raise RuntimeError("GPU is lost")

    calls = []
    assert XidWatcher(Broken(), policy, on_change=lambda: calls.append(1)).poll()
    assert [1] == calls


def test_the_watcher_thread_stops_within_its_bounded_wait(policy):
    watcher = XidWatcher(ScriptedEvents(), policy, timeout_ms=20).start()
    watcher.stop(timeout=2)
    assert not watcher._thread.is_alive()
