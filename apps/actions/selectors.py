"""Tenant-scoped reads of actions and their attempts (DESIGN.md §6; spec table 16.2 "动作")."""

from __future__ import annotations

from django.db.models import QuerySet

from apps.accounts.principal import Principal
from apps.actions.models import Action


def task_actions(*, principal: Principal, task_id) -> QuerySet[Action]:
    """The actions of task ``task_id`` that ``principal``'s tenant owns, oldest first (the ticket
    write, then any compensation), each with its attempts prefetched in number order. Another
    tenant's task yields an empty queryset; role checks are the caller's."""
    return (Action.objects.visible_to(principal).filter(task_id=task_id)
            .prefetch_related("attempts").order_by("created_at", "id"))
