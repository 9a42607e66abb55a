"""``make chaos``: the chaos run of DESIGN.md §12 invariant 5.

N tasks per ticket system (1,000 on the reference service and 100 on django-helpdesk by default) go
through the whole main job — HTTP API, agent, tools and outbox workers, beat, the reference ticket
service and django-helpdesk — on an auto-approval policy, while the run:

* SIGKILLs random workers (the dispatcher among them) and beat and restarts them, and arms random
  remote faults (a response dropped after the remote committed, 503s, delays) on the fault proxies
  in front of both ticket systems (the small faults, every 1–3 s);
* one at a time, takes a long fault (:mod:`tools.chaos.faults`): a worker node paused (SIGSTOP) past
  its lease and woken (SIGCONT), a network partition between faultdesk and one ticket system, or a
  restart of the run's own PostgreSQL — every target at least once — and prints how long the stack
  took to recover from it.

Then it stops the chaos, lets everything settle and checks, for each ticket system::

    reference: tasks=1000 completed=… waiting=… failed=… lost=0 duplicate_effects=0 replay_divergences=0

* ``lost``: a task the API accepted that is missing, or that is still in a running state after
  the settle time with nothing left to wait for;
* ``duplicate_effects``: effects (tickets, and comments on an open ticket) beyond one per
  idempotency key, plus effects beyond one per task;
* ``replay_divergences``: tasks whose replay differs from their row, or whose action records
  disagree with their state or with the ticket system (``replay --all --remote``'s audit);
* ``unreconciled``: tasks still waiting for a reconciliation after the settle time (every ticket
  system here can be asked by key, so none should be).

Exit status 1 when any of these four is not zero, when a planned long fault never took effect (a
paused process that was gone, a PostgreSQL that did not stop: it is tried again until the run's end),
or when the stack did not recover from a long fault within its limit. Everything runs in its own PostgreSQL (a server of
its own in ``var/chaos-pgdata``, so that restarting it disturbs nothing else; database
``faultdesk_chaos``, recreated each run), its own Redis database (or, with ``--broker amqp``, its own
RabbitMQ virtual host) and its own ticket-system files under ``var/chaos/``; figures also go to
``var/chaos/result.json``.

Usage: ``python -m tools.chaos [--n 1000] [--helpdesk-n 100] [--only reference|helpdesk]
[--broker redis|amqp] [--seed S]``.
"""

from __future__ import annotations

import json

import httpx

from config.env import VAR_DIR

CHAOS_DIR = VAR_DIR / "chaos"
CHAOS_PGDATA = VAR_DIR / "chaos-pgdata"
DATABASE = "faultdesk_chaos"
REDIS_DB = 8
API_KEY = "chaos-refservice-key"
HD_TOKEN = "chaoshelpdesktoken".ljust(40, "0")
PASSWORD = "chaos-password"  # noqa: S105 - a throw-away database
RUNNING = ("ACCEPTED", "RETRIEVING", "PROPOSING", "VALIDATING", "DISPATCHING", "COMPENSATING")


# --- run inside Django (manage.py shell -c) -------------------------------------------------------


def seed(printers: dict[str, int]) -> None:
    """Create one tenant per ticket system (``printers`` maps it to a number of printers) with a
    requester ``chaos-<system>``, an auto-approval policy for new tickets and comments, that many
    printers and the public printer procedures; write the device ids to ``var/chaos/devices.json``."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password

    from apps.accounts.models import AccessScope, Membership, Role, Tenant
    from apps.approvals.models import ApprovalPolicy
    from apps.devices.models import Device
    from apps.evidence.corpus import KB_DIR
    from apps.evidence.services import document_ingest

    devices = {}
    for system, count in printers.items():
        tenant = Tenant.objects.create(slug=f"chaos-{system}", name=f"Chaos {system}", ticket_system=system)
        user = get_user_model().objects.create(username=f"chaos-{system}",
                                               password=make_password(PASSWORD, hasher="pbkdf2_sha256"))
        Membership.objects.create(user=user, tenant=tenant, role=Role.REQUESTER,
                                  scopes=[AccessScope.PUBLIC, AccessScope.TIER2])
        ApprovalPolicy.objects.create(tenant=tenant, version=1, rules={
            "ticket.create": {"requires_approval": False, "ttl_minutes": 60},
            "ticket.comment": {"requires_approval": False, "ttl_minutes": 60}})
        devices[system] = [
            Device.objects.create(tenant=tenant, asset_tag=f"PRN-9{i:03d}", name=f"Chaos printer {i}", kind="printer",
                                  model="LaserMax 9050", site="LAB", criticality="medium", state="fault",
                                  alert_code="PRN-FUSER-50.2", alert_message="Fuser temperature low: 142 C",
                                  version=1).pk
            for i in range(count)
        ]
        for scope, name in (("tier2", "laser-printer-fuser-error-replacement.md"),
                            ("public", "laser-printer-paper-jam.md"), ("public", "mfp-toner-and-drum-replacement.md")):
            document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB_DIR / scope / name).read_text(),
                            scope=scope)
    (CHAOS_DIR / "devices.json").write_text(json.dumps(devices))


def check() -> None:
    """Print one JSON line: per ticket system, the figures of the module docstring."""
    from apps.actions.audit import task_actions_audit
    from apps.actions.models import Action, ActionAttempt
    from apps.events.models import RefusedEvent, TaskEvent
    from apps.tasks.models import Task
    from apps.tasks.replay import task_replay
    from apps.tickets.connectors import CONNECTORS

    accepted = json.loads((CHAOS_DIR / "accepted.json").read_text())
    result = {}
    for system, ids in accepted.items():
        connector = CONNECTORS[system]()
        tasks = {str(t.pk): t for t in Task.objects.filter(pk__in=ids)}
        statuses = [t.status for t in tasks.values()]
        lost = (len(ids) - len(tasks)) + sum(s in RUNNING for s in statuses)
        remote = _remote_effects(system, connector)
        by_key: dict[str, int] = {}
        for key in remote:
            by_key[key] = by_key.get(key, 0) + 1
        duplicates = sum(n - 1 for n in by_key.values() if n > 1)
        for task_id in tasks:
            keys = set(Action.objects.filter(task_id=task_id).values_list("idempotency_key", flat=True))
            per_task = sum(by_key.get(k, 0) for k in keys)
            duplicates += max(0, per_task - 1)
        divergences = 0
        for task in tasks.values():
            if not task_replay(task).ok or task_actions_audit(task, remote=True):
                divergences += 1
        attempts = ActionAttempt.objects.filter(action__task_id__in=ids)
        result[system] = {
            "tasks": len(ids), "completed": statuses.count("COMPLETED"),
            "waiting": sum(s.startswith("WAITING") for s in statuses), "failed": statuses.count("FAILED"),
            "cancelled": statuses.count("CANCELLED"), "lost": lost, "duplicate_effects": duplicates,
            "unreconciled": statuses.count("WAITING_RECONCILIATION"),
            "replay_divergences": divergences, "remote_effects": len(remote),
            "comments": TaskEvent.objects.filter(task_id__in=ids, type="task.completed",
                                                 payload__reason="ticket_commented").count(),
            "conflicts": TaskEvent.objects.filter(task_id__in=ids, type="dispatch.conflict").count(),
            # What the chaos did to the work: sends without an answer, refused or retried sends,
            # receipts found by the reconciler, and events refused to a stale worker.
            "unknown_outcomes": attempts.filter(outcome="UNKNOWN").count(),
            "retried_sends": attempts.filter(outcome="RETRYABLE").count(),
            "reconciled_receipts": TaskEvent.objects.filter(task_id__in=ids, type="receipt.recorded",
                                                            actor="reconciler").count(),
            "refused_events": RefusedEvent.objects.filter(task_id__in=ids).count(),
        }
    print(json.dumps(result))


def _remote_effects(system: str, connector) -> list[str]:
    """The idempotency key of every effect the ticket system holds: one entry per ticket and, at
    the reference service, one per comment (a second report on an open ticket is a comment). The
    credential is the one the tool gateway injects (the connector holds none)."""
    from apps.gateway.credentials import authorization

    if system == "reference":
        resp = httpx.get(f"{connector.base_url}/_admin/tickets", headers=authorization("ticket.reference"), timeout=30)
        tickets = resp.json()["results"]
        return [t["idempotency_key"] for t in tickets] + [
            c["idempotency_key"] for t in tickets for c in t.get("comments", []) if c.get("idempotency_key")]
    keys, url = [], f"{connector.base_url}/helpdesk/api/tickets/"
    while url:
        page = httpx.get(url, headers=authorization("ticket.helpdesk"), timeout=60).json()
        keys += [t.get("custom_faultdesk_key") or "" for t in page["results"]]
        url = page.get("next")
    return keys
