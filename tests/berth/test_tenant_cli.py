"""The real `berth reservations|operations|usage` command against a `berth controlplane serve` process.

One server for the module; each test books what it needs and ends it. A
refusal must print the next command and exit with the documented code
(docs/cli.md), and the printed command must work when run.
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from berth import client as c
from berth import cli as tenant_cli
from berth.cli import advice
from berth.cli.parser import build_parser
from berth.cli.render import relative
from tests.controlplane.conftest import TOKENS, bootstrap_doc
from tests.serverproc import ServerProcess
from tests.waiting import wait_for

ONE = ["--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "1", "--hours", "1"]
DAY_MS = 86_400_000


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def json(self) -> dict:
        return json.loads(self.out)

    def line(self, prefix: str) -> str:
        """The text after the first stderr line starting with prefix (a suggested command)."""
        found = [line[len(prefix):].strip() for line in self.err.splitlines() if line.strip().startswith(prefix)]
        assert found, self.err
        return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    doc = bootstrap_doc()
    doc["pools"].append({"id": "solo", "owner": "acme", "region": "eu", "gpuModel": "H100_80GB",
                         "pricePerGpuHourUsd": "1"})
    doc["nodes"].append({"id": "solo1", "pool": "solo", "hostname": "solo1.test", "vcpu": 8, "memoryGiB": 64, "gpus": 1})
    # A pool of its own model, whose node's agent registers in the usage test.
    doc["pools"].append({"id": "metered", "owner": "acme", "region": "eu", "gpuModel": "L40S_48GB", "pricePerGpuHourUsd": "4"})
    doc["nodes"].append({"id": "metered1", "pool": "metered", "hostname": "metered1.test", "gpus": 2})
    doc["nodeTokens"].append({"pool": "metered", "token": "node-token-metered-0001"})
    # A pool whose node's agent fails to bind, in the operations wait test.
    doc["pools"].append({"id": "flaky", "owner": "acme", "region": "eu", "gpuModel": "L40S_48GB", "pricePerGpuHourUsd": "4"})
    doc["nodes"].append({"id": "flaky1", "pool": "flaky", "hostname": "flaky1.test", "gpus": 2})
    doc["nodeTokens"].append({"pool": "flaky", "token": "node-token-flaky-00001"})
    doc["tenants"][0]["quota"]["gpu:L40S_48GB"] = 4
    d = tmp_path_factory.mktemp("cli")
    (d / "b.json").write_text(json.dumps(doc))
    proc = ServerProcess(d / "cp.db", d / "b.json").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def config_home(tmp_path_factory) -> Path:
    """An empty XDG_CONFIG_HOME, so no developer's own config leaks in."""
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture
def berth(server, config_home):
    def run(*argv: str, token: str | None = "alice", env: dict | None = None, url: str | None = None) -> Run:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
        environ.update({"XDG_CONFIG_HOME": str(config_home), "BERTH_URL": url or server.url})
        if token:
            environ["BERTH_TOKEN"] = TOKENS.get(token, token)
        environ.update(env or {})
        environ = {k: v for k, v in environ.items() if v is not None}
        out = subprocess.run([sys.executable, "-m", "berth", *argv], capture_output=True, text=True,
                             env=environ, timeout=60)
        return Run(out.returncode, out.stdout, out.stderr)

    return run


@pytest.fixture
def alice(server):
    with c.Client(server.url, TOKENS["alice"]) as client:
        yield client


def release_all(server) -> None:
    for who in ("alice", "bob", "agent", "dave"):
        with c.Client(server.url, TOKENS[who]) as client:
            for r in client.list(limit=200).reservations:
                if r.state not in ("released", "cancelled"):
                    client.release(r.id)


@pytest.fixture(autouse=True)
def clean(server):
    yield
    release_all(server)


# ---- output modes -------------------------------------------------------------------------

def test_create_prints_the_api_json_and_each_invocation_gets_its_own_key(berth):
    first, second = berth("reservations", "create", *ONE, "--json"), berth("reservations", "create", *ONE)
    assert (0, 0) == (first.code, second.code), first.err + second.err
    a, b = first.json["reservation"], second.json["reservation"]  # piped: JSON without --json too
    assert ("placed", "alice", "H100_80GB") == (a["state"], a["principalId"], a["gpuModel"])
    assert a["id"] != b["id"]  # no --idempotency-key: a new key per invocation, a new intent


def test_a_given_idempotency_key_returns_the_same_reservation(berth):
    runs = [berth("reservations", "create", *ONE, "--idempotency-key", "cli-same", "--json") for _ in range(2)]
    assert [0, 0] == [r.code for r in runs]
    assert runs[0].json["reservation"]["id"] == runs[1].json["reservation"]["id"]


@pytest.mark.parametrize("key", ["k\r", "ünïcödé-key"])
def test_a_key_a_header_cannot_carry_goes_in_the_body_and_still_replays(berth, key):
    """A key with a control character or beyond ASCII gave 'unexpected ValueError' (exit 1): the client put every
    key in the Idempotency-Key header. The body takes any text (docs/api.md), so such a key goes there."""
    runs = [berth("reservations", "create", *ONE, "--idempotency-key", key, "--json") for _ in range(2)]
    assert [0, 0] == [r.code for r in runs], runs[0].err
    assert runs[0].json["reservation"]["id"] == runs[1].json["reservation"]["id"]
    assert key == runs[0].json["reservation"]["idempotencyKey"]


def test_an_empty_idempotency_key_is_refused_not_replaced_by_a_fresh_one(berth, alice):
    """`--idempotency-key "$KEY"` with KEY unset must not book once per run."""
    before = len(alice.list(limit=200).reservations)
    runs = [berth("reservations", "create", *ONE, "--idempotency-key", "") for _ in range(2)]
    assert [3, 3] == [r.code for r in runs], runs[0].err
    assert "INVALID_INPUT" in runs[0].err and "--idempotency-key" in runs[0].err, runs[0].err
    assert before == len(alice.list(limit=200).reservations)


@pytest.mark.parametrize("url, said", [
    ("localhost:{port}", "give, for example, http://localhost:{port}"),
    ("ftp://127.0.0.1:{port}", "is not an http:// or https:// URL"),
    ("http://127.0.0.1:{port}/api", "ends in /api: give the control plane's base URL, http://127.0.0.1:{port}"),
])
def test_a_url_that_is_not_http_exits_2_at_once_saying_what_to_write(berth, server, url, said):
    port = server.url.rsplit(":", 1)[1]
    started = time.monotonic()
    run = berth("whoami", url=url.format(port=port))
    assert (2, True, "retrying" in run.err) == (run.code, said.format(port=port) in run.err, False), run.err
    assert time.monotonic() - started < 10  # no retries: nothing was sent


def test_a_bound_the_api_states_in_milliseconds_is_said_in_the_flag_s_units(berth, alice):
    run = berth("reservations", "create", *ONE[:-2], "--start", "now", "--end", "99999999999999999")
    assert (3, True) == (run.code, "next: fix --end (must be a time <= 3000-01-01T00:00:00Z)" in run.err), run.err
    r = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    run = berth("reservations", "extend", r.id, "--by", "10000d")
    assert (3, True) == (run.code, "next: fix --by (must be a duration <= 366d)" in run.err), run.err


def test_an_unknown_pool_points_at_the_pools_one_may_book(berth):
    run = berth("reservations", "create", "--pool", "nowhere", "--gpu-model", "H100_80GB", "--hours", "1")
    assert (3, "berth pools list") == (run.code, run.line("the pool is not yours or offered to you; the pools you "
                                                           "may book:")), run.err


def test_terminal_mode_prints_tables_and_the_next_command(berth):
    created = berth("reservations", "create", *ONE, env={"BERTH_FORCE_TTY": "1"})
    assert 0 == created.code, created.err
    assert "state        placed" in created.out and "gpus         1 H100_80GB" in created.out
    op = created.out.split("next: berth operations wait ")[1].split()[0]
    assert op.startswith("op_")
    listed = berth("reservations", "list", "--table")
    assert listed.out.splitlines()[0].split() == ["ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION"]
    assert op in listed.out


def test_every_output_form_shows_the_same_answer(berth):
    """-o json and --json are one; yaml is the same document; wide adds binding, spot and principal."""
    rid = berth("reservations", "create", *ONE, "--spot", "--json").json["reservation"]["id"]
    as_json = berth("reservations", "get", rid, "-o", "json")
    as_yaml = berth("reservations", "get", rid, "-o", "yaml")
    assert (0, 0) == (as_json.code, as_yaml.code), as_yaml.err
    assert as_json.json == yaml.safe_load(as_yaml.out)
    assert isinstance(yaml.safe_load(as_yaml.out)["reservation"]["hourlyUsd"], str)  # money stays a decimal string
    wide = berth("reservations", "ls", "-o", "wide")
    header, *rows = wide.out.splitlines()
    assert ["ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION", "BINDING", "SPOT", "PRINCIPAL"] == header.split()
    row = next(r for r in rows if r.startswith(rid))
    assert row.split()[-3:] == ["hold", "yes", "alice"]
    assert "principal        alice" in berth("reservations", "get", rid, "-o", "wide").out


def test_json_is_the_answer_as_the_api_sent_it_with_the_fields_the_client_does_not_read(berth, alice):
    shown = berth("pools", "list", "-o", "json")
    assert 0 == shown.code, shown.err
    alice.list_pools()
    assert (True, list(alice.last_answer)) == ("now" in shown.json, list(shown.json))  # top-level `now` kept
    assert [p["id"] for p in alice.last_answer["pools"]] == [p["id"] for p in shown.json["pools"]]


def test_tables_fit_the_terminal_and_json_is_never_cut(berth):
    for _ in range(2):
        assert 0 == berth("reservations", "create", *ONE, "--json").code
    narrow = berth("reservations", "list", "--table", env={"COLUMNS": "100"})
    assert 0 == narrow.code, narrow.err
    wide_open = berth("reservations", "list", "--table")  # piped, no COLUMNS: as wide as it is
    assert max(map(len, narrow.out.splitlines())) <= 100 < max(map(len, wide_open.out.splitlines()))
    assert len(narrow.out.splitlines()) > len(wide_open.out.splitlines())  # wrapped, not cut
    as_json = berth("reservations", "list", "--json", env={"COLUMNS": "40"})
    assert as_json.json["reservations"]  # parses: JSON is never fitted


def test_times_read_as_iso_with_a_relative_form_and_money_with_two_decimals(berth):
    r = berth("reservations", "create", *ONE, "--json").json["reservation"]
    shown = berth("reservations", "get", r["id"], "--table").out
    start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["start"] // 1000))
    assert f"start        {start} (" in shown and ("ago)" in shown or "(now)" in shown)
    assert re.search(r"end          \S+ \(in (59|60) min\)", shown)
    assert "price        $2.50/hr" in shown  # 2.500000 in the JSON
    assert str(r["start"]) not in shown  # never epoch ms


def test_a_released_reservation_shows_when_it_actually_ended(berth, alice):
    start = (int(time.time() * 1000) // DAY_MS + 3) * DAY_MS
    r = alice.create("h100", "H100_80GB", gpu_count=1, start=start, end=start + 3_600_000, lease_seconds=600)
    assert "renew by" in berth("reservations", "get", r.id, "--table").out
    alice.cancel(r.id)
    shown = berth("reservations", "get", r.id, "--table").out
    assert ["lease        600 s"] == [line for line in shown.splitlines() if line.startswith("lease")]  # ended
    end_line = next(line for line in shown.splitlines() if line.startswith("end"))
    booked = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((start + 3_600_000) / 1000))
    assert f"its window was to run until {booked} (in {relative(start + 3_600_000).removeprefix('in ')})" in end_line
    got = alice.get(r.id)
    ended = got.ended_at
    assert ended is not None and ended == got.updated_at  # the client reads the API's endedAt
    assert end_line.startswith(f"end          {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(ended // 1000))}")
    row = next(line for line in berth("reservations", "list", "--table").out.splitlines() if line.startswith(r.id))
    assert booked not in row and ("ago)" in row or "(now)" in row)


def test_now_and_relative_times_resolve_once_for_the_whole_invocation(berth):
    now = 1_800_000_000_000
    args = build_parser(now).parse_args(["reservations", "create", *ONE[:6], "--start", "now", "--end", "+90m"])
    assert (now, now + 90 * 60_000) == (args.start, args.end)  # one now for every flag, fixed before any retry
    before = int(time.time() * 1000)
    r = berth("reservations", "create", *ONE[:6], "--start", "now", "--end", "+90m", "--json").json["reservation"]
    assert before - 1000 <= r["start"] and r["end"] - before < 90 * 60_000 + 5000  # the server's now starts it
    until = berth("reservations", "extend", r["id"], "--until", "+2h", "--json")
    assert 0 == until.code, until.err
    assert abs(until.json["reservation"]["end"] - (int(time.time() * 1000) + 7_200_000)) < 10_000
    assert 0 == berth("usage", "--since=-7d", "--until", "now", "--json").code


def test_repeated_by_adds_the_durations_up(berth):
    r = berth("reservations", "create", *ONE, "--json").json["reservation"]
    extended = berth("reservations", "extend", r["id"], "--by", "1h", "--by", "30m", "--json")
    assert (0, r["end"] + 90 * 60_000) == (extended.code, extended.json["reservation"]["end"])
    assert "the durations add up" in " ".join(berth("reservations", "extend", "--help").out.split())


def test_ls_and_rm_are_list_and_release(berth):
    r = berth("reservations", "create", *ONE, "--json").json["reservation"]
    assert r["id"] in {x["id"] for x in berth("reservations", "ls", "--json").json["reservations"]}
    removed = berth("reservations", "rm", r["id"], "--json")
    assert (0, "released") == (removed.code, removed.json["reservation"]["state"])
    assert 0 == berth("events", "ls", "--limit", "1", "--json").code
    assert "list (ls)" in berth("reservations", "--help").out and "release (rm)" in berth("reservations", "--help").out


def test_start_and_end_accept_iso_8601_and_epoch_ms(berth):
    start = (int(time.time() * 1000) // DAY_MS + 2) * DAY_MS
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start / 1000))
    run = berth("reservations", "create", "--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "1",
                "--start", iso, "--end", str(start + 3_600_000), "--json")
    assert 0 == run.code, run.err
    assert (start, start + 3_600_000) == (run.json["reservation"]["start"], run.json["reservation"]["end"])


def test_extend_renew_cancel_and_release(berth, alice):
    res = berth("reservations", "create", *ONE, "--lease-seconds", "600", "--json").json["reservation"]
    extended = berth("reservations", "extend", res["id"], "--by", "30m", "--json")
    assert (True, res["end"] + 1_800_000) == (extended.json["extended"], extended.json["reservation"]["end"])
    earlier = berth("reservations", "extend", res["id"], "--until", str(res["end"] - 60_000),
                    env={"BERTH_FORCE_TTY": "1"})
    assert 0 == earlier.code and "not extended: it already ends at" in earlier.out, earlier.out
    renewed = berth("reservations", "renew", res["id"], "--json")
    assert renewed.json["reservation"]["leaseDeadline"] >= res["leaseDeadline"]
    wait_for(lambda: alice.get(res["id"]).state == "binding")  # the reconciler started the window
    refused = berth("reservations", "cancel", res["id"])  # too late to cancel: the refusal names release
    assert 3 == refused.code
    assert f"berth reservations release {res['id']}" == refused.line("next:")
    released = berth("reservations", "release", res["id"], "--table")
    assert 0 == released.code and "released (release)" in released.out
    future = alice.create("h100", "H100_80GB", gpu_count=1, start=res["end"] + 3_600_000, end=res["end"] + 7_200_000)
    cancelled = berth("reservations", "cancel", future.id, "--json")
    assert (0, "cancelled") == (cancelled.code, cancelled.json["reservation"]["state"])


# ---- refusals: the next command and the exit code ----------------------------------------------

REFUSALS = [
    ("price ceiling", [*ONE, "--max-hourly-price", "1"], "alice", 4,
     ["reason: price_ceiling", "cheapest eligible rate: $2.50/hr",
      "next: berth reservations create --pool budget --gpu-model H100_80GB --gpu-count 1 --hours 1 --max-hourly-price 1",
      "  or: berth reservations create --pool h100 --gpu-model H100_80GB --gpu-count 1 --hours 1 --max-hourly-price 2.500000"]),
    ("larger than the pool", ["--pool", "k8s", "--gpu-model", "H100_80GB", "--gpu-count", "8", "--node-count", "2",
                              "--hours", "1"], "alice", 4,
     ["reason: no_stock", "alternative: pool h100 (eu) at $40.00/hr",
      "next: berth reservations create --pool h100 --gpu-model H100_80GB --gpu-count 8 --node-count 2 --hours 1"]),
    ("no stock", ["--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "9", "--hours", "1"], "alice", 4,
     ["reason: no_stock", "its largest node has 8 H100_80GB", "largest: 2 node(s) of 8 GPUs each",
      "next: berth reservations create --pool h100 --gpu-model H100_80GB --gpu-count 8 --node-count 2 --hours 1"]),
    ("quota", [*ONE, "--vcpu", "64"], "alice", 3,
     ["vcpu: 64.0 booked, of which 8.0 come with the GPUs' per-GPU share and 56.0 above it count against quota",
      "quota vcpu: 56.0 above the 8.0 that come with the GPUs count against it; 0.0 of 32.0 in use",
      "ask an admin to raise the tenant's vcpu quota",
      "--vcpu 64 --idempotency-key cli-"]),
    ("offer quota", [*ONE, "--vcpu", "20"], "dave", 3,  # initech's vcpu in pool h100 is the offer's 8
     ["quota offer:h100:vcpu: 12.0 above the 8.0 that come with the GPUs count against it; 0.0 of 8.0 in use",
      "next: reduce --vcpu, or ask an admin to raise pool h100's vcpu quota for your tenant (its offer)",
      "after the quota is raised, the same key continues the request: berth reservations create --pool h100"]),
    ("spend limit", ONE, "carol", 3,  # globex has a budget of 0 and its offer of h100 checks budgets
     ["SPEND_LIMIT_REACHED (HTTP 402)", "spent 0.000000 of 0.000000 USD: ask an admin to raise the budget",
      "after the budget is raised, the same key continues the request: berth reservations create --pool h100",
      "--idempotency-key cli-"]),
    ("confirmation", [*ONE[:4], "--gpu-count", "4", "--hours", "1"], "agent", 3,
     ["alice must approve confirmation cnf_", "then retry with the same key: berth reservations create --pool h100",
      "--idempotency-key cli-"]),
    ("quote expired", [*ONE, "--quote", "qt_missing"], "alice", 3,
     ["next: berth reservations quote --pool h100 --gpu-model H100_80GB --gpu-count 1 --hours 1",
      "then: berth reservations create --pool h100 --gpu-model H100_80GB --gpu-count 1 --hours 1 --quote QUOTE_ID"]),
    ("invalid input", [*ONE[:4], "--gpu-count", "0", "--hours", "1"], "alice", 3,
     ["INVALID_INPUT (HTTP 400): gpuCount: must be an integer >= 1", "next: fix --gpu-count"]),
    ("unknown token", ONE, "not-a-token-of-anyone", 3, ["UNAUTHENTICATED (HTTP 401)", "from env BERTH_TOKEN"]),
    ("policy", [*ONE[:6], "--hours", "200"], "alice", 3,
     ["ACCESS_DENIED (HTTP 403): alice may not create this reservation: reservations longer than 168 h are not "
      "allowed", "refused by policy max-week: reservations longer than 168 h are not allowed"]),
]


@pytest.mark.parametrize("args, token, code, said", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_refused_create_says_what_to_do_next_and_exits_by_whose_move_it_is(berth, args, token, code, said):
    run = berth("reservations", "create", *args, token=token, env={"BERTH_FORCE_TTY": "1"})
    assert code == run.code, run.err
    for text in said:
        assert text in run.err
    assert "" == run.out
    assert "--idempotency-key" in " ".join(said) or "drop --idempotency-key" not in run.err  # no key given: no hint


def test_a_refused_quote_says_to_ask_again_not_to_continue_a_key(berth):
    """A quote leaves no draft behind a key: once the quota is raised, the same quote is asked again."""
    run = berth("reservations", "quote", *ONE, "--vcpu", "64", env={"BERTH_FORCE_TTY": "1"})
    assert (3, True) == (run.code, "  after the quota is raised: berth reservations quote --pool h100" in run.err), run.err
    assert "same key" not in run.err


def test_a_refusal_in_json_mode_prints_the_envelope(berth):
    run = berth("reservations", "create", *ONE, "--max-hourly-price", "1", "--json")
    assert 4 == run.code
    error = run.json["error"]
    assert ("NO_CAPACITY", "price_ceiling", "2.500000") == (
        error["code"], error["details"]["reason"], error["details"]["cheapestEligibleUsdPerHour"])
    assert "next: berth reservations create" in run.err


def test_the_suggested_command_works(berth):
    refused = berth("reservations", "create", *ONE, "--max-hourly-price", "1")
    suggested = shlex.split(refused.line("next:"))
    assert suggested[:3] == ["berth", "reservations", "create"]
    run = berth(*suggested[1:], "--json")
    assert 0 == run.code, run.err
    assert ("budget", "placed") == (run.json["reservation"]["poolId"], run.json["reservation"]["state"])


def test_a_denied_confirmation_is_said_to_be_a_persons_denial_at_every_step(berth, server, alice):
    big = ["--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "4", "--hours", "1"]
    asked = berth("reservations", "create", *big, "--idempotency-key", "cli-denied", "--json", token="agent")
    cid = asked.json["error"]["details"]["confirmationId"]
    own = berth("confirmations", "approve", cid, token="agent")  # not the agent's to decide
    assert (3, True) == (own.code, f"only alice may approve or deny {cid}: ask them" in own.err), own.err
    assert "denied or lapsed" not in own.err and "send a new request" not in own.err
    assert "denied" == alice.deny_confirmation(cid).status
    again = berth("reservations", "create", *big, "--idempotency-key", "cli-denied", token="agent")
    assert (3, True) == (again.code, f"confirmation {cid} was denied by alice" in again.err), again.err
    assert "no policy permits" not in again.err
    late = berth("confirmations", "approve", cid)
    assert (3, "status: denied") == (late.code, late.err.splitlines()[-1]), late.err
    other = berth("reservations", "create", *big[:-2], "--hours", "2", "--idempotency-key", "cli-denied", token="agent")
    assert (3, True) == (other.code, "CONFLICT" in other.err), other.err
    assert "which was not accepted" in other.err and "see it:" not in other.err  # no reservation to get


def test_after_approval_the_printed_retry_continues_the_same_request(berth, server, alice):
    asked = berth("reservations", "create", "--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "4",
                  "--hours", "1", "--json", token="agent")
    assert 3 == asked.code
    details = asked.json["error"]["details"]
    assert "approved" == alice.approve_confirmation(details["confirmationId"]).status
    retry = shlex.split(asked.line("then retry with the same key:"))
    run = berth(*retry[1:], "--json", token="agent")
    assert 0 == run.code, run.err
    key = retry[retry.index("--idempotency-key") + 1]
    from controlplane.domain.ids import reservation_id
    assert reservation_id("acme", "agent", key) == run.json["reservation"]["id"]  # the same request, continued


def test_an_unreachable_server_is_retried_then_exits_5_with_the_key_to_retry(berth, unused_tcp_port):
    run = berth("reservations", "create", *ONE, "--retries", "1", url=f"http://127.0.0.1:{unused_tcp_port}")
    assert 5 == run.code
    assert "retrying in" in run.err and "with the same idempotency key (attempt 2 of 2)" in run.err
    assert "--idempotency-key cli-" in run.line("next: retry with the same key:")


def test_a_redirect_is_not_followed_and_exits_2_saying_where_it_points(berth):
    """A proxy's 302 (a login page, http to https) exited 1 with no advice; followed, a POST would turn into a GET
    and the token go along. The API never redirects: the URL is wrong, said as a configuration error."""
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            self.send_response(302)
            self.send_header("Location", "https://login.example/sso")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    proxy = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        run = berth("whoami", url=f"http://127.0.0.1:{proxy.server_port}")
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert 2 == run.code, run.err
    assert "redirects to https://login.example/sso" in run.err and "give the control plane's own base URL" in run.err


def test_on_a_terminal_a_retry_notice_clears_the_line_a_spinner_may_be_drawing(berth, unused_tcp_port):
    """operations wait draws its spinner on one line without a newline: a retry notice printed after it must not
    run on from it (the line grew past the terminal's width)."""
    run = berth("reservations", "list", "--retries", "1", url=f"http://127.0.0.1:{unused_tcp_port}",
                env={"BERTH_FORCE_TTY": "1"})
    assert "\x1b[Kberth: " in run.err and "retrying in" in run.err, repr(run.err)  # (\r read as a newline)
    plain = berth("reservations", "list", "--retries", "1", url=f"http://127.0.0.1:{unused_tcp_port}")
    assert "\x1b[" not in plain.err  # not on a terminal: no control characters


def test_provider_unavailable_advice_keeps_the_key_and_the_reference():
    args = build_parser().parse_args(["reservations", "create", *ONE, "--idempotency-key", "k-1"])
    ctx = tenant_cli.Context(args, c.Settings("http://x", "t", {"url": "env BERTH_URL"}), None, sys.stdout,  # type: ignore[arg-type]
                             sys.stderr, output="table", progress=False, key="k-1")
    err = c.ProviderUnavailable("PROVIDER_UNAVAILABLE", "pool lost", {"actor": "platform", "reference": "pool-lost:h100:1"}, 503)
    said = advice.advice(ctx, err, [])
    assert 5 == advice.exit_code_of(err)
    assert "reference: pool-lost:h100:1 (quote it to support if this persists)" in said
    assert ("next: retry later with the same key: berth reservations create " + " ".join(ONE)
            + " --idempotency-key k-1") in said


@pytest.mark.parametrize("argv, said", [
    (["reservations", "create", "--pool", "h100"], "the following arguments are required: --gpu-model"),
    (["reservations", "create", *ONE, "--start", "yesterday"], "give now, a relative time (+30m, +1h, +2d), ISO 8601"),
    (["reservations", "create", *ONE, "--start", "+1y"], "give a relative time with a unit, e.g. +30m"),
    (["reservations", "extend", "rsv_x", "--by", "10"], "give a duration with a unit"),
    (["reservations", "create", *ONE, "--max-hourly-price", "cheap"], "give a price in USD per hour in plain decimal"),
    # sent as written, so what the API refuses is refused here: a typo is not quietly a $1000/hr ceiling
    *[(["reservations", "create", *ONE, f"--max-hourly-price={typo}"], f"'{typo}': give a price in USD per hour")
      for typo in ("1e3", "1_000", "+3", " 3", "1E-2", "0.0000001")],
    (["reservations", "create", *ONE[:-2], "--hours", "nan"], "argument --hours: 'nan': give a number"),
    (["whoami", "--retries", "-1"], "argument --retries: '-1': give a whole number of at least 0"),
    (["whoami", "--request-timeout", "0"], "argument --request-timeout: '0': give seconds above 0"),
    (["operations", "wait", "op_x", "--timeout-sec", "-5"], "argument --timeout-sec: '-5': give seconds above 0"),
])
def test_bad_arguments_exit_2_before_anything_is_sent(berth, argv, said):
    run = berth(*argv)
    assert 2 == run.code and said in run.err


def test_an_unknown_confirmation_points_at_the_confirmations_list(berth):
    run = berth("confirmations", "approve", "cnf_missing")
    assert (3, "berth confirmations list") == (run.code, run.line("next: check the id:"))
    assert 0 == berth(*shlex.split(run.line("next: check the id:"))[1:]).code


def test_no_token_anywhere_exits_2_and_says_where_to_put_one(berth):
    run = berth("reservations", "list", token=None)
    assert 2 == run.code and "no token: give --token, set BERTH_TOKEN" in run.err


def test_a_token_with_a_control_character_exits_2_naming_where_it_came_from(berth):
    """A token file with a CRLF line ending gave 'unexpected ValueError: Forbidden control character ...' (exit 1)."""
    run = berth("whoami", token="acme-alice-token-0001\r")
    assert 2 == run.code and "the token (from env BERTH_TOKEN) holds '\\r', which no token has" in run.err, run.err


# ---- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, env, file, expected", [
    (None, None, "bob", "bob"),
    (None, "dave", "bob", "dave"),
    ("alice", "dave", "bob", "alice"),
    ("alice", None, None, "alice"),
])
def test_the_token_comes_from_the_flag_then_the_environment_then_the_file(berth, server, tmp_path, flag, env, file,
                                                                          expected):
    xdg = tmp_path / "xdg"
    if file:
        (xdg / "berth").mkdir(parents=True)
        (xdg / "berth" / "config.json").write_text(json.dumps({"url": server.url, "token": TOKENS[file]}))
    argv = ["reservations", "create", *ONE, "--json"] + (["--token", TOKENS[flag]] if flag else [])
    run = berth(*argv, token=env, env={"XDG_CONFIG_HOME": str(xdg)})
    assert 0 == run.code, run.err
    assert expected == run.json["reservation"]["principalId"]


def test_the_url_comes_from_the_flag_then_the_environment_then_the_file(berth, server, tmp_path, unused_tcp_port):
    nowhere = f"http://127.0.0.1:{unused_tcp_port}"
    config = tmp_path / "berth.json"
    config.write_text(json.dumps({"url": nowhere, "token": TOKENS["bob"]}))
    fast = ["--json", "--retries", "0", "--config", str(config)]
    assert 0 == berth("reservations", "list", *fast, token=None, env={"BERTH_URL": server.url}).code  # env > file
    assert 5 == berth("reservations", "list", *fast, token=None, env={"BERTH_URL": None}).code  # the file's
    assert 0 == berth("reservations", "list", *fast, "--url", server.url, token=None, url=nowhere).code  # flag > env


def test_a_missing_config_file_named_by_flag_exits_2(berth, tmp_path):
    run = berth("reservations", "list", "--config", str(tmp_path / "nope.json"))
    assert 2 == run.code and "no such file" in run.err


def test_profiles_in_the_config_file_come_after_the_flag_and_the_environment(berth, server, tmp_path, unused_tcp_port):
    config = tmp_path / "berth.json"
    config.write_text(json.dumps({
        "url": f"http://127.0.0.1:{unused_tcp_port}", "token": TOKENS["alice"],  # the default profile: nowhere
        "profiles": {"prod": {"url": server.url, "token": TOKENS["bob"]}, "urlonly": {"url": server.url}}}))

    def who(*argv: str, env: dict | None = None) -> Run:
        return berth("reservations", "create", *ONE, "--json", "--retries", "0", "--config", str(config), *argv,
                     token=None, env={"BERTH_URL": None, **(env or {})})

    assert "bob" == who("--profile", "prod").json["reservation"]["principalId"]
    assert "bob" == who(env={"BERTH_PROFILE": "prod"}).json["reservation"]["principalId"]
    assert "alice" == who("--profile", "urlonly").json["reservation"]["principalId"]  # then the top-level token
    assert "dave" == who("--profile", "prod", "--token", TOKENS["dave"]).json["reservation"]["principalId"]
    assert 5 == who().code  # no profile chosen: the top-level keys
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "profile": "prod"}))  # the file's own default
    assert "bob" == who().json["reservation"]["principalId"]
    assert "alice" == who("--profile", "urlonly").json["reservation"]["principalId"]  # the flag wins
    unknown = who("--profile", "staging")
    assert (2, f"berth: --profile staging: no such profile in config file {config} (its profiles: prod, urlonly)") == (
        unknown.code, unknown.err.strip())
    assert 2 == who(env={"BERTH_PROFILE": "staging"}).code


def test_the_settings_and_the_clients_never_show_the_token(tmp_path):
    settings = c.resolve_settings("http://127.0.0.1:1", "secret-token-000001", environ={})
    client, blocking = c.AsyncClient.from_settings(settings), c.Client.from_settings(settings)
    try:
        for shown in (repr(settings), str(settings), repr(client), repr(blocking)):
            assert "secret-token" not in shown and "127.0.0.1:1" in shown
    finally:
        blocking.close()


# ---- operations wait -------------------------------------------------------------------------------

def test_operations_wait_times_out_with_6_then_exits_by_the_failure_actor(berth):
    created = berth("reservations", "create", *ONE, "--json").json["reservation"]
    op = created["operation"]["id"]
    waited = berth("operations", "wait", op, "--timeout-sec", "1", "--json")
    assert (6, False, "running") == (waited.code, waited.json["done"], waited.json["operation"]["status"])
    berth("reservations", "release", created["id"])
    ended = berth("operations", "wait", op, "--timeout-sec", "10", "--table")
    assert 3 == ended.code  # cancelled by the customer's release
    assert "failure      released (actor customer)" in ended.out
    shown = berth("operations", "get", op, "--json")
    assert (0, "cancelled") == (shown.code, shown.json["operation"]["status"])


def test_operations_wait_exits_4_when_the_provider_could_not_place_it(berth):
    blocker = berth("reservations", "create", "--pool", "solo", "--gpu-model", "H100_80GB", "--gpu-count", "1",
                    "--hours", "1", "--json", token="bob")
    assert 0 == blocker.code, blocker.err
    now = int(time.time() * 1000)
    pending = berth("reservations", "create", "--pool", "solo", "--gpu-model", "H100_80GB", "--gpu-count", "1",
                    "--start", str(now), "--end", str(now + 2000), "--json").json["reservation"]
    assert "pending" == pending["state"]
    waited = berth("operations", "wait", pending["operation"]["id"], "--timeout-sec", "20", "--json")
    assert (4, "failed", "provider") == (waited.code, waited.json["operation"]["status"],
                                         waited.json["operation"]["failure"]["actor"])


def test_operations_wait_shows_the_conditions_and_gives_up_when_the_binding_failed(berth, server, alice):
    from tests.controlplane.test_nodes import inventory

    status, node = server.post("/api/nodes/register", "node-token-flaky-00001",
                               {"hostname": "flaky1.test", "inventory": inventory("flaky1.test", "mixed.json")})
    assert status == 200, node
    res = alice.create("flaky", "L40S_48GB", gpu_count=1, duration_hours=1)
    wait_for(lambda: alice.get(res.id).state == "binding", timeout=5)
    waiter = subprocess.Popen  # the wait runs while the agent's failure arrives
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update({"BERTH_URL": server.url, "BERTH_TOKEN": TOKENS["alice"], "BERTH_FORCE_TTY": "1", "COLUMNS": "300"})
    proc = waiter([sys.executable, "-m", "berth", "operations", "wait", res.operation.id, "--timeout-sec", "60"],
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    time.sleep(1)
    status, doc = server.post("/api/nodes/report", node["nodeToken"], {"reports": [
        {"reservationId": res.id, "status": "failed", "message": "binding kind node is not supported"}]})
    assert doc["accepted"] == [res.id]
    out, err = proc.communicate(timeout=30)
    assert advice.EXIT_PLATFORM == proc.returncode, err
    assert time.monotonic() - started < 15  # not the 60 s of --timeout-sec
    assert "DevicesBound=False Binding: waiting for the nodes' agents" in err  # on the progress line, as it changed
    said = f"reservation {res.id} is binding with DevicesBound=False BindFailed: node flaky1: binding kind node"
    assert said in err and "it will not resolve by itself" in err
    assert f"next: end it and book again: berth reservations release {res.id}" in err
    assert "status       running" in out


def test_operations_wait_on_a_terminal_shows_a_spinner_and_a_table(server, config_home, alice):
    """Under a real pty: no env var, no flag; stdout and stderr are the terminal."""
    res = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    env.update({"BERTH_URL": server.url, "BERTH_TOKEN": TOKENS["alice"], "XDG_CONFIG_HOME": str(config_home)})
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "berth", "operations", "wait", res.operation.id,
                             "--timeout-sec", "1"], stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert 6 == proc.wait(30)
    screen = b"".join(chunks).decode()
    assert f"\r\033[K| {res.operation.id} 0s of 1s: " in screen  # the spinner, then the reservation's state
    assert f"{res.operation.id} 0s of 1s: running, reservation " in screen
    assert "status       running" in screen and "wait again: berth operations wait" in screen


# ---- usage --------------------------------------------------------------------------------------------

def test_usage_prints_lines_and_totals(berth, server, alice):
    from decimal import Decimal

    from tests.controlplane.test_nodes import inventory

    hostname = "metered1.test"  # the declared node: its agent takes it over
    status, node = server.post("/api/nodes/register", "node-token-metered-0001",
                               {"hostname": hostname, "inventory": inventory(hostname, "mixed.json")})
    assert status == 200, node
    res = alice.create("metered", "L40S_48GB", gpu_count=2, duration_hours=1)
    wait_for(lambda: alice.get(res.id).state == "binding", timeout=5)
    status, doc = server.post("/api/nodes/report", node["nodeToken"],
                              {"reports": [{"reservationId": res.id, "status": "bound"}]})
    assert doc["accepted"] == [res.id]
    assert alice.get(res.id).state == "active"
    time.sleep(1.1)
    alice.release(res.id)
    as_json = berth("usage", "--json")
    assert 0 == as_json.code, as_json.err
    [line] = [x for x in as_json.json["lines"] if x["reservationId"] == res.id]
    assert line["hourlyUsd"] == "8.000000" and line["seconds"] >= 1
    assert Decimal(line["amountUsd"]) == (Decimal(8) * line["seconds"] / 3600).quantize(Decimal("0.000001"))
    assert Decimal(as_json.json["totalUsd"]) == sum(Decimal(x["amountUsd"]) for x in as_json.json["lines"])
    shown = berth("usage", "--reservation", res.id, "--table")
    assert 0 == shown.code, shown.err
    assert shown.out.splitlines()[0].split() == ["DAY", "RESERVATION", "POOL", "SECONDS", "RATE", "AMOUNT", "RUNNING"]
    assert f"{res.id}  metered" in shown.out and "$8.00/hr" in shown.out  # money for people: two decimals
    assert f"total       ${Decimal(line['amountUsd']).quantize(Decimal('0.01'))}" in shown.out
    tomorrow = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 86_400))
    assert [] == berth("usage", "--since", tomorrow, "--json").json["lines"]



# ---- events ------------------------------------------------------------------------------------

def test_events_list_shows_a_reservations_events_with_iso_times(berth, alice):
    r = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    run = berth("events", "list", "--reservation", r.id, "--limit", "500", env={"BERTH_FORCE_TTY": "1"})
    assert 0 == run.code, run.err
    header, *rows = run.out.splitlines()
    assert header.split()[:5] == ["SEQ", "AT", "RESERVATION", "EVENT", "STATE"]
    assert rows and all(r.id in row for row in rows if not row.startswith("the next page"))
    assert "reservation.placed" in run.out and "Z" in rows[0]
    doc = berth("events", "list", "--reservation", r.id, "--limit", "500", "--json").json
    assert {r.id} == {e["reservationId"] for e in doc["events"]} and doc["nextCursor"] >= doc["events"][-1]["seq"]
    # an id that is not the tenant's is refused as usage refuses it, not listed as "no events"
    missing = berth("events", "list", "--reservation", "res_nope")
    assert (3, True) == (missing.code, "NOT_FOUND" in missing.err), missing.err
    # a page that holds none of the reservation's events says so, and where to list on from
    other = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    page = berth("events", "list", "--reservation", r.id, "--after", str(doc["nextCursor"]),
                 env={"BERTH_FORCE_TTY": "1"})
    assert 0 == page.code and "none of this page's" in page.out and "--after" in page.out, (page.out, page.err)
    assert other.id not in page.out


class Lines:
    """The lines a running command prints on stdout, each within a few seconds or the test fails."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.buf = b""

    def next(self, within: float = 5) -> str:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.proc.stdout], [], [], within)
            assert ready, f"nothing printed within {within} s"
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            assert chunk, "the command ended: " + self.proc.stderr.read().decode()
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def next_json(self, within: float = 5) -> dict:
        return json.loads(self.next(within))


def start_berth(server, config_home, *argv: str, token: str = "alice") -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_")}
    environ.update({"XDG_CONFIG_HOME": str(config_home), "BERTH_URL": server.url, "BERTH_TOKEN": TOKENS[token]})
    return subprocess.Popen([sys.executable, "-m", "berth", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=environ)


def interrupt(proc: subprocess.Popen) -> int:
    proc.send_signal(2)
    return proc.wait(10)


def test_events_follow_prints_each_new_event_as_it_happens(server, config_home, alice):
    cursor = alice.list_events(limit=500)
    while cursor.events:  # the end of the tenant's events so far
        cursor = alice.list_events(after=cursor.next_cursor, limit=500)
    follow = start_berth(server, config_home, "events", "list", "--follow", "--json",
                         "--after", str(cursor.next_cursor or 0))
    lines = Lines(follow)
    try:
        time.sleep(0.5)  # its first long poll is waiting
        started = time.monotonic()
        r = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
        first = lines.next_json()
        assert (r.id, "reservation.placed") == (first["reservationId"], first["type"])
        assert time.monotonic() - started < 5  # pushed by the long poll, not found by a later poll
        alice.release(r.id)
        seen = []  # reservation.binding may come in between
        while "reservation.released" not in seen:
            seen.append(lines.next_json()["type"])
    finally:
        code = interrupt(follow)
    assert advice.EXIT_INTERRUPTED == code, follow.stderr.read()


def test_events_after_a_cursor_the_control_plane_never_gave_says_where_its_events_end(berth, alice):
    alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    page = alice.list_events(limit=500)
    while page.events:
        newest, page = page.next_cursor, alice.list_events(after=page.next_cursor, limit=500)
    # a cursor kept from before a restore of an older copy: past every event this database numbered
    run = berth("events", "list", "--after", str(newest + 1000))
    assert advice.EXIT_CUSTOMER == run.code, run.err
    end = int(re.search(r"events now end at (\d+) ", run.err).group(1))  # every tenant's are numbered together
    assert newest <= end < newest + 1000
    assert f"berth events list --after {end}" in run.err  # the command to go on with


def test_events_follow_goes_on_from_where_the_events_now_end(server, config_home, alice):
    page = alice.list_events(limit=500)
    while page.events:
        page = alice.list_events(after=page.next_cursor, limit=500)
    follow = start_berth(server, config_home, "events", "list", "--follow", "--json",
                         "--after", str((page.next_cursor or 0) + 1000))
    lines = Lines(follow)
    try:
        time.sleep(0.5)  # refused, then waiting on where the events end
        r = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
        first = lines.next_json()
        assert (r.id, "reservation.placed") == (first["reservationId"], first["type"])
    finally:
        code = interrupt(follow)
    assert advice.EXIT_INTERRUPTED == code
    assert "events now end at" in follow.stderr.read().decode()


def test_a_follow_in_json_ends_its_stream_with_the_refusal_on_one_line(berth):
    """--follow --json prints one JSON document per line: a refusal that ends it is one line too, so a reader
    of the stream line by line reads it (it used to be indented over a dozen lines)."""
    run = berth("events", "list", "--follow", "--json", "--reservation", "rsv_nope")
    assert (3, 1) == (run.code, len(run.out.splitlines())), run.out
    assert "NOT_FOUND" == json.loads(run.out)["error"]["code"]


def test_events_follow_outlives_a_control_plane_that_is_away_and_skips_nothing(tmp_path, config_home):
    """A follow runs until Ctrl-C: a control plane killed and back seconds later (its retries spent, even with
    --retries 0) is tried again until it answers, from the last event printed, so nothing is skipped or repeated.
    It used to exit 5 after some 4 seconds, with a retry line that dropped its cursor."""
    import socket

    from tests.controlplane.conftest import bootstrap_doc
    from tests.serverproc import ServerProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    boot = tmp_path / "b.json"
    boot.write_text(json.dumps(bootstrap_doc()))
    served = lambda: ServerProcess(tmp_path / "cp.db", boot, ["--listen", f"127.0.0.1:{port}"]).start()  # noqa: E731
    server = served()
    with c.Client(server.url, TOKENS["alice"]) as alice:
        alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    follow = start_berth(server, config_home, "events", "list", "--follow", "--json", "--retries", "0")
    lines = Lines(follow)
    try:
        seqs = [lines.next_json()["seq"]]
        server.kill()
        time.sleep(3)  # away: the follow keeps trying
        assert follow.poll() is None, follow.stderr.read()
        server = served()
        with c.Client(server.url, TOKENS["alice"]) as alice:
            second = alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
        while True:  # (the first one's window started: its binding may come before)
            got = lines.next_json(within=20)
            seqs.append(got["seq"])
            if (got["reservationId"], got["type"]) == (second.id, "reservation.placed"):
                break
        assert list(range(1, len(seqs) + 1)) == seqs  # none skipped, none repeated
    finally:
        code = interrupt(follow)
        server.stop()
    assert advice.EXIT_INTERRUPTED == code
    assert "trying again in" in follow.stderr.read().decode()


# ---- discover: pools and whoami ------------------------------------------------------------------------

def test_pools_list_and_get_show_what_can_be_booked_and_what_is_free(berth):
    run = berth("pools", "list", env={"BERTH_FORCE_TTY": "1"})
    assert 0 == run.code, run.err
    header = run.out.splitlines()[0].split()
    assert header[:5] == ["POOL", "REGION", "MODEL", "SHARING", "SHAPE"]
    assert "h100" in run.out and "1g.10gb" in run.out and "per GPU" in run.out
    doc = berth("pools", "list", "--json").json
    h100 = {p["id"]: p for p in doc["pools"]}["h100"]
    assert (True, "exclusive") == (h100["owned"], h100["sharing"]) and h100["freeNow"] <= h100["units"]
    got = berth("pools", "get", "mig", env={"BERTH_FORCE_TTY": "1"})
    assert 0 == got.code and "free now" in got.out and "1g.10gb" in got.out, got.err
    # a window from another time: its first count is free at --from, not now
    later = berth("pools", "list", "--from", "+2d", env={"BERTH_FORCE_TTY": "1"})
    assert "FREE AT FROM/TOTAL" in later.out.splitlines()[0] and "FREE NOW" not in later.out, later.out
    assert "free at --from" in berth("pools", "get", "mig", "--from", "+2d", env={"BERTH_FORCE_TTY": "1"}).out
    missing = berth("pools", "get", "nope")
    assert 3 == missing.code and "NOT_FOUND" in missing.err


def test_a_share_below_the_per_gpu_share_is_raised_and_the_table_says_so(berth):
    run = berth("reservations", "quote", *ONE, "--vcpu", "1", env={"BERTH_FORCE_TTY": "1"})
    assert 0 == run.code, run.err
    assert "note: --vcpu 1 raised to the per-GPU share of 8 per node" in run.out
    assert "note:" not in berth("reservations", "quote", *ONE, "--vcpu", "1", "--json").out  # JSON stays the API's


def test_whoami_names_the_tenant_principal_kind_and_scope(berth):
    run = berth("whoami", "--json")
    assert {"id": "alice", "tenantId": "acme", "kind": "user", "scope": "manage", "delegatedBy": None} == \
        run.json["principal"]
    table_run = berth("whoami", token="agent", env={"BERTH_FORCE_TTY": "1"})
    rows = dict(line.split(None, 1) for line in table_run.out.replace("acting for", "acting-for").splitlines())
    assert ("agent", "agent", "alice") == (rows["principal"], rows["kind"], rows["acting-for"])


def later(client: c.Client) -> c.Reservation:
    """A reservation whose window starts in three hours: it stays placed meanwhile."""
    start = (int(time.time() * 1000) // 3_600_000 + 3) * 3_600_000
    return client.create("h100", "H100_80GB", gpu_count=1, start=start, end=start + 3_600_000)


def test_list_watch_prints_the_list_then_each_change_of_my_reservations(server, config_home, alice):
    mine = later(alice)
    watch = start_berth(server, config_home, "reservations", "list", "--watch", "--json", "--state", "placed")
    lines = Lines(watch)
    try:
        first = lines.next_json()
        assert {"reservation"} == set(first) and mine.id == first["reservation"]["id"]
        time.sleep(0.5)  # its first long poll is waiting
        with c.Client(server.url, TOKENS["bob"]) as bob:
            later(bob)  # the tenant's, not mine: not shown
        new = later(alice)
        change = lines.next_json()
        assert (new.id, "placed", "reservation.placed") == (
            change["reservation"]["id"], change["reservation"]["state"], change["event"]["type"])
        alice.release(mine.id)  # leaves --state placed: seen leaving
        change = lines.next_json()
        assert (mine.id, "released", "reservation.released") == (
            change["reservation"]["id"], change["reservation"]["state"], change["event"]["type"])
    finally:
        code = interrupt(watch)
    assert advice.EXIT_INTERRUPTED == code, watch.stderr.read()


def test_list_watch_on_a_terminal_lines_up_the_changed_rows(server, config_home, alice):
    for _ in range(3):  # at least the three rows --limit 3 shows, whatever ran before
        alice.create("h100", "H100_80GB", gpu_count=1, duration_hours=1)
    watch = start_berth(server, config_home, "reservations", "list", "--watch", "--table", "--limit", "3")
    lines = Lines(watch)
    try:
        header = lines.next()
        assert header.split() == ["ID", "STATE", "POOL", "GPUS", "START", "END", "OPERATION"]
        for _ in range(3):
            lines.next()
        time.sleep(0.5)
        new = later(alice)  # starts in hours: still placed when the row is printed
        row = lines.next()
        assert row.startswith(new.id) and row.index("placed") == header.index("STATE")
        alice.cancel(new.id)  # a state wider than any the first table showed: the columns after it stay put
        row = lines.next()
        assert row.startswith(new.id) and row.index("cancelled") == header.index("STATE"), (header, row)
        assert row.index("h100") == header.index("POOL"), (header, row)
    finally:
        interrupt(watch)


# ---- completion ------------------------------------------------------------------------------------

def complete(line: str) -> list[str]:
    """What bash offers for `line` (the cursor at its end), from the generated script."""
    script = subprocess.run([sys.executable, "-m", "berth", "completion", "bash"], capture_output=True, text=True,
                            check=True).stdout
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    driver = (f"{script}\nCOMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1}; "
              "_berth; printf '%s\\n' \"${COMPREPLY[@]}\"")
    return subprocess.run(["bash", "-c", driver], capture_output=True, text=True, check=True).stdout.split()


def test_bash_completion_offers_commands_subcommands_flags_and_choices():
    registered = subprocess.run(["bash", "-c", "source <(python -m berth completion bash) && complete -p berth"],
                                capture_output=True, text=True)
    assert (0, "complete -F _berth berth") == (registered.returncode, registered.stdout.strip()), registered.stderr
    assert ["list", "ls"] == complete("berth reservations l")
    assert {"reservations", "admin", "completion", "controlplane"} <= set(complete("berth "))
    assert ["--scope"] == complete("berth reservations list --sc")
    assert ["all", "mine"] == sorted(complete("berth reservations list --scope "))
    assert ["--profile", "--pool"] == complete("berth reservations ls --state active --p")  # past a flag's value
    assert ["table", "wide", "json", "yaml"] == complete("berth admin nodes list -o ")
    assert ["bash", "zsh"] == complete("berth completion ")


def test_zsh_completion_is_a_zsh_script():
    script = subprocess.run([sys.executable, "-m", "berth", "completion", "zsh"], capture_output=True, text=True,
                            check=True).stdout
    assert script.startswith("#compdef berth") and "'berth reservations' 'create quote get release rm" in script
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed: the script's syntax is not checked")
    checked = subprocess.run(["zsh", "-n"], input=script, capture_output=True, text=True)
    assert 0 == checked.returncode, checked.stderr


def test_completion_for_another_shell_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "berth", "completion", "fish"], capture_output=True, text=True)
    assert 2 == out.returncode and "give the shell, bash or zsh" in out.stderr


def test_ssh_keys_for_a_node_binding_come_from_lines_or_pub_files_and_a_bad_one_names_its_flag(berth, tmp_path):
    import subprocess as sp
    key = tmp_path / "id_ed25519"
    sp.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True)
    pub = Path(f"{key}.pub")
    base = ["--pool", "h100", "--gpu-model", "H100_80GB", "--gpu-count", "8", "--hours", "1", "--binding", "node"]
    quote = berth("reservations", "quote", *base, "--ssh-key", str(pub), "--json")
    assert 0 == quote.code, quote.err
    bad = berth("reservations", "quote", *base, "--ssh-key", str(pub), "--ssh-key", "ssh-ed25519 AAAAnotakey",
                env={"BERTH_FORCE_TTY": "1"})
    assert 3 == bad.code and "access.sshKeys[1]" in bad.err and "next: fix --ssh-key number 2" in bad.err, bad.err
    missing = berth("reservations", "quote", *base)
    assert 3 == missing.code and "next: fix --ssh-key" in missing.err, missing.err
    # a path that is no file, and a private key, are refused here: neither is sent as if it were a key
    for given, said in ((str(tmp_path / "absent.pub"), "no such file, and not a public key's line"),
                        (str(key), f"is a private key; give its public key, {key}.pub")):
        local = berth("reservations", "quote", *base, "--ssh-key", given)
        assert (2, True) == (local.code, said in local.err), local.err
        assert "PRIVATE" not in local.err


def test_a_reader_that_goes_away_ends_the_command_quietly(server, config_home):
    import io

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    err = io.StringIO()
    code = tenant_cli.main(["whoami", "--json"], stdout=ClosedPipe(), stderr=err, environ={
        "BERTH_URL": server.url, "BERTH_TOKEN": TOKENS["alice"], "XDG_CONFIG_HOME": str(config_home)})
    assert (141, "") == (code, err.getvalue())


def test_provider_unavailable_advice_for_a_read_has_no_key_to_keep():
    args = build_parser().parse_args(["reservations", "list"])
    ctx = tenant_cli.Context(args, c.Settings("http://x", "t", {"url": "env BERTH_URL"}), None, sys.stdout,  # type: ignore[arg-type]
                             sys.stderr, output="table", progress=False, key=None)
    err = c.ProviderUnavailable("PROVIDER_UNAVAILABLE", "iam away", {"actor": "platform", "reference": "iam-1"}, 503)
    said = advice.advice(ctx, err, ["reservations", "list"])
    assert "next: retry later: berth reservations list" in said, said
    assert not [line for line in said if "same key" in line]


def _ctx(argv: list[str], key: str | None = None):
    args = build_parser().parse_args(argv)
    return tenant_cli.Context(args, c.Settings("http://x", "t", {"url": "env BERTH_URL"}), None, sys.stdout,  # type: ignore[arg-type]
                              sys.stderr, output="table", progress=False, key=key)


@pytest.mark.parametrize("err", [
    c.BadAnswer("BAD_ANSWER", "HTTP 504 without the API's error envelope: '<html>'", {}, 504),
    c.BadAnswer("BAD_ANSWER", "HTTP 500 without the API's error envelope", {}, 500),
    c.BadAnswer("BAD_ANSWER", "the answer is not JSON", {}, 202),
    c.BerthError("INTERNAL", "a code of a newer server", {}, 500),
])
def test_a_create_answered_by_a_proxys_5xx_or_an_unreadable_answer_prints_the_key_to_retry_with(err):
    """A 504 from a balancer after the create was booked printed no key and no next command: run again, it
    booked twice."""
    argv = ["reservations", "create", *ONE, "--idempotency-key", "cli-k1"]
    said = advice.advice(_ctx(argv, "cli-k1"), err, argv)
    assert "the request may have been accepted: do not use a new key for it" in said, said
    assert any(line.startswith("next: retry later with the same key: ") and "--idempotency-key cli-k1" in line
               for line in said), said
    assert advice.exit_code_of(err) == (1 if err.status == 202 else 5)


@pytest.mark.parametrize("err", [
    c.TransportError("TRANSPORT", "connection dropped", {"sent": True}, None),
    c.ProviderUnavailable("PROVIDER_UNAVAILABLE", "commit not confirmed", {"actor": "platform", "reference": "r"}, 503),
    c.BadAnswer("BAD_ANSWER", "HTTP 504 without the API's error envelope", {}, 504),
])
def test_an_extend_by_whose_answer_was_lost_is_not_advised_again_as_is(err):
    """Repeated, an extend --by extends again from the new end: the advice was to run it again (billed twice)."""
    argv = ["reservations", "extend", "rsv_x", "--by", "30m"]
    said = advice.advice(_ctx(argv), err, argv)
    assert not [line for line in said if "--by" in line and line.startswith(("next:", "then"))], said
    assert "next: see its end: berth reservations get rsv_x" in said, said
    assert any("extend rsv_x --until END" in line for line in said), said


def test_a_proxys_4xx_exits_3_and_an_unknown_method_says_the_url_does_not_reach_the_api():
    assert 3 == advice.exit_code_of(c.BadAnswer("BAD_ANSWER", "HTTP 429 without the API's error envelope", {}, 429))
    said = advice.advice(_ctx(["whoami"]), c.NotFound("NOT_FOUND", "no method /berth/api/iam/whoami", {}, 404),
                         ["whoami"])
    assert ["the URL http://x (from env BERTH_URL) does not reach this method of a Berth control plane: give its "
            "base URL, with no path (a proxy's prefix included only where the proxy strips it), or the control "
            "plane is of an earlier release than this CLI (berth --version)"] == said
