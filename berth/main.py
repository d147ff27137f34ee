"""The `berth` command: one entry point; each subcommand is owned by the package it drives."""
from __future__ import annotations

import os
import sys

USAGE = """usage: berth <command> [args]

commands:
  controlplane serve   run the control plane (HTTP API, calendar, reconciler)
  controlplane migrate copy a SQLite database into PostgreSQL: --from sqlite:///PATH --to postgresql://...
  controlplane backup  copy a SQLite database while the control plane serves it
  controlplane restore put such a copy back in place, the control plane stopped
  agent                run the node agent, or `berth agent discover` to print the host's inventory
  exec RESERVATION -- COMMAND...
                       on a node: run a command inside a reservation's cgroup
  reservations         create|get|list (ls)|release (rm)|cancel|extend|renew|quote (tenants)
  operations           get|wait (tenants)
  pools                list|get: what can be booked, and what is free (tenants)
  whoami               who your token speaks for (tenants)
  events               list [--follow]: what happened to the tenant's reservations (tenants)
  usage                charge history (tenants)
  confirmations        list|get|approve|deny what delegated agents ask (tenants)
  admin                nodes|pools|tenants|events: the fleet (operators: the admin or an operator token)
  completion bash|zsh  print the shell's completion script: source <(berth completion bash)

Run `berth <command> --help` for the options of one command; `berth --version` prints the version.
"""


TENANT_GROUPS = ("reservations", "operations", "pools", "whoami", "events", "usage", "confirmations", "admin")  # berth/cli
# the others this entry point dispatches, with their subcommands (for the shells' completion, which must not import
# their parsers: a shell sources the script at each start; tests/berth/test_main.py holds these to the parsers)
OWN_COMMANDS = {"controlplane": ("serve", "migrate", "backup", "restore"), "agent": ("discover",), "exec": (),
                "completion": ("bash", "zsh"), "version": ()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # (a closed pipe met here, not at the interpreter's exit)
        return code
    except BrokenPipeError:  # `berth completion bash | head`: the reader has all it wanted; end quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the final flush cannot fail again
        except (OSError, ValueError):
            pass
        return 141  # 128 + SIGPIPE, as for every tenant command (berth/cli)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv[0] in ("--version", "version"):
        from berth.version import VERSION

        print(f"berth {VERSION}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "controlplane":
        from controlplane import server

        return server.main(rest)
    if command == "agent":
        from agent import cli as agent_cli

        return agent_cli.main(rest)
    if command == "exec":
        from agent import exec as agent_exec

        return agent_exec.main(rest)
    if command in TENANT_GROUPS:
        from berth import cli

        return cli.main([command, *rest])
    if command == "completion":
        from berth.cli import completion

        return completion.main(rest, top=OWN_COMMANDS)
    print(f"berth: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
