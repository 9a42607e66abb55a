"""Model rows read by SQL written once (``apps.core.sql``) are the instances the ORM builds: every
field's value converted the same way (JSON to dicts, timestamps aware, arrays to lists), related
rows cached as ``select_related`` caches them (None for an empty nullable one), deferred fields
loaded on first access, and a tenant's rows only when a tenant is given."""

from __future__ import annotations

import uuid

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.accounts.models import Membership
from apps.core import sql
from apps.devices.models import Device
from apps.devices.selectors import device_get
from apps.evidence.models import Chunk
from apps.tasks.models import Task
from apps.tasks.services import task_submit
from tests.conftest import p
from tests.factories import DeviceFactory, TenantFactory


def _fields(obj) -> dict:
    return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}


@pytest.fixture
def task(requester, device):
    return task_submit(principal=p(requester), device_id=device.pk, symptom="Paper jam in tray 2, 打印机卡纸",
                       urgency="high").task


def test_a_row_with_its_related_rows_equals_the_orms(task):
    orm = Task.objects.select_related("device", "tenant", "requester").get(pk=task.pk)
    ours = sql.row(Task, "t0.id = %s", [task.pk], related=("device", "tenant", "requester"))
    assert _fields(ours) == _fields(orm)
    assert isinstance(ours.state, dict) and ours.state == orm.state and ours.artifact_bundle == orm.artifact_bundle
    assert ours.created_at.tzinfo is not None
    with CaptureQueriesContext(connection) as queries:
        assert _fields(ours.device) == _fields(orm.device)
        assert _fields(ours.tenant) == _fields(orm.tenant)
        assert ours.requester.username == orm.requester.username
    assert len(queries) == 0, "the related rows come with the row, as select_related's do"
    assert ours._state.adding is False and ours._state.db == "default"


def test_arrays_and_deeper_paths_are_converted_and_cached(requester, kb):
    membership = sql.row(Membership, "t0.user_id = %s", [requester.pk], related=("tenant", "user"))
    assert membership.scopes == Membership.objects.get(user=requester).scopes
    chunk = Chunk.objects.order_by("pk").first()
    ours = sql.row(Chunk, "t0.id = %s", [chunk.pk], related=("document_version__document",),
                   defer=frozenset({"embedding", "search_vector", "document_version__content"}))
    orm = Chunk.objects.select_related("document_version__document").get(pk=chunk.pk)
    assert ours.text == orm.text and ours.section == orm.section
    with CaptureQueriesContext(connection) as queries:
        assert ours.document_version.document.title == orm.document_version.document.title
    assert len(queries) == 0
    # A deferred field is read on first access, as the ORM's defer() does.
    assert ours.get_deferred_fields() == {"embedding", "search_vector"}
    assert list(ours.embedding) == list(orm.embedding)


def test_an_empty_nullable_relation_is_cached_as_none(task):
    from apps.actions.models import Action
    from apps.actions.registry import tool_get
    from apps.actions.services import action_create

    action = action_create(action_id=uuid.uuid4(), tenant_id=task.tenant_id, task_id=task.pk,
                           tool=tool_get("ticket.create"), connector="reference", params={"title": "x"},
                           params_digest="d" * 64, idempotency_key="k-1", approval=None, object_version=1,
                           compensates=None)
    ours = sql.row(Action, "t0.id = %s", [action.pk], related=("approval", "task"))
    with CaptureQueriesContext(connection) as queries:
        assert ours.approval is None and ours.task.pk == task.pk
    assert len(queries) == 0


def test_a_tenant_sees_only_its_own_rows(device):
    other = DeviceFactory(tenant=TenantFactory(slug="globex"), asset_tag="PRN-9000")
    assert sql.row(Device, "t0.id = %s", [other.pk], tenant_id=device.tenant_id) is None
    assert sql.row(Device, "t0.id = %s", [device.pk], tenant_id=device.tenant_id).pk == device.pk
    assert device_get(tenant_id=device.tenant_id, device_id=other.pk) is None
    assert device_get(tenant_id=other.tenant_id, device_id=other.pk).asset_tag == "PRN-9000"


@pytest.mark.parametrize("bad", [0, -1, 2**63, 10**30, "abc", None, "1 OR 1=1"])
def test_a_device_id_that_names_no_row_finds_nothing(device, bad):
    assert device_get(tenant_id=device.tenant_id, device_id=bad) is None


def test_several_rows_keep_the_order_asked_for(requester, device):
    tasks = [task_submit(principal=p(requester), device_id=device.pk, symptom=f"fault {i}").task for i in range(3)]
    found = sql.rows(Task, "t0.id = ANY(%s)", [[t.pk for t in tasks]], tail="ORDER BY t0.created_at DESC")
    assert [t.pk for t in found] == [t.pk for t in reversed(tasks)]


def test_insert_writes_what_create_writes(device):
    from django.db import IntegrityError, transaction

    from apps.accounts.models import Tenant

    ours = sql.insert(Device(tenant_id=device.tenant_id, asset_tag="PRN-7001", name="打印机 7001", kind="printer",
                             site="HQ", state="fault", alert_code="X-1", metrics={"temp_c": 142.5, "页数": 10}))
    theirs = Device.objects.create(tenant_id=device.tenant_id, asset_tag="PRN-7002", name="打印机 7001",
                                   kind="printer", site="HQ", state="fault", alert_code="X-1",
                                   metrics={"temp_c": 142.5, "页数": 10})
    assert isinstance(ours.pk, int) and ours.pk != theirs.pk and ours._state.adding is False
    fresh = Device.objects.get(pk=ours.pk)
    skip = {"id", "asset_tag", "updated_at"}
    assert {k: v for k, v in _fields(fresh).items() if k not in skip} == \
        {k: v for k, v in _fields(Device.objects.get(pk=theirs.pk)).items() if k not in skip}
    tenant = sql.insert(Tenant(slug="initech", name="Initech"))
    assert Tenant.objects.get(pk=tenant.pk).created_at is not None  # auto_now_add, set by pre_save
    with pytest.raises(IntegrityError), transaction.atomic():
        sql.insert(Device(tenant_id=device.tenant_id, asset_tag="PRN-7001", name="dup", kind="printer", site="HQ"))


def test_a_tail_with_parameters_is_refused(device):
    # The tenant's parameter follows where's: a placeholder in the tail would take the wrong value.
    with pytest.raises(ValueError):
        sql.rows(Device, "t0.id = %s", [device.pk, 1], tenant_id=device.tenant_id, tail="LIMIT %s")


def test_a_tenant_id_of_none_fails_loudly_as_for_tenant_does(device):
    with pytest.raises(ValueError):
        Device.objects.for_tenant(None)
    with pytest.raises(ValueError):
        sql.rows(Device, "t0.id = %s", [device.pk], tenant_id=None)
    # Without the keyword the read is unscoped on purpose (a worker's re-read of a row it holds).
    assert sql.row(Device, "t0.id = %s", [device.pk]).pk == device.pk
