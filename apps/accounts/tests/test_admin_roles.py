"""No way up from tenant admin (apps.accounts.roles): a tenant admin is staff with the
tenant-admin group's permissions, never a superuser; the Django admin offers them no superuser,
staff, group or permission field; staff, superusers and members of other tenants are beyond their
reach; a user's last membership cannot be deleted; a platform superuser is never a member.

Every attempt is made through the Django admin's own forms, filled in from the page the admin is
served (so a field the page does not offer cannot be sent by a browser either), and also with the
forbidden fields forced into the POST (what an attacker sends). Each refusal is checked on the
database, and each has a positive control: the same form with a permitted change is accepted.
"""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError

from apps.accounts.models import AccessScope, Membership, Role
from tests.factories import DeviceFactory, MembershipFactory, TenantFactory, UserFactory

User = get_user_model()


class _FormFields(HTMLParser):
    """The fields a browser would submit from the page's change form: ``{name: [values]}``."""

    def __init__(self):
        super().__init__()
        self.fields: dict[str, list[str]] = {}
        self.offered: set[str] = set()  # every field name on the page, checked or not
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        name = a.get("name")
        if tag in ("input", "select", "textarea") and name:
            self.offered.add(name)
        if tag == "input" and name and a.get("type") not in ("submit", "button"):
            if a.get("type") in ("checkbox", "radio"):
                if "checked" in a:
                    self.fields.setdefault(name, []).append(a.get("value", "on"))
            else:
                self.fields.setdefault(name, []).append(a.get("value") or "")
        elif tag == "select" and name:
            self._select = name
            self.fields.setdefault(name, [])
        elif tag == "option" and self._select and "selected" in a:
            self.fields[self._select].append(a.get("value", ""))
        elif tag == "textarea" and name:
            self._textarea = name
            self.fields[name] = [""]

    def handle_data(self, data):
        if self._textarea:
            self.fields[self._textarea][0] += data

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None


def _parse(client, path: str) -> _FormFields:
    resp = client.get(path)
    assert resp.status_code == 200, f"GET {path}: {resp.status_code}"
    parser = _FormFields()
    parser.feed(resp.content.decode())
    parser.fields.pop("csrfmiddlewaretoken", None)
    return parser


def form_of(client, path: str) -> dict[str, list[str]]:
    """What a browser submits from the form at ``path`` unchanged."""
    return _parse(client, path).fields


def offered_on(client, path: str) -> set[str]:
    """Every field name the form at ``path`` offers."""
    return _parse(client, path).offered


@pytest.fixture
def people(db, tenant, admin_user, requester, approver, device):
    """acme's admin (adele), requester (riley) and approver (avery); globex with its own admin
    (gus) and approver (gabe); ``shared`` (sam), a requester of acme who approves for globex; and
    the platform superuser (root), a member of no tenant."""
    globex = TenantFactory(slug="globex", name="Globex")
    gus = MembershipFactory(user=UserFactory(username="gus"), tenant=globex, role=Role.ADMIN).user
    MembershipFactory(user=UserFactory(username="gabe"), tenant=globex, role=Role.APPROVER)
    sam = UserFactory(username="sam")
    MembershipFactory(user=sam, tenant=tenant, role=Role.REQUESTER)
    MembershipFactory(user=sam, tenant=globex, role=Role.APPROVER)
    root = User.objects.create_superuser("root", "root@example.test", "root-password-1")
    DeviceFactory(tenant=globex, asset_tag="GLX-0001")
    return {"admin": admin_user, "requester": requester, "approver": approver, "globex": globex, "gus": gus,
            "sam": sam, "root": root}


def _user_url(user, view="change"):
    return f"/django-admin/auth/user/{user.pk}/{view}/"


def test_a_tenant_admin_is_staff_in_the_tenant_admin_group_never_a_superuser(people):
    adele = User.objects.get(username="adele")
    assert adele.is_staff and not adele.is_superuser
    assert list(adele.groups.values_list("name", flat=True)) == ["Tenant admins"]
    assert adele.has_perm("devices.change_device") and adele.has_perm("auth.change_user")
    assert not adele.has_perm("auth.change_group") and not adele.has_perm("auth.add_permission")
    assert not adele.has_perm("tasks.change_task") and not adele.has_perm("actions.change_action")
    # Losing the admin role takes the door away.
    m = Membership.objects.get(user=adele)
    m.role = Role.APPROVER
    m.save()
    adele.refresh_from_db()
    assert not adele.is_staff and not adele.groups.exists()


def test_the_users_change_form_offers_no_superuser_staff_group_or_permission_field(client, people):
    forbidden = {"is_superuser", "is_staff", "groups", "user_permissions"}
    client.force_login(people["admin"])
    offered = offered_on(client, _user_url(people["requester"]))
    assert {"username", "is_active", "first_name"} <= offered
    assert not offered & forbidden, offered & forbidden
    # The control: the platform superuser's form has them all.
    client.force_login(people["root"])
    assert forbidden <= offered_on(client, _user_url(people["requester"]))


def test_forcing_superuser_and_staff_into_the_post_changes_neither(client, people):
    """The first step of the attack: make a requester a superuser. Then the rest of it: delete
    the membership, so that the superuser belongs to no tenant and sees every one."""
    riley = people["requester"]
    client.force_login(people["admin"])
    data = form_of(client, _user_url(riley))
    data["first_name"] = ["Riley"]
    resp = client.post(_user_url(riley), {**data, "is_superuser": "on", "is_staff": "on",
                                          "groups": [str(g) for g in riley.groups.values_list("pk", flat=True)]})
    assert resp.status_code in (302, 403), resp.status_code
    riley.refresh_from_db()
    assert not riley.is_superuser and not riley.is_staff
    # Positive control: the same form with only the permitted change is accepted.
    client.post(_user_url(riley), data)
    riley.refresh_from_db()
    assert riley.first_name == "Riley" and not riley.is_superuser

    membership = Membership.objects.get(user=riley)
    resp = client.post(f"/django-admin/accounts/membership/{membership.pk}/delete/", {"post": "yes"})
    assert resp.status_code == 403
    assert Membership.objects.filter(pk=membership.pk).exists(), "a user's last membership was deleted"
    resp = client.post("/django-admin/accounts/membership/",
                       {"action": "delete_selected", "_selected_action": [membership.pk], "post": "yes"})
    assert Membership.objects.filter(pk=membership.pk).exists(), "bulk delete removed the last membership"
    client.force_login(riley)
    assert client.get("/django-admin/devices/device/").status_code == 302  # not staff: the login page


def test_the_platform_superuser_is_never_pulled_into_a_tenant(client, people):
    root, adele = people["root"], people["admin"]
    client.force_login(adele)
    fields = form_of(client, "/django-admin/accounts/membership/add/")
    assert fields["user"] == [""]
    body = client.get("/django-admin/accounts/membership/add/").content.decode()
    assert f'value="{root.pk}"' not in body and ">root<" not in body
    resp = client.post("/django-admin/accounts/membership/add/",
                       {"user": root.pk, "tenant": people["requester"].memberships.get().tenant_id,
                        "role": Role.ADMIN, "scopes": "public", "is_active": "on"})
    assert resp.status_code == 200  # the form again, with its error
    assert not Membership.objects.filter(user=root).exists()
    with pytest.raises(ValidationError):
        MembershipFactory(user=root, tenant=people["globex"], role=Role.ADMIN)
    # Its password cannot be reset, nor the account edited or deleted.
    for path in (_user_url(root), _user_url(root, "password"), _user_url(root, "delete")):
        assert client.post(path, {"password1": "Pwned-pass-1234", "password2": "Pwned-pass-1234",
                                  "post": "yes"}).status_code in (302, 403, 404), path
    root.refresh_from_db()
    assert root.check_password("root-password-1") and root.is_superuser and root.is_active


def test_staff_and_members_of_another_tenant_are_view_only(client, people):
    """Sam, an acme requester, also approves for globex; a co-admin (ada) is staff."""
    sam, adele = people["sam"], people["admin"]
    co_admin = MembershipFactory(user=UserFactory(username="ada"), tenant=people["requester"].memberships.get().tenant,
                                 role=Role.ADMIN).user
    client.force_login(adele)
    for target in (sam, co_admin):
        assert client.get(_user_url(target)).status_code == 200  # visible: they belong to acme
        before = target.password
        resp = client.post(_user_url(target, "password"), {"password1": "Pwned-pass-1234",
                                                           "password2": "Pwned-pass-1234"})
        assert resp.status_code == 403, target.username
        target.refresh_from_db()
        assert target.password == before
        assert client.post(_user_url(target, "delete"), {"post": "yes"}).status_code == 403
        assert User.objects.filter(pk=target.pk).exists()
    # Positive control: acme's own requester's password is reset by acme's admin.
    riley = people["requester"]
    resp = client.post(_user_url(riley, "password"), {"password1": "Fresh-pass-5678", "password2": "Fresh-pass-5678",
                                                      "usable_password": "true"})
    assert resp.status_code == 302
    riley.refresh_from_db()
    assert riley.check_password("Fresh-pass-5678")
    # Membership forms never offer staff or another tenant's people.
    body = client.get("/django-admin/accounts/membership/add/").content.decode()
    assert f'value="{co_admin.pk}"' not in body and f'value="{people["gus"].pk}"' not in body
    assert f'value="{riley.pk}"' in body


def test_a_user_added_by_a_tenant_admin_joins_her_tenant_in_the_same_step(client, people):
    adele = people["admin"]
    client.force_login(adele)
    acme = Membership.objects.get(user=adele).tenant
    resp = client.post("/django-admin/auth/user/add/", {
        "username": "newbie", "usable_password": "true", "password1": "Newbie-pass-2468",
        "password2": "Newbie-pass-2468", "tenant": people["globex"].pk, "role": Role.REQUESTER,
        "is_superuser": "on", "is_staff": "on"})
    assert resp.status_code == 200 and not User.objects.filter(username="newbie").exists()  # not her tenant
    resp = client.post("/django-admin/auth/user/add/", {
        "username": "newbie", "usable_password": "true", "password1": "Newbie-pass-2468",
        "password2": "Newbie-pass-2468", "tenant": acme.pk, "role": Role.REQUESTER, "is_superuser": "on"})
    assert resp.status_code == 302, resp.content.decode()[:2000]
    newbie = User.objects.get(username="newbie")
    assert not newbie.is_superuser and not newbie.is_staff
    assert list(newbie.memberships.values_list("tenant__slug", "role", "scopes")) == [
        ("acme", Role.REQUESTER, [AccessScope.PUBLIC])]


def test_a_staff_user_sees_only_the_tenants_she_administers(client, people):
    """Gus administers globex; a requester membership in acme gives him nothing of acme's there."""
    gus = people["gus"]
    MembershipFactory(user=gus, tenant=people["requester"].memberships.get().tenant, role=Role.REQUESTER)
    client.force_login(gus)
    body = client.get("/django-admin/devices/device/").content.decode()
    assert "GLX-0001" in body and "PRN-0417" not in body


def test_a_co_admin_cannot_be_demoted_edited_and_promoted_back(client, people):
    """The takeover path: demote another admin's membership (dropping her staff flag), reset her
    password, promote her back. The first step is refused."""
    adele = people["admin"]
    tenant = Membership.objects.get(user=adele).tenant
    adam = MembershipFactory(user=UserFactory(username="adam"), tenant=tenant, role=Role.ADMIN)
    client.force_login(adele)
    base = f"/django-admin/accounts/membership/{adam.pk}/"
    assert client.post(base + "change/", {"role": Role.REQUESTER, "scopes": "public", "is_active": "on"}
                       ).status_code == 403
    assert client.post(base + "delete/", {"post": "yes"}).status_code == 403
    adam.refresh_from_db()
    adam.user.refresh_from_db()
    assert adam.role == Role.ADMIN and adam.is_active and adam.user.is_staff
    before = adam.user.password
    assert client.post(_user_url(adam.user, "password"), {"password1": "Pwned-pass-1234",
                                                          "password2": "Pwned-pass-1234"}).status_code == 403
    adam.user.refresh_from_db()
    assert adam.user.password == before
    # A requester's membership she still manages (the control).
    riley = Membership.objects.get(user=people["requester"])
    resp = client.post(f"/django-admin/accounts/membership/{riley.pk}/change/",
                       {"role": Role.APPROVER, "scopes": "public", "is_active": "on"})
    assert resp.status_code == 302
    riley.refresh_from_db()
    assert riley.role == Role.APPROVER
