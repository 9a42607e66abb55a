"""Adversarial review of ``reducer/6`` (branch review-plans): δ is documented as the guard that
"recomputes the verdict and refuses an event whose verdict is not the one its premises give" and
"refuses a barrier that lets a read continue whose result depends on a premise that changed". These
tests feed δ events a buggy or stale worker could produce and expect δ to refuse them. Each one that
fails shows a hole in the guard: δ takes the event's own word for the facts it is meant to check."""

from __future__ import annotations

import pytest

from apps.tasks import reducer
from apps.tasks.reducer import v6
from apps.tasks.tests.test_reducer_v6 import (
    DISPATCHED,
    PREMISES,
    REF,
    _proposing,
    activate,
    fold,
    reserve,
    result,
)


def _epoch_moved_on_while_ticket_read_lapsed():
    """Plan 1's ticket read t1 lapses (charged at its reservation, step pending again), plan 2
    is activated with the open ticket's epoch moved on (the ticket read cancelled): the lapsed t1 is
    still allowed to report and must be judged by the premises it was *dispatched* under (epoch 0)."""
    s = fold([*DISPATCHED, ("budget.settled", {"reservation_id": "t1", "used": {"tool_calls": 1},
                                               "unknown_outcome": True})])
    assert s["activities"]["t1"]["status"] == "lapsed"
    newer = {**PREMISES, "ticket_epoch": 1}
    barrier = {"from_version": 1, "why": "the open ticket moved on", "changed": ["ticket_epoch"],
               "continuing": {"device": "in_flight", "retrieval": "in_flight"},
               "cancelled": ["ticket", "draft", "authorize", "write"]}
    return fold([activate(2, newer, barrier)], s), newer


def test_delta_refuses_a_late_ticket_read_whose_claimed_premises_are_not_those_it_was_dispatched_under():
    s, newer = _epoch_moved_on_while_ticket_read_lapsed()
    assert s["activities"]["t1"]["premises"]["ticket_epoch"] == 0, "t1 was dispatched at epoch 0"
    # t1 read the ticket at epoch 0 (the ticket read observes nothing of its own: its premises can only
    # be those it was dispatched with). It claims plan 2's premises instead.
    with pytest.raises(reducer.IllegalTransition):
        fold([result("ticket", "t1", plan_version=1, premises=newer, verdict="accepted",
                     ticket={"connector": "reference", "external_id": "STALE", "version": 1, "status": "open"})], s)


def test_delta_refuses_a_late_read_that_omits_the_premise_it_depends_on():
    s, _ = _epoch_moved_on_while_ticket_read_lapsed()
    # the same stale t1, reporting premises without ticket_epoch: changed_premises() skips keys the
    # result does not carry, so the verdict is "accepted"
    stale = {k: v for k, v in PREMISES.items() if k != "ticket_epoch"}
    with pytest.raises(reducer.IllegalTransition):
        fold([result("ticket", "t1", plan_version=1, premises=stale, verdict="accepted",
                     ticket={"connector": "reference", "external_id": "STALE", "version": 1, "status": "open"})], s)


def test_delta_refuses_a_plan_version_whose_ticket_epoch_is_not_the_tasks():
    # a conflict/deferral moved state["ticket_epoch"] to 1; the next plan version's premise says 0, so
    # the ticket read from before the conflict is carried "joined" across the barrier
    s = fold([("draft.proposed", {"draft": {"ticket": {}}}),
              ("intent.deferred", {"reason": "another report's ticket.create is in flight",
                                   "action_id": "x", "task_id": "y"})], _proposing())
    assert s["status"] == reducer.RETRIEVING and s["ticket_epoch"] == 1 and "ticket" in s["carried"]
    barrier = {"from_version": 1, "why": "intent.deferred", "changed": [],
               "continuing": {"device": "joined", "ticket": "joined", "retrieval": "joined"},
               "cancelled": ["draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition):
        fold([activate(2, PREMISES, barrier)], s)


def test_delta_refuses_a_barrier_whose_changed_list_is_untrue():
    s = fold([*DISPATCHED, result("retrieval", "r1")])
    newer = {**PREMISES, "device_version": 18}
    barrier = {"from_version": 1, "why": "nothing changed", "changed": [],  # the device's version did change
               "continuing": {"retrieval": "joined"},
               "cancelled": ["device", "ticket", "draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition):
        fold([activate(2, newer, barrier)], s)


def test_delta_refuses_a_barrier_that_carries_retrieval_whose_evidence_is_superseded():
    # ADR 0023: superseded or retired evidence re-plans and "retrieval is read again". The evidence
    # premise is not in DEPENDS["retrieval"], so δ lets the superseded result continue, joined.
    s = fold([*DISPATCHED, result("retrieval", "r1")])
    assert s["evidence"] == [REF]
    superseded = {**PREMISES, "evidence": {str(REF["chunk_id"]): "superseded"}}
    barrier = {"from_version": 1, "why": "evidence changed: chunk superseded", "changed": ["evidence"],
               "continuing": {"retrieval": "joined", "device": "in_flight", "ticket": "in_flight"},
               "cancelled": ["draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition):
        fold([activate(2, superseded, barrier)], s)
