"""A throwaway PostgreSQL cluster for tests: initdb in a temporary directory as an unprivileged OS user (initdb
refuses root), listening only on a unix socket in that directory, trust authentication for that user; stopped
and removed after. The binaries come from the distribution's packages (.ci/run installs `postgresql`)."""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

USER = "nobody"  # an unprivileged account every Debian system has


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


@dataclass
class Cluster:
    bin: Path
    data: Path
    socket_dir: Path
    user: str = USER
    options: str = ""  # what the postmaster was started with (start() starts it again so)
    port: int = 5432  # of its socket, and on 127.0.0.1 once serve_tls() made it listen there

    def stop(self) -> None:
        """Stop the postmaster at once, as a crash of the primary would (`-m immediate`: no checkpoint)."""
        out = _as_user([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"],
                       cwd=str(self.data.parent))
        assert out.returncode == 0, out.stderr

    def start(self) -> None:
        """Start it again on the same data and socket (after stop(): it recovers from its WAL)."""
        out = _as_user([str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", self.options, "-l",
                        str(self.data / "log"), "-w", "start"], cwd=str(self.data.parent))
        if out.returncode != 0:
            raise ClusterError(f"pg_ctl start failed: {out.stderr}{out.stdout}")

    def processes(self) -> list[int]:
        """The postmaster's pid and its children's (the backends, the WAL writer...): to stop them all at once
        (SIGSTOP: a primary that stops answering, as a host frozen or a link dropping packets looks)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                if f"\nPPid:\t{postmaster}\n" in status.read_text():
                    children.append(int(status.parent.name))
            except OSError:
                continue  # gone meanwhile
        return [postmaster, *children]

    def dsn(self, database: str = "postgres") -> str:
        """A unix-socket DSN, as `--db postgresql://...` takes it."""
        return f"postgresql://{self.user}@/{database}?host={self.socket_dir}" + \
            (f"&port={self.port}" if self.port != 5432 else "")

    def psql(self, sql: str, database: str = "postgres") -> str:
        out = subprocess.run([str(self.bin / "psql"), "-h", str(self.socket_dir), "-p", str(self.port), "-U",
                              self.user, "-d", database, "-Atc", sql], capture_output=True, text=True, timeout=30,
                             user=self.user)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def createdb(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def serve_tls(self, cert: Path, key: Path, port: int) -> None:
        """Restart it listening on 127.0.0.1:port (and its socket, at that port) as well, with TLS (the server's
        certificate and key, PEM) and, over TCP, only TLS connections authenticated by password (SCRAM), as a
        database a network away is set up; the socket keeps trusting this cluster's OS user."""
        for name, source in (("server.crt", cert), ("server.key", key)):
            target = self.data / name
            shutil.copyfile(source, target)
            os.chown(target, pwd.getpwnam(self.user).pw_uid, -1)
            target.chmod(0o600)  # PostgreSQL refuses a key others may read
        hba = self.data / "pg_hba.conf"
        hba.write_text("hostssl all all 127.0.0.1/32 scram-sha-256\nhostnossl all all 127.0.0.1/32 reject\n"
                       "host all all ::1/128 reject\n" + hba.read_text())  # the first line that matches decides
        self.stop()
        self.port = port
        self.options += f" -c listen_addresses=127.0.0.1 -c port={port} -c ssl=on"
        self.start()


def _as_user(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, user=USER, **kw)


class ClusterError(Exception):
    """A throwaway cluster cannot be made here; the message says why."""


def _own_dir(path: Path, uid: int) -> Path:
    path.mkdir()
    os.chown(path, uid, -1)
    os.chmod(path, 0o700)
    return path


def _options(sock: Path, fsync: bool) -> str:
    return (f"-c listen_addresses='' -c unix_socket_directories={sock} -c max_connections=200"
            f" -c fsync={'on' if fsync else 'off'}")


@contextmanager
def throwaway_cluster(fsync: bool = False) -> Iterator[Cluster]:
    """A cluster for the duration of the block. fsync off for tests (speed); on where durability is measured
    (bench/replicas.py compares commits with commits)."""
    bin_dir = binaries()
    if bin_dir is None:
        raise ClusterError("PostgreSQL is not installed (apt-get install postgresql)")
    if os.geteuid() != 0:
        raise ClusterError("the throwaway cluster runs as an unprivileged user: needs root to become it")
    root = Path(tempfile.mkdtemp(prefix="berth-pg-"))
    uid = pwd.getpwnam(USER).pw_uid
    os.chmod(root, 0o755)
    data, sock = _own_dir(root / "data", uid), _own_dir(root / "sock", uid)
    try:
        init = _as_user([str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8",
                         "--no-sync"], cwd=str(root))
        if init.returncode != 0:
            raise ClusterError(f"initdb failed: {init.stderr}")
        cluster = Cluster(bin_dir, data, sock, options=_options(sock, fsync))
        cluster.start()
        yield cluster
    finally:
        for pid in (root / "standby" / "postmaster.pid", data / "postmaster.pid"):
            if pid.exists():
                _as_user([str(bin_dir / "pg_ctl"), "-D", str(pid.parent), "-m", "immediate", "-w", "stop"],
                         cwd=str(root))
        shutil.rmtree(root, ignore_errors=True)


def hot_standby(primary: Cluster) -> Cluster:
    """A hot standby of `primary` beside it (pg_basebackup, streaming asynchronously, as Patroni's replicas do by
    default), on a socket of its own; removed with the primary's directory. `promote()` makes it the primary."""
    root, uid = primary.data.parent, pwd.getpwnam(USER).pw_uid
    data, sock = _own_dir(root / "standby", uid), _own_dir(root / "standby-sock", uid)
    out = _as_user([str(primary.bin / "pg_basebackup"), "-h", str(primary.socket_dir), "-U", USER, "-D", str(data),
                    "-R", "-X", "stream", "--checkpoint=fast", "--no-sync"], cwd=str(root))
    if out.returncode != 0:
        raise ClusterError(f"pg_basebackup failed: {out.stderr}")
    standby = Cluster(primary.bin, data, sock, options=_options(sock, fsync=False))
    standby.start()
    return standby


def promote(standby: Cluster) -> None:
    """End the standby's recovery: it is the primary from now on (what a failover manager does)."""
    out = _as_user([str(standby.bin / "pg_ctl"), "-D", str(standby.data), "-w", "promote"],
                   cwd=str(standby.data.parent))
    assert out.returncode == 0, out.stderr


def cluster_or_skip() -> Iterator[Cluster]:
    """A throwaway cluster for a fixture, or the test skipped saying why none can be made here."""
    try:
        with throwaway_cluster() as cluster:
            yield cluster
    except ClusterError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def pg_cluster():
    yield from cluster_or_skip()
