"""``manage.py audit_approvals``: the binding audit of every decided approval, from the command line —
ok, purged (retention emptied the copy), unsent, and a differing one named with exit status 1."""

from __future__ import annotations

import io
import uuid

import pytest
from django.core.management import CommandError, call_command

from apps.actions.models import Action
from apps.approvals.tests.test_retention import _age, _completed
from apps.retention.purge import purge_run
from tests.tamper import immutability_bypassed


def _audit(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("audit_approvals", *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code), out.getvalue()
    return 0, out.getvalue()


@pytest.mark.allow_divergence  # an action row's digest is changed by hand to plant a difference
def test_the_audit_counts_ok_purged_and_differs_and_fails_on_a_difference(requester, approver, device, kb,
                                                                          refservice):
    task, approval = _completed(requester, approver, device)
    assert _audit() == (0, "audit_approvals: ok=1 purged=0 unsent=0 differs=0\n")
    _age(task, 200)
    purge_run()
    assert _audit()[1].endswith("audit_approvals: ok=0 purged=1 unsent=0 differs=0\n")
    assert _audit("--task", str(uuid.uuid4())) == (0, "audit_approvals: ok=0 purged=0 unsent=0 differs=0\n")
    with immutability_bypassed("actions_action"):
        Action.objects.filter(task=task).update(params_digest="0" * 64)
    status, out = _audit("--task", str(task.pk))
    assert status == 1 and f"approval {approval.pk} (task {task.pk}): differs:" in out
    assert out.endswith("differs=1\n")


@pytest.mark.django_db
def test_a_bad_task_id_is_a_clear_error():
    with pytest.raises(CommandError, match="not a task id"):
        call_command("audit_approvals", "--task", "not-a-uuid")
