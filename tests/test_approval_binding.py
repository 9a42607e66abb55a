"""Approval binding, re-checked before the intent and again at the moment of dispatch (DESIGN.md §7;
spec §16.6): each invalidation cause — parameters changed after the approval, the device's version
changed, the approval expired, the approver's role revoked — sends nothing, records why, and leads
to a new approval that can be granted. And the versioned policy: risk levels, who may decide,
validation."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from apps.accounts.models import Membership, Role
from apps.actions.models import Action, ActionStatus
from apps.agent.runner import agent_run
from apps.approvals.models import ApprovalPolicy, ApprovalRequest, ApprovalStatus
from apps.approvals.policy import policy_decide
from apps.approvals.rules import DEFAULT_RULES
from apps.approvals.services import approval_decide
from apps.core.errors import Forbidden
from apps.devices.services import device_update_state
from apps.outbox.dispatch import outbox_dispatch_batch
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.tamper import immutability_bypassed

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


def _pending(task) -> ApprovalRequest:
    return ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)


def _approve(user, task) -> ApprovalRequest:
    approval = _pending(task)
    approval_decide(principal=p(user), approval_id=approval.pk, decision="approve", reason="ok")
    return approval


@pytest.fixture
def approved(requester, approver, device, kb, refservice):
    """A task whose first approval was just granted; nothing committed yet."""
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task.pk)
    _approve(approver, task)
    return Task.objects.get(pk=task.pk)


def _expire(approval) -> None:
    ApprovalRequest.objects.filter(pk=approval.pk).update(expires_at=timezone.now() - timedelta(seconds=1))


def _revoke(approver) -> None:
    Membership.objects.filter(user=approver).update(role=Role.REQUESTER)


def _tamper_params(task) -> None:
    """Someone changes what will be sent after it was approved (past the database's refusal)."""
    action = Action.objects.get(task=task)
    with immutability_bypassed("actions_action"):
        Action.objects.filter(pk=action.pk).update(params={**action.params, "priority": "P4"},
                                                   params_digest="0" * 64)


CAUSES = {
    "device version changed": lambda task, device, approver: device_update_state(
        device=device, alert_message="Fuser temperature low: 120 C"),
    "approval expired": lambda task, device, approver: _expire(ApprovalRequest.objects.get(task=task)),
    "approver no longer holds an approver role": lambda task, device, approver: _revoke(approver),
}


def _reapproved_and_completed(task, user, refadmin) -> Task:
    second = _pending(task)
    assert second.status == ApprovalStatus.PENDING
    approval_decide(principal=p(user), approval_id=second.pk, decision="approve", reason="checked again")
    task = drive(task.pk)
    assert task.status == reducer.COMPLETED
    sent = Action.objects.get(task=task, status=ActionStatus.SUCCEEDED)
    assert sent.approval_id == second.pk and refadmin.effects(sent.idempotency_key) == 1
    assert len(refadmin.tickets()) == 1
    return task


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_a_broken_binding_before_the_intent_sends_nothing_and_asks_again(cause, approved, device, approver,
                                                                        admin_user, refadmin):
    CAUSES[cause](approved, device, approver)
    task = drive(approved.pk)
    first = ApprovalRequest.objects.filter(task=task).order_by("created_at").first()
    assert first.status == ApprovalStatus.INVALIDATED and cause in first.closed_reason
    assert not Action.objects.filter(task=task).exists(), "no intent on a broken binding"
    assert refadmin.tickets() == []
    assert task.status == reducer.WAITING_APPROVAL
    _reapproved_and_completed(task, admin_user, refadmin)


@pytest.mark.parametrize("cause", sorted([*CAUSES, "parameters changed since approval"]))
def test_a_broken_binding_at_the_moment_of_dispatch_sends_nothing_and_asks_again(cause, approved, device, approver,
                                                                                admin_user, refadmin):
    agent_run(task_id=approved.pk)  # the intent and its outbox row are committed under the approval
    action = Action.objects.get(task=approved)
    if cause == "parameters changed since approval":
        _tamper_params(approved)
    else:
        CAUSES[cause](approved, device, approver)
    outbox_dispatch_batch()
    action.refresh_from_db()
    assert action.status == ActionStatus.NOT_SENT and refadmin.requests(action.idempotency_key) == 0
    first = ApprovalRequest.objects.get(pk=action.approval_id)
    expected = "digest mismatch" if cause.startswith("parameters") else cause
    assert first.status == ApprovalStatus.INVALIDATED and expected in first.closed_reason
    task = drive(approved.pk)
    assert task.status == reducer.WAITING_APPROVAL
    _reapproved_and_completed(task, admin_user, refadmin)


# --- the versioned policy -------------------------------------------------------------------------

def test_the_default_policy_resolves_by_tool_then_risk_level(tenant):
    create = policy_decide(tenant_id=tenant.pk, tool="ticket.create")
    assert (create.requires_approval, create.ttl, create.policy_version, create.risk) == \
        (True, timedelta(minutes=240), 1, "medium")
    assert create.approver_roles == ("approver", "admin")
    unknown = policy_decide(tenant_id=tenant.pk, tool="printer.reboot")
    assert (unknown.requires_approval, unknown.risk, unknown.approver_roles) == (True, "high", ("admin",))
    assert ApprovalPolicy.objects.get(tenant=tenant).rules == DEFAULT_RULES


def test_a_policy_that_reserves_a_tool_for_admins_binds_its_approvals(tenant, requester, approver, admin_user,
                                                                      device, kb, refservice, refadmin):
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "risk": DEFAULT_RULES["risk"],
        "tools": {"ticket.create": {"requires_approval": True, "ttl_minutes": 30, "approver_roles": ["admin"]}}})
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task.pk)
    approval = _pending(task)
    assert (approval.policy_version, approval.approver_roles) == (2, ["admin"])
    assert approval.expires_at - approval.created_at <= timedelta(minutes=30, seconds=5)
    with pytest.raises(Forbidden, match="only Admin"):
        approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve")
    assert _pending(task).pk == approval.pk
    # A newer policy does not change what an existing approval needs (it was asked under V_p = 2).
    ApprovalPolicy.objects.create(tenant=tenant, version=3, rules=DEFAULT_RULES)
    with pytest.raises(Forbidden):
        approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve")
    approval_decide(principal=p(admin_user), approval_id=approval.pk, decision="approve")
    assert drive(task.pk).status == reducer.COMPLETED


def test_an_approver_may_not_decide_their_own_request(tenant, admin_user, device, kb):
    task = drive(task_submit(principal=p(admin_user), device_id=device.pk, symptom=SYMPTOM).task.pk)
    with pytest.raises(Forbidden, match="your own request"):
        approval_decide(principal=p(admin_user), approval_id=_pending(task).pk, decision="approve")


def test_a_policy_that_no_longer_lets_the_approver_decide_invalidates_at_intent_and_dispatch(
        approved, tenant, approver, admin_user, refadmin):
    """Review F4: the binding includes V_p. A newer policy version that reserves the tool for admins
    invalidates an approver's approval at the next re-check; an admin approves again."""
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "risk": DEFAULT_RULES["risk"],
        "tools": {"ticket.create": {"requires_approval": True, "ttl_minutes": 60, "approver_roles": ["admin"]}}})
    task = drive(approved.pk)
    first = ApprovalRequest.objects.filter(task=task).order_by("created_at").first()
    assert first.status == ApprovalStatus.INVALIDATED
    assert "policy changed since approval (v1 → v2)" in first.closed_reason
    assert not Action.objects.filter(task=task).exists() and refadmin.tickets() == []
    second = _pending(task)
    assert second.approver_roles == ["admin"]
    with pytest.raises(Forbidden):
        approval_decide(principal=p(approver), approval_id=second.pk, decision="approve")
    approval_decide(principal=p(admin_user), approval_id=second.pk, decision="approve")
    assert drive(task.pk).status == reducer.COMPLETED


def test_a_policy_change_between_the_intent_and_the_send_stops_the_send(approved, tenant, refadmin):
    agent_run(task_id=approved.pk)
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "tools": {"ticket.create": {"requires_approval": True, "ttl_minutes": 60, "approver_roles": ["admin"]}}})
    outbox_dispatch_batch()
    action = Action.objects.get(task=approved)
    assert action.status == ActionStatus.NOT_SENT and refadmin.requests(action.idempotency_key) == 0
    assert "policy changed" in ApprovalRequest.objects.get(pk=action.approval_id).closed_reason


@pytest.mark.parametrize("rules, problem", [
    ({"tools": {"ticket.create": {"requires_approval": "yes"}}}, "is not of type 'boolean'"),
    ({"tools": {"ticket.create": {"approver_roles": ["requester"]}}}, "is not one of"),
    ({"tools": {}, "risk": {"critical": {}}}, "Additional properties"),
    ({"tools": {"ticket.create": {"ttl_minutes": 0}}}, "less than the minimum"),
    ({"tools": {"ticket.craete": {"requires_approval": False}}}, "ticket.craete: no such tool"),
    ({"ticket.comnent": {"requires_approval": False}}, "ticket.comnent: no such tool"),
    ({"Tools": {}}, "Tools: no such tool"),
])
def test_a_malformed_policy_is_refused_with_the_field_that_is_wrong(tenant, rules, problem):
    policy = ApprovalPolicy(tenant=tenant, version=9, rules=rules)
    with pytest.raises(ValidationError) as err:
        policy.full_clean()
    assert problem in str(err.value)


def test_a_pending_approval_of_a_task_that_ended_cannot_be_decided(requester, approver, device, kb):
    """Review F7: a task that ends (here: its deadline passed) invalidates its pending approvals."""
    from apps.core.errors import Conflict

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task.pk)
    approval = _pending(task)
    Task.objects.filter(pk=task.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    assert drive(task.pk).status == reducer.FAILED
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.INVALIDATED and "the task ended (FAILED" in approval.reason
    with pytest.raises(Conflict):
        approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve")


@pytest.mark.django_db(transaction=True)
def test_approve_and_cancel_at_once_never_deadlock(requester, approver, device, kb, monkeypatch):
    """Review F6: the decision holds its locks for half a second (a slow clock read after both
    locks); a cancel arriving meanwhile waits for the task lock instead of deadlocking."""
    import threading
    import time

    from django.db import connection

    from apps.approvals import services as approval_services
    from apps.tasks.services import task_cancel

    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task.pk)
    approval = _pending(task)
    real_now = approval_services.timezone.now
    decider = {}

    class SlowClock:
        @staticmethod
        def now():
            if threading.get_ident() == decider.get("id"):
                time.sleep(0.5)
            return real_now()

    monkeypatch.setattr(approval_services, "timezone", SlowClock)
    results = {}

    def decide():
        decider["id"] = threading.get_ident()
        try:
            approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
            results["decide"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            results["decide"] = repr(exc)
        finally:
            connection.close()

    def cancel():
        time.sleep(0.2)
        try:
            task_cancel(principal=p(requester), task_id=task.pk, reason="fixed itself")
            results["cancel"] = "ok"
        except Exception as exc:  # noqa: BLE001
            results["cancel"] = repr(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=decide), threading.Thread(target=cancel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"decide": "ok", "cancel": "ok"}, results
    task = Task.objects.get(pk=task.pk)
    assert task.status == reducer.CANCELLED
    assert ApprovalRequest.objects.get(pk=approval.pk).status == ApprovalStatus.APPROVED


def test_a_decision_the_current_policy_no_longer_allows_is_refused_and_the_approval_stays_pending(
        tenant, requester, approver, admin_user, device, kb, refservice, refadmin):
    """A policy that now reserves the tool for admins, published while an approval (asked under v1)
    waits: an approver's decision is refused at once — never accepted and then undone on resume — and
    the approval stays for an admin, whose approval binds."""
    task = drive(task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM).task.pk)
    approval = _pending(task)
    assert approval.policy_version == 1
    ApprovalPolicy.objects.create(tenant=tenant, version=2, rules={
        "risk": DEFAULT_RULES["risk"],
        "tools": {"ticket.create": {"requires_approval": True, "ttl_minutes": 30, "approver_roles": ["admin"]}}})
    for decision, reason in (("approve", ""), ("reject", "not needed")):
        with pytest.raises(Forbidden, match=r"changed since this was requested \(v1 → v2\): only Admin may decide"):
            approval_decide(principal=p(approver), approval_id=approval.pk, decision=decision, reason=reason)
    assert _pending(task).pk == approval.pk
    approval_decide(principal=p(admin_user), approval_id=approval.pk, decision="approve")
    assert drive(task.pk).status == reducer.COMPLETED
