"""A node's state as operators (and cleaning) set it, and the one table of what each operator action does to it.

Stored on the node (Node.state): `ready` (placement may use it), `cordoned`
(no new placements; its bookings stay), `draining` (cordoned, and its placed
reservations that have not started were moved elsewhere), `cleaning` (a
bare-metal node being scrubbed after a tenant had root) and `maintenance`
(held out until an operator clears it). `lost` is not stored here: it is
what the heartbeats say (Node.schedulable is False while the node is lost),
and it is shown instead of the stored state while it lasts.

Every action is idempotent: asked again, it changes nothing and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

READY, CORDONED, DRAINING, CLEANING, MAINTENANCE, LOST = (
    "ready", "cordoned", "draining", "cleaning", "maintenance", "lost")
STORED = (READY, CORDONED, DRAINING, CLEANING, MAINTENANCE)
SHOWN = (*STORED, LOST)  # what a node's `state` reads on the wire (lost wins while it lasts)

FLEET_EVENTS = "@fleet"  # the events stream of node actions (no tenant id can start with "@")

CORDON, UNCORDON, DRAIN, CLEAR = "cordon", "uncordon", "drain", "clear"
ACTIONS = (CORDON, UNCORDON, DRAIN, CLEAR)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The action does not apply in this state; `next` is what the operator does instead."""

    state: str
    next: str
    message: str


# (action, state) -> the state after it. A state missing for an action is a refusal (REFUSED below);
# a state that maps to itself is an idempotent no-op.
TABLE: dict[str, dict[str, str]] = {
    # Cordon on a node that already takes no placements keeps its (stronger) state.
    CORDON: {READY: CORDONED, CORDONED: CORDONED, DRAINING: DRAINING, CLEANING: CLEANING, MAINTENANCE: MAINTENANCE},
    UNCORDON: {READY: READY, CORDONED: READY, DRAINING: READY},
    # Drain moves placed reservations off the node in every state; it never hides cleaning or maintenance.
    DRAIN: {READY: DRAINING, CORDONED: DRAINING, DRAINING: DRAINING, CLEANING: CLEANING, MAINTENANCE: MAINTENANCE},
    CLEAR: {READY: READY, MAINTENANCE: READY},
}

REFUSED: dict[tuple[str, str], tuple[str, str]] = {
    (UNCORDON, CLEANING): ("wait", "the node is being cleaned: when clean it returns to {returns_to} (to "
                                   "maintenance if the cleaning fails)"),
    (UNCORDON, MAINTENANCE): ("clear", "the node is in maintenance: clear it to make it ready"),
    (CLEAR, CORDONED): ("uncordon", "the node is cordoned, not in maintenance: uncordon it"),
    (CLEAR, DRAINING): ("uncordon", "the node is draining, not in maintenance: uncordon it"),
    (CLEAR, CLEANING): ("wait", "the node is being cleaned: when clean it returns to {returns_to} (to maintenance "
                                "if the cleaning fails)"),
}


def apply(action: str, state: str, returns_to: str = READY) -> str | Refusal:
    """The state after `action` on a node in `state`, or the refusal saying what to do instead (`returns_to`: the
    state a node being cleaned returns to when clean)."""
    after = TABLE[action].get(state)
    if after is not None:
        return after
    nxt, message = REFUSED.get((action, state), ("", f"{action} does not apply to a {state} node"))
    return Refusal(state, nxt, message.format(returns_to=returns_to))


def shown(stored: str, lost: bool) -> str:
    """The state a node reads as: lost while its agent is silent past the grace, else the stored one."""
    return LOST if lost else stored
