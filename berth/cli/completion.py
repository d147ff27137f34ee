"""Shell completion for `berth`: bash and zsh scripts generated from the tenant CLI's argparse parser.

`berth completion bash|zsh` prints a script that holds, for each command
path (`berth reservations list`), the words that may follow it (its
subcommands and aliases, or its flags) and, for each flag that takes a value,
its choices. The shell function walks the words typed so far to the deepest
known path and offers that path's words, or the choices of the flag before
the cursor. Nothing else is needed at completion time: no Python, no server.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Iterator, Mapping, Sequence

from berth.cli.parser import build_parser

ROOT = "berth"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by every name they answer to (aliases included), in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    return (a for a in parser._actions if a.option_strings)


def command_table(parser: argparse.ArgumentParser, top: Mapping[str, Sequence[str]] | Sequence[str] = ()
                  ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(words, values): the words after each command path, and the choices of each value-taking flag, keyed by
    `PATH|FLAG` (an empty list: a free value). `top` adds the entry point's commands that are not the parser's,
    with their subcommands (a word after one of them is never taken for a tenant command)."""
    words: dict[str, list[str]] = {}
    values: dict[str, list[str]] = {}

    def walk(path: str, p: argparse.ArgumentParser) -> None:
        subs = _subcommands(p)
        flags = [f for a in _flags(p) for f in a.option_strings]
        words[path] = list(subs) + flags if subs else flags
        for a in _flags(p):
            if a.nargs != 0:
                for flag in a.option_strings:
                    values[f"{path}|{flag}"] = [str(c) for c in a.choices or ()]
        for name, sub in subs.items():
            walk(f"{path} {name}", sub)

    walk(ROOT, parser)
    groups = list(_subcommands(parser))
    words[ROOT] = groups + list(top) + words[ROOT][len(groups):]  # the entry point's own commands beside the CLI's
    for command, subs in (top.items() if isinstance(top, Mapping) else ((c, ()) for c in top)):
        words[f"{ROOT} {command}"] = list(subs)
        for sub in subs:
            words[f"{ROOT} {command} {sub}"] = []
    words[f"{ROOT} completion"] = list(SHELLS)
    return words, values


def _assignments(table: dict[str, list[str]], form: str) -> str:
    return "\n".join(form.format(key=shlex.quote(k), value=shlex.quote(" ".join(v))) for k, v in table.items())


BASH = """# berth completion for bash: source <(berth completion bash)
declare -gA _berth_words=(
{words}
)
declare -gA _berth_values=(  # PATH|FLAG: the choices of a flag that takes a value ("" for any value)
{values}
)

_berth() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" path=berth word next skip=0 i
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        if ((skip)); then skip=0; continue; fi
        if [[ $word == -* ]]; then
            [[ $word != *=* && -n ${{_berth_values["$path|$word"]+x}} ]] && skip=1
            continue
        fi
        next="$path $word"
        [[ -n ${{_berth_words["$next"]+x}} ]] && path="$next"
    done
    local prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    if ((COMP_CWORD > 1)) && [[ $prev == -* && -n ${{_berth_values["$path|$prev"]+x}} ]]; then
        COMPREPLY=($(compgen -W "${{_berth_values["$path|$prev"]}}" -- "$cur"))
        return 0
    fi
    COMPREPLY=($(compgen -W "${{_berth_words["$path"]}}" -- "$cur"))
}}
complete -F _berth berth
"""

ZSH = """#compdef berth
# berth completion for zsh: source <(berth completion zsh) after compinit, or save as _berth in a $fpath directory
typeset -gA _berth_words _berth_values
_berth_words=(
{words}
)
_berth_values=(  # PATH|FLAG: the choices of a flag that takes a value ("" for any value)
{values}
)

_berth() {{
    local cmdpath=berth word next key skip=0 i
    for (( i = 2; i < CURRENT; i++ )); do
        word=${{words[i]}}
        if (( skip )); then skip=0; continue; fi
        if [[ $word == -* ]]; then
            key="$cmdpath|$word"
            [[ $word != *=* ]] && (( ${{+_berth_values[$key]}} )) && skip=1
            continue
        fi
        next="$cmdpath $word"
        (( ${{+_berth_words[$next]}} )) && cmdpath=$next
    done
    key="$cmdpath|${{words[CURRENT-1]}}"
    if (( CURRENT > 2 )) && [[ ${{words[CURRENT-1]}} == -* ]] && (( ${{+_berth_values[$key]}} )); then
        compadd -- ${{=_berth_values[$key]}}
        return
    fi
    compadd -- ${{=_berth_words[$cmdpath]}}
}}

if (( $+functions[compdef] )); then
    compdef _berth berth
fi
if [[ $funcstack[1] == _berth ]]; then  # autoloaded from $fpath: complete now
    _berth "$@"
fi
"""

SHELLS = {"bash": (BASH, "    [{key}]={value}"), "zsh": (ZSH, "    {key} {value}")}


def script(shell: str, top: Mapping[str, Sequence[str]] | Sequence[str] = ()) -> str:
    """The completion script for `shell` (bash or zsh)."""
    template, form = SHELLS[shell]
    words, values = command_table(build_parser(), top)
    return template.format(words=_assignments(words, form), values=_assignments(values, form))


USAGE = """usage: berth completion bash|zsh

  bash: source <(berth completion bash)    (in ~/.bashrc)
  zsh:  source <(berth completion zsh)     (in ~/.zshrc, after compinit)
"""


def main(argv: Sequence[str], top: Mapping[str, Sequence[str]] | Sequence[str] = ()) -> int:
    """`berth completion bash|zsh`: print the script; anything else is a usage error (exit 2)."""
    if list(argv) in (["-h"], ["--help"]):
        print(USAGE, end="")
        return 0
    if len(argv) != 1 or argv[0] not in SHELLS:
        print(f"berth completion: give the shell, bash or zsh\n\n{USAGE}", end="", file=sys.stderr)
        return 2
    print(script(argv[0], top), end="")
    return 0
