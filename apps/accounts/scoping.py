"""Tenant scoping: the one mechanism every principal-facing read goes through (DESIGN.md §12 "no data crosses
tenants"; spec runtime-invariants.md §2.2).

Every tenant-owned model's default manager is :class:`TenantScopedManager`. Code that acts for a
person reads through ``Model.objects.visible_to(principal)`` (or ``for_tenant(tenant_id)`` where
the tenant comes from a trusted record, e.g. a worker holding a task). Nothing in a view, an API
endpoint or a selector filters by tenant by hand: ``tests/test_tenant_isolation.py`` fails on a
principal-facing module that reads a tenant-owned model without going through these two methods,
and probes every URL as a user of another tenant.

A model whose rows belong to a tenant through a parent (``ActionAttempt`` through its action,
``TaskSnapshot`` through its task) declares ``tenant_path`` on its queryset, so the same two
methods scope it.
"""

from __future__ import annotations

from django.db import models


class TenantScopedQuerySet(models.QuerySet):
    """A queryset that can be narrowed to one tenant. ``tenant_path`` is the lookup path from the
    model to its tenant id (``"tenant_id"`` for a model with its own ``tenant`` field)."""

    tenant_path = "tenant_id"

    def for_tenant(self, tenant_id: int) -> TenantScopedQuerySet:
        """Rows of tenant ``tenant_id`` only. Raises ``ValueError`` for a missing tenant id, so a
        forgotten scope fails loudly instead of returning every tenant's rows."""
        if tenant_id is None:
            raise ValueError(f"{self.model.__name__}: a tenant id is required to scope the query")
        return self.filter(**{self.tenant_path: tenant_id})

    def visible_to(self, principal) -> TenantScopedQuerySet:
        """Rows of the principal's tenant only (a :class:`~apps.accounts.principal.Principal`).
        Role checks stay with the caller: scoping decides *whose* rows, roles decide *which*."""
        return self.for_tenant(principal.tenant_id)


class TenantScopedManager(models.Manager.from_queryset(TenantScopedQuerySet)):
    """The default manager of every tenant-owned model (see the module docstring)."""


def scoped_manager(tenant_path: str = "tenant_id") -> TenantScopedManager:
    """A :class:`TenantScopedManager` whose queries reach the tenant through ``tenant_path``
    (e.g. ``"action__tenant_id"``)."""
    queryset = type("ScopedQuerySet", (TenantScopedQuerySet,), {"tenant_path": tenant_path})
    return models.Manager.from_queryset(queryset)()
