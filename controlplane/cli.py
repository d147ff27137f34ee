"""The `berth` command: one entry point, each subcommand owned by the package it drives."""
from __future__ import annotations

import sys

USAGE = """usage: berth <command> [args]

commands:
  controlplane serve   run the control plane (HTTP API, calendar, reconciler)
  agent                run the node agent, or `berth agent discover` to print the host's inventory

Run `berth <command> --help` for the options of one command.
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "controlplane":
        from controlplane import server

        return server.main(rest)
    if command == "agent":
        from agent import cli as agent_cli

        return agent_cli.main(rest)
    print(f"berth: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
