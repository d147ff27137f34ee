"""The remote authorizer against a small AuthZEN decision service that the test starts on loopback."""
from __future__ import annotations

import asyncio

import pytest
import structlog
from aiohttp import web

from controlplane.api.app import create_app
from controlplane.wiring import Config
from tests.controlplane.conftest import Api


class Pdp:
    """A decision service in the AuthZEN evaluation shape, with switches for failures."""

    def __init__(self):
        self.delay = 0.0
        self.status = 200
        self.malformed = False
        self.seen: list[dict] = []

    def decide(self, ev: dict) -> dict:
        subject, resource = ev["subject"], ev["resource"]
        props = resource["properties"]
        same_tenant = subject["properties"]["tenant"] == props.get("tenant")
        if not same_tenant:
            return {"decision": False, "context": {"reason": "other tenant"}}
        if subject["type"] == "Agent" and ev["action"]["name"].endswith(":create") and props.get("gpuCount", 0) > 2:
            confirm = "delegatedBy" in subject["properties"]
            return {"decision": False, "context": {"confirmation": {"required": confirm}}}
        return {"decision": True}

    async def evaluation(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.Response(status=self.status)
        if self.malformed:
            return web.json_response({"verdict": "yes"})
        return web.json_response(self.decide(body))

    async def evaluations(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"evaluations": [self.decide(ev) for ev in body["evaluations"]]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/access/v1/evaluation", self.evaluation)
        app.router.add_post("/access/v1/evaluations", self.evaluations)
        return app


@pytest.fixture
async def remote(aiohttp_server, aiohttp_client, tmp_path, bootstrap_file, clock):
    pdp = Pdp()
    server = await aiohttp_server(pdp.app())
    config = Config(db=f"sqlite:///{tmp_path / 'cp.db'}", bootstrap=bootstrap_file(), clock=clock, synchronous="NORMAL",
                    reconcile=False, authzen=str(server.make_url("/")), authzen_timeout_s=0.5)
    client = await aiohttp_client(create_app(config))
    return Api(client, clock), pdp


async def test_remote_decisions_carry_the_request_in_authzen_shape(remote):
    api, pdp = remote
    status, doc = await api.create(key="a", gpuCount=2)
    assert status == 202 and doc["reservation"]["state"] == "placed"
    ev = pdp.seen[-1]
    assert ev["subject"] == {"type": "User", "id": "alice", "properties": {"tenant": "acme"}}
    assert ev["action"] == {"name": "compute:reservations:create"}
    assert ev["resource"]["type"] == "Reservation"
    assert ev["resource"]["properties"]["gpuCount"] == 2 and ev["resource"]["properties"]["region"] == "eu"
    listed = await api.ok("list", "alice", {"scope": "all"})
    assert len(listed["reservations"]) == 1


async def test_a_confirmation_answer_in_the_context_opens_a_confirmation(remote):
    api, pdp = remote
    status, doc = await api.create("agent", key="big", gpuCount=4)
    assert (status, doc["error"]["code"]) == (403, "CONFIRMATION_REQUIRED")
    status, doc = await api.create("robot", key="big", gpuCount=4)
    assert (status, doc["error"]["code"]) == (403, "ACCESS_DENIED")


@pytest.mark.parametrize("failure", ["timeout", "500", "malformed", "down"])
async def test_a_failed_remote_decision_denies_and_answers_provider_unavailable(remote, failure):
    """Nothing is allowed without a decision; since the fault is the platform's, the answer is 503 with a reference."""
    api, pdp = remote
    if failure == "timeout":
        pdp.delay = 1.0
    elif failure == "500":
        pdp.status = 500
    elif failure == "malformed":
        pdp.malformed = True
    else:
        api.cp.authorizer.base_url = "http://127.0.0.1:9"  # nothing listens there
    with structlog.testing.capture_logs() as logged:
        status, doc = await api.create(key="x")
    assert (status, doc["error"]["code"]) == (503, "PROVIDER_UNAVAILABLE")
    details = doc["error"]["details"]
    assert details["actor"] == "platform" and details["reference"]
    assert api.cp.state.calendar.by_reservation == {}
    # the reference is what support finds in the log, with how the service failed; the tenant is not told its address
    [line] = [x for x in logged if x.get("reference") == details["reference"]]
    text = " ".join(line["errors"])
    assert {"timeout": "did not answer", "500": "HTTP 500", "malformed": "boolean", "down": "failed"}[failure] in text
    assert "errors" not in details and "127.0.0.1" not in str(doc)


async def test_after_the_decision_service_recovers_the_same_key_is_decided_again(remote):
    api, pdp = remote
    pdp.status = 500
    status, _ = await api.create(key="again")
    assert status == 503
    pdp.status = 200
    status, doc = await api.create(key="again")
    assert status == 202 and doc["reservation"]["state"] == "placed"
