"""Make a finished task look old to the retention purge: its last change, its actions, their attempts
and outbox rows moved ``days`` back."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from apps.actions.models import Action, ActionAttempt
from apps.outbox.models import OutboxMessage
from apps.tasks.models import Task


def age_finished_task(task: Task, days: float) -> None:
    """Move ``task`` (and its actions, attempts and outbox rows) ``days`` into the past."""
    then = timezone.now() - timedelta(days=days)
    Task.objects.filter(pk=task.pk).update(updated_at=then)
    Action.objects.filter(task=task).update(created_at=then)
    ActionAttempt.objects.filter(action__task=task).update(finished_at=then, started_at=then)
    OutboxMessage.objects.filter(action__task=task).update(delivered_at=then, created_at=then)
