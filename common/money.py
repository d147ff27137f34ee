"""Money on the wire: a plain decimal string of USD, the one grammar the API, the client and the CLI read.

Plain digits with at most six decimals ("12", "2.5", "0.000001"), non-negative
and below a trillion; not Python's wider Decimal grammar ("1e3", "1_000",
" 3", "+3", "-0"), which other clients would read otherwise.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MICRO = Decimal("0.000001")
MAX_MONEY = Decimal(10) ** 12  # a trillion dollars: beyond any price or budget, within Decimal's exact range
RULE = "plain decimal digits, at most six decimals, below 10^12 (e.g. 3.420000; not 1e3, 1_000 or +3)"

_PLAIN = re.compile(r"[0-9]{1,13}(?:\.[0-9]{1,6})?")  # below 10^12 is checked on the value
PATTERN = f"^{_PLAIN.pattern}$"  # the same, for a schema's `pattern` (anchored there; fullmatch here)


def parse_money(text: str) -> Decimal | None:
    """The amount `text` writes in the wire's grammar, or None if it is not one."""
    if not isinstance(text, str) or not _PLAIN.fullmatch(text):
        return None
    try:
        amount = Decimal(text)
    except InvalidOperation:
        return None
    if amount >= MAX_MONEY:
        return None
    return amount
