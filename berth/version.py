"""Berth's version, as the CLI and the client name it: defined once in common/version.py."""
from __future__ import annotations

from common.version import VERSION

__all__ = ["VERSION"]
