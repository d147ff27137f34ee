"""Child processes for the real-kernel tests: started here, waiting for a line before they run (so they can be
moved into a cgroup first), always ended by pid (`end`) in the test's finally."""
from __future__ import annotations

import subprocess
import sys
import textwrap

OPENER = textwrap.dedent("""
    import json, os, sys
    for line in sys.stdin:
        out = {}
        for path in line.split():
            try:
                fd = os.open(path, os.O_RDWR)
                if path == "/dev/null":
                    os.write(fd, b"x")
                os.close(fd)
                out[path] = 0
            except OSError as exc:
                out[path] = exc.errno
        print(json.dumps(out), flush=True)
""")


def spawn(code: str, *args: str) -> subprocess.Popen:
    """A python child that waits for its first stdin line before running code, so it can be moved first."""
    wrapper = "import sys; sys.stdin.readline(); exec(compile(sys.argv[1], 'child', 'exec'))"
    return subprocess.Popen([sys.executable, "-c", wrapper, code, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def ask(child: subprocess.Popen, line: str) -> str:
    child.stdin.write(line + "\n")
    child.stdin.flush()
    return child.stdout.readline()


def end(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=10)


def outgrow_memory(subtree, name: str, grow_mib: int = 512) -> int:
    """A child moved into `subtree`'s cgroup `name` allocates `grow_mib` MiB and sleeps; its exit status once it
    ends (-SIGKILL where the kernel's OOM killer ended it), within 20 s."""
    child = spawn(f"x = bytearray({grow_mib} << 20); import time; time.sleep(30)")
    try:
        subtree.move(name, child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        return child.wait(timeout=20)
    finally:
        end(child)
