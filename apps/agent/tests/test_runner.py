"""The controller's decisions (and what a fresh user's review found): answers to the agent's
questions are used, resume re-checks premises, and every bound ends in an explicit decision with a
reason."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.accounts.models import AccessScope, Membership
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_cancel, task_provide_input, task_submit
from tests.conftest import drive, p, reads_run


def _submit(requester, device, symptom="Fuser error after warm-up, pages smeared."):
    return task_submit(principal=p(requester), device_id=device.pk, symptom=symptom).task


def test_a_short_symptom_asks_and_the_answer_moves_the_task_on(requester, device, kb):
    task = drive(_submit(requester, device, symptom="broken").pk)
    assert task.status == reducer.WAITING_INPUT
    assert "Describe the symptom" in task.state["questions"][0]
    task_provide_input(principal=p(requester), task_id=task.pk,
                       text="Fuser error after warm-up since Monday; power-cycling did not help.")
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    assert "since Monday" in task.state["proposal"]["params"]["description"]
    assert task.state["replans"] == 1


def test_cancel_closes_the_pending_approval(requester, approver, device, kb):
    task = drive(_submit(requester, device).pk)
    task_cancel(principal=p(requester), task_id=task.pk)
    approval = ApprovalRequest.objects.get(task=task)
    assert approval.status == ApprovalStatus.INVALIDATED and approval.reason == "the task was cancelled"


def test_resume_after_approval_replans_when_the_requester_lost_a_scope(requester, approver, device, kb):
    task = drive(_submit(requester, device).pk)
    assert any(r["scope"] == "tier2" for r in task.state["evidence"])
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve")
    Membership.objects.filter(user=requester).update(scopes=[AccessScope.PUBLIC])
    task = drive(task.pk)
    approvals = list(ApprovalRequest.objects.filter(task=task).order_by("created_at"))
    assert approvals[0].status == ApprovalStatus.INVALIDATED
    assert "permissions changed" in approvals[0].closed_reason
    assert task.status == reducer.WAITING_APPROVAL
    # re-planned with the narrowed scopes: the fuser procedure is tier2 only, so nothing readable
    # covers the report any more, and the new proposal says so instead of citing it
    assert task.state["evidence"] == []
    assert task.state["selection"]["outcome"] == "no_procedure"
    assert task.state["selection"]["withheld"]["scopes"] == ["tier2"]


def test_resume_fails_explicitly_when_the_requester_was_removed(requester, approver, device, kb):
    task = drive(_submit(requester, device).pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=task).pk,
                    decision="approve")
    Membership.objects.filter(user=requester).update(is_active=False)
    task = drive(task.pk)
    assert task.status == reducer.FAILED
    assert "requester no longer" in task.termination_reason


def test_deadline_passed_while_waiting_is_an_explicit_failure(requester, device, kb):
    task = drive(_submit(requester, device).pk)
    assert task.status == reducer.WAITING_APPROVAL
    Task.objects.filter(pk=task.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    from apps.agent.sweeper import tasks_needing_work

    assert ("WAITING_APPROVAL", str(task.pk)) in tasks_needing_work(now=timezone.now(), idle=timedelta(0))
    task = drive(task.pk)
    assert task.status == reducer.FAILED and task.termination_reason == "deadline_exceeded"


def test_replan_limit_ends_the_task(requester, device, kb, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "MAX_REPLANS": 1}
    task = drive(_submit(requester, device, symptom="broken").pk)
    for answer in ("it", "no"):  # still too short: the agent asks again, and re-plans each time
        task_provide_input(principal=p(requester), task_id=task.pk, text=answer)
        task = drive(task.pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason.startswith("replan_limit")


def test_step_limit_ends_the_task(requester, device, kb, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "MAX_EVENTS_PER_TASK": 3}
    task = drive(_submit(requester, device).pk)
    assert task.status == reducer.FAILED
    assert task.termination_reason.startswith("step_limit")


# --- pools: which worker runs which step ------------------------------------------------------------

def _sent(monkeypatch) -> list[tuple]:
    import apps.core.queue as queue

    sent: list[tuple] = []
    monkeypatch.setattr(queue, "send_now", lambda name, *args: sent.append((name, *map(str, args))))
    return sent


@pytest.mark.django_db(transaction=True)
def test_a_tools_run_hands_a_hosted_models_draft_to_the_agent_pool(requester, device, kb, refservice, model_server,
                                                                    monkeypatch, plans_reducer):
    """The context reads run on the tools pool (the open-ticket read an activity of its own, the local
    ones in the run that dispatches it); a draft by a model outside the process does not: the read
    that completes the join stops at PROPOSING, gives the lease back and sends ``agent_step``, and the
    agent pool calls."""
    from apps.agent.runner import agent_run, context_read
    from apps.core.queue import AGENT_STEP, READ_CONTEXT, READ_STEP
    from apps.events.models import TaskEvent
    from apps.tasks.replay import task_replay

    sent = _sent(monkeypatch)
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                       symptom="Fuser error after warm-up, pages come out smeared with unfused toner.").task
    assert sent == [(READ_CONTEXT, str(task.pk))], "a report starts on the tools pool"
    context_read(task_id=task.pk)
    reads = [m for m in sent if m[0] == READ_STEP]
    assert len(reads) == 1 and Task.objects.get(pk=task.pk).status == reducer.RETRIEVING, "the remote read dispatched"
    assert sorted(reads_run(task.pk)) == sorted(m[2] for m in reads)
    t = Task.objects.get(pk=task.pk)
    assert t.status == reducer.PROPOSING and t.lease_owner is None
    assert not TaskEvent.objects.filter(task=t, type="model.called").exists()
    assert sent[-1] == (AGENT_STEP, str(task.pk))
    agent_run(task_id=task.pk)  # the agent pool makes the call
    assert TaskEvent.objects.filter(task=t, type="model.called").exists()
    assert task_replay(Task.objects.get(pk=task.pk), use_snapshot=False).ok


@pytest.mark.django_db(transaction=True)
def test_with_the_local_drafter_the_read_that_completes_the_join_reaches_the_approval_request(requester, device, kb,
                                                                                             monkeypatch,
                                                                                             plans_reducer):
    """The local drafter makes no outside call: the run that starts the reads reserves all three,
    dispatches the open-ticket read, makes the local two and ends; the read that completes the join
    goes on to the draft, validation and the approval request, with no hand-over."""
    from apps.agent.runner import context_read
    from apps.events.models import TaskEvent

    sent = _sent(monkeypatch)
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                       symptom="Fuser error after warm-up, pages come out smeared with unfused toner.").task
    context_read(task_id=task.pk)
    assert [name for name, *_ in sent] == ["read_context", "read_step"]
    reads_run(task.pk)
    t = Task.objects.get(pk=task.pk)
    assert t.status == reducer.WAITING_APPROVAL and t.lease_owner is None
    assert len(sent) == 2, "nothing handed over"
    types = list(TaskEvent.objects.filter(task=t).order_by("seq").values_list("type", flat=True))
    assert types[:6] == ["task.accepted", "retrieval.started", "plan.activated", "budget.reserved", "budget.reserved",
                         "budget.reserved"]
    assert types[6:9] == ["device.read", "evidence.retrieved", "ticket.read"], "each read settles by its event"
    assert types[9:] == ["budget.reserved", "model.called", "draft.proposed", "approval.requested"]


@pytest.mark.django_db(transaction=True)
def test_the_sweeper_re_queues_an_idle_task_once_per_window_not_every_tick(requester, device, kb, settings,
                                                                            monkeypatch):
    """A task waiting behind a backlog looks idle on every tick; one message per tick for it would
    only lengthen the backlog. The window is capped at half a lease."""
    from celery import current_app

    from apps.agent.tasks import sweep_leases

    settings.CACHES = {**settings.CACHES, "coordination": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "sweeper-test"}}
    settings.FAULTDESK = {**settings.FAULTDESK, "SWEEPER_IDLE_SECONDS": 0, "SWEEPER_REQUEUE_SECONDS": 30,
                          "LEASE_SECONDS": 2}
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args=(), **kw: sent.append((name, list(args))))
    task = _submit(requester, device)
    Task.objects.filter(pk=task.pk).update(updated_at=timezone.now() - timedelta(minutes=5))
    sent.clear()
    for _ in range(3):
        sweep_leases()
    assert sent == [("read_context", [str(task.pk)])]  # ACCEPTED: its next step is the context reads
    import time

    time.sleep(1.1)  # the window is min(30 s, half the 2 s lease)
    sweep_leases()
    assert sent == [("read_context", [str(task.pk)])] * 2


@pytest.mark.django_db(transaction=True)
def test_a_sweep_reaches_past_the_tasks_it_re_queued_recently(requester, device, kb, settings, monkeypatch):
    """One tick sends at most a fixed number of messages, oldest first; the next tick passes over
    those (still inside their window) and reaches the rest instead of finding the same ones."""
    from celery import current_app

    import apps.agent.tasks as agent_tasks

    settings.CACHES = {**settings.CACHES, "coordination": {
        "BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "sweeper-reach-test"}}
    settings.FAULTDESK = {**settings.FAULTDESK, "SWEEPER_IDLE_SECONDS": 0, "SWEEPER_REQUEUE_SECONDS": 30}
    monkeypatch.setattr(agent_tasks, "SWEEP_SENDS_PER_TICK", 2)
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args=(), **kw: sent.append(args[0]))
    tasks = [_submit(requester, device, symptom=f"Fuser error after warm-up, tray {i}.") for i in range(3)]
    for age, task in zip((30, 20, 10), tasks, strict=True):  # the first submitted is the longest untouched
        Task.objects.filter(pk=task.pk).update(updated_at=timezone.now() - timedelta(minutes=age))
    sent.clear()
    agent_tasks.sweep_leases()
    assert sent == [str(tasks[0].pk), str(tasks[1].pk)]
    agent_tasks.sweep_leases()
    assert sent[2:] == [str(tasks[2].pk)]
    agent_tasks.sweep_leases()
    assert len(sent) == 3
