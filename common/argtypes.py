"""argparse types the three commands share (`berth controlplane`, `berth agent`, the tenant CLI): a flag's value
that cannot work (nan, inf, a negative interval, a URL without its scheme) is refused when the command line is read,
naming the flag (argparse adds it) with an example, before anything runs."""
from __future__ import annotations

import argparse
import math
import urllib.parse
from typing import Callable


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return math.nan
    return value


def finite(text: str) -> float:
    """A number, such as 1.5 (float() also takes nan and inf)."""
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number, e.g. 1.5")
    return value


# The most an amount may be: 2^20 CPUs or GiB is past any host (the inventory counts at most 100,000 CPUs), and far
# enough from a float's range that amount * 1000 or * 1024 stays exact when rounded to an int (1e308 overflowed).
AMOUNT_MOST = 1 << 20


def amount(text: str) -> float:
    """A number from 0 to AMOUNT_MOST (a reserve of CPUs or GiB, a share)."""
    value = _float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of at least 0, e.g. 2")
    if value > AMOUNT_MOST:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number from 0 to {AMOUNT_MOST}, e.g. 2")
    return value


def seconds(text: str) -> float:
    """Seconds above 0 (an interval, a timeout)."""
    value = _float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0, e.g. 30")
    return value


def seconds_within_a_day(text: str) -> float:
    """Seconds above 0 and below a day (the control plane's timeouts and graces: longer is a typo)."""
    value = seconds(text)
    if value >= 86_400:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0 and below a day, e.g. 10")
    return value


def whole(least: int) -> Callable[[str], int]:
    """A whole number of at least `least` (retries, milliseconds)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least {least}")
        return value
    return parse


def is_http_url(text: str) -> bool:
    """http(s)://HOST[:PORT][/PATH], with a port that is one."""
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def http_url(text: str) -> str:
    """A service's base URL (the control plane, an AuthZEN service)."""
    if not is_http_url(text):
        hint = f"https://{text}" if "://" not in text and text else "https://HOST:PORT"
        raise argparse.ArgumentTypeError(f"{text!r}: give the URL, http(s)://HOST[:PORT], e.g. {hint}")
    return text


def listen(text: str) -> tuple[str, int]:
    """HOST:PORT to listen on, as (host, port): [::1]:PORT for IPv6, an empty host for every address, port 0 for
    any free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:9100")
    return host.strip("[]") or "0.0.0.0", int(port)
