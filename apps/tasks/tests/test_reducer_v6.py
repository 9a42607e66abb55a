"""δ version ``reducer/6`` (apps.tasks.reducer.v6) as a pure function: plan versions and their
barrier, the reads as activities joined by premise, each rule for a late result (same premises →
accepted; a change the read does not depend on → re-validated; a change it depends on → refused and
done again, whatever the order of arrival), and the approval held while changed evidence is
re-validated."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.tasks import reducer
from apps.tasks.reducer import v6
from apps.tasks.tests.test_reducer_v1 import DEVICE, PROPOSAL, REF

PREMISES = {"request": "r1", "scopes": ["public"], "requester_role": "requester", "device_version": 17,
            "device_profile": {"kind": "printer", "alert_code": "E1", "alert_message": ""},
            "policy_version": 1, "bundle": "b1", "approver_role": None, "ticket_epoch": 0, "evidence": None}
ACCEPT = ("task.accepted", {"request": {"device_id": 1, "symptom": "fuser error"}, "budget_total": 100,
                            "limits": {"tokens": 1000, "tool_calls": 20, "retries": 5}})
START = ("retrieval.started", {})
TICKET = {"connector": "reference", "external_id": "REF-1", "version": 3, "status": "open"}


def activate(version=1, premises=None, barrier=None, reason="first plan"):
    return ("plan.activated", {"version": version, "premises": premises or PREMISES, "steps": list(v6.STEPS),
                               "reason": reason, "barrier": barrier})


def reserve(step, rid, plan_version=1):
    return ("budget.reserved", {"reservation_id": rid, "activity": f"read:{step}", "step": step,
                                "plan_version": plan_version, "amounts": {"tool_calls": 1}, "generation": None})


def result(step, rid, plan_version=1, premises=None, verdict="accepted", **extra):
    body = {"device": {"reading": DEVICE}, "ticket": {"ticket": None}, "retrieval": {"refs": [REF]}}[step]
    return (v6.READ_EVENT[step], {"activity_id": rid, "plan_version": plan_version,
                                  "premises": premises or PREMISES, "verdict": verdict, **body, **extra})


DISPATCHED = [ACCEPT, START, activate(), reserve("device", "d1"), reserve("ticket", "t1"),
              reserve("retrieval", "r1")]


def fold(events, state=None):
    s = state or reducer.v1.initial_state()
    for etype, payload in events:
        s = v6.reduce(s, etype, payload)
    return s


def test_reducer_6_is_registered_with_plans():
    assert reducer.reducer_for("reducer/6") is v6.reduce
    assert reducer.supports("reducer/6", "plans") and not reducer.supports("reducer/5", "plans")


def test_the_reads_join_in_any_order_and_only_then_the_task_proposes():
    for order in (("device", "ticket", "retrieval"), ("retrieval", "ticket", "device"), ("ticket", "retrieval",
                                                                                           "device")):
        s = fold(DISPATCHED)
        ids = {"device": "d1", "ticket": "t1", "retrieval": "r1"}
        for i, step in enumerate(order):
            s = fold([result(step, ids[step])], s)
            assert s["status"] == (reducer.PROPOSING if i == 2 else reducer.RETRIEVING)
        assert s["device"] == DEVICE and s["evidence"] == [REF] and s["ticket"] is None
        assert {k: v["status"] for k, v in s["activities"].items()} == {"d1": "accepted", "t1": "accepted",
                                                                        "r1": "accepted"}


def test_a_plan_version_is_immutable_and_records_every_premise():
    s = fold(DISPATCHED)
    assert s["plans"] == [{"version": 1, "premises": PREMISES, "steps": list(v6.STEPS), "reason": "first plan",
                           "barrier": None}]
    with pytest.raises(reducer.IllegalTransition, match="next plan version is 2"):
        fold([activate(version=1)], s)
    with pytest.raises(reducer.IllegalTransition, match="records every premise"):
        fold([activate(version=2, premises={"request": "r1"})], s)
    with pytest.raises(reducer.IllegalTransition, match="behind a barrier"):
        fold([activate(version=2)], s)


def test_a_result_names_a_dispatched_activity_and_reports_once():
    s = fold(DISPATCHED)
    with pytest.raises(reducer.IllegalTransition, match="names an activity"):
        fold([result("device", "nope")], s)
    with pytest.raises(reducer.IllegalTransition, match="read ticket, not device"):
        fold([result("device", "t1")], s)
    s = fold([result("device", "d1")], s)
    with pytest.raises(reducer.IllegalTransition, match="already reported"):
        fold([result("device", "d1")], s)


# --- the barrier ----------------------------------------------------------------------------------

NEWER_DEVICE = {**PREMISES, "device_version": 18}


def test_the_barrier_records_which_steps_continue_and_which_are_cancelled_and_why():
    s = fold([*DISPATCHED, result("retrieval", "r1")])
    barrier = {"from_version": 1, "why": "the device moved on: v17 → v18 while it was read",
               "changed": ["device_version"], "continuing": {"retrieval": "joined"},
               "cancelled": ["device", "ticket", "draft", "authorize", "write"]}
    s = fold([activate(2, NEWER_DEVICE, barrier, reason="a new device reading")], s)
    assert [p["version"] for p in s["plans"]] == [1, 2]
    assert s["plans"][0]["premises"]["device_version"] == 17, "the old version is left as it was"
    assert s["plans"][1]["barrier"] == barrier
    assert s["steps"]["retrieval"]["status"] == "joined" and s["evidence"] == [REF]
    assert s["steps"]["device"] == {"status": "pending"} and s["steps"]["ticket"] == {"status": "pending"}


def test_the_barrier_may_not_let_a_step_continue_whose_premises_changed():
    s = fold([*DISPATCHED, result("device", "d1")])
    barrier = {"from_version": 1, "why": "device moved", "changed": ["device_version"],
               "continuing": {"device": "joined"},
               "cancelled": ["ticket", "retrieval", "draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition, match="depends on premises that changed: device_version"):
        fold([activate(2, NEWER_DEVICE, barrier)], s)
    s2 = fold(DISPATCHED)
    barrier = {"from_version": 1, "why": "device moved", "changed": ["device_version"],
               "continuing": {"device": "in_flight"},
               "cancelled": ["ticket", "retrieval", "draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition, match="in flight depends on a premise that changed"):
        fold([activate(2, NEWER_DEVICE, barrier)], s2)
    barrier = {"from_version": 1, "why": "device moved", "changed": ["device_version"], "continuing": {},
               "cancelled": ["device"]}
    with pytest.raises(reducer.IllegalTransition, match="cancels every step that does not continue"):
        fold([activate(2, NEWER_DEVICE, barrier)], s)


# --- late results ----------------------------------------------------------------------------------

def _replanned(premises, continuing):
    """v1's reads dispatched, then plan 2 with ``premises`` letting ``continuing`` go on in flight."""
    cancelled = [s for s in v6.STEPS if s not in continuing]
    return fold([*DISPATCHED, activate(2, premises, {"from_version": 1, "why": "re-plan",
                                                     "changed": v6.changed_premises(PREMISES, premises),
                                                     "continuing": continuing, "cancelled": cancelled})])


def test_a_late_result_with_the_same_premises_is_accepted():
    # plan 2 differs only in the device's version; the retrieval in flight under plan 1 read the device
    # itself (a premise it observes, v6.OBSERVES) and found it at v18: it worked under the very premises
    # of plan 2, and is accepted as it is
    s = _replanned(NEWER_DEVICE, {"retrieval": "in_flight", "ticket": "in_flight"})
    s = fold([result("retrieval", "r1", plan_version=1, premises=NEWER_DEVICE, verdict="accepted")], s)
    assert s["steps"]["retrieval"]["status"] == "joined" and s["activities"]["r1"]["status"] == "accepted"


def test_a_result_is_judged_by_the_premises_it_was_dispatched_under_except_those_it_observes():
    # plan 2 differs in the policy version, which no read observes: a read of plan 1 can only have
    # worked under plan 1's policy, whatever its report claims
    newer = {**PREMISES, "policy_version": 2}
    s = _replanned(newer, {"retrieval": "in_flight", "device": "in_flight", "ticket": "in_flight"})
    with pytest.raises(reducer.IllegalTransition, match="claims premises it was not dispatched under: policy_version"):
        fold([result("retrieval", "r1", plan_version=1, premises=newer, verdict="accepted")], s)
    with pytest.raises(reducer.IllegalTransition, match="records every premise"):
        fold([result("retrieval", "r1", premises={k: v for k, v in PREMISES.items() if k != "bundle"},
                     verdict="revalidated", revalidation={"ok": True})], s)
    s = fold([result("retrieval", "r1", verdict="revalidated", revalidation={"ok": True})], s)
    assert s["activities"]["r1"]["status"] == "revalidated"


def test_a_late_result_after_a_change_it_does_not_depend_on_is_revalidated_before_it_joins():
    newer = {**PREMISES, "policy_version": 2}
    s = _replanned(newer, {"retrieval": "in_flight", "device": "in_flight", "ticket": "in_flight"})
    assert v6.verdict("retrieval", PREMISES, newer) == ("revalidated", ["policy_version"])
    with pytest.raises(reducer.IllegalTransition, match="verdict by premise is 'revalidated'"):
        fold([result("retrieval", "r1")], s)
    with pytest.raises(reducer.IllegalTransition, match="carries a passing check"):
        fold([result("retrieval", "r1", verdict="revalidated")], s)
    s = fold([result("retrieval", "r1", verdict="revalidated",
                     revalidation={"ok": True, "checked": ["every cited chunk is current and readable"]})], s)
    assert s["steps"]["retrieval"]["status"] == "joined" and s["activities"]["r1"]["status"] == "revalidated"
    failed = fold([("result.refused", {"activity_id": "d1", "plan_version": 1, "premises": PREMISES,
                                       "reason": "re-validation failed: the device moved on",
                                       "revalidation": {"ok": False}})], s)
    assert failed["steps"]["device"] == {"status": "pending"}, "a failed re-validation is done again"


def test_a_late_result_after_a_change_it_depends_on_is_refused_and_done_again():
    changed = {**PREMISES, "request": "r2"}  # the requester answered a question: new material
    s = _replanned(changed, {"device": "in_flight", "ticket": "in_flight"})
    assert s["steps"]["retrieval"] == {"status": "pending"}
    with pytest.raises(reducer.IllegalTransition, match=r"premises it depends on changed \(request\)"):
        fold([result("retrieval", "r1")], s)
    s = fold([("result.refused", {"activity_id": "r1", "plan_version": 1, "premises": PREMISES,
                                  "reason": "decisive premise changed: request"})], s)
    assert s["activities"]["r1"]["status"] == "refused" and s["evidence"] is None
    s = fold([reserve("retrieval", "r2", plan_version=2), result("retrieval", "r2", plan_version=2, premises=changed)],
             s)
    assert s["steps"]["retrieval"]["activity_id"] == "r2" and s["evidence"] == [REF]


def test_a_refusal_must_be_owed_to_its_premises():
    s = fold(DISPATCHED)
    with pytest.raises(reducer.IllegalTransition, match="only a result whose decisive premises changed"):
        fold([("result.refused", {"activity_id": "r1", "plan_version": 1, "premises": PREMISES,
                                  "reason": "arrived late"})], s)


@given(st.permutations(["device", "ticket", "retrieval", "replan"]))
def test_arrival_order_never_decides(order):
    """Whatever order the three results of plan 1 and a re-plan (the device moved on) arrive in, the
    device read is refused (or cancelled) once the device has moved, the ticket read and retrieval —
    which do not depend on the device's version — are kept (re-validated when they arrive after the
    re-plan), and the task proposes only when plan 2's device read is joined."""
    ids = {"device": "d1", "ticket": "t1", "retrieval": "r1"}
    s = fold(DISPATCHED)
    for item in order:
        plan = v6.current_plan(s)
        if item == "replan":
            if s["status"] != reducer.RETRIEVING:
                # every read was joined before the device moved: the plan proposes (the approval's
                # binding to the device version catches the move later)
                assert s["status"] == reducer.PROPOSING and order[-1] == "replan"
                return
            continuing = {}
            for step in v6.READS:
                st_ = s["steps"][step]
                if v6.verdict(step, PREMISES, NEWER_DEVICE)[0] != "refused":
                    continuing[step] = "joined" if st_["status"] == "joined" else "in_flight"
            s = fold([activate(2, NEWER_DEVICE, {"from_version": 1, "why": "device moved",
                                                 "changed": ["device_version"], "continuing": continuing,
                                                 "cancelled": [x for x in v6.STEPS if x not in continuing]})], s)
            continue
        v, changed = v6.verdict(item, PREMISES, plan["premises"])
        if v == "refused":
            s = fold([("result.refused", {"activity_id": ids[item], "plan_version": 1, "premises": PREMISES,
                                          "reason": f"changed: {changed}"})], s)
        else:
            extra = {"revalidation": {"ok": True}} if v == "revalidated" else {}
            s = fold([result(item, ids[item], verdict=v, **extra)], s)
    assert s["steps"]["retrieval"]["status"] == "joined" and s["steps"]["ticket"]["status"] == "joined"
    assert len(s["plans"]) == 2
    # joined under plan 1 before the re-plan, it was cancelled; arriving after it, refused: read again
    assert s["steps"]["device"] == {"status": "pending"}, (order, s["steps"])
    assert s["status"] == reducer.RETRIEVING
    s = fold([reserve("device", "d2", 2), result("device", "d2", 2, NEWER_DEVICE)], s)
    assert s["status"] == reducer.PROPOSING


# --- re-plans carry the reads whose premises still hold ---------------------------------------------

def _proposing():
    return fold([*DISPATCHED, result("device", "d1"), result("ticket", "t1"), result("retrieval", "r1")])


def test_an_earlier_replan_event_leaves_a_due_replan_and_the_reads_it_may_carry():
    s = fold([("draft.proposed", {"draft": {"ticket": {}}}), ("input.requested", {"questions": ["which tray?"]}),
              ("input.provided", {"text": "tray 2"})], _proposing())
    assert s["status"] == reducer.RETRIEVING and s["replan_due"]["event"] == "input.provided"
    assert set(s["carried"]) == {"device", "ticket", "retrieval"} and s["evidence"] is None
    newer = {**PREMISES, "request": "r2"}
    s = fold([activate(2, newer, {"from_version": 1, "why": "the requester answered: new material",
                                  "changed": ["request"], "continuing": {"device": "joined", "ticket": "joined"},
                                  "cancelled": ["retrieval", "draft", "authorize", "write"]})], s)
    assert s["device"] == DEVICE and s["steps"]["device"]["plan_version"] == 1
    assert s["steps"]["retrieval"] == {"status": "pending"} and s["replan_due"] is None and s["carried"] == {}


# --- an approval held while changed evidence is re-validated ----------------------------------------

ASK = ("approval.requested", {"approval_id": "a1", "proposal": PROPOSAL, "object_version": 17,
                              "policy_version": 1, "expires_at": "2030-01-01T00:00:00+00:00"})
SUPERSEDED = {**PREMISES, "evidence": {"1": "superseded"}}


def _waiting(granted=True):
    s = fold([("draft.proposed", {"draft": {"ticket": {}}}), ASK], _proposing())
    if granted:
        s = fold([("approval.granted", {"approval_id": "a1", "decided_by": "avery"})], s)
    barrier = {"from_version": 1, "why": "evidence superseded: chunk 1 (Fuser v1) is no longer current",
               "changed": ["evidence"], "continuing": {"device": "joined", "ticket": "joined"},
               "cancelled": ["retrieval", "draft", "authorize", "write"]}
    return fold([activate(2, SUPERSEDED, barrier)], s)


def test_evidence_superseded_during_the_wait_replans_and_holds_the_approval():
    s = _waiting()
    assert s["status"] == reducer.RETRIEVING and s["approval"]["status"] == "APPROVED"
    assert s["revalidating"] == {"approval_id": "a1", "digest": "d1",
                                 "why": "evidence superseded: chunk 1 (Fuser v1) is no longer current"}
    assert s["proposal"] is None and s["evidence"] is None and s["device"] == DEVICE
    with pytest.raises(reducer.IllegalTransition):
        fold([("intent.committed", {"action_id": "x1", "idempotency_key": "k", "digest": "d1", "reservation": 5})], s)


def _redrafted(s):
    return fold([reserve("retrieval", "r2", 2), result("retrieval", "r2", 2, SUPERSEDED),
                 ("draft.proposed", {"draft": {"ticket": {}}})], s)


def test_the_same_proposal_after_revalidation_keeps_the_approval():
    s = _redrafted(_waiting())
    s = fold([("approval.revalidated", {"approval_id": "a1", "proposal": PROPOSAL})], s)
    assert s["status"] == reducer.WAITING_APPROVAL and s["approval"]["status"] == "APPROVED"
    assert s["revalidating"] is None
    s = fold([("intent.committed", {"action_id": "x1", "idempotency_key": "k", "digest": "d1", "reservation": 5})], s)
    assert s["status"] == reducer.DISPATCHING


def test_a_changed_proposal_after_revalidation_asks_again():
    s = _redrafted(_waiting())
    other = {**PROPOSAL, "params": {"title": "other"}, "digest": "d2"}
    with pytest.raises(reducer.IllegalTransition, match="differs from the approved one"):
        fold([("approval.revalidated", {"approval_id": "a1", "proposal": other})], s)
    s = fold([("approval.requested", {"approval_id": "a2", "proposal": other, "object_version": 17,
                                      "policy_version": 1, "expires_at": "2030-01-01T00:00:00+00:00"})], s)
    assert s["approval"]["id"] == "a2" and s["approval"]["status"] == "PENDING" and s["revalidating"] is None


def test_a_pending_approval_is_held_too_and_closed_when_the_draft_asks_the_requester():
    s = _redrafted(_waiting(granted=False))
    assert s["approval"]["status"] == "PENDING"
    s = fold([("input.requested", {"questions": ["which tray?"]})], s)
    assert s["approval"]["status"] == "INVALIDATED" and s["revalidating"] is None


def test_replay_of_a_task_with_several_plan_versions_reproduces_its_state():
    events = [*DISPATCHED, result("device", "d1"), result("ticket", "t1"), result("retrieval", "r1"),
              ("draft.proposed", {"draft": {"ticket": {}}}), ASK,
              ("approval.granted", {"approval_id": "a1", "decided_by": "avery"}),
              activate(2, SUPERSEDED, {"from_version": 1, "why": "evidence superseded", "changed": ["evidence"],
                                       "continuing": {"device": "joined", "ticket": "joined"},
                                       "cancelled": ["retrieval", "draft", "authorize", "write"]}),
              reserve("retrieval", "r2", 2), result("retrieval", "r2", 2, SUPERSEDED),
              ("draft.proposed", {"draft": {"ticket": {}}}),
              ("approval.revalidated", {"approval_id": "a1", "proposal": PROPOSAL})]
    once, twice = fold(events), fold(events)
    assert once == twice and [p["version"] for p in once["plans"]] == [1, 2]
    assert once["status"] == reducer.WAITING_APPROVAL


# --- δ checks the facts a report or a barrier states, never takes them on trust ----------------------

def _epoch_moved_on_while_ticket_read_lapsed():
    """Plan 1's ticket read t1 lapses (charged at its reservation) and t2 reads the ticket instead;
    the task proposes, another report's ticket.create defers its intent (the open ticket's epoch moves
    on: ``ticket_epoch`` 1), and plan 2 is activated behind a barrier that cancels the ticket read. The
    lapsed t1 may still report, and must be judged by the premises it was *dispatched* under (epoch 0)."""
    s = fold([*DISPATCHED, ("budget.settled", {"reservation_id": "t1", "used": {"tool_calls": 1},
                                               "unknown_outcome": True})])
    assert s["activities"]["t1"]["status"] == "lapsed"
    s = fold([reserve("ticket", "t2"), result("device", "d1"), result("ticket", "t2"), result("retrieval", "r1"),
              ("draft.proposed", {"draft": {"ticket": {}}}),
              ("intent.deferred", {"reason": "another report's ticket.create is in flight", "action_id": "x",
                                   "task_id": "y"})], s)
    assert s["ticket_epoch"] == 1
    newer = {**PREMISES, "ticket_epoch": 1}
    barrier = {"from_version": 1, "why": "the open ticket moved on", "changed": ["ticket_epoch"],
               "continuing": {"device": "joined", "retrieval": "joined"},
               "cancelled": ["ticket", "draft", "authorize", "write"]}
    s = fold([activate(2, newer, barrier)], s)
    assert s["activities"]["t1"]["status"] == "lapsed" and s["steps"]["ticket"] == {"status": "pending"}
    return s, newer


def test_delta_refuses_a_late_ticket_read_whose_claimed_premises_are_not_those_it_was_dispatched_under():
    s, newer = _epoch_moved_on_while_ticket_read_lapsed()
    assert s["activities"]["t1"]["premises"]["ticket_epoch"] == 0, "t1 was dispatched at epoch 0"
    # t1 read the ticket at epoch 0 (the ticket read observes nothing of its own: its premises can only
    # be those it was dispatched with). It claims plan 2's premises instead.
    with pytest.raises(reducer.IllegalTransition, match="not dispatched under: ticket_epoch"):
        fold([result("ticket", "t1", plan_version=1, premises=newer, verdict="accepted",
                     ticket={"connector": "reference", "external_id": "STALE", "version": 1, "status": "open"})], s)
    # reported as it was dispatched, it is refused by premise and the ticket is read again
    with pytest.raises(reducer.IllegalTransition, match=r"premises it depends on changed \(ticket_epoch\)"):
        fold([result("ticket", "t1", plan_version=1, verdict="accepted")], s)
    s = fold([("result.refused", {"activity_id": "t1", "plan_version": 1, "premises": PREMISES,
                                  "reason": "premises it depends on changed: ticket_epoch"})], s)
    assert s["activities"]["t1"]["status"] == "refused" and s["steps"]["ticket"] == {"status": "pending"}


def test_delta_refuses_a_late_read_that_omits_the_premise_it_depends_on():
    s, _ = _epoch_moved_on_while_ticket_read_lapsed()
    # the same stale t1, reporting premises without ticket_epoch: a premise missing counts as changed
    stale = {k: v for k, v in PREMISES.items() if k != "ticket_epoch"}
    assert v6.verdict("ticket", stale, {**PREMISES, "ticket_epoch": 0}) == ("refused", ["ticket_epoch"])
    with pytest.raises(reducer.IllegalTransition, match="records every premise"):
        fold([result("ticket", "t1", plan_version=1, premises=stale, verdict="accepted",
                     ticket={"connector": "reference", "external_id": "STALE", "version": 1, "status": "open"})], s)
    with pytest.raises(reducer.IllegalTransition, match="records every premise"):
        fold([("result.refused", {"activity_id": "t1", "plan_version": 1, "premises": stale,
                                  "reason": "premises it depends on changed: ticket_epoch"})], s)


def test_delta_refuses_a_plan_version_whose_ticket_epoch_is_not_the_tasks():
    # a conflict/deferral moved state["ticket_epoch"] to 1; the next plan version's premise says 0, so
    # the ticket read from before the conflict would be carried "joined" across the barrier
    s = fold([("draft.proposed", {"draft": {"ticket": {}}}),
              ("intent.deferred", {"reason": "another report's ticket.create is in flight",
                                   "action_id": "x", "task_id": "y"})], _proposing())
    assert s["status"] == reducer.RETRIEVING and s["ticket_epoch"] == 1 and "ticket" in s["carried"]
    barrier = {"from_version": 1, "why": "intent.deferred", "changed": [],
               "continuing": {"device": "joined", "ticket": "joined", "retrieval": "joined"},
               "cancelled": ["draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition, match="ticket_epoch premise is the task's own"):
        fold([activate(2, PREMISES, barrier)], s)


def test_delta_refuses_a_barrier_whose_changed_list_is_untrue():
    s = fold([*DISPATCHED, result("retrieval", "r1")])
    newer = {**PREMISES, "device_version": 18}
    barrier = {"from_version": 1, "why": "nothing changed", "changed": [],  # the device's version did change
               "continuing": {"retrieval": "joined"},
               "cancelled": ["device", "ticket", "draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition, match="changed premises are those that differ"):
        fold([activate(2, newer, barrier)], s)
    without = {k: v for k, v in barrier.items() if k != "changed"}
    with pytest.raises(reducer.IllegalTransition, match="changed premises are those that differ"):
        fold([activate(2, newer, without)], s)
    s = fold([activate(2, newer, {**barrier, "changed": ["device_version"]})], s)
    assert s["plans"][1]["barrier"]["changed"] == ["device_version"]


def test_delta_refuses_a_barrier_that_carries_retrieval_whose_evidence_is_superseded():
    # ADR 0023: superseded or retired evidence re-plans and retrieval is read again: evidence is a
    # premise retrieval depends on (v6.DEPENDS), decisive when a chunk is no longer current
    s = fold([*DISPATCHED, result("retrieval", "r1")])
    assert s["evidence"] == [REF]
    superseded = {**PREMISES, "evidence": {str(REF["chunk_id"]): "superseded"}}
    barrier = {"from_version": 1, "why": "evidence changed: chunk superseded", "changed": ["evidence"],
               "continuing": {"retrieval": "joined", "device": "in_flight", "ticket": "in_flight"},
               "cancelled": ["draft", "authorize", "write"]}
    with pytest.raises(reducer.IllegalTransition, match="depends on premises that changed: evidence"):
        fold([activate(2, superseded, barrier)], s)
    # evidence found all current (none before: a fresh retrieval) is a change to re-validate, not decisive
    current = {**PREMISES, "evidence": {str(REF["chunk_id"]): "current"}}
    assert v6.verdict("retrieval", PREMISES, current) == ("revalidated", ["evidence"])
    s = fold([activate(2, current, {**barrier, "changed": ["evidence"]})], s)
    assert s["steps"]["retrieval"]["status"] == "joined"


def test_a_late_retrieval_is_refused_by_evidence_only_when_its_own_chunks_are_not_current():
    superseded = {**PREMISES, "evidence": {"99": "superseded"}}
    assert v6.verdict("retrieval", PREMISES, superseded, refs=[REF["chunk_id"]])[0] == "revalidated"
    assert v6.verdict("retrieval", PREMISES, superseded, refs=[99]) == ("refused", ["evidence"])
    assert v6.verdict("retrieval", PREMISES, superseded) == ("refused", ["evidence"])


def test_a_read_settled_unjoined_is_closed_and_may_not_report_again():
    # t1 lapses, t2 reads the ticket again, then t1 reports after all and joins: t2's report finds
    # nothing waiting for it, and only its cost is settled, marked unjoined
    s = fold([*DISPATCHED, ("budget.settled", {"reservation_id": "t1", "used": {"tool_calls": 1},
                                               "unknown_outcome": True}),
              reserve("ticket", "t2"), result("device", "d1"), result("ticket", "t1"), result("retrieval", "r1")])
    assert s["status"] == reducer.PROPOSING and s["steps"]["ticket"]["activity_id"] == "t1"
    settle = ("budget.settled", {"reservation_id": "t2", "used": {"tool_calls": 1}, "unjoined": True,
                                 "reason": "the ticket read reported when nothing waited for it"})
    closed = fold([settle], s)
    assert closed["activities"]["t2"]["status"] == v6.UNJOINED and "t2" not in closed["reservations"]
    assert closed["steps"] == s["steps"] and closed["status"] == reducer.PROPOSING
    with pytest.raises(reducer.IllegalTransition, match="already reported"):
        fold([("read.failed", {"activity_id": "t2", "plan_version": 1, "error": "again"})], closed)
    with pytest.raises(reducer.IllegalTransition, match="only a read still dispatched"):
        fold([("budget.settled", {"reservation_id": "d1", "used": {}, "unjoined": True})], s)
    # a settle without the mark (logs from before it) leaves the activity as it was: replay is unchanged
    plain = fold([("budget.settled", {"reservation_id": "t2", "used": {"tool_calls": 1}})], s)
    assert plain["activities"]["t2"]["status"] == "dispatched"
