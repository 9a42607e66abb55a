"""A rejection is a constraint that survives re-wording (spec §16.6: a rejection is feedback, not a
transient error to retry): after an approver rejects a proposed ticket, the model gets the reason
back and re-drafts; a re-worded draft of the same action (same tool, same target, same kind of
change) is refused before any approval request, and the task ends ``proposal_rejected``.

Driven through the product's own provider against the scripted model server (a real HTTP server on
loopback) scripted to re-word, and through ``reducer/5`` directly for what differs materially. The
same scenario against the real local model is in tests/test_real_model.py.
"""

from __future__ import annotations

import json

import pytest

from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.services import task_submit
from tests.conftest import drive, p

pytestmark = pytest.mark.django_db(transaction=True)

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."
REASON = "A technician is already booked for this fuser: no new ticket."


def _reject(approver, task, reason=REASON) -> ApprovalRequest:
    approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
    return approval_decide(principal=p(approver), approval_id=approval.pk, decision="reject", reason=reason)


def test_a_reworded_draft_of_a_rejected_ticket_is_refused_before_any_new_approval(
        requester, approver, device, kb, refservice, refadmin, model_server):
    model_server.set_script([
        {"reply": "draft", "overrides": {"title": "Fuser error after warm-up on the printer",
                                         "description": "Pages come out smeared with unfused toner after warm-up."}},
        # the re-draft after the rejection: other words, other priority suggestion, the same action
        {"reply": "draft", "overrides": {"title": "Smeared pages: unfused toner after the warm-up",
                                         "description": "After warm-up the printer shows a fuser error and the "
                                                        "pages are smeared.", "priority": "P1"}},
    ])
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    first = task.state["proposal"]
    _reject(approver, task)
    task = drive(task.pk)

    # the task ended on the rejection: no second approval request, no action, no ticket
    assert task.status == reducer.COMPLETED and task.termination_reason == "proposal_rejected"
    assert ApprovalRequest.objects.filter(task=task).count() == 1
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []
    # the model was asked again, with the approver's reason as feedback
    assert len(model_server.requests) == 2
    feedback = model_server.requests[1]["messages"][-1]["content"]
    assert REASON in feedback and "rejected" in feedback
    # the re-draft really was re-worded (a digest check alone would have let it through)
    events = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", "payload"))
    redraft = json.loads([pl for t, pl in events if t == "model.called"][-1]["output"])
    assert redraft["title"] != first["params"]["title"]
    # what was refused, and why, is on the record
    [(_, completed)] = [(t, pl) for t, pl in events if t == "task.completed"]
    identity = {"tool": "ticket.create", "target": f"device/{device.asset_tag}", "change": "create"}
    assert completed["refused"]["identity"] == identity
    assert completed["refused"]["rejection_reason"] == REASON
    assert completed["refused"]["digest"] != first["digest"]
    assert task.state["rejections"] == [{"approval_id": task.state["approval"]["id"], "identity": identity,
                                         "digest": first["digest"], "reason": REASON, "decided_by": "avery"}]
    # and the replay of the record reproduces the state
    state = reducer.initial_state()
    for etype, payload in events:
        state = reducer.reducer_for(task.artifact_bundle["reducer"])(state, etype, payload)
    assert state == task.state


def test_the_reducer_refuses_the_rejected_identity_and_admits_a_material_difference():
    """``reducer/5`` itself: a re-worded ticket.create on the same device is refused at
    ``approval.requested``; a comment on a ticket (another target, another kind) is not."""
    from apps.actions.digest import action_digest
    from apps.tasks.reducer import v5

    def proposal(tool, params):
        return {"tool": tool, "tool_version": "1", "params": params,
                "digest": action_digest(tool=tool, tool_version="1", params=params)}

    create = proposal("ticket.create", {"device": "PRN-1", "title": "Fuser fault", "priority": "P2"})
    reworded = proposal("ticket.create", {"device": "PRN-1", "title": "The fuser is faulty", "priority": "P1"})
    comment = proposal("ticket.comment", {"device": "PRN-1", "ticket_id": "REF-9", "body": "Fuser fault again"})
    other_device = proposal("ticket.create", {"device": "PRN-2", "title": "Fuser fault", "priority": "P2"})
    state = {"status": reducer.WAITING_APPROVAL, "proposal": create, "draft": {}, "rejected_digests": [],
             "approval": {"id": "a1", "status": "PENDING", "digest": create["digest"]},
             "model": {"calls": 1, "reasks": 0, "last": None, "feedback": None}}
    after = {**state}
    v5._approval_rejected(after, {"approval_id": "a1", "decided_by": "avery", "reason": "not needed"})
    assert after["status"] == reducer.PROPOSING
    assert after["rejections"][0]["identity"] == {"tool": "ticket.create", "target": "device/PRN-1",
                                                  "change": "create"}
    assert "not needed" in after["model"]["feedback"][0]

    def ask(p):
        s = {**after, "status": reducer.VALIDATING}
        v5._approval_requested(s, {"approval_id": "a2", "proposal": p, "object_version": 1, "policy_version": 1,
                                   "expires_at": "2030-01-01T00:00:00+00:00"})
        return s

    with pytest.raises(reducer.IllegalTransition, match="rejected earlier"):
        ask(reworded)
    assert ask(comment)["status"] == reducer.WAITING_APPROVAL
    assert ask(other_device)["status"] == reducer.WAITING_APPROVAL
    # an unapproved intent for the rejected identity is refused too
    with pytest.raises(reducer.IllegalTransition, match="rejected earlier"):
        v5._intent_committed({**after, "status": reducer.VALIDATING, "action": None},
                             {"proposal": reworded, "digest": reworded["digest"], "approval_required": False,
                              "reservation": 1, "action_id": "x", "idempotency_key": "k"})
