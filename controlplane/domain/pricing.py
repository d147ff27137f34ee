"""Prices and money: what a request costs per hour, and what a span of time bills. Decimal only, never float.

A pool prices each device-hour (a GPU, a MIG instance or a slot) and,
optionally, each vcpu-hour and GiB-hour of host resources booked above the
per-GPU share (1 GiB hugepages count as memory). Billing is prorated to the
second and rounded half-even to a millionth of a dollar, the six decimals of
the wire, once per reservation: each line is what the reservation's running
total reached at its end less what it had reached at its start, so the lines
a UTC midnight or a hold cuts add up to the whole time rounded once, what a
budget check counts; totals are sums of lines, so they add up exactly.
"""
from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

from controlplane.domain.model import Pool
from common.money import MICRO
from common.share import Share

SECONDS_PER_HOUR = Decimal(3600)
DAY_MS = 86_400_000


def money(amount: Decimal) -> str:
    """The wire form: a decimal string with six decimals."""
    return str(amount.quantize(MICRO, rounding=ROUND_HALF_EVEN))


def hourly(pool: Pool, units_per_node: int, node_count: int, excess_per_node: Share) -> Decimal:
    """The running price per hour of a request in this pool."""
    devices = pool.price_per_gpu_hour * units_per_node
    vcpu = pool.price_per_vcpu_hour * Decimal(excess_per_node.vcpu_milli) / 1000
    gib = pool.price_per_gib_hour * (Decimal(excess_per_node.memory_mib) / 1024 + excess_per_node.hugepages_1g)
    return ((devices + vcpu + gib) * node_count).quantize(MICRO, rounding=ROUND_HALF_EVEN)


def charge(hourly_usd: Decimal, start_ms: int, end_ms: int) -> tuple[int, Decimal]:
    """(seconds, amount) billed for [start, end): prorated to the second.

    Seconds are counted on the clock's whole-second ticks (end//1000 -
    start//1000), so cutting a span at any instant never loses or adds one.
    """
    seconds = max(0, end_ms // 1000 - start_ms // 1000)
    return seconds, (hourly_usd * seconds / SECONDS_PER_HOUR).quantize(MICRO, rounding=ROUND_HALF_EVEN)


def line_amount(hourly_usd: Decimal, billed_from: int, start_ms: int, end_ms: int) -> Decimal:
    """What the part [start, end) of a reservation's billed time, which began at billed_from, bills: its running
    total at end less its running total at start, each rounded. Rounding each part on its own would bill a window
    cut at midnight up to half a millionth more per cut than the window whole (what its budget check counted)."""
    return charge(hourly_usd, billed_from, end_ms)[1] - charge(hourly_usd, billed_from, start_ms)[1]


def exposure(hourly_usd: Decimal, ms: int) -> Decimal:
    """What a window of ms may bill at most: every whole-second tick it can touch wherever it starts (5.9 s from
    x.100 touches six), rounded as a billed line is, so a budget check never lets through what billing then counts."""
    return charge(hourly_usd, 0, -(-max(0, ms) // 1000) * 1000)[1]


def prorated(hourly_usd: Decimal, ms: int) -> Decimal:
    """A window's price prorated exactly, to the millisecond (a quote's total)."""
    return (hourly_usd * max(0, ms) / (SECONDS_PER_HOUR * 1000)).quantize(MICRO, rounding=ROUND_HALF_EVEN)


def day_spans(start_ms: int, end_ms: int) -> list[tuple[int, int, int]]:
    """[start, end) cut at UTC midnights: (day start, span start, span end)."""
    out = []
    t = start_ms
    while t < end_ms:
        day = t - t % DAY_MS
        stop = min(end_ms, day + DAY_MS)
        out.append((day, t, stop))
        t = stop
    return out
