"""Berth's version: read from the installed distribution's metadata, whose one source is pyproject.toml.

In common so that every part may name it (the control plane's API description does; berth/ sits on top of the
import graph and re-exports it).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    VERSION = _version("berth")
except PackageNotFoundError:  # pragma: no cover - running from a checkout that was never installed
    VERSION = "0+unknown"
