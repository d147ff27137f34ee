"""Another revision of this repository as a source tree of its own, to run an older release beside this one (the
rolling upgrade's test; bench/ab.py and the benches that take --tree): a detached git worktree in a temporary
directory, removed when the caller's stack closes."""
from __future__ import annotations

import contextlib
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str, stack: contextlib.ExitStack) -> Path:
    """A worktree of `rev` (a commit id or anything git names one by), removed when `stack` closes."""
    where = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="berth-tree-"))) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--quiet", "--detach", str(where), rev], check=True)
    stack.callback(subprocess.run, ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                   capture_output=True)
    return where
