"""Task API (DESIGN.md §1 step 1): file a request (with ``Idempotency-Key``), read it, cancel it,
answer the agent's questions, read its events and its actions (admins)."""

from __future__ import annotations

from django.utils.translation import gettext as _
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.api import HasPrincipal, request_principal
from apps.actions.api.serializers import ActionSerializer
from apps.actions.selectors import task_actions
from apps.attachments.services import attachments_check
from apps.attachments.uploads import recorded_uploads
from apps.core.errors import Forbidden, NotFound, Unprocessable
from apps.tasks import reducer
from apps.tasks.api.serializers import (
    CancelSerializer,
    EventSerializer,
    InputSerializer,
    TaskCreateSerializer,
    TaskCreateWithFilesSerializer,
    TaskSerializer,
)
from apps.tasks.selectors import payload_shown, task_events_for_viewer, task_get, task_list
from apps.tasks.services import task_cancel, task_provide_input, task_submit

#: the status names a list may be filtered by, as plain strings (for the schema and the error)
STATUS_NAMES = [str(s) for s in reducer.ALL_STATUSES]


class TaskListCreateApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=TaskSerializer(many=True),
                   parameters=[OpenApiParameter("status", enum=STATUS_NAMES)])
    def get(self, request):
        principal = request_principal(request)
        qs = task_list(principal=principal)
        if s := request.query_params.get("status"):
            if s not in STATUS_NAMES:
                raise ValidationError({"status": _("must be one of %(choices)s") % {"choices": STATUS_NAMES}})
            qs = qs.filter(status=s)
        return Response(TaskSerializer(qs[:100], many=True).data)

    @extend_schema(
        request={"application/json": TaskCreateSerializer, "multipart/form-data": TaskCreateWithFilesSerializer},
        responses={201: TaskSerializer, 200: TaskSerializer},
        parameters=[OpenApiParameter("Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER,
                                     description="same key + same body → the same task; different body → 422")],
    )
    def post(self, request):
        principal = request_principal(request)
        ser = TaskCreateSerializer(data=request.data)
        valid = ser.is_valid()
        # multipart/form-data: the files of field "attachments", checked by their content — also when
        # another field is wrong, so every problem is told at once
        files, skipped = recorded_uploads(request, "attachments")
        try:
            checked = attachments_check([(name, f, f.content_type) for name, f in files], skipped)
        except Unprocessable as exc:
            if valid:
                raise
            raise ValidationError({**ser.errors, "attachments": exc.extra.get("attachments") or [exc.detail]}) from exc
        if not valid:
            raise ValidationError(ser.errors)
        result = task_submit(principal=principal, request_key=request.headers.get("Idempotency-Key"),
                             attachments=checked, **ser.validated_data)
        if result.task.requester_id == request.user.pk:
            result.task.requester = request.user  # the signed-in user, already read: no query for the answer
        return Response(
            TaskSerializer(result.task).data, status=status.HTTP_201_CREATED if result.created else status.HTTP_200_OK
        )


class TaskDetailApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=TaskSerializer)
    def get(self, request, task_id):
        task = task_get(principal=request_principal(request), task_id=task_id)
        if task is None:
            raise NotFound(_("task not found"))
        return Response(TaskSerializer(task).data)


class TaskCancelApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(request=CancelSerializer, responses=TaskSerializer)
    def post(self, request, task_id):
        ser = CancelSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        task = task_cancel(principal=request_principal(request), task_id=task_id, reason=ser.validated_data["reason"])
        return Response(TaskSerializer(task).data)


class TaskInputApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(request=InputSerializer, responses=TaskSerializer)
    def post(self, request, task_id):
        ser = InputSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        task = task_provide_input(principal=request_principal(request), task_id=task_id,
                                  text=ser.validated_data["text"])
        return Response(TaskSerializer(task).data)


def _task_for_admin(request, task_id, *, what: str):
    """``(principal, task)`` for an admin of the task's tenant. Raises Forbidden (403) for other
    roles, saying they may not read ``what``, and NotFound (404) for another tenant's task."""
    principal = request_principal(request)
    if not principal.is_admin:
        raise Forbidden(_("only admins may read %(what)s") % {"what": what})
    task = task_get(principal=principal, task_id=task_id)
    if task is None:
        raise NotFound(_("task not found"))
    return principal, task


class TaskEventsApi(APIView):
    permission_classes = [HasPrincipal]

    @extend_schema(responses=EventSerializer(many=True))
    def get(self, request, task_id):
        principal, task = _task_for_admin(request, task_id, what=_("traces"))
        # Sensitive payloads: their digest and view link, unless ?include=payloads asks for them.
        include = request.GET.get("include") == "payloads"
        events = task_events_for_viewer(principal=principal, task=task)
        for e in events:
            e.payload = payload_shown(e, task_id=task.pk, include_sensitive=include)
        return Response(EventSerializer(events, many=True).data)


class TaskActionsApi(APIView):
    """``GET /api/tasks/<id>/actions/``: the task's actions, oldest first, each with the
    idempotency key it is sent with, its parameter digest, status, receipt and attempts (admins
    only, like the trace; 403 for other roles, 404 for another tenant's task). This is where a
    client learns an action's key: the ``intent.committed`` payload in the events API is redacted
    to its digest (DESIGN.md §6, §13)."""

    permission_classes = [HasPrincipal]

    @extend_schema(responses=ActionSerializer(many=True))
    def get(self, request, task_id):
        principal, task = _task_for_admin(request, task_id, what=_("a task's actions"))
        return Response(ActionSerializer(task_actions(principal=principal, task_id=task.pk), many=True).data)


class TaskAttachmentApi(APIView):
    """``GET /api/tasks/<id>/attachments/<sha256>/``: one attachment's bytes, for whoever may read
    the task (its requester, the tenant's approvers and admins); 404 otherwise, and for another
    tenant's task. The same answer as the page's link (:func:`apps.tasks.views.attachment_response`)."""

    permission_classes = [HasPrincipal]

    @extend_schema(responses={(200, "application/octet-stream"): OpenApiTypes.BINARY})
    def get(self, request, task_id, sha256):
        from apps.tasks.views import attachment_response

        return attachment_response(request_principal(request), task_id, sha256)
