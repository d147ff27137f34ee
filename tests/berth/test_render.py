"""How the CLI writes for people: times as ISO 8601 with a relative form, money to two decimals, tables fitted to
the terminal by wrapping their widest column."""
from __future__ import annotations

from decimal import Decimal

import pytest

from berth.cli import render
from berth.client import iso_ms, parse_time

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z


@pytest.mark.parametrize("offset_ms, said", [
    (0, "now"), (58_000, "in 58 s"), (-119_000, "119 s ago"), (12 * 60_000, "in 12 min"),
    (-3 * 3_600_000, "3 h ago"), (47 * 3_600_000, "in 47 h"), (-3 * 86_400_000, "3 d ago"),
])
def test_relative_times_read_as_people_say_them(offset_ms, said):
    assert said == render.relative(NOW + offset_ms, NOW)


def test_a_moment_is_iso_8601_utc_with_its_relative_form():
    assert render.when(NOW).startswith("2027-01-15T08:00:00Z (")
    assert "-" == render.when(None)


def test_epoch_ms_in_a_message_become_moments_and_other_numbers_stay():
    text = render.humane(f"the window ended at {NOW}: extend refused (reference pool-lost:h100:{NOW}, 12 GPUs)")
    assert f"ended at {render.when(NOW)}: extend" in text and f"pool-lost:h100:{NOW}" in text and "12 GPUs" in text


@pytest.mark.parametrize("value, shown", [("2.500000", "$2.50"), ("0.002222", "$0.00"), ("0.005", "$0.01"),
                                          (Decimal("1234.5"), "$1234.50"), (None, "-")])
def test_money_for_people_has_two_decimals(value, shown):
    assert shown == render.money(value)


def test_iso_ms_reads_back_to_the_same_millisecond():
    for ms in (NOW, NOW + 1, NOW + 999, 1_796_221_636_346):
        assert ms == parse_time(iso_ms(ms))
    assert "2027-01-15T08:00:00Z" == iso_ms(NOW)


def test_relative_times_count_from_the_given_now():
    assert (NOW, NOW + 5_400_000, NOW - 2 * 86_400_000) == (parse_time("now", NOW), parse_time("+90m", NOW),
                                                            parse_time("-2d", NOW))
    with pytest.raises(ValueError, match="give a relative time with a unit"):
        parse_time("+3", NOW)


ROWS = [("rsv_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "placed", "an operation with a long description of what it does"),
        ("rsv_b", "released", "short")]


def test_a_table_as_wide_as_its_cells_without_a_width():
    lines = render.table(("ID", "STATE", "OPERATION"), ROWS).splitlines()
    assert 3 == len(lines) and lines[1].startswith("rsv_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa  placed    an operation")


def test_a_table_fits_the_width_by_wrapping_its_widest_column():
    lines = render.table(("ID", "STATE", "OPERATION"), ROWS, width=70).splitlines()
    assert max(map(len, lines)) <= 70
    assert lines[1].startswith("rsv_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa  placed    ")  # the ID column kept whole
    assert "an operation with a long description of what it does" == " ".join(
        line[44:].strip() for line in lines[1:-1])  # wrapped onto the next line, nothing cut
    assert lines[-1].split() == ["rsv_b", "released", "short"]


def test_rows_printed_apart_line_up_with_at_least():
    widths = render.column_widths(("ID", "STATE", "OPERATION"), ROWS)
    alone = render.table(("ID", "STATE", "OPERATION"), [ROWS[1]], header=False, at_least=widths)
    assert alone.index("released") == render.table(("ID", "STATE", "OPERATION"), ROWS).splitlines()[2].index("released")


def test_usage_has_a_held_column_only_where_a_kubernetes_release_was_held():
    from types import SimpleNamespace

    import msgspec

    from berth.cli.render import render_usage
    from berth.client.answers import Usage

    def usage(*held: bool) -> Usage:
        lines = [{"reservationId": f"rsv_{i}", "poolId": "k8s", "day": "2026-12-06", "from": 0, "to": 1000,
                  "seconds": 1, "hourlyUsd": "8", "amountUsd": "0.002222", "held": h} for i, h in enumerate(held)]
        return msgspec.convert({"lines": lines, "pageTotalUsd": "0.004444", "totalUsd": "0.004444"}, Usage)

    ctx = SimpleNamespace(width=None)
    plain = render_usage(usage(False, False), ctx, []).splitlines()[0].split()
    assert "HELD" not in plain
    header, first, second = render_usage(usage(False, True), ctx, []).splitlines()[:3]
    assert "HELD" == header.split()[-1] and not first.endswith("yes") and second.endswith("yes")


def test_the_next_page_of_usage_carries_the_moments_this_invocation_resolved():
    """docs/cli.md: a suggested command carries the resolved moment, so it continues the same request (run later,
    `--since=-1d` or `--until now` would name another window than the cursor's)."""
    from types import SimpleNamespace

    import msgspec

    from berth.cli.render import render_usage
    from berth.client.answers import Usage

    since, until = parse_time("2026-12-06T01:02:03.456Z", 0), parse_time("2026-12-07T00:00:00Z", 0)
    page = msgspec.convert({"lines": [], "pageTotalUsd": "0", "totalUsd": "0", "nextCursor": "c2"}, Usage)
    ctx = SimpleNamespace(width=None, args=SimpleNamespace(since=since, until=until))
    argv = ["usage", "--since=-1d", "--until", "now", "--limit", "1", "--cursor", "c1", "--table"]
    more = render_usage(page, ctx, argv).splitlines()[-1]
    assert more == ("more: berth usage --limit 1 --table --since 2026-12-06T01:02:03.456Z "
                    "--until 2026-12-07T00:00:00Z --cursor c2")


def test_a_tenant_row_without_a_limit_reads_0_not_none():
    """A missing limit grants 0 (controlplane/domain/quota.py): quota held under a row since removed is over it."""
    from berth.cli.render import render_tenant, render_tenants
    from berth.client.answers import AdminTenant

    t = AdminTenant(id="initech", quota={"offer:h100:vcpu": 8.0}, used={"offer:h100:vcpu": 8.0, "gpu:H100_80GB": 2})
    rows = [line.split() for line in render_tenant(t).splitlines()[-2:]]
    assert [["gpu:H100_80GB", "2", "0"], ["offer:h100:vcpu", "8", "8"]] == rows
    assert "gpu:H100_80GB 2/0, offer:h100:vcpu 8/8" in render_tenants([t])


def test_followed_events_line_up_under_the_header_on_a_terminal_whatever_their_details():
    """Each followed event is rendered on its own: one with long details was fitted apart (its AT column cut to 12
    and the time broken mid-word) and stood out of line with the header and the others."""
    from berth.client.answers import Event

    now = 1_796_573_474_499
    plain = Event(seq=5, at=now, type="reservation.placed", reservation_id="rsv_" + "a" * 26,
                  data={"state": "placed"})
    detailed = Event(seq=6, at=now, type="reservation.extended", reservation_id="rsv_" + "b" * 26,
                     data={"state": "active", "end": now + 3_600_000, "reason": "x " * 40})
    header, *_ = render.render_events([plain], header=True, width=120, fixed=True).splitlines()
    rows = [render.render_events([e], header=False, width=120, fixed=True).splitlines()[0] for e in (plain, detailed)]
    for name in ("AT", "RESERVATION", "EVENT", "STATE"):
        col = header.index(name)
        assert all(row[col - 1] == " " and row[col] != " " for row in rows), (name, header, rows)
