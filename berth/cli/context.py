"""One invocation of the tenant CLI: its arguments, settings, client and streams, and the commands it suggests."""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence, TextIO

import yaml

from berth.cli.parser import flag_of
from berth.client import AsyncClient, ReservationRequest, Settings, iso_ms


@dataclass
class Context:
    args: argparse.Namespace
    settings: Settings
    client: AsyncClient
    out: TextIO
    err: TextIO
    output: str  # one of parser.OUTPUTS
    progress: bool
    key: str | None = None  # the create's idempotency key (given or derived)
    width: int | None = None  # the terminal's columns that tables fit (None: as wide as they are)

    @property
    def structured(self) -> bool:
        """The API's answer as data (json or yaml), not a table."""
        return self.output in ("json", "yaml")

    @property
    def wide(self) -> bool:
        return self.output == "wide"

    def emit(self, doc: dict, text: str) -> None:
        """The answer: the API's document as JSON or YAML, else the text for people."""
        if self.output == "json":
            print(json.dumps(doc, indent=2), file=self.out)
        elif self.output == "yaml":
            print(yaml_text(doc), end="", file=self.out)
        else:
            print(text, file=self.out)

    def emit_record(self, doc: dict, text: str) -> None:
        """One record of a stream (--follow, --watch): a JSON line, a YAML document, or the text; flushed at once."""
        if self.output == "json":
            print(json.dumps(doc), file=self.out, flush=True)
        elif self.output == "yaml":
            print("---\n" + yaml_text(doc), end="", file=self.out, flush=True)
        else:
            print(text, file=self.out, flush=True)

    def say(self, text: str) -> None:
        print(text, file=self.err)


def yaml_text(doc: Any) -> str:
    """JSON-shaped data as block YAML, keys in the API's order; strings that would read as numbers stay quoted."""
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, allow_unicode=True)


def forced_tty(environ: Mapping[str, str]) -> bool:
    return environ.get("BERTH_FORCE_TTY", "") not in ("", "0")


def terminal_width(out: TextIO, environ: Mapping[str, str]) -> int | None:
    """The columns tables fit: COLUMNS when set, else the terminal's when stdout is one; None (no limit) for a pipe
    or a file, so nothing printed there is cut to a guess."""
    if environ.get("COLUMNS", "").isdigit() and int(environ["COLUMNS"]) > 0:
        return int(environ["COLUMNS"])
    try:
        return shutil.get_terminal_size().columns if out.isatty() else None
    except (AttributeError, ValueError, OSError):
        return None


# ---- suggested commands ------------------------------------------------------------------

def _flag_value(value: Any, kind: str = "plain") -> str:
    if kind == "time" and isinstance(value, int):
        return iso_ms(value)  # a time resolved from now or +1h: the same moment, readable and exact
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
    if getattr(ctx.args, "profile", None):
        out += ["--profile", ctx.args.profile]
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
        if isinstance(value, (list, tuple)):  # a repeated flag (--ssh-key)
            for item in value:
                words += [flag_of(f), str(item)]
            continue
        words += [flag_of(f)] if value is True else [flag_of(f), _flag_value(value, f.metadata["kind"])]
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


def times_resolved(ctx: Context, argv: Sequence[str], flags: Mapping[str, str]) -> list[str]:
    """argv with each time flag (flag -> its dest) at the moment this invocation resolved it: `now` or `-1d` typed
    again later would name another moment than the one a cursor of this answer belongs to."""
    out = list(argv)
    for flag, dest in flags.items():
        value = getattr(ctx.args, dest, None)
        if value is not None:
            out = [*without(out, flag), flag, _flag_value(value, "time")]
    return out


