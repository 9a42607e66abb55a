"""The principal lookups (``principal_for_user``, ``principal_current``), written as one SQL
statement: they must answer exactly what the membership rows say — role, scopes, tenant slug,
username — and nothing for an inactive membership, a deactivated account or another tenant."""

from __future__ import annotations

import pytest

from apps.accounts.models import AccessScope, Role
from apps.accounts.principal import (
    NoMembership,
    Principal,
    principal_current,
    principal_for_user,
    principal_from_membership,
)
from tests.factories import MembershipFactory, TenantFactory, UserFactory


@pytest.fixture
def member(db):
    return MembershipFactory(user=UserFactory(username="lin"), tenant=TenantFactory(slug="acme"),
                             role=Role.APPROVER, scopes=[AccessScope.PUBLIC, AccessScope.SECURITY])


def test_the_lookups_answer_what_the_membership_row_says(member):
    expected = Principal(user_id=member.user_id, username="lin", tenant_id=member.tenant_id, tenant_slug="acme",
                         role=Role.APPROVER, scopes=(AccessScope.PUBLIC, AccessScope.SECURITY))
    assert principal_from_membership(member) == expected
    assert principal_for_user(member.user) == expected
    assert principal_current(user_id=member.user_id, tenant_id=member.tenant_id) == expected


def test_a_changed_role_and_scopes_are_read_at_once(member):
    member.role, member.scopes = Role.REQUESTER, [AccessScope.PUBLIC]
    member.save()
    now = principal_current(user_id=member.user_id, tenant_id=member.tenant_id)
    assert (now.role, now.scopes, now.is_approver) == (Role.REQUESTER, (AccessScope.PUBLIC,), False)


def test_an_inactive_membership_or_a_deactivated_account_has_no_principal(member):
    member.is_active = False
    member.save()
    assert principal_current(user_id=member.user_id, tenant_id=member.tenant_id) is None
    with pytest.raises(NoMembership):
        principal_for_user(member.user)
    member.is_active = True
    member.save()
    member.user.is_active = False
    member.user.save()
    assert principal_current(user_id=member.user_id, tenant_id=member.tenant_id) is None
    with pytest.raises(NoMembership):
        principal_for_user(member.user)


def test_another_tenants_membership_is_not_this_tenants_principal(member):
    other = TenantFactory(slug="globex")
    assert principal_current(user_id=member.user_id, tenant_id=other.pk) is None
    MembershipFactory(user=member.user, tenant=other, role=Role.ADMIN, scopes=list(AccessScope.values))
    there = principal_current(user_id=member.user_id, tenant_id=other.pk)
    assert (there.tenant_slug, there.role) == ("globex", Role.ADMIN)
    # A user with two memberships signs in to the first one (by id); a deactivated first one
    # hands over to the next.
    assert principal_for_user(member.user).tenant_slug == "acme"
    member.is_active = False
    member.save()
    assert principal_for_user(member.user).tenant_slug == "globex"


def test_a_user_without_any_membership_has_no_principal(db):
    user = UserFactory(username="nobody")
    with pytest.raises(NoMembership):
        principal_for_user(user)
    assert principal_current(user_id=user.pk, tenant_id=1) is None


def test_no_tenant_is_no_principal_not_some_other_tenants(member):
    assert principal_current(user_id=member.user_id, tenant_id=None) is None
