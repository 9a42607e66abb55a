"""Plan versions at run time (``reducer/6``; long-task-runtime.md: PlanVersion, Replan Barrier): the
reads run as activities under a plan version; a read that finds the world moved on activates the
next version behind a recorded barrier; each late result is judged by its premises — accepted,
re-validated, or refused and read again — never by when it arrived; a granted approval whose
evidence was superseded while the task waited re-plans, and is kept only if the action comes out
the same. Every task here is replayed after the test (the suite's replay check)."""

from __future__ import annotations

import pytest

from apps.accounts.models import Membership
from apps.agent import drafting, runner
from apps.agent.runner import agent_run, read_activity_run
from apps.approvals.models import ApprovalRequest
from apps.approvals.services import approval_decide
from apps.devices.services import device_update_state
from apps.events.models import TaskEvent
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.reducer import v6
from apps.tasks.replay import task_replay
from apps.tasks.services import task_submit
from tests.conftest import KB, drive, p, reads_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("plans_reducer")]

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _dispatched(requester, device) -> tuple[Task, dict[str, str]]:
    """A report whose three reads are dispatched under plan 1: ``(task, {step: activity_id})``."""
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    agent_run(task_id=task.pk)
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.RETRIEVING and [v["version"] for v in task.state["plans"]] == [1]
    return task, {a["step"]: aid for aid, a in task.state["activities"].items()}


def _late(monkeypatch, step: str, meanwhile) -> None:
    """Make the ``step`` read late: once it has read, ``meanwhile()`` runs before it reports."""
    real, done = runner.read_perform, []

    def read_then_wait(task, activity, *, timeout):
        out = real(task, activity, timeout=timeout)
        if activity["step"] == step and not done:
            done.append(True)
            meanwhile()
        return out

    monkeypatch.setattr(runner, "read_perform", read_then_wait)


def _event(task, etype, **match) -> list[TaskEvent]:
    return [e for e in TaskEvent.objects.filter(task=task, type=etype).order_by("seq")
            if all(e.payload.get(k) == v for k, v in match.items())]


def test_a_late_result_whose_premises_equal_the_current_ones_is_accepted(requester, device, kb,
                                                                         reads_as_activities):
    task, ids = _dispatched(requester, device)
    device_update_state(device=device, state="offline")  # v18; what retrieval filters on is unchanged
    read_activity_run(task_id=task.pk, activity_id=ids["device"])  # finds v18: plan 2
    t = Task.objects.get(pk=task.pk)
    assert [v["version"] for v in t.state["plans"]] == [1, 2]
    barrier = t.state["plans"][1]["barrier"]
    assert "device_version" in barrier["why"] and barrier["changed"] == ["device_version"]
    assert barrier["continuing"] == {"ticket": "in_flight", "retrieval": "in_flight"}
    # the retrieval dispatched under plan 1 reads now, under the very premises of plan 2
    read_activity_run(task_id=task.pk, activity_id=ids["retrieval"])
    retrieved = _event(task, "evidence.retrieved")[0]
    assert retrieved.payload["plan_version"] == 1 and retrieved.payload["verdict"] == "accepted"
    assert retrieved.payload["premises"]["device_version"] == 18
    t = Task.objects.get(pk=task.pk)
    assert t.state["steps"]["retrieval"]["status"] == "joined" and t.state["activities"][ids["retrieval"]][
        "status"] == "accepted"


def test_a_late_result_after_a_change_it_does_not_depend_on_is_revalidated(requester, device, kb, monkeypatch,
                                                                           reads_as_activities):
    task, ids = _dispatched(requester, device)

    def device_moves_and_is_read():
        device_update_state(device=device, state="offline")  # v18, same kind and alert
        read_activity_run(task_id=task.pk, activity_id=ids["device"])  # plan 2

    _late(monkeypatch, "retrieval", device_moves_and_is_read)
    read_activity_run(task_id=task.pk, activity_id=ids["retrieval"])  # read at v17, reports under plan 2
    retrieved = _event(task, "evidence.retrieved")[0]
    assert retrieved.payload["plan_version"] == 1 and retrieved.payload["premises"]["device_version"] == 17
    assert retrieved.payload["verdict"] == "revalidated"
    assert retrieved.payload["revalidation"]["ok"] is True
    assert "current" in retrieved.payload["revalidation"]["checked"]
    t = Task.objects.get(pk=task.pk)
    assert len(t.state["plans"]) == 2 and t.state["activities"][ids["retrieval"]]["status"] == "revalidated"
    assert not _event(task, "result.refused")
    reads_run(task.pk)  # the ticket read: its premise (the ticket's epoch) held
    t = drive(task.pk)
    assert t.status == reducer.WAITING_APPROVAL


def test_a_late_result_after_a_change_it_depends_on_is_refused_and_read_again(requester, device, kb, monkeypatch,
                                                                              reads_as_activities):
    task, ids = _dispatched(requester, device)

    def alert_changes_and_is_read():
        device_update_state(device=device, alert_code="PRN-PAPER-13.1", alert_message="Paper jam in tray 2")
        read_activity_run(task_id=task.pk, activity_id=ids["device"])  # plan 2: another device profile

    _late(monkeypatch, "retrieval", alert_changes_and_is_read)
    read_activity_run(task_id=task.pk, activity_id=ids["retrieval"])
    refused = _event(task, "result.refused", activity_id=ids["retrieval"])
    assert len(refused) == 1 and "device_profile" in refused[0].payload["reason"]
    assert refused[0].payload["used"] == {"tool_calls": 1}, "the read's cost is settled all the same"
    assert not _event(task, "evidence.retrieved"), "the refused evidence never entered the plan"
    t = Task.objects.get(pk=task.pk)
    again = [aid for aid, a in t.state["activities"].items() if a["step"] == "retrieval" and a["plan_version"] == 2]
    assert len(again) == 1 and t.state["steps"]["retrieval"]["activity_id"] == again[0], "read again under plan 2"
    reads_run(task.pk)
    retrieved = _event(task, "evidence.retrieved")
    assert len(retrieved) == 1 and retrieved[0].payload["plan_version"] == 2
    assert retrieved[0].payload["premises"]["device_profile"]["alert_code"] == "PRN-PAPER-13.1"
    assert task_replay(Task.objects.get(pk=task.pk), use_snapshot=False).ok


def _supersede(tenant, source: str, extra: str) -> None:
    """A new version of the knowledge-base document ``source`` (``scope/name``), with ``extra`` added."""
    from apps.evidence.services import document_ingest

    scope, name = source.split("/", 1)
    document_ingest(tenant=tenant, source=source, raw=(KB / scope / name).read_text() + extra, scope=scope)


def _waiting_approval(requester, device) -> Task:
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    return task


def test_cited_evidence_superseded_during_the_approval_wait_revalidates_and_asks_again(
        requester, approver, device, kb, tenant):
    task = _waiting_approval(requester, device)
    first = ApprovalRequest.objects.get(task=task)
    cited = {r["chunk_id"] for r in task.state["evidence"]
             if str(r["chunk_id"]) in set(task.state["proposal"]["params"]["evidence"])}
    assert cited, "the proposal cites retrieved evidence"
    source = next(r["source"] for r in task.state["evidence"] if r["chunk_id"] in cited)
    _supersede(tenant, source, "\n\n## Note\n\nSwitch the printer off before opening the fuser door.\n")
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    plans = task.state["plans"]
    assert len(plans) == 2 and "superseded" in plans[1]["barrier"]["why"]
    assert set(plans[1]["barrier"]["continuing"]) == {"device", "ticket"}, "the reads whose premises held continue"
    assert "retrieval" in plans[1]["barrier"]["cancelled"]
    assert task.status == reducer.WAITING_APPROVAL
    first.refresh_from_db()
    assert first.status == "INVALIDATED" and "changed" in first.closed_reason
    second = ApprovalRequest.objects.get(task=task, status="PENDING")
    assert second.pk != first.pk and task.state["approval"]["id"] == str(second.pk)
    assert not _event(task, "intent.committed"), "nothing is sent on the old approval"


# --- the local reads, in the dispatching run ------------------------------------------------------------

def _local_reads_watched(monkeypatch, order: list, *, raise_on: str | None = None) -> None:
    """Record in ``order`` each message sent (``("sent", name)``) and each local read the dispatching
    run makes (``("read", step)``); the ``raise_on`` read raises once."""
    import apps.core.queue as queue
    from apps.agent import reads

    monkeypatch.setattr(queue, "send_now", lambda name, *args: order.append(("sent", name)))
    real, raised = reads.read_perform, []

    def perform(task, activity, *, timeout):
        order.append(("read", activity["step"]))
        if activity["step"] == raise_on and not raised:
            raised.append(True)
            raise RuntimeError("embedding model crashed")
        return real(task, activity, timeout=timeout)

    monkeypatch.setattr(reads, "read_perform", perform)


def test_the_dispatch_sends_the_remote_read_first_then_reads_locally_and_the_remote_report_joins(
        requester, device, kb, monkeypatch):
    order: list = []
    _local_reads_watched(monkeypatch, order)
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    order.clear()
    agent_run(task_id=task.pk)
    assert order == [("sent", "read_step"), ("read", "device"), ("read", "retrieval")], \
        "only the ticket system's read is an activity, and its message left before the local reads"
    t = Task.objects.get(pk=task.pk)
    assert t.status == reducer.RETRIEVING and t.lease_owner is None
    reserved = _event(task, "budget.reserved")
    assert sorted(e.payload["step"] for e in reserved) == ["device", "retrieval", "ticket"]
    assert all(e.payload["plan_version"] == 1 and e.payload["deadline"] for e in reserved), "each keeps its identity"
    ids = {e.payload["step"]: e.payload["reservation_id"] for e in reserved}
    for step, etype in (("device", "device.read"), ("retrieval", "evidence.retrieved")):
        [read] = _event(task, etype)
        assert read.payload["activity_id"] == ids[step] and read.payload["verdict"] == "accepted"
        assert read.payload["used"] == {"tool_calls": 1} and ids[step] not in t.state["reservations"], "settled"
        assert t.state["steps"][step]["status"] == "joined"
    assert t.state["steps"]["ticket"] == {"status": "dispatched", "activity_id": ids["ticket"], "plan_version": 1}
    assert reads_run(task.pk) == [ids["ticket"]]
    t = Task.objects.get(pk=task.pk)
    assert t.status == reducer.WAITING_APPROVAL, "the remote read's report completed the join and went on"
    assert task_replay(t, use_snapshot=False).ok


def test_a_local_read_that_raises_is_a_failed_read_at_its_cost_and_is_read_again(requester, device, kb, monkeypatch):
    order: list = []
    _local_reads_watched(monkeypatch, order, raise_on="retrieval")
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    agent_run(task_id=task.pk)
    [failed] = _event(task, "read.failed")
    t = Task.objects.get(pk=task.pk)
    assert "embedding model crashed" in failed.payload["error"] and failed.payload["used"] == {"tool_calls": 1}
    assert failed.payload["activity_id"] not in t.state["reservations"], "its cost is settled"
    assert t.state["steps"]["retrieval"] == {"status": "pending"} and t.state["steps"]["device"]["status"] == "joined"
    reads_run(task.pk)  # the ticket read reports, and its run reads retrieval again, itself
    t = Task.objects.get(pk=task.pk)
    assert t.status == reducer.WAITING_APPROVAL
    assert [s for kind, s in order if kind == "read"] == ["device", "retrieval", "retrieval"]
    [retrieved] = _event(task, "evidence.retrieved")
    assert retrieved.payload["activity_id"] != failed.payload["activity_id"]
    assert task_replay(t, use_snapshot=False).ok


def test_a_local_read_that_finds_the_device_moved_replans_and_the_stale_read_is_read_again(
        requester, device, kb, monkeypatch):
    from apps.agent import reads

    real = reads.read_perform

    def perform(task, activity, *, timeout):
        out = real(task, activity, timeout=timeout)
        if activity["step"] == "device" and activity["plan_version"] == 1:
            # between the device read and retrieval: the alert retrieval filters on changes
            device_update_state(device=device, alert_code="PRN-PAPER-13.1", alert_message="Paper jam in tray 2")
        return out

    monkeypatch.setattr(reads, "read_perform", perform)
    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    agent_run(task_id=task.pk)
    t = Task.objects.get(pk=task.pk)
    plans = t.state["plans"]
    assert [v["version"] for v in plans] == [1, 2]
    assert "retrieval read found premises moved" in plans[1]["barrier"]["why"]
    assert "device" in plans[1]["barrier"]["cancelled"] and plans[1]["barrier"]["continuing"] == {"ticket": "in_flight"}
    devices = _event(task, "device.read")
    assert [e.payload["plan_version"] for e in devices] == [1, 2], "the device read of plan 1 is read again"
    assert devices[1].payload["reading"]["alert_code"] == "PRN-PAPER-13.1"
    reads_run(task.pk)
    t = drive(task.pk)
    assert t.status == reducer.WAITING_APPROVAL
    assert task_replay(t, use_snapshot=False).ok


def _cited_source(task) -> str:
    cited = set(task.state["proposal"]["params"]["evidence"])
    return next(r["source"] for r in task.state["evidence"] if str(r["chunk_id"]) in cited)


# --- a resume re-checks every premise; a held approval closed in the state is closed on its row ---------

@pytest.mark.no_trajectory_check  # the re-draft is patched to ask the requester
def test_a_held_approval_closed_by_a_redraft_that_asks_the_requester_is_closed_on_its_row_too(
        requester, approver, device, kb, tenant, monkeypatch):
    """When the re-validated draft asks the requester (``input.requested``), δ closes the held approval
    (INVALIDATED); its ApprovalRequest row — what the approvals queue and API read — is invalidated in
    the same transaction, with the same reason (reducer/3: the state shows what the approval row says)."""
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
    assert first.closed_reason == task.state["approval"]["reason"] == (
        f"{task.state['plans'][-1]['barrier']['why']} — {v6.ASKS_REQUESTER}")  # what moved, then what instead
    assert first.status == "INVALIDATED", (
        f"the state closed the held approval, but its row still says {first.status}: the queue and the API show "
        "an approval the task no longer holds")


def test_a_resume_after_approval_replans_behind_a_barrier_when_the_requesters_scopes_changed(
        requester, approver, device, kb, tenant, refservice):
    """long-task-runtime.md: resume re-checks the current premises (Knowledge, Capability, Security,
    Domain) and continues only if they hold. Retrieval depends on the requester's scopes
    (v6.DEPENDS): when they change while the task waits for its approval, the resume re-plans behind
    a barrier that reads retrieval again (the approval held), instead of committing on plan 1."""
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
    barrier = task.state["plans"][1]["barrier"]
    assert "scopes" in barrier["changed"] and "retrieval" in barrier["cancelled"]
    assert "premises changed while the task waited" in barrier["why"]
    assert committed_under["premises"]["scopes"] == ["public", "security", "tier2"]


def test_a_read_settled_when_nothing_waited_for_it_does_not_read_again_on_a_duplicate_message(
        requester, device, kb, settings, monkeypatch):
    """A read whose report found nothing waiting (another read of its step joined first) is settled
    ``unjoined``: its activity is closed, so a redelivered read_step message (at-least-once delivery)
    neither reads the ticket system again, outside any reservation, nor reports as if for the first
    time."""
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


def _approve_pending(task, approver):
    a = ApprovalRequest.objects.get(task=task, status="PENDING")
    approval_decide(principal=p(approver), approval_id=a.pk, decision="approve", reason="ok")
    return a


def test_an_approval_closed_because_the_device_moved_during_the_wait_says_the_device_moved_not_the_evidence(
        requester, approver, device, kb, tenant, refservice):
    """Under a comment on an open ticket (bound to the ticket's version), the device's alert moves
    while the task waits: the resume re-plans and asks again, and the old approval's reason (shown by
    the queue and the API) says what moved."""
    first_report = task_submit(principal=p(requester), device_id=device.pk, urgency="high", symptom=SYMPTOM).task
    drive(first_report.pk)
    _approve_pending(first_report, approver)
    assert drive(first_report.pk).status == reducer.COMPLETED, "the device's ticket is open"

    task = task_submit(principal=p(requester), device_id=device.pk, urgency="high",
                       symptom=SYMPTOM + " Again today.").task
    task = drive(task.pk)
    assert task.status == reducer.WAITING_APPROVAL
    first = ApprovalRequest.objects.get(task=task)
    assert first.tool == "ticket.comment"
    # nothing in the knowledge base changes; only the device's alert does, while the task waits
    device_update_state(device=device, alert_code="PRN-PAPER-13.1", alert_message="Paper jam in tray 2")
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    barrier = task.state["plans"][-1]["barrier"]
    assert "device_version" in barrier["changed"]
    assert "superseded" not in barrier["why"] and "retired" not in barrier["why"], barrier["why"]
    first.refresh_from_db()
    assert first.status == "INVALIDATED"
    assert ApprovalRequest.objects.filter(task=task, status="PENDING").exists(), "the approver is asked again"
    assert first.closed_reason.startswith(barrier["why"]), first.closed_reason
    assert "device_version" in first.closed_reason, first.closed_reason
    assert (first.reason, first.decided_by_id) == ("ok", approver.pk), "the approver's own decision is kept"
    assert "superseded" not in first.closed_reason and "retired" not in first.closed_reason, first.closed_reason


def test_a_replan_during_the_approval_wait_whose_redraft_proposes_the_same_action_keeps_the_approval(
        requester, approver, device, kb, tenant, refservice):
    """long-task-runtime.md: a premise that moved while the task waited re-plans and re-drafts; when
    the re-drafted action is the one approved (same h(a)), the approval stands
    (``approval.revalidated``) — the approver is not asked again and exactly one ticket is made."""
    task = _waiting_approval(requester, device)
    first = ApprovalRequest.objects.get(task=task)
    approved_digest = task.state["approval"]["digest"]
    Membership.objects.filter(user=requester, tenant=tenant).update(scopes=["public", "tier2", "security"])
    approval_decide(principal=p(approver), approval_id=first.pk, decision="approve", reason="ok")
    task = drive(task.pk)
    assert len(task.state["plans"]) == 2 and "scopes" in task.state["plans"][1]["barrier"]["changed"]
    [kept] = _event(task, "approval.revalidated")
    assert kept.payload["approval_id"] == str(first.pk)
    assert ApprovalRequest.objects.filter(task=task).count() == 1, "the approver was asked again"
    first.refresh_from_db()
    assert first.status == "APPROVED" and first.closed_reason == ""
    assert task.status == reducer.COMPLETED and task.state["action"]["digest"] == approved_digest
    assert len(_event(task, "intent.committed")) == 1

