"""Run `berth controlplane serve` as a real process for tests: start, wait for its listening line, stop or kill."""
from __future__ import annotations

import json
import os
import re
import resource
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from tests.waiting import stop_process

LISTENING = re.compile(r'"address":\s*"(https?://[^"]+)"|\baddress=\'(https?://[^\']+)\'')  # JSON, or key=value


class ServerProcess:
    def __init__(self, db: Path | str | None, bootstrap: Path, extra: list[str] | None = None,
                 nofile: int | None = None, context: ssl.SSLContext | None = None, env: dict[str, str] | None = None,
                 cwd: Path | None = None):
        self.db = db  # None: no --db (BERTH_DB in env, or the default)
        self.env = env or {}  # added to this process's environment
        self.bootstrap = bootstrap
        self.extra = extra or []
        self.nofile = nofile  # the server's open-file limit (soft and hard), when given
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.lines: list[str] = []
        self.context = context  # what post() verifies an https server with (and shows it, for mutual TLS)
        self.cwd = cwd  # where it runs (with PYTHONPATH in env: another release's source tree), when given

    @property
    def db_url(self) -> str:
        """db as --db takes it: a URL as given, a path as a SQLite file."""
        return str(self.db) if str(self.db).startswith(("postgresql://", "sqlite:///")) else f"sqlite:///{self.db}"

    def start(self, timeout: float = 20) -> "ServerProcess":
        cmd = [sys.executable, "-m", "berth", "controlplane", "serve", "--listen", "127.0.0.1:0",
               *(["--db", self.db_url] if self.db is not None else []), "--bootstrap", str(self.bootstrap),
               "--log-format", "json", *self.extra]
        nofile = self.nofile

        def limit_files() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, cwd=self.cwd,
                                     preexec_fn=limit_files if nofile else None)
        found = threading.Event()

        def pump() -> None:
            for line in self.proc.stderr:  # type: ignore[union-attr]
                self.lines.append(line)
                m = LISTENING.search(line)
                if m and not found.is_set():
                    self.url = m.group(1) or m.group(2)
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(timeout):
            self.kill()
            raise RuntimeError("control plane did not start:\n" + "".join(self.lines))
        return self

    def post(self, path: str, token: str | None, body, timeout: float = 10, headers: dict | None = None):
        return post(self.url, path, token, body, timeout, headers, self.context)

    def stop(self) -> int:
        code = stop_process(self.proc)
        return 0 if code is None else code

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def post(url: str, path: str, token: str | None, body, timeout: float = 10, headers: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """POST body (JSON, or bytes as they are) to url + path: the status and the decoded answer. An error answer that
    is not JSON (a load balancer's own page) comes back as {"text": its first 200 characters}."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw or b"{}")
        except ValueError:
            return err.code, {"text": raw[:200].decode(errors="replace")}
