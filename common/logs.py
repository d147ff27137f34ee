"""Logging for both halves: structlog, JSON in production, key=value on a terminal.

Context (reservation_id, node_id) is bound once where it is known and
carried by the bound logger; processors are plain functions.
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.processors.KeyValueRenderer(
        key_order=["timestamp", "level", "event"], drop_missing=True
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
