"""δ version ``reducer/2`` (apps.tasks.reducer.v2): ticket reads, conflicts and compensation, as a
pure function — every new transition, its guards, and the budget invariant over random
sequences (ADR 0011)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.tasks import reducer as r1
from apps.tasks.reducer import v2 as r2
from apps.tasks.tests.test_reducer_v1 import ACCEPT, ASK, DEVICE, DRAFT, EVID, GRANT, INTENT, RECEIPT, START

TICKET = {"connector": "reference", "external_id": "REF-1", "version": 3, "status": "open"}
TREAD = ("ticket.read", {"ticket": TICKET})
READ = ("device.read", {"reading": DEVICE})
CONFLICT = ("dispatch.conflict", {"action_id": "x1", "expected_version": 3, "current_version": 4})
CANCEL = ("cancel.requested", {"reason": "fixed itself"})
UPDATE = {"tool": "ticket.update", "tool_version": "1", "params": {"ticket_id": "REF-1"}, "digest": "c1"}
COMP_ASK = ("compensation.requested", {"reason": "cancelled", "ticket": {**TICKET, "version": 1}, "proposal": UPDATE,
                                       "approval_id": "ca1", "policy_version": 1,
                                       "expires_at": "2030-01-01T00:00:00+00:00"})
COMP_GRANT = ("approval.granted", {"approval_id": "ca1", "decided_by": "avery"})
COMP_INTENT = ("intent.committed", {"action_id": "cx1", "idempotency_key": "ck", "digest": "c1", "reservation": 2,
                                    "approval_required": True})
COMP_RECEIPT = ("receipt.recorded", {"action_id": "cx1", "receipt": {"external_id": "REF-1", "version": 2,
                                                                      "status": "closed"}, "cost": 2})
COMP_FAILED = ("dispatch.failed", {"action_id": "cx1", "error": "unauthorized"})
COMP_CONFLICT = ("dispatch.conflict", {"action_id": "cx1", "expected_version": 1, "current_version": 2})

DISPATCHING = [ACCEPT, START, EVID, TREAD, READ, DRAFT, ASK, GRANT, INTENT]
CANCELLED_WITH_TICKET = [*DISPATCHING, RECEIPT, CANCEL]
COMPENSATING = [*CANCELLED_WITH_TICKET, COMP_ASK]
COMP_DISPATCHING = [*COMPENSATING, COMP_GRANT, COMP_INTENT]


def fold(events):
    state = r1.initial_state()
    for etype, payload in events:
        state = r2.reduce(state, etype, payload)
    return state


def test_reducer_2_is_still_registered_for_its_tasks():
    assert r1.reducer_for("reducer/2") is r2.reduce and r1.CURRENT == "reducer/6"
    assert r1.reducer_for(None) is r1.reduce, "an unpinned task is a reducer/1 task"


def test_ticket_read_comes_before_the_device_read_and_a_replan_forgets_it():
    s = fold([ACCEPT, START, EVID, TREAD])
    assert s["ticket"] == TICKET and s["status"] == r1.RETRIEVING
    with pytest.raises(r1.IllegalTransition, match="not legal in PROPOSING"):
        r2.reduce(fold([ACCEPT, START, EVID, TREAD, READ]), *TREAD)
    s = fold([ACCEPT, START, EVID, TREAD, READ, DRAFT, ("input.requested", {"questions": ["q"]}),
              ("input.provided", {"text": "more"})])
    assert s["ticket"] is None and s["status"] == r1.RETRIEVING


def test_a_conflict_releases_the_reservation_invalidates_the_approval_and_replans():
    s = fold(DISPATCHING)
    assert s["budget"]["reserved"] == 5
    s = r2.reduce(s, *CONFLICT)
    assert s["status"] == r1.RETRIEVING and s["action"] is None and s["budget"]["reserved"] == 0
    assert s["approval"]["status"] == "INVALIDATED" and s["conflicts"] == 1 and s["replans"] == 1
    assert all(s[k] is None for k in ("proposal", "draft", "evidence", "device", "ticket"))
    assert s["last_conflict"] == {"action_id": "x1", "expected_version": 3, "current_version": 4}


def test_a_conflict_is_refused_for_another_action_or_after_an_unknown_outcome():
    with pytest.raises(r1.IllegalTransition, match="unknown action"):
        r2.reduce(fold(DISPATCHING), "dispatch.conflict", {"action_id": "nope", "expected_version": 1})
    unknown = fold([*DISPATCHING, ("outcome.unknown", {"action_id": "x1", "error": {}})])
    with pytest.raises(r1.IllegalTransition):
        r2.reduce(unknown, *CONFLICT)


def test_a_conflict_on_a_cancelled_task_ends_the_action_unsent():
    s = fold([*DISPATCHING, CANCEL, CONFLICT])
    assert s["status"] == r1.CANCELLED and s["action"]["status"] == "FAILED" and s["budget"]["reserved"] == 0


def test_the_compensation_saga_closes_the_ticket_and_returns_to_cancelled():
    s = fold(COMPENSATING)
    assert s["status"] == r1.COMPENSATING and s["compensation"]["status"] == r2.C_WAITING_APPROVAL
    s = fold(COMP_DISPATCHING)
    assert s["compensation"]["action"]["status"] == "INTENDED" and s["budget"]["reserved"] == 2
    s = r2.reduce(s, *COMP_RECEIPT)
    assert s["status"] == r1.CANCELLED and s["compensation"]["status"] == r2.C_DONE
    assert s["budget"] == {"total": 100, "used": 7, "reserved": 0}
    assert s["termination_reason"] == "cancelled: fixed itself; compensation done: ticket REF-1 closed"


def test_a_compensation_is_only_for_a_created_ticket_and_only_once():
    comment = fold([*DISPATCHING, ("receipt.recorded", {"action_id": "x1", "cost": 5, "receipt": {
        "external_id": "REF-1-C1", "version": 4, "kind": "comment", "ticket_id": "REF-1"}}), CANCEL])
    with pytest.raises(r1.IllegalTransition, match="only a ticket this task created"):
        r2.reduce(comment, *COMP_ASK)
    with pytest.raises(r1.IllegalTransition, match="not re-planning"):
        r2.reduce(fold(COMPENSATING), *COMP_ASK)
    other = (COMP_ASK[0], {**COMP_ASK[1], "ticket": {**TICKET, "external_id": "REF-9"}})
    with pytest.raises(r1.IllegalTransition, match="no other"):
        r2.reduce(fold(CANCELLED_WITH_TICKET), *other)


def test_a_rejected_compensation_leaves_the_ticket_and_the_task_cancelled():
    s = fold([*COMPENSATING, ("approval.rejected", {"approval_id": "ca1", "decided_by": "avery", "reason": "keep"})])
    assert s["status"] == r1.CANCELLED and s["compensation"]["status"] == r2.C_REJECTED
    assert s["rejected_digests"] == [], "the compensation's rejection is not a rejection of the task's action"


def test_a_failed_compensation_waits_in_its_own_state_until_a_person_decides():
    s = fold([*COMP_DISPATCHING, COMP_FAILED])
    assert s["status"] == r1.WAITING_COMPENSATION and s["budget"]["reserved"] == 0
    for event in (CANCEL, ("task.failed", {"reason": "x"})):
        with pytest.raises(r1.IllegalTransition):
            r2.reduce(s, *event)
    retried = r2.reduce(s, "compensation.retry", {"by": "adele", "note": "try again"})
    assert retried["status"] == r1.COMPENSATING and retried["compensation"]["status"] == r2.C_REPLANNING
    assert retried["compensation"]["action"] is None and retried["compensation"]["history"][0]["id"] == "ca1"
    done = r2.reduce(s, "compensation.resolved", {"outcome": "done_by_hand", "by": "adele", "note": "closed it"})
    assert done["status"] == r1.CANCELLED and done["compensation"]["status"] == r2.C_RESOLVED
    with pytest.raises(r1.IllegalTransition, match="unknown outcome"):
        r2.reduce(s, "compensation.resolved", {"outcome": "forget it", "by": "adele"})


def test_a_compensation_conflict_replans_and_asks_again_at_the_new_version():
    s = fold([*COMP_DISPATCHING, COMP_CONFLICT])
    c = s["compensation"]
    assert s["status"] == r1.COMPENSATING and c["status"] == r2.C_REPLANNING and c["conflicts"] == 1
    assert c["action"] is None and s["budget"]["reserved"] == 0
    again = (COMP_ASK[0], {**COMP_ASK[1], "approval_id": "ca2", "ticket": {**TICKET, "version": 2}})
    s = r2.reduce(s, *again)
    assert s["compensation"]["approval"]["object_version"] == 2 and s["compensation"]["status"] == r2.C_WAITING_APPROVAL
    with pytest.raises(r1.IllegalTransition, match="approval not granted"):
        r2.reduce(s, "intent.committed", {**COMP_INTENT[1], "action_id": "cx2"})


EVENTS = [TREAD, CONFLICT, CANCEL, COMP_ASK, COMP_GRANT, COMP_INTENT, COMP_RECEIPT, COMP_FAILED, COMP_CONFLICT,
          ("compensation.retry", {"by": "a", "note": "n"}),
          ("compensation.resolved", {"outcome": "not_needed", "by": "a", "note": "n"}),
          ("compensation.failed", {"reason": "r"}), RECEIPT, INTENT, GRANT, ASK, DRAFT, READ, EVID, START]


@given(st.lists(st.sampled_from(EVENTS), max_size=25))
def test_any_sequence_keeps_the_budget_invariant_and_refuses_without_changing_state(seq):
    state = fold([ACCEPT])
    for etype, payload in seq:
        try:
            nxt = r2.reduce(state, etype, payload)
        except r1.IllegalTransition:
            continue
        b = nxt["budget"]
        assert 0 <= b["reserved"] and b["used"] + b["reserved"] <= b["total"]
        if state["status"] in r1.TERMINAL and nxt["status"] != state["status"]:
            # Only a compensation leaves a terminal status, and only from CANCELLED.
            assert (state["status"], etype, nxt["status"]) == (r1.CANCELLED, "compensation.requested",
                                                               r1.COMPENSATING)
        state = nxt


def test_a_compensation_without_its_approval_is_refused_not_crashed():
    """Review F6: every malformed order is an IllegalTransition, never a TypeError."""
    bare = (COMP_ASK[0], {**COMP_ASK[1], "proposal": None, "approval_id": None})
    with pytest.raises(r1.IllegalTransition, match="needs its proposal and its own approval"):
        r2.reduce(fold(CANCELLED_WITH_TICKET), *bare)
    person = (COMP_ASK[0], {"reason": "cancelled", "ticket": TICKET, "outcome": "needs_person",
                            "note": "no conditional update"})
    s = r2.reduce(fold(CANCELLED_WITH_TICKET), *person)
    assert s["status"] == r1.WAITING_COMPENSATION and s["compensation"]["approval"] is None
    with pytest.raises(r1.IllegalTransition):
        r2.reduce(s, *COMP_INTENT)
    kept = (COMP_ASK[0], {**person[1], "outcome": "not_needed", "by": "worker", "note": "other reports"})
    s = r2.reduce(fold(CANCELLED_WITH_TICKET), *kept)
    assert s["status"] == r1.CANCELLED and s["compensation"]["status"] == r2.C_RESOLVED
