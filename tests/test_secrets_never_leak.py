"""No credential leaves the tool gateway (spec agent-execution-system.md §16.6: "凭证由网关注入而非放进模型
上下文"; ADR 0022). Real tasks run end to end, in process, against real servers on loopback — the
reference ticket service, django-helpdesk, the scripted model server, a remote embedding model and an
SMTP relay with a login — each configured with a distinctive secret. The servers see them (the
gateway injects them); afterwards none of them occurs in any row faultdesk wrote (events, refused
events, actions, attempts, outbox rows, the gateway's call records, notifications …), any log line,
the trace pages and their JSON export, the approval queue, or any prompt the model received."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from django.apps import apps as django_apps

from apps.approvals.models import ApprovalRequest, ApprovalStatus
from apps.approvals.services import approval_decide
from apps.events.models import TaskEvent
from apps.evidence.embedding import USE_MODEL, embed_texts
from apps.evidence.services import document_ingest
from apps.gateway.models import GatewayCall
from apps.gateway.tests.servers import smtp_relay_on_loopback, use_relay
from apps.notifications.services import notifications_drain
from apps.tasks import reducer
from apps.tasks.services import task_submit
from apps.tickets.connectors import ReferenceTicketConnector
from tests.conftest import KB, SMALL_KB, drive, p
from tests.factories import DeviceFactory
from tests.procs import free_port, helpdesk_running

SECRETS = {
    "ticket.reference": "refLEAKprobe-7f3a9c51-ref",
    "ticket.helpdesk": "hdLEAKprobe8e2d4b7700000000000000000000",  # a DRF token: 40 characters
    "model": "modelLEAKprobe-51e2c3d4-model",
    "embeddings": "embLEAKprobe-9d0c7a6b-emb",
    "notifications.smtp": "smtpLEAKprobe-c4b8e1f2-smtp",
}
SYMPTOM = "Fuser error after warm-up, pages come out smeared with unfused toner."


@pytest.fixture(scope="module")
def helpdesk_site(tmp_path_factory):
    """A real django-helpdesk (gunicorn, own SQLite) whose API token is the distinctive secret."""
    with helpdesk_running(tmp_path_factory.mktemp("helpdesk-leak"), SECRETS["ticket.helpdesk"]) as base:
        yield base


@pytest.fixture
def embedding_server():
    """A remote embedding model (OpenAI ``/v1/embeddings``) that requires its bearer key and answers
    with the local multilingual model's vectors."""
    from apps.gateway.tests.servers import Recorder

    def answer(handler):
        body = json.loads(handler.server.seen[-1]["body"])
        if handler.headers.get("Authorization") != f"Bearer {SECRETS['embeddings']}":
            status, data = 401, {"error": "unauthorized"}
        else:
            vectors = embed_texts(body["input"], model=USE_MODEL)
            status, data = 200, {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)]}
        raw = json.dumps(data).encode()
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    server = Recorder({"POST /v1/embeddings": answer})
    yield server
    server.close()


@pytest.fixture
def smtp_relay(settings):
    from aiosmtpd.smtp import AuthResult

    seen = {"logins": [], "messages": []}

    class Sink:
        async def handle_DATA(self, server, session, envelope):  # noqa: N802
            seen["messages"].append(envelope.content)
            return "250 OK"

    def authenticator(server, session, envelope, mechanism, auth_data):
        seen["logins"].append(auth_data.password.decode())
        return AuthResult(success=auth_data.password.decode() == SECRETS["notifications.smtp"])

    with smtp_relay_on_loopback(Sink(), authenticator) as port:
        use_relay(settings, port, "faultdesk", SECRETS["notifications.smtp"])
        yield seen


def _pages(client, admin_user, approver, tasks) -> dict[str, str]:
    """Every page and export an admin or approver reads about ``tasks``."""
    out = {}
    client.force_login(admin_user)
    for task in tasks:
        for url in (f"/tasks/{task.pk}/trace/", f"/tasks/{task.pk}/trace.json", f"/tasks/{task.pk}/trace/budget/",
                    f"/tasks/{task.pk}/", f"/api/tasks/{task.pk}/events/", f"/api/tasks/{task.pk}/actions/"):
            out[url] = client.get(url).content.decode()
        for seq in TaskEvent.objects.filter(task=task).values_list("seq", flat=True):
            url = f"/tasks/{task.pk}/events/{seq}/"
            out[url] = client.get(url).content.decode()
    for url in ("/admin-tasks/", "/reconciliation/", "/ops/metrics/", "/django-admin/gateway/gatewaycall/",
                "/notifications/"):
        out[url] = client.get(url).content.decode()
    client.force_login(approver)
    for url in ("/approvals/", "/approvals/?status=approved", "/api/approvals/"):
        out[url] = client.get(url).content.decode()
    return out


def _rows() -> str:
    """Every row of every faultdesk model, as text."""
    parts = []
    for model in django_apps.get_models():
        if model.__module__.startswith("apps."):
            parts.append(repr(list(model._base_manager.all().values())))
    return "\n".join(parts)


@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
def test_no_credential_appears_anywhere_after_real_tasks_through_every_tool(
        settings, tenant, requester, approver, admin_user, device, model_server, helpdesk_site, embedding_server,
        smtp_relay, client, caplog, capfd, tmp_path):
    from tools.refservice import serve_in_thread

    caplog.set_level(logging.DEBUG)
    ref = serve_in_thread("127.0.0.1", 0, str(tmp_path / "tickets.sqlite3"), api_key=SECRETS["ticket.reference"])
    try:
        settings.FAULTDESK = {
            **settings.FAULTDESK,
            "REFSERVICE_URL": ref.url, "REFSERVICE_API_KEY": SECRETS["ticket.reference"],
            "HELPDESK_URL": helpdesk_site, "HELPDESK_API_TOKEN": SECRETS["ticket.helpdesk"],
            "HELPDESK_REQUEST_LIFETIME_SECONDS": 1.0,
            "MODEL_API_KEY": SECRETS["model"],
            "EMBEDDING_MODEL": f"openai:{embedding_server.url}#leak-probe",
            "EMBEDDING_API_KEY": SECRETS["embeddings"],
        }
        model_server.api_key = SECRETS["model"]
        for person in (requester, approver, admin_user):  # notifications go by e-mail, through the relay
            person.email = f"{person.username}@acme.test"
            person.save(update_fields=["email"])
        for scope, name in SMALL_KB:  # embedded by the remote model, through the gateway
            document_ingest(tenant=tenant, source=f"{scope}/{name}", raw=(KB / scope / name).read_text(), scope=scope)

        tasks = []
        for system, asset in (("reference", "PRN-0417"), ("helpdesk", "PRN-0811")):
            tenant.ticket_system = system
            tenant.save(update_fields=["ticket_system"])
            target = device if asset == device.asset_tag else DeviceFactory(tenant=tenant, asset_tag=asset)
            task = task_submit(principal=p(requester), device_id=target.pk, symptom=SYMPTOM, urgency="high").task
            task = drive(task.pk)
            assert task.status == reducer.WAITING_APPROVAL, task.state.get("termination")
            pending_queue = _pages(client, admin_user, approver, [task])
            approval = ApprovalRequest.objects.get(task=task, status=ApprovalStatus.PENDING)
            approval_decide(principal=p(approver), approval_id=approval.pk, decision="approve", reason="ok")
            task = drive(task.pk)
            assert task.status == reducer.COMPLETED, task.state.get("termination")
            assert task.state["receipt"]["connector"] == system
            tasks.append(task)
        # a refused destination, recorded with the tenant bound
        with pytest.raises(Exception):  # noqa: B017 - DefinitelyNotExecuted
            ReferenceTicketConnector(base_url=f"http://127.0.0.1:{free_port()}").lookup_by_key(idempotency_key="x")
        notifications_drain()
        with httpx.Client(base_url=ref.url, headers={"Authorization": f"Bearer {SECRETS['ticket.reference']}"}) as c:
            tickets = c.get("/_admin/tickets").json()["results"]
    finally:
        ref.shutdown()

    # each secret was used: the servers saw them
    assert model_server.requests and smtp_relay["logins"] and SECRETS["notifications.smtp"] in smtp_relay["logins"]
    assert any(r["headers"].get("Authorization") == f"Bearer {SECRETS['embeddings']}" for r in embedding_server.seen)
    tools_used = set(GatewayCall.objects.filter(outcome="ok").values_list("tool", flat=True))
    assert set(SECRETS) <= tools_used, tools_used

    places = {
        "rows of every faultdesk table": _rows(),
        "log records": "\n".join(f"{r.name} {r.getMessage()} {r.__dict__}" for r in caplog.records
                                 if not r.name.startswith("mail.log")),  # aiosmtpd's own log is the relay's
        "log lines": capfd.readouterr().err,
        "prompts the model received": json.dumps(model_server.requests),
        "what the embedding model received": repr([r["body"] for r in embedding_server.seen]),
        "tickets the reference service holds": repr(tickets),
        **_pages(client, admin_user, approver, tasks),
        **{f"{url} (pending)": text for url, text in pending_queue.items()},
    }
    for where, text in places.items():
        for tool, secret in SECRETS.items():
            assert secret not in text, f"the {tool} credential appears in {where}"
