"""The Django admin shows knowledge only in the scopes the admin may read (DESIGN.md §9)."""

from __future__ import annotations

from apps.accounts.models import AccessScope, Membership, Role
from apps.evidence.models import Chunk, Document
from tests.factories import MembershipFactory, UserFactory


def test_an_admin_without_the_security_scope_sees_no_security_document_or_chunk(client, tenant, kb, admin_user):
    narrow = MembershipFactory(user=UserFactory(username="nora"), tenant=tenant, role=Role.ADMIN,
                               scopes=[AccessScope.PUBLIC]).user
    secret = Chunk.objects.filter(scope=AccessScope.SECURITY).first()
    public = Chunk.objects.filter(scope=AccessScope.PUBLIC).first()
    doc = Document.objects.get(scope=AccessScope.SECURITY)
    client.force_login(narrow)
    listing = client.get("/django-admin/evidence/chunk/?all=").content.decode()
    assert f"/chunk/{public.pk}/" in listing and f"/chunk/{secret.pk}/" not in listing
    assert client.get(f"/django-admin/evidence/chunk/{secret.pk}/change/").status_code == 302  # "doesn't exist"
    assert client.get(f"/django-admin/evidence/document/{doc.pk}/change/").status_code == 302
    assert "badge" not in client.get("/django-admin/evidence/document/").content.decode().lower()
    # The control: acme's admin with every scope reads it.
    client.force_login(admin_user)
    assert Membership.objects.get(user=admin_user).scopes == list(AccessScope.values)
    assert client.get(f"/django-admin/evidence/chunk/{secret.pk}/change/").status_code == 200
