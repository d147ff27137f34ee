"""One invocation of the tenant CLI: its arguments, settings, client and streams, and the commands it suggests."""
from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass, fields
from typing import Any, Sequence, TextIO

from berth.cli.parser import flag_of
from berth.client import AsyncClient, ReservationRequest, Settings


@dataclass
class Context:
    args: argparse.Namespace
    settings: Settings
    client: AsyncClient
    out: TextIO
    err: TextIO
    json: bool
    progress: bool
    key: str | None = None  # the create's idempotency key (given or derived)

    def emit(self, doc: dict, text: str) -> None:
        if self.json:
            print(json.dumps(doc, indent=2), file=self.out)
        else:
            print(text, file=self.out)

    def say(self, text: str) -> None:
        print(text, file=self.err)


def _forced_tty(environ: dict) -> bool:
    return environ.get("BERTH_FORCE_TTY", "") not in ("", "0")


def forced_tty(environ: dict) -> bool:
    return environ.get("BERTH_FORCE_TTY", "") not in ("", "0")


# ---- suggested commands ------------------------------------------------------------------

def _flag_value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value).removesuffix(".0")
    return str(value)


def connection_flags(ctx: Context) -> list[str]:
    """The connection flags a suggested command needs to reach the same server (never the token)."""
    out: list[str] = []
    if ctx.settings.sources.get("url") == "flag":
        out += ["--url", ctx.settings.url]
    if ctx.args.config:
        out += ["--config", ctx.args.config]
    for dest in ("ca_file", "client_cert", "client_key"):
        if getattr(ctx.args, dest, None):
            out += ["--" + dest.replace("_", "-"), getattr(ctx.args, dest)]
    return out


def request_command(ctx: Context, command: str, overrides: dict[str, Any] | None = None,
                    keep: Sequence[str] = ()) -> str:
    """`berth reservations <command>` with this invocation's request flags, changed by overrides.

    keep: which create-only fields to carry (quote_id, max_hourly_price, wait_ms, idempotency_key).
    """
    overrides = overrides or {}
    words = ["berth", "reservations", command]
    for f in fields(ReservationRequest):
        if f.metadata["create_only"] and f.name not in keep and f.name not in overrides:
            continue
        value = overrides[f.name] if f.name in overrides else getattr(ctx.args, f.name, None)
        if value is None or value is False:
            continue
        words += [flag_of(f)] if value is True else [flag_of(f), _flag_value(value)]
    for dest, flag in (("idempotency_key", "--idempotency-key"),):
        value = overrides[dest] if dest in overrides else (getattr(ctx.args, dest, None) if dest in keep else None)
        if value is not None:
            words += [flag, _flag_value(value)]
    return shlex.join(words + connection_flags(ctx))


def without(words: Sequence[str], flag: str) -> list[str]:
    """words less `flag VALUE` and `flag=VALUE`."""
    out: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == flag:
            skip = True
        elif not w.startswith(flag + "="):
            out.append(w)
    return out


def same_command(ctx: Context, argv: Sequence[str]) -> str:
    """This invocation again, as typed, without the token."""
    return shlex.join(["berth", *without(argv, "--token")])


