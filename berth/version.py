"""Berth's version: read from the installed distribution's metadata, whose one source is pyproject.toml."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    VERSION = _version("berth")
except PackageNotFoundError:  # pragma: no cover - running from a checkout that was never installed
    VERSION = "0+unknown"
