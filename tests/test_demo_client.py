"""``make demo``'s client (tools/demo_client.py) against real processes: web (gunicorn), a Celery
worker, beat, the reference ticket service and django-helpdesk, seeded by ``tools.demo_data.seed``. The
README's first command runs exactly this client, so a change to any API it reads (the task, the
approvals, the task's actions, the ticket systems' lookups) fails here, in ``make test``, not only
in CI's demo runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from apps.actions.models import Action, ActionStatus
from tests.procs import HELPDESK_TOKEN, ROOT, demo_stack
from tools import demo_client

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

DEMO_OK = re.compile(r"^DEMO OK task=(?P<task>[0-9a-f-]{36}) ticket=(?P<ticket>\S+)$")


def test_the_demo_files_comments_and_files_in_helpdesk_against_real_processes(transactional_db, tmp_path, capsys):
    """Given make demo's stack and seed, when the demo client runs for acme twice and for initech
    once, then each run ends with ``DEMO OK``: acme's first run creates a reference ticket, its
    second comments on that still-open ticket, initech's creates a django-helpdesk ticket; each
    ticket system holds exactly the action the actions API names, and every task replays."""
    with demo_stack(tmp_path, helpdesk=True) as (stack, credentials):
        systems = demo_client.TicketSystems(refservice_url=stack.ref, refservice_api_key="e2e-key",
                                            helpdesk_url=stack.proxy, helpdesk_token=HELPDESK_TOKEN)
        replays: list[str] = []

        def replay_all() -> None:  # what devstack runs before DEMO OK
            done = subprocess.run([sys.executable, "manage.py", "replay", "--all", "--remote"], cwd=ROOT,  # noqa: S603
                                  env=stack.env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            replays.append(done.stdout)

        ends = []
        for tenant in ("acme", "acme", "initech"):
            ok = demo_client.run(base_url=stack.web, credentials_path=credentials, tenant=tenant, systems=systems,
                                 timeout=120, before_ok=replay_all)
            out = capsys.readouterr().out
            assert ok, f"{out}\n{stack.logs()}"
            last = out.strip().splitlines()[-1]
            match = DEMO_OK.match(last)
            assert match, last
            ends.append(match)

        first, second, third = (m["ticket"] for m in ends)
        assert re.fullmatch(r"REF-\d+", first)
        assert re.fullmatch(re.escape(first) + r"-C\d+", second)  # a comment on the first run's ticket
        assert re.fullmatch(r"\d+", third)  # a django-helpdesk ticket id
        sent = {str(a.task_id): a for a in Action.objects.filter(status=ActionStatus.SUCCEEDED)}
        assert [(sent[m["task"]].tool, sent[m["task"]].connector, sent[m["task"]].external_id) for m in ends] == [
            ("ticket.create", "reference", first), ("ticket.comment", "reference", second),
            ("ticket.create", "helpdesk", third)]
        assert "3 of 3 tasks replay to their materialized state" in replays[-1]

        # A run that cannot sign in says so on its last line instead of a traceback.
        wrong = tmp_path / "wrong-credentials.json"
        wrong.write_text(json.dumps({u: "not-the-password" for u in json.loads(credentials.read_text())}))
        assert demo_client.run(base_url=stack.web, credentials_path=wrong, systems=systems, timeout=30) is False
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("DEMO FAILED: finding the device:") and "403" in last
