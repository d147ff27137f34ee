"""The `berth` entry point dispatches to the package that owns each command."""
import os
import subprocess
import sys


def test_berth_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "berth", "--help"], capture_output=True, text=True, check=True)
    assert "controlplane serve" in out.stdout
    assert "controlplane migrate" in out.stdout
    assert "agent" in out.stdout


def test_every_controlplane_subcommand_in_the_usage_answers_its_help():
    from berth.main import USAGE

    listed = [line.split()[1] for line in USAGE.splitlines() if line.strip().startswith("controlplane ")]
    assert listed == ["serve", "migrate", "backup", "restore"]
    for sub in listed:
        out = subprocess.run([sys.executable, "-m", "berth", "controlplane", sub, "--help"], capture_output=True,
                             text=True)
        assert out.returncode == 0 and f"berth controlplane {sub}" in out.stdout, out


def test_unknown_command_exits_2_and_says_so():
    out = subprocess.run([sys.executable, "-m", "berth", "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr


def test_the_manual_page_names_every_command_the_usage_lists():
    """berth(1), which the berth package installs, had fallen behind the usage (admin, pools, whoami, events and
    completion were missing): each command of `berth --help` has its line in the page's synopsis."""
    import re
    from pathlib import Path

    from berth.main import USAGE

    page = (Path(__file__).resolve().parents[2] / "packaging" / "deb" / "debian" / "berth.1").read_text()
    synopsis = page[page.index(".SH SYNOPSIS"):page.index(".SH DESCRIPTION")]
    named = set(re.findall(r"^\.B berth (\w+)", synopsis, re.M))
    listed = {line.split()[0] for line in USAGE.split("commands:")[1].splitlines()
              if line.startswith("  ") and not line.startswith("   ")}
    assert listed and listed <= named, sorted(listed - named)


def test_a_reader_that_goes_away_ends_completion_help_and_version_quietly():
    """`berth completion bash | head -1` printed a BrokenPipeError traceback and exited 1; the tenant commands
    already ended quietly with 141 (docs/cli.md)."""
    for argv in (["completion", "bash"], ["--help"], ["--version"]):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before a byte is written
        out = subprocess.run([sys.executable, "-m", "berth.main", *argv], stdout=w, stderr=subprocess.PIPE,
                             text=True, timeout=60)
        os.close(w)
        assert (141, "") == (out.returncode, out.stderr), (argv, out.stderr)


def test_the_entry_points_own_subcommands_are_the_parsers_and_completion_offers_them():
    """Completion after `berth controlplane` offered the tenant commands again; it names each own command's
    subcommands from berth.main.OWN_COMMANDS (no parser import at a shell's start), held here to the parsers."""
    import argparse

    from agent import cli as agent_cli
    from berth.main import OWN_COMMANDS
    from controlplane import server

    def subcommands(p: argparse.ArgumentParser) -> tuple[str, ...]:
        return tuple(name for a in p._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices)

    assert OWN_COMMANDS["controlplane"] == subcommands(server.build_parser())
    assert OWN_COMMANDS["agent"] == ("discover",) and "discover" in agent_cli.main.__code__.co_consts
    script = subprocess.run([sys.executable, "-m", "berth.main", "completion", "bash"], capture_output=True,
                            text=True, timeout=60).stdout
    offered = subprocess.run(["bash", "-c", script + '\nCOMP_WORDS=(berth controlplane ""); COMP_CWORD=2; _berth; '
                              'echo "${COMPREPLY[*]}"'], capture_output=True, text=True, timeout=60).stdout.split()
    assert ["serve", "migrate", "backup", "restore"] == offered
