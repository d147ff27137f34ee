"""How the suite is spread over pytest-xdist's workers (`pytest` runs `-n auto --dist loadgroup`, pyproject.toml).

Each test file is one group, so a file's module fixtures (a control plane, a PostgreSQL cluster) start once on
one worker. Two groups span files because they share the machine, not just a fixture: the packaging tests
(one build for all of them, and dpkg installs what a second worker's snapshot of /etc and /usr would see) and
the tests that reserve 1 GiB hugepages (the host's one pool). The longest groups are queued first so the run
does not end with one worker alone on them.

A worker's environment is otherwise the one `pytest` was started in: xdist sets COLUMNS=80 and LINES=24 in its
workers, and the CLI's tests decide the terminal's width themselves.
"""
from __future__ import annotations

import os

import pytest

TERMINAL_SIZE = ("COLUMNS", "LINES")

# Group -> its place in the queue; the rest follow in collection order. Measured on a 2-core machine: the
# packaging tests take some 200 s together, the benches' smoke runs 100 s, the end-to-end tests about 100 s.
FIRST = ("packaging", "tests/test_benches.py", "tests/e2e/", "tests/controlplane/test_replicas.py")


def _group(item: pytest.Item) -> str:
    path = item.nodeid.split("::", 1)[0]
    if path.startswith("tests/packaging/"):
        return "packaging"
    if "reserved_1g_hugepages" in getattr(item, "fixturenames", ()):
        return "hugepages"
    return path


def _rank(group: str) -> int:
    return next((i for i, head in enumerate(FIRST) if group.startswith(head)), len(FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {id(item): _group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    items.sort(key=lambda item: _rank(groups[id(item)]))  # stable: a file's own order is kept


def pytest_configure_node(node) -> None:
    """(xdist, in the controller) hand each worker the terminal size variables `pytest` was started with."""
    node.workerinput["terminal_size"] = {name: os.environ.get(name) for name in TERMINAL_SIZE}


def pytest_configure(config: pytest.Config) -> None:
    started_with = getattr(config, "workerinput", {}).get("terminal_size")
    for name, value in (started_with or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
