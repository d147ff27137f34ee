"""The calendar page (`GET /ui/`): static HTML, CSS and JavaScript shipped in the package, no build step.

It reads the same API as everyone else with the user's token (kept in the
browser's sessionStorage, never in a URL): the admin API's nodes with their
bookings for operators, the tenant API's reservations and pools for tenants.
"""
from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).with_name("static")
