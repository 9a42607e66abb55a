"""Retention of attachments (apps/attachments/retention.py): a report's files go with its payload —
the stored bytes deleted, the row kept as a marker with its digest — unless an open delivery still
sends them or another unpurged report holds the same bytes; a report filing the same bytes while
they are purged stores them again."""

from __future__ import annotations

from django.core.files.storage import storages
from django.db import transaction
from django.utils import translation

from apps.attachments.delivery import deliveries_drain
from apps.attachments.models import Attachment, AttachmentDelivery, DeliveryStatus
from apps.attachments.retention import STORAGE_TABLE
from apps.attachments.services import STORAGE_ALIAS, attachments_check, attachments_record, attachments_store
from apps.retention.purge import purge_run
from apps.tasks import reducer
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.aging import age_finished_task as _age
from tests.conftest import p
from tests.test_attachments import LOG, SYMPTOM, _approved_and_sent, _own_storage, png, post_form, upload  # noqa: F401

PHOTO = png()


def _sent(client, requester, approver, device) -> Task:
    task = _approved_and_sent(client, requester, approver, device,
                              [upload("panel.png", PHOTO, "image/png"), upload("printer.log", LOG, "text/plain")])
    assert task.status == reducer.COMPLETED
    return task


def test_a_purged_reports_files_are_deleted_and_their_rows_keep_the_digest(
        client, requester, approver, device, kb, refservice):
    task = _sent(client, requester, approver, device)
    assert deliveries_drain() == 2
    storage = storages[STORAGE_ALIAS]
    rows = list(Attachment.objects.filter(task=task).order_by("position"))
    digests = [(a.sha256, a.size, a.content_type) for a in rows]
    assert all(storage.exists(a.storage_key) for a in rows) and rows[1].text
    _age(task, 200)
    run = purge_run()
    assert run.tasks["payload"] == 1
    assert run.tables[STORAGE_TABLE] == {"rows": 2, "bytes": len(PHOTO) + len(LOG)}
    assert run.tables["attachments_attachment"]["rows"] == 2
    rows = list(Attachment.objects.filter(task=task).order_by("position"))
    assert [(a.sha256, a.size, a.content_type) for a in rows] == digests
    assert all(a.purged_at and a.name == "" and a.text == "" for a in rows)
    assert not any(storage.exists(a.storage_key) for a in rows)
    # the page says so instead of linking a file that is gone; the link answers 404 with the reason
    client.force_login(requester)
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert "purged on" in page and "panel.png" not in page
    gone = client.get(f"/tasks/{task.pk}/attachments/{rows[0].sha256}/")
    assert gone.status_code == 404
    assert STORAGE_TABLE not in purge_run().tables  # nothing left to do


def test_a_file_an_open_delivery_still_sends_stays_until_it_is_sent(client, requester, approver, device, kb,
                                                                    refservice):
    task = _sent(client, requester, approver, device)  # its deliveries are PENDING: not drained
    assert set(AttachmentDelivery.objects.values_list("status", flat=True)) == {DeliveryStatus.PENDING}
    _age(task, 200)
    run = purge_run()
    assert run.tasks["payload"] == 1 and STORAGE_TABLE not in run.tables
    assert not Attachment.objects.filter(purged_at__isnull=False).exists()
    assert deliveries_drain() == 2  # the bytes were still there to send
    assert set(AttachmentDelivery.objects.values_list("status", flat=True)) == {DeliveryStatus.DELIVERED}
    assert purge_run().tables[STORAGE_TABLE]["rows"] == 2


def test_bytes_another_report_still_holds_stay(client, requester, approver, device, kb, refservice):
    task = _sent(client, requester, approver, device)
    deliveries_drain()
    client.force_login(requester)
    assert post_form(client, device, [upload("same-panel.png", PHOTO, "image/png")]).status_code == 302
    other = Attachment.objects.exclude(task=task).get()
    _age(task, 200)
    run = purge_run()
    assert run.tables[STORAGE_TABLE]["rows"] == 1  # the log; the picture is the other report's too
    assert Attachment.objects.filter(task=task, purged_at__isnull=False).count() == 2
    assert storages[STORAGE_ALIAS].exists(other.storage_key)


def test_a_report_filing_bytes_the_purge_deleted_meanwhile_stores_them_again(requester, device):
    [checked] = attachments_check([("panel.png", PHOTO, "image/png")])
    keys = attachments_store(tenant_id=device.tenant_id, files=[checked])
    storage = storages[STORAGE_ALIAS]
    storage.delete(keys[0])  # the purge of an older report with the same bytes, between store and record
    task = task_submit(principal=p(requester), device_id=device.pk, symptom=SYMPTOM, urgency="high").task
    with transaction.atomic():
        attachments_record(tenant_id=device.tenant_id, task_id=task.pk, files=[checked], keys=keys)
    assert storage.exists(keys[0])


def test_a_report_whose_bytes_the_purge_deletes_while_they_are_checked_stores_them_again(device, monkeypatch):
    # given: the bytes are stored (an older report's), and the purge deletes them just after the new
    # report saw they were there, before it re-read them to check they are intact
    [checked] = attachments_check([("panel.png", PHOTO, "image/png")])
    [key] = attachments_store(tenant_id=device.tenant_id, files=[checked])
    storage = storages[STORAGE_ALIAS]
    opened = storage.open

    def purged_meanwhile(name, mode="rb"):
        storage.delete(name)
        return opened(name, mode)

    monkeypatch.setattr(storage, "open", purged_meanwhile)
    # when: the report stores its files, then: it does not fail, and its bytes are there
    assert attachments_store(tenant_id=device.tenant_id, files=[checked]) == [key]
    monkeypatch.undo()
    with storage.open(key, "rb") as f:
        assert f.read() == PHOTO


def test_the_approval_queue_shows_a_purged_approvals_files_without_links_to_bytes_that_are_gone(
        client, requester, approver, admin_user, device, kb, refservice):
    task = _sent(client, requester, approver, device)
    deliveries_drain()
    _age(task, 200)
    purge_run()
    client.force_login(admin_user)
    for language, purged in (("en", "under the retention policy"), ("zh-hans", "保留策略")):
        with translation.override("en"):
            page = client.get("/approvals/?status=APPROVED", HTTP_ACCEPT_LANGUAGE=language).content.decode()
        assert 'data-purged="payload"' in page and purged in page
        # no link or picture of a file the purge took, and no link without a name to click
        assert f"/tasks/{task.pk}/attachments/" not in page
        assert "></a>" not in page
