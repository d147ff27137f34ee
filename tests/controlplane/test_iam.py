"""The embedded Cedar authorizer: policies validated against the schema, decisions, memo soundness."""
from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import bootstrap
from controlplane.domain.model import Principal
from controlplane.iam.authorizer import CREATE, EXTEND, READ, AuthzRequest, Resource
from controlplane.iam.cedar import CedarAuthorizer, PolicyError, validate
from tests.controlplane.conftest import POLICIES

ROOT = Path(__file__).resolve().parents[2]
ALICE = Principal("alice", "acme")
AGENT = Principal("agent", "acme", "agent", "alice")


def _res(rid: str = "r1", **attrs) -> Resource:
    base = {"tenant": "acme", "poolId": "p", "region": "eu", "gpuModel": "H100_80GB", "gpuCount": 1, "nodeCount": 1,
            "durationHours": 1, "vcpu": 8, "memoryGiB": 64, "binding": "hold", "spot": False, "principal": ALICE}
    return Resource("Reservation", rid, {**base, **attrs})


def _authorizer(policies: str) -> CedarAuthorizer:
    people = {"alice": ALICE, "agent": AGENT}
    return CedarAuthorizer(policies, people.get)


def test_the_example_and_test_policies_validate_against_the_schema():
    catalog, _, _ = bootstrap.read(ROOT / "examples" / "bootstrap.json")
    validate(catalog.policies)
    validate(POLICIES)


def test_the_example_agents_24_hour_cap_caps_its_extensions_too():
    catalog, _, _ = bootstrap.read(ROOT / "examples" / "bootstrap.json")
    az = _authorizer(catalog.policies)
    assert az.decide_now(AuthzRequest(AGENT, CREATE, _res(durationHours=24, principal=AGENT))).allowed
    # an extend is decided on the total after it
    assert not az.decide_now(AuthzRequest(AGENT, EXTEND, _res(durationHours=124, principal=AGENT))).allowed
    assert az.decide_now(AuthzRequest(AGENT, EXTEND, _res(durationHours=20, principal=AGENT))).allowed
    assert az.decide_now(AuthzRequest(ALICE, EXTEND, _res(durationHours=124))).allowed  # the user may


def test_a_policy_with_an_unknown_attribute_does_not_validate():
    with pytest.raises(PolicyError):
        validate('permit (principal, action, resource) when { resource.colour == "red" };')


def test_nothing_is_allowed_unless_a_policy_permits_it():
    assert not _authorizer("").decide_now(AuthzRequest(ALICE, CREATE, _res())).allowed


def test_agent_limits_and_tenant_scoping():
    az = _authorizer(POLICIES)
    assert az.decide_now(AuthzRequest(ALICE, CREATE, _res(gpuCount=8))).allowed
    assert not az.decide_now(AuthzRequest(AGENT, CREATE, _res(gpuCount=3, principal=AGENT))).allowed
    assert not az.decide_now(AuthzRequest(ALICE, READ, _res(tenant="globex"))).allowed


def test_memoized_decisions_equal_fresh_ones():
    az = _authorizer(POLICIES)
    for count in (1, 2, 3, 1, 3):
        req = AuthzRequest(AGENT, CREATE, _res(gpuCount=count, principal=AGENT))
        assert az.decide_now(req).allowed == az._decide(req).allowed == (count <= 2)


@pytest.mark.parametrize("named", ['Reservation::"r1"', 'Reservation :: "r1"', 'Reservation\n  ::"r1"'])
def test_a_policy_naming_a_reservation_turns_the_memo_off(named):
    az = _authorizer(f'permit (principal, action, resource) when {{ resource == {named} }};')
    assert az._memo is None
    assert az.decide_now(AuthzRequest(ALICE, READ, _res("r1"))).allowed
    assert not az.decide_now(AuthzRequest(ALICE, READ, _res("r2"))).allowed


@pytest.mark.parametrize("first", ["r1", "r2"])
def test_a_forbid_of_one_reservation_in_its_scope_holds_whichever_is_decided_first(first):
    """Two reservations of equal attributes: the one forbidden by name is denied, the other allowed, in either
    order (a memo keyed on the attributes would give the second the first one's decision)."""
    az = _authorizer(POLICIES + '\nforbid (principal, action, resource == Reservation :: "r2");')
    order = [first, "r2" if first == "r1" else "r1"]
    decided = {rid: az.decide_now(AuthzRequest(ALICE, READ, _res(rid))).allowed for rid in order}
    assert decided == {"r1": True, "r2": False}


@pytest.mark.parametrize("policy", [
    'permit (principal in Tenant :: "acme", action, resource);',
    'permit (principal, action, resource) when { [Pool :: "p"].contains(resource.pool) };',
    'permit (principal, action in [Action::"compute:reservations:read"], resource) when { resource.tenant == Tenant::"acme" };',
])
def test_a_tenant_or_pool_named_anywhere_turns_the_memo_off_too(policy):
    from controlplane.iam.cedar import names_an_entity
    assert names_an_entity(policy)


def test_policies_naming_only_actions_and_people_keep_the_memo():
    from controlplane.iam.cedar import names_an_entity
    assert not names_an_entity(POLICIES)
    assert not names_an_entity('permit (principal == User::"alice", action == Action::"compute:reservations:read", '
                               'resource is Reservation);')


def test_a_failed_decision_is_a_deny_with_the_reason():
    az = _authorizer(POLICIES)
    decision = az.decide_now(AuthzRequest(ALICE, CREATE, _res(vcpu=1.5)))  # Cedar has no float
    assert not decision.allowed and decision.errors


async def test_batch_decisions_match_single_ones():
    az = _authorizer(POLICIES)
    bob = Principal("bob", "acme")
    reqs = [AuthzRequest(bob, READ, _res(f"r{i}", principal=bob if i % 2 else ALICE)) for i in range(6)]
    batch = await az.decide_many(reqs)
    assert [d.allowed for d in batch] == [az._decide(r).allowed for r in reqs] == [False, True] * 3


def test_a_deny_names_the_forbid_that_matched_with_its_annotations_or_says_no_policy_permits_it():
    from controlplane.iam.authorizer import access_denied
    policies = POLICIES + """
@id("no-h200")
@reason("H200 GPUs are for the research tenant")
forbid (principal, action, resource is Reservation) when { resource.gpuCount == 7 };"""
    az = _authorizer(policies)
    denied = az.decide_now(AuthzRequest(ALICE, CREATE, _res(gpuCount=7)))
    assert (False, "no-h200", "H200 GPUs are for the research tenant") == (denied.allowed, denied.policy, denied.reason)
    err = access_denied(denied, "alice may not create this reservation", {"action": CREATE})
    assert err.message == "alice may not create this reservation: H200 GPUs are for the research tenant"
    assert ("no-h200", "H200 GPUs are for the research tenant") == (err.details["policy"], err.details["reason"])
    # with a second forbid that matches too and says nothing, the one that says why is named, whatever their order
    for unannotated in ("forbid (principal, action, resource is Reservation) when { resource.gpuCount > 6 };\n",
                        "@id(\"zz-big\") forbid (principal, action, resource is Reservation) when { resource.gpuCount > 6 };"):
        for both in (unannotated + policies, policies + "\n" + unannotated):
            twice = _authorizer(both).decide_now(AuthzRequest(ALICE, CREATE, _res(gpuCount=7)))
            assert ("no-h200", "H200 GPUs are for the research tenant") == (twice.policy, twice.reason)
    # a forbid without a reason is named in the message
    bare = _authorizer(POLICIES + "\n@id(\"big\") forbid (principal, action, resource is Reservation) "
                                  "when { resource.gpuCount == 7 };").decide_now(AuthzRequest(ALICE, CREATE, _res(gpuCount=7)))
    err = access_denied(bare, "alice may not create this reservation", {"action": CREATE})
    assert err.message == "alice may not create this reservation: forbidden by policy big"
    nobody = _authorizer("forbid (principal, action, resource) when { false };")
    none = nobody.decide_now(AuthzRequest(ALICE, CREATE, _res()))
    assert (False, "", "") == (none.allowed, none.policy, none.reason)
    err = access_denied(none, "alice may not create this reservation", {"action": CREATE})
    assert err.message.endswith(": no policy permits it") and "policy" not in err.details


def test_a_policy_that_does_not_parse_or_validate_is_named_by_its_line_and_first_words():
    policies = ('// the tenant\'s own\n'
                'permit (principal, action, resource) when { principal.tenant == resource.tenant };\n'
                '\n'
                'permit (principal, action, resource) when { "a;b" == "x" && };\n'
                'forbid (principal, action, resource) when { resource.colour == 1 };\n')
    with pytest.raises(PolicyError) as err:
        validate(policies)
    assert str(err.value).startswith("line 4 ('permit (principal, action, resource) when { \"a;b\" == \"x\"")
    assert str(err.value).endswith("Policy parse error: unexpected token `}`")
    fixed = policies.replace("&& }", "}")
    with pytest.raises(PolicyError) as err:
        validate(fixed)
    said = str(err.value)
    assert (True, 1) == (said.startswith("line 5 ('forbid (principal, action, resource) when { resource.colour"),
                         said.count("line 5")), said  # its several complaints under one place
