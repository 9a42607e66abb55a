"""Tenant isolation and roles, probed at every URL (DESIGN.md §12 "no data crosses tenants"; ADR
0012).

Tenant ``acme`` has a completed task with its ticket, a task waiting for its approval, an action,
events and a policy. Users of tenant ``globex`` — one per role, plus a staff admin for the Django
admin — and each role of ``acme`` itself request every URL pattern the project serves (the Django
admin's too), with ``acme``'s object ids filled in. The test asserts:

* no response to a ``globex`` user contains any of ``acme``'s identifiers (task, approval and action
  ids, idempotency keys, the device's asset tag, the requester's name, the ticket id, the symptom);
* refusals are 403 or 404 (anonymous users are sent to the login page), never a 500;
* every role of ``acme`` gets exactly what :data:`ACCESS` says it may, and nothing changes for a
  refused write;
* every URL pattern has an entry in :data:`ACCESS`, so a new URL cannot be added without saying who
  may use it.

It also checks the one mechanism of scoping statically: principal-facing modules read tenant-owned
models only through ``visible_to(principal)`` / ``for_tenant(tenant_id)`` (apps.accounts.scoping).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from django.contrib.admin.sites import site as admin_site
from django.urls import URLPattern, URLResolver, get_resolver

from apps.accounts.models import AccessScope, Role
from apps.actions.models import Action
from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.attachments.services import attachments_check
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import drive, p
from tests.factories import DeviceFactory, MembershipFactory, TenantFactory, UserFactory

ROOT = Path(__file__).resolve().parent.parent

ANON, REQ, APPR, ADMIN = "anonymous", "requester", "approver", "admin"
EVERYONE = {ANON, REQ, APPR, ADMIN}
SIGNED_IN = {REQ, APPR, ADMIN}

#: URL name -> roles (of the object's own tenant) that may use it. ``"webhook"``: authenticated by
#: its HMAC signature instead of a user; ``"staff"``: the Django admin (staff admins only).
ACCESS: dict[str, set[str] | str] = {
    "home": SIGNED_IN,
    "healthz": EVERYONE,
    "login": EVERYONE,
    "logout": SIGNED_IN,
    "language-set": EVERYONE,  # a visitor's choice is a cookie; a signed-in user's their own preference
    "request-list": {REQ, APPR, ADMIN},  # requesters their own, approvers and admins the tenant's
    "request-new": {REQ, ADMIN},
    "task-detail": {REQ, APPR, ADMIN},
    "task-cancel": {REQ, ADMIN},
    "task-input": {REQ},
    "task-trace": {ADMIN},
    "task-trace-export": {ADMIN},
    "task-trace-budget": {ADMIN},
    "task-event": {ADMIN},
    "admin-tasks": {ADMIN},
    "metrics-page": {ADMIN},  # the admin's own tenant only
    "metrics": EVERYONE,  # Prometheus: service-wide counts, no tenant label or identifier (a token when set)
    "reconciliation": {ADMIN},
    "reconciliation-resolve": {ADMIN},
    "compensation-settle": {ADMIN},
    "evidence-detail": {REQ, APPR, ADMIN},  # and only for scopes the viewer may read now
    "approval-queue": {APPR, ADMIN},
    "approval-decide": {APPR, ADMIN},
    "webhook-reference": "webhook",
    "api-task-list": {REQ, APPR, ADMIN},
    "api-task-detail": {REQ, APPR, ADMIN},
    "api-task-cancel": {REQ, ADMIN},
    "api-task-input": {REQ},
    "task-attachment": {REQ, APPR, ADMIN},  # the task's readers only (apps/attachments)
    "api-task-attachment": {REQ, APPR, ADMIN},
    "api-task-events": {ADMIN},
    "api-task-actions": {ADMIN},
    "api-approval-list": {APPR, ADMIN},
    "api-approval-detail": {APPR, ADMIN},
    "api-approval-decision": {APPR, ADMIN},
    "api-device-list": {REQ, APPR, ADMIN},
    "api-reconciliation-list": {ADMIN},
    "api-reconciliation-resolve": {ADMIN},
    "api-compensation-list": {ADMIN},
    "api-compensation-decision": {ADMIN},
    "api-schema": EVERYONE,  # the OpenAPI description: no tenant's data in it
    # each person's own notifications in their tenant (apps/notifications)
    "notification-list": SIGNED_IN,
    "notification-bell": SIGNED_IN,
    "notification-read-all": SIGNED_IN,
}


def _walk(patterns, prefix=""):
    for pat in patterns:
        if isinstance(pat, URLResolver):
            yield from _walk(pat.url_patterns, prefix + str(pat.pattern))
        elif isinstance(pat, URLPattern):
            yield prefix + str(pat.pattern), pat


def _all_patterns():
    return list(_walk(get_resolver().url_patterns))


@pytest.fixture
def acme(tenant, requester, approver, admin_user, device, kb, refservice):
    """Tenant ``acme``'s data: one completed task (ticket created) and one waiting for approval."""
    log = attachments_check([("printer.log", b"08:00:09 ERROR E-203 fuser cold\n", "text/plain")])
    done = drive(task_submit(principal=p(requester), device_id=device.pk, urgency="high", attachments=log,
                             symptom="Fuser error after warm-up, pages come out smeared.").task.pk)
    approval_decide(principal=p(approver), approval_id=ApprovalRequest.objects.get(task=done).pk,
                    decision="approve", reason="ok")
    done = drive(done.pk)
    assert done.status == reducer.COMPLETED
    waiting = drive(task_submit(principal=p(requester), device_id=DeviceFactory(tenant=tenant, asset_tag="PRN-7733").pk,
                                symptom="Paper jams at the fuser exit on every duplex job.").task.pk)
    assert waiting.status == reducer.WAITING_APPROVAL
    action = Action.objects.get(task=done)
    pending = ApprovalRequest.objects.get(task=waiting, status=ApprovalStatus.PENDING)
    secrets = {str(done.pk), str(waiting.pk), str(pending.pk), str(action.pk), action.idempotency_key,
               "PRN-0417", "PRN-7733", "riley", "avery", "adele", action.external_id, "smeared", "duplex",
               ">acme<", ">ACME<", "tenant__id__exact=" + str(tenant.pk)}
    chunk = done.state["evidence"][0]["chunk_id"]  # a public chunk every acme role may read
    return {"done": done, "waiting": waiting, "approval": pending, "action": action, "secrets": secrets,
            "chunk": chunk, "sha256": log[0].sha256}


@pytest.fixture
def globex(db):
    """Tenant ``globex``: one user per role (its admin is staff, for the Django admin) and its own task."""
    other = TenantFactory(slug="globex", name="Globex")
    users = {}
    for role, name in ((Role.REQUESTER, "gina"), (Role.APPROVER, "gabe"), (Role.ADMIN, "gus")):
        # globex's admin is staff through his admin membership, as tenant admins are in the demo:
        # every admin page his group allows renders for him, scoped to his tenant.
        user = UserFactory(username=name)
        MembershipFactory(user=user, tenant=other, role=role, scopes=list(AccessScope.values))
        users[role] = user
    device = DeviceFactory(tenant=other, asset_tag="GLX-0001")
    task_submit(principal=p(users[Role.REQUESTER]), device_id=device.pk, symptom="Globex's own toner fault report.")
    return {REQ: users[Role.REQUESTER], APPR: users[Role.APPROVER], ADMIN: users[Role.ADMIN]}


def _admin_object(model):
    """One ``acme`` row of ``model`` for the Django admin's object URLs."""
    return model.objects.order_by("pk").first() if model.__name__ != "Tenant" else model.objects.get(slug="acme")


def _urls(acme):
    """Every URL pattern outside the Django admin with ``acme``'s ids filled in, then the Django
    admin's URLs for every registered model: ``(name, path)``."""
    ids = {"task_id": acme["done"].pk, "approval_id": acme["approval"].pk, "action_id": acme["action"].pk,
           "chunk_id": acme["chunk"], "seq": 4,  # seq 4: evidence.retrieved, excerpts and all
           "sha256": acme["sha256"]}
    out = []
    for route, pat in _all_patterns():
        if route.startswith("django-admin/"):
            continue
        here = {**ids, "task_id": acme["waiting"].pk} if pat.name in ("task-input", "api-task-input") else ids
        out.append((pat.name, "/" + re.sub(r"<(?:\w+:)?(\w+)>", lambda m, h=here: str(h[m.group(1)]), route)))
    return out


def _admin_urls():
    """The Django admin's index, and for every registered model its app index, changelist, add
    form, and the change, history and delete views of an ``acme`` row."""
    urls = [("admin-index", "/django-admin/")]
    for model in admin_site._registry:
        base = f"/django-admin/{model._meta.app_label}/{model._meta.model_name}/"
        urls += [("admin-app", f"/django-admin/{model._meta.app_label}/"), ("admin-changelist", base),
                 ("admin-add", base + "add/")]
        obj = model.objects.get(slug="acme") if model.__name__ == "Tenant" else \
            model.objects.order_by("pk").first()
        if obj is not None:
            urls += [(f"admin-{view}", f"{base}{obj.pk}/{view}/") for view in ("change", "history", "delete")]
    return urls


def _status_ok_for_refusal(resp, role) -> bool:
    if role == ANON:
        return resp.status_code in (302, 403, 404) and (resp.status_code != 302 or "login" in resp["Location"])
    return resp.status_code in (302, 403, 404, 405) and (resp.status_code != 302 or "login" in resp["Location"])


def _assert_no_secrets(resp, secrets, where):
    body = resp.content.decode(errors="replace")
    leaked = sorted(s for s in secrets if s and s in body)
    assert not leaked, f"{where}: {resp.status_code} leaks {leaked}"


def test_every_url_pattern_is_in_the_access_table():
    names = {pat.name for route, pat in _all_patterns() if not route.startswith("django-admin/")}
    assert names == set(ACCESS), f"missing: {names - set(ACCESS)}, stale: {set(ACCESS) - names}"


def test_another_tenant_sees_nothing_of_acme_at_any_url(client, acme, globex):
    urls = _urls(acme) + _admin_urls()
    assert len(urls) > 100
    object_ids = [str(acme[k].pk) for k in ("done", "waiting", "approval", "action")] + [f"/evidence/{acme['chunk']}/"]
    before = (ApprovalRequest.objects.get(pk=acme["approval"].pk).status,
              Task.objects.get(pk=acme["waiting"].pk).status, Task.objects.count())
    data = {"decision": "approve", "reason": "x", "note": "x", "executed": "no", "text": "x"}
    probed = 0
    for role, user in globex.items():
        client.force_login(user)
        for name, path in urls:
            for method in ("get", "post"):
                resp = getattr(client, method)(path, data if method == "post" else None, HTTP_HX_REQUEST="true")
                where = f"{role} {method.upper()} {path}"
                assert resp.status_code < 500, f"{where}: {resp.status_code}"
                _assert_no_secrets(resp, acme["secrets"], where)
                if any(i in path for i in object_ids) or (name.startswith("admin-") and "/add/" not in path
                                                         and name not in ("admin-index", "admin-app",
                                                                          "admin-changelist")):
                    # An acme object's own URL: refused outright.
                    assert resp.status_code in (302, 403, 404, 405), f"{where}: {resp.status_code}"
                probed += 1
    after = (ApprovalRequest.objects.get(pk=acme["approval"].pk).status,
             Task.objects.get(pk=acme["waiting"].pk).status, Task.objects.count())
    assert after == before, "a request by another tenant changed acme's data"
    assert probed == 3 * 2 * len(urls)


@pytest.mark.parametrize("role", [ANON, REQ, APPR, ADMIN])
def test_each_role_gets_exactly_what_the_access_table_allows(client, acme, role, requester, approver, admin_user):
    user = {REQ: requester, APPR: approver, ADMIN: admin_user}.get(role)
    if user is not None:
        client.force_login(user)
    for name, path in _urls(acme):
        access = ACCESS.get(name)
        if access is None or access == "webhook" or name in ("logout", "login"):
            continue
        resp = client.get(path)
        assert resp.status_code < 500, f"{role} GET {path}: {resp.status_code}"
        if role in access:
            ok = resp.status_code in (200, 405) or (resp.status_code == 302 and "login" not in resp["Location"])
            assert ok, f"{role} may use {name}: GET {path} → {resp.status_code}"
        else:
            assert _status_ok_for_refusal(resp, role), f"{role} may not use {name}: GET {path} → {resp.status_code}"
    # Refused writes change nothing.
    waiting, approval = acme["waiting"], acme["approval"]
    if role not in ACCESS["approval-decide"]:
        client.post(f"/approvals/{approval.pk}/decide/", {"decision": "approve", "reason": "x"})
        client.post(f"/api/approvals/{approval.pk}/decision/", {"decision": "approve", "reason": "x"},
                    content_type="application/json")
        assert ApprovalRequest.objects.get(pk=approval.pk).status == ApprovalStatus.PENDING
    if role not in ACCESS["task-cancel"]:
        client.post(f"/tasks/{waiting.pk}/cancel/", {"reason": "x"})
        client.post(f"/api/tasks/{waiting.pk}/cancel/", {"reason": "x"}, content_type="application/json")
        assert Task.objects.get(pk=waiting.pk).status == reducer.WAITING_APPROVAL


def test_a_forged_webhook_changes_nothing(client, acme):
    resp = client.post("/webhooks/reference/", data=b'{"event_id": "x", "type": "ticket.status_changed"}',
                       content_type="application/json")
    assert resp.status_code in (400, 401, 403)
    _assert_no_secrets(resp, acme["secrets"], "forged webhook")


#: Modules that serve people (views, API, selectors, people's services): every read of a
#: tenant-owned model there goes through visible_to(...) or for_tenant(...).
PRINCIPAL_FACING = [
    "apps/tasks/views.py", "apps/tasks/api/views.py", "apps/tasks/selectors.py", "apps/tasks/compensation.py",
    "apps/approvals/views.py", "apps/approvals/api/views.py", "apps/approvals/selectors.py",
    "apps/outbox/views.py", "apps/outbox/api.py", "apps/outbox/reconciliation.py", "apps/traces/views.py",
    "apps/devices/selectors.py", "apps/devices/api/views.py", "apps/evidence/selectors.py",
    "apps/tickets/selectors.py",
    "apps/notifications/views.py", "apps/notifications/selectors.py", "apps/notifications/services.py",
]
TENANT_MODELS = {"Task", "TaskEvent", "RefusedEvent", "TaskSnapshot", "Action", "ActionAttempt", "ApprovalRequest",
                 "ApprovalPolicy", "Device", "Document", "DocumentVersion", "Chunk", "OutboxMessage", "TicketMirror",
                 "InboundWebhook", "Membership", "Notification"}


def _unscoped_reads(path: Path) -> list[str]:
    """``Model.objects.<method>`` chains on tenant-owned models whose first call is not
    ``visible_to``/``for_tenant`` — except a re-read by primary key of a row already scoped
    (``select_for_update().get(pk=...)``), allowed where the row came from a scoped read."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "objects" and isinstance(node.value.value, ast.Name) \
                and node.value.value.id in TENANT_MODELS and node.attr not in ("visible_to", "for_tenant", "none"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.value.id}.objects.{node.attr}")
        # Rows read by SQL written once (apps.core.sql) name their tenant as for_tenant does.
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("row", "rows") \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "sql" and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in TENANT_MODELS \
                and not any(k.arg == "tenant_id" for k in node.keywords):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} sql.{node.func.attr}({node.args[0].id}) "
                         "without tenant_id")
    return found


ALLOWED_REREADS = {
    # Re-reads by primary key of an action already fetched through visible_to (row lock).
    "apps/outbox/reconciliation.py": 2,
}


def test_the_scan_finds_an_unscoped_sql_read(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    module = tmp_path / "selectors.py"
    module.write_text("def f(i, t):\n    a = sql.row(Device, 't0.id = %s', [i])\n"
                      "    b = sql.rows(Device, 't0.id = %s', [i], tenant_id=t)\n    return Device.objects.get(pk=i)\n")
    assert _unscoped_reads(module) == ["selectors.py:2 sql.row(Device) without tenant_id",
                                       "selectors.py:4 Device.objects.get"]


def test_principal_facing_code_reads_tenant_rows_only_through_the_scoping_methods():
    problems = []
    for rel in PRINCIPAL_FACING:
        path = ROOT / rel
        assert path.exists(), rel
        found = _unscoped_reads(path)
        if len(found) > ALLOWED_REREADS.get(rel, 0):
            problems += found
    assert not problems, "unscoped reads: " + "; ".join(problems)


def test_a_revoked_tenant_admin_sees_less_not_more_in_the_django_admin(client, acme, globex, admin_user):
    """Review F1: deactivating a superuser tenant admin's membership leaves her no tenant at all."""
    from apps.accounts.models import Membership

    Membership.objects.filter(user=admin_user).update(is_active=False)
    client.force_login(admin_user)
    for path in ("/django-admin/devices/device/", "/django-admin/tasks/task/", "/django-admin/accounts/tenant/"):
        resp = client.get(path)
        assert resp.status_code == 200
        body = resp.content.decode()
        assert "GLX-0001" not in body and "PRN-0417" not in body and ">globex<" not in body, path


def test_a_tenant_admin_cannot_change_or_delete_her_own_membership(client, acme, admin_user):
    """Review F1: nobody unscopes herself."""
    from apps.accounts.models import Membership

    own = Membership.objects.get(user=admin_user)
    client.force_login(admin_user)
    base = f"/django-admin/accounts/membership/{own.pk}/"
    resp = client.post(base + "change/", {"user": admin_user.pk, "tenant": own.tenant_id, "role": "admin",
                                          "scopes": "[]"})
    assert resp.status_code == 403 or Membership.objects.get(pk=own.pk).is_active
    assert client.post(base + "delete/", {"post": "yes"}).status_code == 403
    assert Membership.objects.get(pk=own.pk).is_active


def test_policy_versions_cannot_be_deleted_or_edited_in_the_django_admin(client, acme, admin_user):
    """Review F3: approvals name their V_p, so a version is never removed or reused."""
    from apps.approvals.models import ApprovalPolicy

    policy = ApprovalPolicy.objects.get(tenant=acme["done"].tenant)
    client.force_login(admin_user)
    base = f"/django-admin/approvals/approvalpolicy/{policy.pk}/"
    assert client.post(base + "delete/", {"post": "yes"}).status_code == 403
    assert ApprovalPolicy.objects.filter(pk=policy.pk).exists()
    resp = client.post("/django-admin/approvals/approvalpolicy/add/",
                       {"tenant": policy.tenant_id, "version": policy.version + 1, "active": "on",
                        "rules": '{"tools": {"ticket.craete": {"requires_approval": false}}}'})
    assert resp.status_code == 200 and "no such tool" in resp.content.decode()
    assert ApprovalPolicy.objects.filter(tenant=policy.tenant).count() == 1


def _fingerprint() -> dict[str, list[tuple]]:
    """Every row of every model the Django admin serves, field by field (vectors aside)."""
    out = {}
    for model in admin_site._registry:
        names = [f.attname for f in model._meta.concrete_fields if f.name not in ("embedding", "search_vector")]
        out[model._meta.label] = [tuple(map(str, row)) for row in model.objects.order_by("pk").values_list(*names)]
    return out


def test_another_tenants_admin_writes_nothing_of_acme_through_the_django_admin(client, acme, globex):
    """Admin writes are scoped as admin reads are: globex's admin posts to every add form with
    acme's tenant, people and device filled in, to every change, password and delete URL of an
    acme row, and runs the bulk delete on acme's rows. Not one row of any model changes."""
    from django.contrib.auth import get_user_model

    tenant = acme["done"].tenant
    riley = get_user_model().objects.get(username="riley")
    forged = {"tenant": tenant.pk, "user": riley.pk, "role": "admin", "scopes": "public,tier2,security",
              "is_active": "on", "asset_tag": "PRN-9999", "name": "x", "kind": "printer", "state": "fault",
              "criticality": "low", "site": "x", "version": 99, "rules": "{}", "active": "on",
              "username": "mallory", "usable_password": "true", "password1": "Mallory-pass-1357",
              "password2": "Mallory-pass-1357", "is_superuser": "on", "is_staff": "on", "post": "yes",
              "slug": "acme2", "ticket_system": "helpdesk", "daily_budget_units": 999999}
    client.force_login(globex[ADMIN])
    before = _fingerprint()
    posted = 0
    for model in admin_site._registry:
        base = f"/django-admin/{model._meta.app_label}/{model._meta.model_name}/"
        resp = client.post(base + "add/", forged)
        assert resp.status_code in (200, 403), f"POST {base}add/: {resp.status_code}"
        ids = [str(pk) for pk in _acme_rows(model, tenant)]
        for pk in ids[:3]:
            for view in ("change", "delete", "password"):
                resp = client.post(f"{base}{pk}/{view}/", forged)
                assert resp.status_code in (302, 403, 404), f"POST {base}{pk}/{view}/: {resp.status_code}"
                posted += 1
        if ids:
            client.post(base, {"action": "delete_selected", "_selected_action": ids, "post": "yes"})
    assert posted > 30
    assert _fingerprint() == before, "another tenant's admin changed acme's rows through the Django admin"
    assert not get_user_model().objects.filter(username="mallory").exists()


def _acme_rows(model, tenant) -> list:
    """Primary keys of ``model``'s rows that belong to ``tenant`` (users: its members)."""
    from django.contrib.auth import get_user_model

    if model is get_user_model():
        return list(model.objects.filter(memberships__tenant=tenant).values_list("pk", flat=True))
    if model.__name__ == "Tenant":
        return [tenant.pk]
    if model.__name__ == "Group" or model._meta.app_label == "axes":
        # Rows of no tenant (the tenant-admin group, sign-in attempts): for the platform only.
        return list(model.objects.values_list("pk", flat=True))
    qs = model.objects.all()
    path = getattr(admin_site._registry[model], "tenant_path", "tenant_id")
    return list(qs.filter(**{path: tenant.pk}).order_by("pk").values_list("pk", flat=True))
