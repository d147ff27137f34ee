"""The tenant CLI (`berth reservations|operations|usage|confirmations ...`), built on the typed client.

parser.py (the arguments), context.py (one invocation and the commands it
suggests), commands.py (one function per command), render.py (tables),
advice.py (refusals: what to do next, and the exit code).
"""
from __future__ import annotations

import asyncio
import os
import sys
from typing import Sequence, TextIO

from berth.cli.advice import EXIT_CLI, EXIT_INTERRUPTED, EXIT_USAGE
from berth.cli.commands import run
from berth.cli.context import Context, forced_tty, terminal_width
from berth.cli.parser import build_parser
from berth.client import AsyncClient, BerthError, new_idempotency_key, resolve_settings
from berth.version import VERSION


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
         environ: dict[str, str] | None = None) -> int:
    """Run one tenant command; argv starts with the group (`reservations`, `operations`, `usage`, `confirmations`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = stdout or sys.stdout, stderr or sys.stderr
    env = dict(os.environ if environ is None else environ)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or bad arguments (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        settings = resolve_settings(args.url, args.token, args.config, env, ca_file=args.ca_file,
                                    client_cert=args.client_cert, client_key=args.client_key, profile=args.profile)
        ssl_context = settings.tls_context()
    except ValueError as exc:  # ConfigError, or tls.TlsError naming the file's flag, variable or config key
        print(f"berth: {exc}", file=err)
        return EXIT_USAGE
    forced = forced_tty(env)
    output = args.output or ("table" if forced or out.isatty() else "json")
    progress = forced or err.isatty()

    def retrying(attempt: int, error: BerthError, delay: float) -> None:
        cause = error.details.get("cause") or error.code
        same = "the same idempotency key" if args.group == "reservations" and args.command == "create" else "the same request"
        clear = "\r\033[K" if progress else ""  # a spinner's line (operations wait) is cleared first, not appended to
        print(f"{clear}berth: {cause}; retrying in {delay:.1f}s with {same} (attempt {attempt + 1} of "
              f"{args.retries + 1})", file=err)

    client = AsyncClient.from_settings(settings, retries=max(0, args.retries), timeout=args.request_timeout,
                                       user_agent=f"berth-cli/{VERSION}", on_retry=retrying, ssl_context=ssl_context)
    ctx = Context(args, settings, client, out, err, output, progress=progress,
                  width=terminal_width(out, env))
    if args.group == "reservations" and args.command == "create":
        # an empty --idempotency-key (an unset shell variable) is sent, and refused: never a fresh key silently
        ctx.key = new_idempotency_key("cli") if args.idempotency_key is None else args.idempotency_key
    try:
        return asyncio.run(run(ctx, argv))
    except KeyboardInterrupt:
        print("berth: interrupted" + (f"; retry with --idempotency-key {ctx.key}" if ctx.key else ""), file=err)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `berth ... | head`: the reader has all it wanted; end quietly, as cat does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # so that the final flush cannot fail again
        except (OSError, ValueError):
            pass
        return EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug of the CLI: say so plainly, with what to report
        print(f"berth: unexpected {type(exc).__name__}: {exc}", file=err)
        return EXIT_CLI


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
