"""Fixtures for the packaging tests: the artefacts of packaging/deb/build.sh (built once per session, in a
temporary directory), real installations with dpkg that are always purged again, also on failure, and a
snapshot of the file system that shows what an installation left behind.

What these tests need, and skip without (with the reason): root, dpkg-dev, debhelper, lintian, python3-venv,
systemd-analyze, and a machine where no Berth package or /opt/berth is installed already (they must never
touch a real installation). The build downloads the dependencies' wheels through pip; .ci/run installs the rest.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cgroups.conftest import bpf_works, own_cgroup2  # noqa: F401 (fixtures for the upgrade test)

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "deb" / "build.sh"
PACKAGES = ("berth", "berth-agent", "berth-controlplane")
UPGRADE_LABEL = "upgrade1"
# A plain environment for running what the packages installed: nothing of this test process (a virtualenv,
# PYTHONPATH, PYTHONDONTWRITEBYTECODE) may help or hide anything.
PLAIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": "/root"}
# The test builds compress with xz level 1 (lintian on Debian 12 accepts only gzip and xz members): the same
# packages as the default level 6, in seconds instead of a minute each.
COMPRESSION = "xz:1"


def pyproject_version() -> str:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def run(cmd: list[str], *, timeout: float = 120, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} exited {out.returncode}\nstdout:\n{out.stdout[-4000:]}\nstderr:\n"
                             f"{out.stderr[-4000:]}")
    return out


def dpkg_status(package: str) -> str:
    """dpkg's status word for a package ('installed', 'config-files', ...), or '' when dpkg does not know it."""
    out = run(["dpkg-query", "-W", "-f=${db:Status-Status}", package], check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


def require_packaging_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("the packaging tests install packages with dpkg: they need root")
    needs = {"dpkg-buildpackage": "dpkg-dev", "dh": "debhelper", "lintian": "lintian", "dpkg": "dpkg",
             "systemd-analyze": "systemd"}
    missing = sorted({pkg for tool, pkg in needs.items() if shutil.which(tool) is None})
    if subprocess.run(["/usr/bin/python3", "-c", "import ensurepip, venv"], capture_output=True).returncode != 0:
        missing.append("python3-venv")
    if missing:
        pytest.skip(f"packaging tools missing: apt-get install -y {' '.join(missing)} (.ci/run does)")
    present = [p for p in PACKAGES if dpkg_status(p)]
    if present or Path("/opt/berth").exists():
        pytest.skip(f"Berth is already installed here ({', '.join(present) or '/opt/berth'}): the packaging tests "
                    "never touch a real installation")


# -- the build -------------------------------------------------------------------------------------------------


@dataclass
class Build:
    version: str  # PEP 440, as the wheel and `berth --version` have it
    deb_version: str
    out: Path
    log: str
    seconds: float

    @property
    def debs(self) -> dict[str, Path]:
        found = {p.name.split("_")[0]: p for p in (self.out / "deb").glob("*.deb")}
        assert sorted(found) == sorted(PACKAGES), found
        return found

    @property
    def changes(self) -> Path:
        (path,) = (self.out / "deb").glob("berth_*.changes")
        return path

    def artefact(self, pattern: str) -> Path:
        (path,) = self.out.glob(pattern)
        return path


class Builder:
    """Runs build.sh into a temporary directory; the tool environment (build, twine) is kept between builds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"
        self.builds: dict[str, Build] = {}

    @property
    def tools(self) -> Path:
        return self.work / "tools" / "bin"

    def build(self, label: str = "") -> Build:
        if label in self.builds:
            return self.builds[label]
        out = self.root / f"out-{label or 'plain'}"
        env = {**os.environ, "BERTH_WORK_DIR": str(self.work), "BERTH_DEB_COMPRESSION": COMPRESSION}
        env.pop("BERTH_VERSION_LOCAL", None)
        if label:
            env["BERTH_VERSION_LOCAL"] = label
        start = time.monotonic()
        proc = subprocess.run([str(BUILD), str(out)], capture_output=True, text=True, timeout=900, env=env)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            pytest.fail(f"packaging/deb/build.sh failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                        f"{proc.stderr[-6000:]}")
        # The staging tree goes: what is installed must work without it.
        shutil.rmtree(self.work / "deb", ignore_errors=True)
        shutil.rmtree(self.work / "src", ignore_errors=True)
        version = pyproject_version() + (f"+{label}" if label else "")
        deb_version = next(p.name.split("_")[1] for p in (out / "deb").glob("berth_*.deb"))
        self.builds[label] = Build(version, deb_version, out, proc.stdout + proc.stderr, seconds)
        return self.builds[label]


@pytest.fixture(scope="session")
def builder(tmp_path_factory) -> Builder:
    require_packaging_host()
    return Builder(tmp_path_factory.mktemp("berth-packaging"))


@pytest.fixture(scope="session")
def built(builder) -> Build:
    """The artefacts of one build.sh run on this tree: sdist, wheel, and the three .deb files."""
    return builder.build()


@pytest.fixture(scope="session")
def built_upgrade(builder, built) -> Build:
    """The same tree built again as version <pyproject>+upgrade1 (BERTH_VERSION_LOCAL), for upgrades."""
    return builder.build(UPGRADE_LABEL)


# -- the file system ---------------------------------------------------------------------------------------------

ROOTS = ("/etc", "/opt", "/usr", "/lib", "/var")
# Written by dpkg, apt, man-db and logging for any package, or busy with other tenants' work on a shared machine;
# none of it is the packages' own.
VOLATILE = ("/var/log", "/var/cache", "/var/lib/dpkg", "/var/lib/apt", "/var/tmp", "/var/backups", "/var/mail",
            "/var/spool", "/var/lib/man-db", "/var/lib/ucf")
# The shadow tools keep the previous /etc/passwd (etc.) as a backup: it may still name the user that purge deleted.
BACKUPS = ("/etc/passwd-", "/etc/group-", "/etc/shadow-", "/etc/gshadow-", "/etc/subuid-", "/etc/subgid-")
ACCOUNTS = ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow")


def snapshot() -> set[str]:
    paths: set[str] = set()
    for root in ROOTS:
        for d, dirs, files in os.walk(root):
            if d.startswith(VOLATILE):
                dirs[:] = []
                continue
            paths.update(os.path.join(d, n) for n in (*dirs, *files))
    return {p for p in paths if not p.startswith(VOLATILE) and p not in BACKUPS}


def accounts_named(name: str) -> list[str]:
    return [f"{f}: {line}" for f in ACCOUNTS if Path(f).exists()
            for line in Path(f).read_text().splitlines() if line.split(":", 1)[0] == name]


class Installation:
    """Packages installed with `dpkg -i` and purged with `dpkg --purge`; `close()` purges whatever is still
    installed (fixtures call it in their teardown, so a failing test leaves nothing either)."""

    def __init__(self) -> None:
        self.before = snapshot()
        self.log: list[str] = []

    def dpkg(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        out = run(["dpkg", *args], timeout=timeout, check=False,
                  env={**PLAIN_ENV, "DEBIAN_FRONTEND": "noninteractive"})
        self.log.append(f"$ dpkg {' '.join(args)}\n{out.stdout}{out.stderr}")
        assert out.returncode == 0, self.log[-1]
        return out

    def install(self, build: Build) -> None:
        debs = build.debs
        self.dpkg("-i", *(str(debs[p]) for p in PACKAGES))
        for p in PACKAGES:
            assert dpkg_status(p) == "installed", (p, self.log[-1])

    def purge(self) -> subprocess.CompletedProcess:
        return self.dpkg("--purge", *PACKAGES)

    def leftovers(self) -> list[str]:
        return sorted(snapshot() - self.before)

    def close(self) -> None:
        if any(dpkg_status(p) for p in PACKAGES):
            self.purge()


@pytest.fixture
def installation():
    """An Installation for one test; purged at the end whatever happens."""
    require_packaging_host()
    inst = Installation()
    try:
        yield inst
    finally:
        inst.close()


# -- the units, as systemd would run them -------------------------------------------------------------------


def unit_settings(path: Path) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def environment_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a systemd EnvironmentFile (comments and blank lines skipped, quotes removed)."""
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";")) and "=" in line:
            key, _, value = line.partition("=")
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            env[key.strip()] = value
    return env


def unit_command(unit: Path, overrides: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """ExecStart of an installed unit and its environment, expanded the way systemd does: Environment= first,
    then the EnvironmentFile= files, then `overrides` (what a test puts in place of an operator's drop-in);
    `${VAR}` becomes one word, `$VAR` splits on white space."""
    s = unit_settings(unit)
    env: dict[str, str] = {}
    for item in s.get("Environment", []):
        key, _, value = item.partition("=")
        env[key] = value
    for item in s.get("EnvironmentFile", []):
        path = Path(item.lstrip("-"))
        if path.exists():
            env.update(environment_file(path))
        else:
            assert item.startswith("-"), f"{unit}: EnvironmentFile {path} is missing"
    env.update(overrides or {})
    words: list[str] = []
    for word in s["ExecStart"][0].split():
        if word.startswith("${") and word.endswith("}"):
            words.append(env.get(word[2:-1], ""))
        elif word.startswith("$"):
            words.extend(env.get(word[1:], "").split())
        else:
            words.append(word)
    return words, env


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
