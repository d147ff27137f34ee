"""Placement: which nodes and devices of a pool a request gets for its window.

Policy only: it reads the calendar and the pool's nodes and returns a
placement or None; booking it is the caller's job. The rules:

- all or nothing: a gang (node_count > 1) gets node_count distinct nodes,
  each with gpu_count free units and room for the per-node host share;
- least fragmentation: nodes that already hold bookings are filled before
  an idle one is opened, so whole free nodes stay whole for whole-node and
  large requests. The cost of a create must not grow with the fleet or the
  calendar, so the search is bounded (as kube-scheduler samples nodes):
  first the SAMPLE most recently booked nodes, taking the first that fits;
  then idle nodes; then the other nodes in use, least recently booked
  first (the likeliest to be free in a new window), scoring a few fits past
  what is needed and taking the tightest. Only a request that fits nowhere
  examines every node;
- NUMA: within a node, units are taken from one NUMA node where one has
  enough (the tightest), else from the fullest NUMA nodes first;
- slots: one slot per GPU, on distinct GPUs, fullest GPUs first.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Mapping, Sequence

from controlplane.domain.calendar import NodeCalendar, PoolCalendar
from controlplane.domain.model import Node, Placement, Unit
from common.share import Share

SAMPLE = 8  # most recently booked nodes scored before the idle ones are tried
EXTRA_FITS = 3  # fits past what is needed that the fallback scan scores before it stops


@dataclass(slots=True)
class Ask:
    """What one placement must find: per node, gpu_count units matching the filter and the host share."""

    gpu_count: int
    node_count: int
    share: Share
    start: int
    end: int
    sharing: str = "exclusive"
    mig_profile: str | None = None
    whole_node: bool = False


def eligible_units(node: Node, ask: Ask) -> Sequence[Unit]:
    if ask.mig_profile is not None:
        return [u for u in node.units if u.mig_profile == ask.mig_profile]
    return node.units


def could_ever_fit(node: Node, ask: Ask) -> bool:
    """Whether the node could hold the request with nothing else booked (lost or not)."""
    units = eligible_units(node, ask)
    if ask.whole_node:
        return node.gpu_count > 0 and (ask.gpu_count in (0, node.gpu_count))
    if ask.sharing == "slots":
        if len({u.gpu_index for u in units}) < ask.gpu_count:
            return False
    elif len(units) < ask.gpu_count:
        return False
    return ask.share.empty or ask.share.fits_in(node.capacity)


def _choose_units(node: Node, free: list[Unit], ask: Ask) -> list[str] | None:
    """Pick gpu_count of the free units, NUMA-aligned where possible; None if too few."""
    need = ask.gpu_count
    if ask.whole_node:  # every unit of a node with the GPUs asked (0: any count), as could_ever_fit says
        if node.gpu_count == 0 or need not in (0, node.gpu_count) or len(free) != len(node.units):
            return None
        return [u.id for u in node.units]
    if ask.sharing == "slots":
        by_gpu: dict[int, list[Unit]] = {}
        for u in free:
            by_gpu.setdefault(u.gpu_index, []).append(u)
        if len(by_gpu) < need:
            return None
        # Fullest GPUs first (fewest free slots), so lightly used GPUs stay free.
        gpus = sorted(by_gpu.items(), key=lambda kv: (len(kv[1]), kv[0]))[:need]
        return [units[0].id for _, units in gpus]
    if len(free) < need:
        return None
    groups: dict[int | None, list[Unit]] = {}
    for u in free:
        groups.setdefault(u.numa_node, []).append(u)
    fitting = [g for g in groups.values() if len(g) >= need]
    if fitting:
        best = min(fitting, key=len)
        return [u.id for u in best[:need]]
    chosen: list[str] = []
    for g in sorted(groups.values(), key=len, reverse=True):
        chosen.extend(u.id for u in g[: need - len(chosen)])
        if len(chosen) == need:
            break
    return chosen


def _fit(node: Node, cal: NodeCalendar, ask: Ask) -> tuple[int, list[str]] | None:
    """(leftover free units, chosen units) if the node can take the ask in its window."""
    if not node.placeable:  # lost, cordoned, draining, cleaning or in maintenance
        return None
    units = eligible_units(node, ask)
    devices = cal.devices
    free = [u for u in units if devices[u.id].is_free(ask.start, ask.end)]
    chosen = _choose_units(node, free, ask)
    if chosen is None:
        return None
    if ask.whole_node:
        if cal.host_busy(ask.start, ask.end):
            return None
    elif not cal.host_fits(ask.start, ask.end, ask.share, node.capacity):
        return None
    return len(free) - len(chosen), chosen


def place(pool: PoolCalendar, nodes: Mapping[str, Node], ask: Ask) -> list[Placement] | None:
    """The placement for the ask, or None when it does not fit in its window."""
    found: dict[str, list[str]] = {}

    def take(candidates, limit: int | None) -> None:
        scored: list[tuple[int, str, list[str]]] = []
        for node_id in candidates:
            if node_id in found:
                continue
            node = nodes.get(node_id)
            if node is None:
                continue
            fit = _fit(node, pool.nodes[node_id], ask)
            if fit is None:
                continue
            scored.append((fit[0], node_id, fit[1]))
            if fit[0] == 0 and len(scored) >= ask.node_count - len(found):
                break  # perfect fits: nothing tighter exists
            if limit is not None and len(scored) >= limit:
                break
        scored.sort(key=lambda s: s[0])
        for _, node_id, chosen in scored[: ask.node_count - len(found)]:
            found[node_id] = chosen

    recent = islice(reversed(pool.in_use), SAMPLE * max(1, ask.node_count))
    if not ask.whole_node:
        take(recent, ask.node_count)
    if len(found) < ask.node_count:
        take(pool.idle, ask.node_count - len(found))
    if len(found) < ask.node_count:
        take(pool.in_use, ask.node_count - len(found) + EXTRA_FITS)
    if len(found) < ask.node_count:
        return None
    return [Placement(node_id, units) for node_id, units in found.items()]


def earliest_start(pool: PoolCalendar, nodes: Mapping[str, Node], ask: Ask, now: int, horizon_ms: int,
                   limit: int = 2000) -> int | None:
    """The earliest start, from now to now + horizon, at which the ask's window fits; None if none does.

    Starts worth trying are now and the ends of the pool's bookings (only when
    something ends can a window that did not fit start to fit).
    """
    length = ask.end - ask.start
    ends = sorted({e for cal in pool.nodes.values() for tl in cal.devices.values() for e in tl.ends if now < e <= now + horizon_ms}
                  | {h.end for cal in pool.nodes.values() for h in cal.host if now < h.end <= now + horizon_ms})
    for t in [now, *ends][:limit]:
        candidate = Ask(ask.gpu_count, ask.node_count, ask.share, t, t + length, ask.sharing, ask.mig_profile, ask.whole_node)
        if place(pool, nodes, candidate) is not None:
            return t
    return None
