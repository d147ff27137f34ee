"""An idempotency key recorded by an earlier release replays on this one. Each release before this one
fingerprinted every field of the create it knew, those left at their defaults too, so each field a release added
changed every request's fingerprint, and a retry after an upgrade (or on a replica of the other release in a
rolling upgrade) was CONFLICT for its own reservation. The earlier releases are run for real, their trees checked
out from this repository's history, and the fingerprints they store are compared with the ones this release
accepts."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import msgspec
import pytest

from controlplane import schemas
from tests import worktree
from tests.controlplane.conftest import NODE_ACCESS

BODIES = [
    {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 1, "start": 1_800_000_000_000, "end": 1_800_003_600_000},
    {"poolId": "h100", "gpuModel": "H100_80GB", "gpuCount": 8, "nodeCount": 2, "durationHours": 1.5, "spot": True,
     "leaseSeconds": 60, "resources": {"vcpu": 4, "memoryGiB": 32}},
    {"poolId": "mig", "gpuModel": "A100_80GB", "migProfile": "1g.10gb", "gpuCount": 2, "nodeCount": 1,
     "binding": "hold", "resources": {"hugepages1Gi": 0}, "wait": {"timeoutMs": 5}, "idempotencyKey": "k"},
]
WITH_ACCESS = {"poolId": "h100", "gpuModel": "H100_80GB", "binding": "node", "nodeCount": 1, "access": NODE_ACCESS}

# What the release in the current directory stores for each body (as its create path computed it).
STORED = r"""
import json, sys
import msgspec
from controlplane import schemas
from controlplane.domain.ids import fingerprint
out = []
for doc in json.loads(sys.stdin.read()):
    body = msgspec.json.decode(json.dumps(doc).encode(), type=schemas.CreateBody)
    if hasattr(schemas, "create_command"):
        out.append(schemas.create_command(body, None).fingerprint)
    else:  # the first release hashed the canonical bytes in the service
        out.append(fingerprint(schemas.fingerprint_of(body)))
print(json.dumps(out))
"""


def release_before(added: str) -> str | None:
    """The commit before the one that added `added` to controlplane/schemas.py; None without git history."""
    try:
        found = subprocess.run(["git", "-C", str(worktree.ROOT), "log", "--format=%H", "-S", added, "--",
                                "controlplane/schemas.py"], capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{found[-1]}^" if found else None


def stored_by(rev: str, bodies: list[dict]) -> list[str]:
    with contextlib.ExitStack() as stack:
        tree = worktree.checkout(rev, stack)
        out = subprocess.run([sys.executable, "-c", STORED], input=json.dumps(bodies), capture_output=True, text=True,
                             cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("added, with_access", [
    ("def _set_fields(value: Any) -> Any:", True),  # the last release that fingerprinted every field
    ("access: Access | None", False),  # before access
    ("quoteId: Id | None", False),  # before quotes and price ceilings
])
def test_a_key_an_earlier_release_recorded_is_the_same_request_here(added, with_access):
    rev = release_before(added)
    if rev is None:
        pytest.skip("needs this repository's git history (the earlier releases are checked out from it)")
    bodies = BODIES + ([WITH_ACCESS] if with_access else [])
    for doc, theirs in zip(bodies, stored_by(rev, bodies), strict=True):
        cmd = schemas.create_command(msgspec.json.decode(json.dumps(doc).encode(), type=schemas.CreateBody), None)
        assert theirs != cmd.fingerprint  # this release stores another form ...
        assert theirs in cmd.earlier(), doc  # ... and takes theirs as the same request
    # a request that differs is not taken for theirs
    other = schemas.create_command(msgspec.json.decode(json.dumps({**BODIES[0], "gpuCount": 2}).encode(),
                                                       type=schemas.CreateBody), None)
    assert not set(stored_by(rev, BODIES[:1])) & {other.fingerprint, *other.earlier()}


def test_a_field_left_at_its_default_or_out_is_one_fingerprint():
    def fp(doc: dict) -> str:
        return schemas.create_command(msgspec.json.decode(json.dumps(doc).encode(), type=schemas.CreateBody),
                                      None).fingerprint

    base = BODIES[0]
    same = [{**base, "nodeCount": 1}, {**base, "binding": "hold", "spot": False}, {**base, "migProfile": None},
            {**base, "wait": {"timeoutMs": 100}, "idempotencyKey": "x", "quoteId": "q", "maxHourlyPrice": "9.0"}]
    assert {fp(base)} == {fp(doc) for doc in same}
    assert fp(base) != fp({**base, "nodeCount": 2}) != fp({**base, "spot": True})
