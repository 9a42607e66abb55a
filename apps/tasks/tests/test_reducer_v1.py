"""The reducer δ (DESIGN.md §4): every legal transition, refusal of every illegal one, and
properties over random event sequences (terminal states never change; U + R ≤ B)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.tasks import reducer as r

DEVICE = {"device_id": 1, "asset_tag": "PRN-0417", "kind": "printer", "state": "fault", "version": 17}
REF = {"chunk_id": 1, "document_title": "Fuser", "version": 1, "section": "Procedure", "excerpt": "x"}
PROPOSAL = {"tool": "ticket.create", "tool_version": "1", "params": {"title": "t"}, "digest": "d1"}


def _apply(state, *events):
    for etype, payload in events:
        state = r.reduce(state, etype, payload)
    return state


ACCEPT = ("task.accepted", {"request": {"device_id": 1, "symptom": "fuser error"}, "budget_total": 100})
START = ("retrieval.started", {})
EVID = ("evidence.retrieved", {"refs": [REF]})
READ = ("device.read", {"reading": DEVICE})
DRAFT = ("draft.proposed", {"draft": {"ticket": {}}})
ASK = ("approval.requested", {"approval_id": "a1", "proposal": PROPOSAL, "object_version": 17,
                              "policy_version": 1, "expires_at": "2030-01-01T00:00:00+00:00"})
GRANT = ("approval.granted", {"approval_id": "a1", "decided_by": "avery"})
INTENT = ("intent.committed", {"action_id": "x1", "idempotency_key": "k", "digest": "d1", "reservation": 5,
                               "approval_required": True})
RECEIPT = ("receipt.recorded", {"action_id": "x1", "receipt": {"external_id": "REF-1", "version": 1},
                                "cost": 5})
DONE = ("task.completed", {"reason": "ticket_created", "answer": {"text": "a"}})

# A prefix of events that brings a fresh task into each status.
PREFIX = {
    None: [],
    r.ACCEPTED: [ACCEPT],
    r.RETRIEVING: [ACCEPT, START],
    r.PROPOSING: [ACCEPT, START, EVID, READ],
    r.VALIDATING: [ACCEPT, START, EVID, READ, DRAFT],
    r.WAITING_INPUT: [ACCEPT, START, EVID, READ, DRAFT, ("input.requested", {"questions": ["q"]})],
    r.WAITING_APPROVAL: [ACCEPT, START, EVID, READ, DRAFT, ASK],
    r.DISPATCHING: [ACCEPT, START, EVID, READ, DRAFT, ASK, GRANT, INTENT],
    r.WAITING_RECONCILIATION: [ACCEPT, START, EVID, READ, DRAFT, ASK, GRANT, INTENT,
                               ("outcome.unknown", {"action_id": "x1", "error": {}})],
    r.COMPLETED: [ACCEPT, START, EVID, READ, DRAFT, ASK, GRANT, INTENT, RECEIPT, DONE],
    r.FAILED: [ACCEPT, ("task.failed", {"reason": "deadline_exceeded"})],
    r.CANCELLED: [ACCEPT, ("cancel.requested", {"reason": "changed my mind"})],
}


def state_in(status):
    return _apply(r.initial_state(), *PREFIX[status])


# (status before, event, payload, status after) — one row per legal transition of the state table.
LEGAL = [
    (None, *ACCEPT, r.ACCEPTED),
    (r.ACCEPTED, *START, r.RETRIEVING),
    (r.RETRIEVING, *EVID, r.RETRIEVING),
    ("RETRIEVING+evidence", *READ, r.PROPOSING),
    (r.PROPOSING, *DRAFT, r.VALIDATING),
    (r.PROPOSING, "task.completed", {"reason": "proposal_rejected", "answer": {}}, r.COMPLETED),
    (r.VALIDATING, "draft.invalid", {"problems": ["p"]}, r.PROPOSING),
    (r.VALIDATING, "input.requested", {"questions": ["q"]}, r.WAITING_INPUT),
    (r.VALIDATING, *ASK, r.WAITING_APPROVAL),
    (r.VALIDATING, "intent.committed", {"action_id": "x1", "idempotency_key": "k", "digest": "d9",
                                        "reservation": 5, "approval_required": False, "proposal": PROPOSAL},
     r.DISPATCHING),
    (r.VALIDATING, "task.completed", {"reason": "no_action_needed", "answer": {}}, r.COMPLETED),
    (r.WAITING_INPUT, "input.provided", {"text": "since Monday"}, r.RETRIEVING),
    (r.WAITING_APPROVAL, *GRANT, r.WAITING_APPROVAL),
    (r.WAITING_APPROVAL, "approval.rejected", {"approval_id": "a1", "decided_by": "avery", "reason": "no"},
     r.PROPOSING),
    (r.WAITING_APPROVAL, "approval.invalidated", {"approval_id": "a1", "reason": "expired"}, r.RETRIEVING),
    ("WAITING_APPROVAL+granted", *INTENT, r.DISPATCHING),
    (r.DISPATCHING, *RECEIPT, r.DISPATCHING),
    (r.DISPATCHING, "outcome.unknown", {"action_id": "x1", "error": {}}, r.WAITING_RECONCILIATION),
    (r.DISPATCHING, "dispatch.failed", {"action_id": "x1", "error": "invalid_params"}, r.FAILED),
    (r.DISPATCHING, "approval.invalidated", {"approval_id": "a1", "reason": "device version changed",
                                             "action_not_sent": True}, r.RETRIEVING),
    ("DISPATCHING+receipt", *DONE, r.COMPLETED),
    (r.WAITING_RECONCILIATION, *RECEIPT, r.DISPATCHING),
    (r.WAITING_RECONCILIATION, "reconciliation.retry", {"action_id": "x1", "reason": "not found"}, r.DISPATCHING),
    (r.WAITING_RECONCILIATION, "dispatch.failed", {"action_id": "x1", "error": "not executed"}, r.FAILED),
    ("CANCELLED+action", *RECEIPT, r.CANCELLED),
    ("CANCELLED+action", "outcome.unknown", {"action_id": "x1", "error": {}}, r.CANCELLED),
    ("CANCELLED+action", "dispatch.failed", {"action_id": "x1", "error": "cancelled before send"}, r.CANCELLED),
] + [(s, "task.failed", {"reason": "limit"}, r.FAILED) for s in r.NON_TERMINAL
     if s not in (r.DISPATCHING, r.WAITING_RECONCILIATION)] + [
    (s, "cancel.requested", {"reason": "stop"}, r.CANCELLED) for s in r.NON_TERMINAL
]

SPECIAL = {
    "RETRIEVING+evidence": lambda: _apply(state_in(r.RETRIEVING), EVID),
    "WAITING_APPROVAL+granted": lambda: _apply(state_in(r.WAITING_APPROVAL), GRANT),
    "DISPATCHING+receipt": lambda: _apply(state_in(r.DISPATCHING), RECEIPT),
    "CANCELLED+action": lambda: _apply(state_in(r.DISPATCHING), ("cancel.requested", {"reason": "stop"})),
}


@pytest.mark.parametrize(("before", "etype", "payload", "after"), LEGAL,
                         ids=[f"{row[0]}--{row[1]}" for row in LEGAL])
def test_every_legal_transition(before, etype, payload, after):
    state = SPECIAL[before]() if before in SPECIAL else state_in(before)
    frozen = copy.deepcopy(state)
    nxt = r.reduce(state, etype, payload)
    assert nxt["status"] == after
    assert state == frozen, "δ must not mutate its input"


def test_state_table_rows_cover_every_event_type():
    covered = {row[1] for row in LEGAL}
    assert covered == set(r.EVENT_TYPES)


ILLEGAL = [(s, e) for s in [None, *r.STATUSES] for e in r.EVENT_TYPES if s not in r.TRANSITIONS[e][0]]


@pytest.mark.parametrize(("status", "etype"), ILLEGAL, ids=[f"{s}--{e}" for s, e in ILLEGAL])
def test_every_illegal_transition_is_refused(status, etype):
    state = state_in(status)
    with pytest.raises(r.IllegalTransition) as exc:
        r.reduce(state, etype, {})
    assert exc.value.event_type == etype
    assert exc.value.status == status


def test_unknown_event_type_refused():
    with pytest.raises(r.IllegalTransition, match="unknown event type"):
        r.reduce(state_in(r.ACCEPTED), "model.hallucinated", {})


def test_guards_refuse_late_and_mismatched_events():
    dispatching = state_in(r.DISPATCHING)
    with pytest.raises(r.IllegalTransition, match="did not commit"):
        r.reduce(dispatching, "receipt.recorded", {"action_id": "other", "receipt": {}, "cost": 1})
    with pytest.raises(r.IllegalTransition, match="no receipt"):
        r.reduce(dispatching, *DONE)
    waiting = state_in(r.WAITING_APPROVAL)
    with pytest.raises(r.IllegalTransition, match="approval not granted"):
        r.reduce(waiting, *INTENT)
    granted = _apply(waiting, GRANT)
    with pytest.raises(r.IllegalTransition, match="digest differs"):
        r.reduce(granted, "intent.committed", {**INTENT[1], "digest": "other"})
    with pytest.raises(r.IllegalTransition, match="approval is APPROVED"):
        r.reduce(granted, "approval.rejected", {"approval_id": "a1", "decided_by": "b"})
    with pytest.raises(r.IllegalTransition, match="terminal"):
        r.reduce(state_in(r.COMPLETED), "cancel.requested", {})
    with pytest.raises(r.IllegalTransition, match="in flight"):
        r.reduce(state_in(r.WAITING_RECONCILIATION), "task.failed", {"reason": "deadline"})
    with pytest.raises(r.IllegalTransition, match="receipt is already recorded"):
        r.reduce(_apply(dispatching, RECEIPT), "outcome.unknown", {"action_id": "x1", "error": {}})


def test_rejected_digest_cannot_be_proposed_again():
    rejected = _apply(state_in(r.WAITING_APPROVAL),
                      ("approval.rejected", {"approval_id": "a1", "decided_by": "avery", "reason": "wrong"}))
    assert rejected["rejected_digests"] == ["d1"]
    validating = _apply(rejected, DRAFT)
    with pytest.raises(r.IllegalTransition, match="rejected earlier"):
        r.reduce(validating, *ASK)


def test_budget_reservation_admission_and_settlement():
    # DESIGN.md §8's worked example, on the reducer's budget: B=100.
    s = state_in(r.VALIDATING)
    s["budget"] = {"total": 100, "used": 40, "reserved": 20}
    auto = {"action_id": "x1", "idempotency_key": "k", "digest": "d9", "approval_required": False,
            "proposal": PROPOSAL}
    admitted = r.reduce(s, "intent.committed", {**auto, "reservation": 30})
    assert admitted["budget"] == {"total": 100, "used": 40, "reserved": 50}
    with pytest.raises(r.IllegalTransition, match="exceeds B"):
        r.reduce({**s, "budget": {"total": 100, "used": 40, "reserved": 50}}, "intent.committed",
                 {**auto, "reservation": 20})
    settled = r.reduce(admitted, "receipt.recorded", {"action_id": "x1", "receipt": {"external_id": "R"}, "cost": 24})
    assert settled["budget"] == {"total": 100, "used": 64, "reserved": 20}
    with pytest.raises(r.IllegalTransition, match="outside"):
        r.reduce(admitted, "receipt.recorded", {"action_id": "x1", "receipt": {}, "cost": 31})


EVENTS_FOR_FUZZ = [ACCEPT, START, EVID, READ, DRAFT, ASK, GRANT, INTENT, RECEIPT, DONE,
                   ("outcome.unknown", {"action_id": "x1", "error": {}}),
                   ("reconciliation.retry", {"action_id": "x1", "reason": "r"}),
                   ("dispatch.failed", {"action_id": "x1", "error": "e"}),
                   ("task.failed", {"reason": "limit"}), ("cancel.requested", {"reason": "stop"}),
                   ("approval.rejected", {"approval_id": "a1", "decided_by": "b", "reason": "no"}),
                   ("approval.invalidated", {"approval_id": "a1", "reason": "expired", "action_not_sent": True}),
                   ("input.requested", {"questions": ["q"]}), ("input.provided", {"text": "t"}),
                   ("draft.invalid", {"problems": []})]


@pytest.mark.property
@given(st.lists(st.sampled_from(EVENTS_FOR_FUZZ), max_size=30))
def test_properties_over_random_event_sequences(events):
    state = r.initial_state()
    applied = 0
    for etype, payload in events:
        before = state
        try:
            state = r.reduce(state, etype, payload)
            applied += 1
        except r.IllegalTransition:
            assert state is before
            continue
        b = state["budget"]
        assert 0 <= b["reserved"] and b["used"] + b["reserved"] <= b["total"]  # invariant 6
        if before["status"] in r.TERMINAL:  # invariant 1: status of a terminal task never changes
            assert state["status"] == before["status"]
        if state["status"] == r.COMPLETED and before["status"] == r.DISPATCHING:
            assert state["receipt"] is not None  # invariant 9: every "completed" dispatch has a receipt
        if before["status"] == r.CANCELLED:  # invariant 3: no new action after cancel
            assert state["action"] is None or state["action"]["id"] == before["action"]["id"]
    assert r.replay(_only_legal(events)) == state


def _only_legal(events):
    state, kept = r.initial_state(), []
    for etype, payload in events:
        try:
            state = r.reduce(state, etype, payload)
        except r.IllegalTransition:
            continue
        kept.append((etype, payload))
    return kept
