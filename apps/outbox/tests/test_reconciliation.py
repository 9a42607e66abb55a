"""The admin's reconciliation page and API (DESIGN.md §6): unknown actions the reconciler cannot
settle wait for a person, who records "executed, here is the ticket" or "not executed" — each
checked against the real reference ticket service first, each an event."""

from __future__ import annotations

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from apps.actions.models import Action, ActionStatus
from apps.core import tool_errors as errors
from apps.core.errors import Conflict, Forbidden, NotFound, Unavailable, Unprocessable
from apps.events.models import TaskEvent
from apps.outbox import dispatch as outbox
from apps.outbox import unknown_outcomes
from apps.outbox.models import OutboxMessage, OutboxStatus
from apps.outbox.reconciliation import reconciliation_list, reconciliation_resolve
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tickets.connectors import ReferenceTicketConnector
from tests.conftest import drive, p

SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture
def lookups_fail(monkeypatch):
    """The ticket service's lookup by key keeps failing: the reconciler cannot settle anything."""
    def failing(self, **kwargs):
        raise errors.OutcomeUnknown("lookup failed: ReadTimeout")

    monkeypatch.setattr(ReferenceTicketConnector, "lookup_by_key", failing)


def _unknown_after_remote_commit(refadmin):
    """Send with the response dropped after the remote committed: the ticket exists, the action
    is UNKNOWN."""
    refadmin.fault("drop_after_commit")
    outbox.outbox_dispatch_batch()


def _unknown_lost_in_transit(monkeypatch):
    """The request never arrived (but the dispatcher cannot know): the action is UNKNOWN, the
    remote holds nothing. Returns the captured request, which may still arrive later."""
    late = {}

    def lost(self, **kwargs):
        late.update(kwargs)
        raise errors.OutcomeUnknown("sent, no answer: ReadTimeout")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ReferenceTicketConnector, "create_ticket", lost)
        outbox.outbox_dispatch_batch()
    return late


def test_failed_lookups_escalate_to_a_person(committed, admin_user, refadmin, lookups_fail, settings):
    settings.FAULTDESK = {**settings.FAULTDESK, "RECONCILE_ESCALATE_AFTER": 3}
    _unknown_after_remote_commit(refadmin)
    action = Action.objects.get(task=committed)
    assert action.status == ActionStatus.UNKNOWN
    [row] = reconciliation_list(principal=p(admin_user))
    assert (row.action.pk, row.needs_person) == (action.pk, False)
    for _ in range(3):
        unknown_outcomes.actions_reconcile()
    action.refresh_from_db()
    assert action.reconcile_attempts == 3 and action.last_reconcile_error["class"] == "OutcomeUnknown"
    [row] = reconciliation_list(principal=p(admin_user))
    assert row.needs_person and "3 lookups by key did not settle it" in row.why


def test_executed_records_the_verified_ticket_as_the_receipt(committed, admin_user, refadmin, lookups_fail):
    _unknown_after_remote_commit(refadmin)
    action = Action.objects.get(task=committed)
    [ticket] = refadmin.tickets()
    resolved = reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True,
                                      external_id=ticket["id"], note="seen in the ticket system's UI")
    assert resolved.status == ActionStatus.SUCCEEDED and resolved.external_id == ticket["id"]
    event = TaskEvent.objects.get(task=committed, type="receipt.recorded")
    assert event.actor == p(admin_user).as_actor()
    assert event.payload["resolution"] == {"by": p(admin_user).as_actor(), "executed": True,
                                           "note": "seen in the ticket system's UI", "verified": "ticket read by id"}
    task = drive(committed.pk)
    assert task.status == reducer.COMPLETED and task.state["answer"]["change"]["ticket_id"] == ticket["id"]
    assert refadmin.effects(action.idempotency_key) == 1


def test_executed_is_refused_for_a_missing_or_foreign_ticket(committed, admin_user, refadmin, lookups_fail,
                                                             monkeypatch):
    _unknown_lost_in_transit(monkeypatch)
    action = Action.objects.get(task=committed)
    with pytest.raises(Unprocessable, match="has no ticket REF-999999"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True,
                               external_id="REF-999999", note="I think so")
    other = ReferenceTicketConnector().create_ticket(idempotency_key="someone-else", fencing_token=1,
                                                     params=action.params)
    with pytest.raises(Unprocessable, match="was not created by this action"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True,
                               external_id=other.external_id, note="this one?")
    with pytest.raises(Unprocessable, match="name the ticket"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=True, note="no id")
    with pytest.raises(Unprocessable, match="note"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=False, note="  ")
    assert Action.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    assert not TaskEvent.objects.filter(task=committed, type__in=["receipt.recorded", "dispatch.failed"]).exists()


def test_not_executed_is_refused_when_the_ticket_exists_and_the_truth_is_recorded(committed, admin_user, refadmin,
                                                                                  lookups_fail):
    _unknown_after_remote_commit(refadmin)
    action = Action.objects.get(task=committed)
    [ticket] = refadmin.tickets()
    with pytest.raises(Conflict, match=f"holds ticket {ticket['id']}"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=False,
                               note="the ticket system looked empty to me")
    action.refresh_from_db()
    assert action.status == ActionStatus.SUCCEEDED and action.external_id == ticket["id"]
    event = TaskEvent.objects.get(task=committed, type="receipt.recorded")
    assert event.payload["resolution"]["verified"] == "found by key at the ticket system"
    assert not TaskEvent.objects.filter(task=committed, type="dispatch.failed").exists()


def test_not_executed_fences_the_key_so_a_late_request_cannot_create_the_ticket(committed, admin_user, refadmin,
                                                                                lookups_fail, monkeypatch):
    late = _unknown_lost_in_transit(monkeypatch)
    action = Action.objects.get(task=committed)
    resolved = reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=False,
                                      note="the remote's operator confirmed no ticket")
    assert resolved.status == ActionStatus.NOT_SENT
    assert OutboxMessage.objects.get(action=action).status == OutboxStatus.FAILED
    event = TaskEvent.objects.get(task=committed, type="dispatch.failed")
    assert event.payload["executed"] is False and event.actor == p(admin_user).as_actor()
    assert event.payload["resolution"]["note"] == "the remote's operator confirmed no ticket"
    task = Task.objects.get(pk=committed.pk)
    assert task.status == reducer.FAILED and task.budget_reserved == 0
    # The request that was lost in transit finally arrives: the fence refuses it.
    with pytest.raises(errors.PreconditionFailed):
        ReferenceTicketConnector().create_ticket(**late)
    assert refadmin.effects(action.idempotency_key) == 0
    # A second resolution of the same action is a conflict, not a second event.
    with pytest.raises(Conflict, match="NOT_SENT"):
        reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=False, note="again")


def test_nothing_is_recorded_when_the_ticket_system_cannot_be_asked(committed, admin_user, refadmin, lookups_fail,
                                                                   monkeypatch, settings):
    _unknown_lost_in_transit(monkeypatch)
    action = Action.objects.get(task=committed)
    settings.FAULTDESK = {**settings.FAULTDESK, "REFSERVICE_URL": "http://127.0.0.1:9"}
    for executed in (True, False):
        with pytest.raises(Unavailable, match="cannot be asked now"):
            reconciliation_resolve(principal=p(admin_user), action_id=action.pk, executed=executed,
                                   external_id="REF-000001", note="sure")
    assert Action.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN
    assert Task.objects.get(pk=committed.pk).status == reducer.WAITING_RECONCILIATION


def test_only_admins_of_the_tenant_may_reconcile(committed, admin_user, requester, approver, other_tenant_user,
                                                 refadmin, lookups_fail):
    _unknown_after_remote_commit(refadmin)
    action = Action.objects.get(task=committed)
    for user in (requester, approver):
        with pytest.raises(Forbidden):
            reconciliation_list(principal=p(user))
        with pytest.raises(Forbidden):
            reconciliation_resolve(principal=p(user), action_id=action.pk, executed=False, note="x")
    assert reconciliation_list(principal=p(other_tenant_user)) == []
    with pytest.raises(NotFound):
        reconciliation_resolve(principal=p(other_tenant_user), action_id=action.pk, executed=False, note="x")

    api = APIClient()
    api.force_authenticate(other_tenant_user)
    assert api.get(reverse("api-reconciliation-list")).json() == []
    resp = api.post(reverse("api-reconciliation-resolve", args=[action.pk]), {"executed": False, "note": "x"},
                    format="json")
    assert resp.status_code == 404
    api.force_authenticate(requester)
    assert api.get(reverse("api-reconciliation-list")).status_code == 403
    assert Action.objects.get(pk=action.pk).status == ActionStatus.UNKNOWN


def test_api_lists_and_resolves(committed, admin_user, refadmin, lookups_fail):
    _unknown_after_remote_commit(refadmin)
    action = Action.objects.get(task=committed)
    api = APIClient()
    api.force_authenticate(admin_user)
    [item] = api.get(reverse("api-reconciliation-list")).json()
    assert item["id"] == str(action.pk) and item["idempotency_key"] == action.idempotency_key
    assert [a["outcome"] for a in item["attempts"]] == ["UNKNOWN"] and item["needs_person"] is False
    url = reverse("api-reconciliation-resolve", args=[action.pk])
    resp = api.post(url, {"executed": "maybe", "note": "x"}, format="json")
    assert resp.status_code == 400 and "executed" in resp.json()
    [ticket] = refadmin.tickets()
    resp = api.post(url, {"executed": True, "external_id": ticket["id"], "note": "checked"}, format="json")
    assert resp.status_code == 200 and resp.json()["status"] == "SUCCEEDED"
    resp = api.post(url, {"executed": True, "external_id": ticket["id"], "note": "checked"}, format="json")
    assert resp.status_code == 409 and resp.json()["error"] == "conflict"


def test_page_shows_what_is_known_and_resolves_without_a_reload(client, committed, admin_user, requester, refadmin,
                                                                lookups_fail, monkeypatch):
    _unknown_lost_in_transit(monkeypatch)
    action = Action.objects.get(task=committed)
    client.force_login(requester)
    assert client.get(reverse("reconciliation")).status_code == 404
    client.force_login(admin_user)
    page = client.get(reverse("reconciliation"))
    html = page.content.decode()
    assert page.status_code == 200 and "HX-Request" in page["Vary"]
    assert action.idempotency_key in html and "sent, no answer: ReadTimeout" in html
    assert f'hx-post="{reverse("reconciliation-resolve", args=[action.pk])}"' in html

    url = reverse("reconciliation-resolve", args=[action.pk])
    resp = client.post(url, {"executed": "no", "note": ""}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 422 and "say how you know" in resp.content.decode()
    assert "<html" not in resp.content.decode()
    resp = client.post(url, {"executed": "no", "note": "operator confirmed"}, HTTP_HX_REQUEST="true")
    assert resp.status_code == 200 and "Resolved: Not sent" in resp.content.decode()
    assert Action.objects.get(pk=action.pk).status == ActionStatus.NOT_SENT
