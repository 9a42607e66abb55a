"""Adversarial review of plan versions at run time (``reducer/6``; branch review-plans). Each test
states the behaviour the capability promises and fails where it does not hold."""

from __future__ import annotations

import pytest

from apps.agent import drafting
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.tasks import reducer
from apps.tasks.models import Task
from tests.conftest import drive, p
from tests.test_plan_versions import _supersede, _waiting_approval

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("plans_reducer")]


def _cited_source(task) -> str:
    cited = set(task.state["proposal"]["params"]["evidence"])
    return next(r["source"] for r in task.state["evidence"] if str(r["chunk_id"]) in cited)


@pytest.mark.no_trajectory_check  # the re-draft is patched to ask the requester
def test_a_held_approval_closed_by_a_redraft_that_asks_the_requester_is_closed_on_its_row_too(
        requester, approver, device, kb, tenant, monkeypatch):
    """The state says the held approval is INVALIDATED (δ's _close_held) when the re-validated draft
    asks the requester; the approvals queue and API read the ApprovalRequest row. reducer/3's rule:
    "the state shows what the approval row says"."""
    task = _waiting_approval(requester, device)
    first = ApprovalRequest.objects.get(task=task)
    _supersede(tenant, _cited_source(task), "\n\n## Note\n\nSwitch the printer off first.\n")
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")

    real = drafting.with_due_date

    def asks_when_held(t, draft):
        draft = real(t, draft)
        if (t.state or {}).get("revalidating"):
            draft = {**draft, "missing_information": ["Which tray is the paper jammed in?"]}
        return draft

    monkeypatch.setattr(drafting, "with_due_date", asks_when_held)
    task = drive(task.pk)
    assert task.status == reducer.WAITING_INPUT and len(task.state["plans"]) == 2
    assert task.state["approval"]["id"] == str(first.pk) and task.state["approval"]["status"] == "INVALIDATED"
    first.refresh_from_db()
    assert first.status == "INVALIDATED", (
        f"the state closed the held approval, but its row still says {first.status}: the queue and the API show "
        "an approval the task no longer holds")


def test_a_resume_after_approval_rechecks_the_requesters_scopes_a_read_depends_on(
        requester, approver, device, kb, tenant, refservice):
    """long-task-runtime.md: resume re-checks the current premises (Knowledge, Capability, Security,
    Domain) and continues only if they hold. Retrieval depends on the requester's scopes
    (v6.DEPENDS); when they change while the task waits for its approval, the retrieval result of
    plan 1 is stale by the capability's own rule, yet the old approval commits the intent on plan 1
    (resume_after_approval only checks that the cited chunks are still readable)."""
    from apps.accounts.models import Membership
    from apps.tasks.reducer import v6

    task = _waiting_approval(requester, device)
    plan_scopes = task.state["plans"][-1]["premises"]["scopes"]
    Membership.objects.filter(user=requester, tenant=tenant).update(scopes=["public", "tier2", "security"])
    first = ApprovalRequest.objects.get(task=task)
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    committed_under = task.state["plans"][-1]
    assert v6.verdict("retrieval", {"scopes": plan_scopes}, {"scopes": ["public", "security", "tier2"]})[0] == "refused"
    assert task.state.get("action") is None or len(task.state["plans"]) > 1, (
        f"the intent was committed under plan {committed_under['version']}, whose scopes premise "
        f"{committed_under['premises']['scopes']} no longer holds; no barrier was recorded")


def test_a_read_settled_when_nothing_waited_for_it_does_not_read_again_on_a_duplicate_message(
        requester, device, kb, settings, monkeypatch):
    """A read whose report found nothing waiting (another read of its step joined first) is settled
    by a plain budget.settled that leaves its activity 'dispatched'. A redelivered read_step message
    (at-least-once delivery) then reads the ticket system again, outside any reservation, and a
    later report of it would be taken as its first."""
    from apps.agent import runner
    from apps.agent.runner import agent_run, read_activity_run
    from apps.events.models import TaskEvent
    from apps.tasks.services import task_submit
    from tests.test_plan_versions import SYMPTOM

    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    agent_run(task_id=task.pk)  # device and retrieval joined here; the ticket read t1 is an activity
    t1 = next(aid for aid, a in Task.objects.get(pk=task.pk).state["activities"].items() if a["step"] == "ticket")
    settings.FAULTDESK = {**settings.FAULTDESK, "ACTIVITY_CLEANUP_SECONDS": -3600}  # t1's deadline is past
    agent_run(task_id=task.pk)  # t1 lapses (charged at its reservation); t2 dispatched
    state = Task.objects.get(pk=task.pk).state
    assert state["activities"][t1]["status"] == "lapsed"
    t2 = state["steps"]["ticket"]["activity_id"]

    reads = []
    real = runner.read_perform
    monkeypatch.setattr(runner, "read_perform", lambda t, a, *, timeout: reads.append(a["step"]) or real(
        t, a, timeout=timeout))
    read_activity_run(task_id=task.pk, activity_id=t1)  # the lapsed read reports after all: joined, task goes on
    assert Task.objects.get(pk=task.pk).status == reducer.WAITING_APPROVAL
    read_activity_run(task_id=task.pk, activity_id=t2)  # nothing waits for it: its cost is settled
    assert t2 not in Task.objects.get(pk=task.pk).state["reservations"]
    assert len(reads) == 2
    read_activity_run(task_id=task.pk, activity_id=t2)  # the same message, delivered again
    assert len(reads) == 2, "a read already reported (and settled) is read again, outside any reservation"
    assert Task.objects.get(pk=task.pk).state["activities"][t2]["status"] != "dispatched", \
        "an activity whose report was recorded still looks dispatched"
    assert TaskEvent.objects.filter(task=task, type="budget.settled", payload__reservation_id=t2).count() == 1
