"""Logging for both halves: structlog, JSON in production, key=value on a terminal, and no secret in any line.

Context (reservation_id, node_id) is bound once where it is known and
carried by the bound logger; processors are plain functions.

Two paths reach the stream, in the same format: structlog's own lines, and
the standard `logging` records of aiohttp, asyncio and other libraries, which
`configure` routes through one handler on the root logger (instead of
logging's last-resort handler). Both end with `redact_event`, then the
renderer: it replaces the value after `Bearer`, the value of an
`Authorization` header, node tokens (`nt_...`), every token registered with
`add_secrets` (the bootstrap file's), whole or cut short, and the values of
fields named like a secret (`token`, `authorization`, `password`, `secret`).
"""
from __future__ import annotations

import logging
import re
import sys
from typing import Iterable

import structlog

REDACTED = "[REDACTED]"
SECRET_PREFIX = 12  # a registered token is known by its first 12 characters, so one cut short is redacted too
_VALUE = r"[^\s'\"\\]+"  # a token as it shows in a line: up to a space, a quote or a backslash (repr's escapes)
# (a word that must be in the lowered text, the pattern; group 1 is kept), each run only where its word is
_FIXED = (
    ("bearer", re.compile(r"(?i)(\bbearer\s+)" + _VALUE)),
    ("authorization", re.compile(r"(?i)(\bauthorization['\"]?\s*[:=]\s*['\"]?(?:(?:bearer|basic|digest|token)\s+)?)"
                                 + _VALUE)),
    # the node tokens the control plane issues (random: an identifier like content_length_... has no digit or capital)
    ("nt_", re.compile(r"()nt_(?=[a-z_-]*[A-Z0-9])[A-Za-z0-9_-]{10,}")),
)
_RUN = re.compile(r"[^\s'\"\\]{%d,}" % SECRET_PREFIX)  # where a registered token can be
_SECRET_KEY = re.compile(r"token|authorization|password|secret", re.IGNORECASE)
_prefixes: set[str] = set()  # the first SECRET_PREFIX characters of each registered token
# registered tokens that hold a space, a quote or a backslash (a run, and the Bearer pattern, would cut them), each
# also as repr writes it in a line (aiohttp's refused-request lines: a backslash doubled, a quote escaped)
_whole: list[str] = []


def add_secrets(tokens: Iterable[str]) -> None:
    """Redact these tokens (at least SECRET_PREFIX characters each) from every line from now on."""
    for token in tokens:
        if isinstance(token, str) and len(token) >= SECRET_PREFIX:
            _prefixes.add(token[:SECRET_PREFIX])
            if re.search(r"[\s'\"\\]", token):
                for form in (token, repr(token)[1:-1], repr(token.encode())[2:-1], token.replace("\\", "\\\\")):
                    if form not in _whole:
                        _whole.append(form)
                _whole.sort(key=len, reverse=True)  # the longest form first: an escaped one holds the plain one's start


# any scheme, any case; the user up to its first ':', the password up to the last '@' before the query (an
# unencoded '/' or '@' in either, as an operator may leave them, is hidden too: more hidden than asked is safe)
_URL_PASSWORD = re.compile(r"^(\s*[a-z][a-z0-9+.-]*://[^/:?]*):[^?]*@", re.IGNORECASE)
_QUERY_PASSWORD = re.compile(r"([?&](?:ssl)?password=)[^&#]*", re.IGNORECASE)  # libpq's password, a key's passphrase


def redact_url(url: str) -> str:
    """A database URL as it may be shown: a password in its user part, or as a parameter, replaced
    (postgresql://u:[REDACTED]@h/db, ...?password=[REDACTED])."""
    return _QUERY_PASSWORD.sub(r"\1" + REDACTED, _URL_PASSWORD.sub(r"\1:" + REDACTED + "@", url))


def redact(text: str) -> str:
    """text with every secret it shows replaced by [REDACTED] (a token from its known prefix to the run's end)."""
    for token in _whole:  # first: the patterns below stop at a space, a quote or a backslash, leaving its rest
        text = text.replace(token, REDACTED)
    low = text.lower()
    for word, pattern in _FIXED:
        if word in low:
            text = pattern.sub(r"\1" + REDACTED, text)
    if not _prefixes:
        return text
    pieces, last = [], 0
    for m in _RUN.finditer(text):
        run = m.group()
        for i in range(len(run) - SECRET_PREFIX + 1):
            if run[i:i + SECRET_PREFIX] in _prefixes:
                pieces += [text[last:m.start() + i], REDACTED]
                last = m.end()
                break
    return "".join(pieces) + text[last:] if pieces else text


def _redact_value(value):
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, dict):
        return {k: REDACTED if isinstance(k, str) and _SECRET_KEY.search(k) else _redact_value(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_value(v) for v in value]
    text = repr(value)
    cleaned = redact(text)
    return value if cleaned == text else cleaned


def redact_event(_logger, _method: str, event_dict: dict) -> dict:
    """The processor before every renderer: each value with its secrets replaced by [REDACTED]."""
    for key, value in event_dict.items():
        if _SECRET_KEY.search(key) and isinstance(value, (str, bytes)):
            event_dict[key] = REDACTED
        else:
            event_dict[key] = _redact_value(value)
    return event_dict


class _Handler(logging.StreamHandler):
    """The one handler of the standard logging records (a type of its own, so configure can replace it)."""


def configure(fmt: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.processors.KeyValueRenderer(
        key_order=["timestamp", "level", "event"], drop_missing=True
    )
    numeric = getattr(logging, level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
    handler = _Handler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            redact_event,
            renderer,
        ],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
