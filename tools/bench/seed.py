"""Bench data, written in-process on the bench database: tenants like the chaos run's (a requester,
an auto-approval policy for new tickets, printers with a fuser fault, the public and tier-2 printer
procedures), users of the other roles, and the reports the requesters file."""

from __future__ import annotations

from dataclasses import dataclass

from tools.bench.harness import PASSWORD

SYMPTOMS = [
    "Fuser error after warm-up, pages come out smeared with unfused toner.",
    "Paper jams at the fuser exit on every duplex job from tray 2.",
    "Toner smears on every page and the fuser temperature alert keeps coming back.",
]
KB = (("tier2", "laser-printer-fuser-error-replacement.md"), ("public", "laser-printer-paper-jam.md"),
      ("public", "mfp-toner-and-drum-replacement.md"))


@dataclass
class SeededTenant:
    """A seeded tenant: its row, its users' usernames by role and its device ids (one per report,
    so that every report creates its own ticket)."""

    tenant: object
    users: dict[str, str]
    devices: list[int]


def tenant_seed(slug: str, *, devices: int, auto_approve: bool = True, kb: bool | str = True,
                rules: dict | None = None) -> SeededTenant:
    """Create tenant ``slug`` with a requester ``<slug>-req``, an approver ``<slug>-appr`` and an
    admin ``<slug>-admin`` (password :data:`PASSWORD`, scopes public + tier2), generous quotas,
    ``devices`` faulty printers, an approval policy (no approval for new tickets and comments when
    ``auto_approve``; ``rules``, when given, are the policy's rules instead) and, when ``kb``, the
    three printer procedures — or, with ``kb="whole"``, the project's whole knowledge base (every
    scope, English and Chinese: what a tenant's retrieval searches in production), with the
    planner's statistics of the evidence tables refreshed."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.hashers import make_password

    from apps.accounts.models import AccessScope, Membership, Role, Tenant
    from apps.approvals.models import ApprovalPolicy
    from apps.devices.models import Device
    from apps.evidence.corpus import KB_DIR
    from apps.evidence.services import document_ingest

    tenant = Tenant.objects.create(slug=slug, name=f"Bench {slug}", ticket_system="reference",
                                   max_active_tasks=100_000, daily_budget_units=100_000_000,
                                   daily_token_limit=10_000_000_000)
    password = make_password(PASSWORD, hasher="pbkdf2_sha256")
    users = {}
    for role in (Role.REQUESTER, Role.APPROVER, Role.ADMIN):
        name = f"{slug}-{role.value[:5]}"
        user = get_user_model().objects.create(username=name, password=password)
        Membership.objects.create(user=user, tenant=tenant, role=role,
                                  scopes=[AccessScope.PUBLIC, AccessScope.TIER2])
        users[role.value] = name
    ApprovalPolicy.objects.create(tenant=tenant, version=1, rules=rules or {
        "ticket.create": {"requires_approval": not auto_approve, "ttl_minutes": 600},
        "ticket.comment": {"requires_approval": not auto_approve, "ttl_minutes": 600}})
    rows = Device.objects.bulk_create([
        Device(tenant=tenant, asset_tag=f"PRN-{i:05d}", name=f"Bench printer {i}", kind="printer",
               model="LaserMax 9050", site="LAB", criticality="medium", state="fault",
               alert_code="PRN-FUSER-50.2", alert_message="Fuser temperature low: 142 C", version=1)
        for i in range(devices)])
    if kb == "whole":
        _whole_kb_ingest(tenant)
    elif kb:
        for scope, name in KB:
            document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB_DIR / scope / name).read_text(),
                            scope=scope)
    return SeededTenant(tenant=tenant, users=users, devices=[d.pk for d in rows])


def _whole_kb_ingest(tenant) -> None:
    """Ingest every document of ``apps/evidence/kb`` for ``tenant`` with its scope (the directory it
    is in), then ``ANALYZE`` the evidence tables."""
    from django.db import connection

    from apps.accounts.models import AccessScope
    from apps.evidence.corpus import KB_DIR
    from apps.evidence.services import path_ingest

    for scope in AccessScope.values:
        if (KB_DIR / scope).is_dir():
            path_ingest(tenant=tenant, path=KB_DIR / scope, scope=scope)
    with connection.cursor() as cur:
        cur.execute("ANALYZE evidence_chunk, evidence_documentversion, evidence_document")
