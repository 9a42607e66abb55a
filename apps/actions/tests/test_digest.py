"""h(a) and k_a (apps/actions/digest.py; DESIGN.md §6, §7): the digest binds tool, tool version and
parameters; the idempotency key is one per logical action; what is sent is what is hashed."""

from __future__ import annotations

from apps.actions.digest import action_digest, idempotency_key, proposal_digest, sendable

PARAMS = {"title": "Fuser error 50.4", "priority": "P3", "labels": ["faultdesk", "printer"]}


def test_the_digest_binds_tool_version_and_every_parameter():
    base = action_digest(tool="ticket.create", tool_version="1", params=PARAMS)
    assert base == action_digest(tool="ticket.create", tool_version="1", params=dict(reversed(PARAMS.items())))
    assert base != action_digest(tool="ticket.create", tool_version="2", params=PARAMS)
    assert base != action_digest(tool="ticket.comment", tool_version="1", params=PARAMS)
    assert base != action_digest(tool="ticket.create", tool_version="1", params={**PARAMS, "priority": "P1"})


def test_a_proposal_digest_is_recomputed_never_read_from_its_label():
    proposal = {"tool": "ticket.create", "tool_version": "1", "params": {**PARAMS, "priority": "P1"},
                "digest": action_digest(tool="ticket.create", tool_version="1", params=PARAMS)}
    assert proposal_digest(proposal) != proposal["digest"]
    assert proposal_digest(proposal) == action_digest(tool="ticket.create", tool_version="1",
                                                      params=proposal["params"])


def test_what_is_sent_is_a_fresh_copy_of_exactly_what_is_hashed():
    params, digest = sendable(tool="ticket.create", tool_version="1", params=PARAMS)
    assert params == PARAMS and params is not PARAMS and params["labels"] is not PARAMS["labels"]
    assert digest == action_digest(tool="ticket.create", tool_version="1", params=PARAMS)


def test_the_key_is_scoped_by_tenant_and_tool_and_differs_per_intent():
    key = idempotency_key(tenant_slug="acme", tool="ticket.create", task_id="t1", digest="d", intent_seq=7)
    assert key.startswith("acme:ticket.create:") and len(key.rsplit(":", 1)[1]) == 32
    assert key == idempotency_key(tenant_slug="acme", tool="ticket.create", task_id="t1", digest="d", intent_seq=7)
    assert key != idempotency_key(tenant_slug="acme", tool="ticket.create", task_id="t1", digest="d", intent_seq=9)
