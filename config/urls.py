"""URL map: pages (requester, approver, admin), the DRF API under /api/, the OpenAPI schema."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from apps.accounts.language import language_set
from apps.approvals import views as approval_views
from apps.approvals.api import views as approval_api
from apps.devices.api import views as device_api
from apps.evidence import views as evidence_views
from apps.notifications import views as notification_views
from apps.outbox import api as reconciliation_api
from apps.outbox import views as reconciliation_views
from apps.tasks import views as task_views
from apps.tasks.api import views as task_api
from apps.tickets import webhooks as ticket_webhooks
from apps.traces import views as trace_views

urlpatterns = [
    path("", task_views.home, name="home"),
    path("healthz", trace_views.healthz, name="healthz"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("language/", language_set, name="language-set"),
    path("requests/", task_views.request_list, name="request-list"),
    path("requests/new/", task_views.request_new, name="request-new"),
    path("tasks/<uuid:task_id>/", task_views.task_detail, name="task-detail"),
    path("tasks/<uuid:task_id>/cancel/", task_views.task_cancel_view, name="task-cancel"),
    path("tasks/<uuid:task_id>/input/", task_views.task_input_view, name="task-input"),
    path("tasks/<uuid:task_id>/attachments/<str:sha256>/", task_views.task_attachment, name="task-attachment"),
    path("tasks/<uuid:task_id>/trace/", trace_views.task_trace, name="task-trace"),
    path("tasks/<uuid:task_id>/trace/budget/", trace_views.task_trace_budget, name="task-trace-budget"),
    path("tasks/<uuid:task_id>/trace.json", trace_views.task_trace_export, name="task-trace-export"),
    path("tasks/<uuid:task_id>/events/<int:seq>/", trace_views.task_event_payload, name="task-event"),
    path("admin-tasks/", trace_views.admin_tasks, name="admin-tasks"),
    path("ops/metrics/", trace_views.metrics_page, name="metrics-page"),
    path("metrics", trace_views.prometheus_metrics, name="metrics"),
    path("reconciliation/", reconciliation_views.reconciliation_page, name="reconciliation"),
    path("reconciliation/<uuid:action_id>/resolve/", reconciliation_views.reconciliation_resolve_view,
         name="reconciliation-resolve"),
    path("reconciliation/compensations/<uuid:task_id>/", reconciliation_views.compensation_settle_view,
         name="compensation-settle"),
    path("evidence/<int:chunk_id>/", evidence_views.evidence_detail, name="evidence-detail"),
    path("approvals/", approval_views.approval_queue, name="approval-queue"),
    path("approvals/<uuid:approval_id>/decide/", approval_views.approval_decide_view, name="approval-decide"),
    path("notifications/", notification_views.notification_list, name="notification-list"),
    path("notifications/bell/", notification_views.notification_bell, name="notification-bell"),
    path("notifications/read/", notification_views.notification_read_all, name="notification-read-all"),
    path("webhooks/reference/", ticket_webhooks.reference_webhook, name="webhook-reference"),
    # API
    path("api/tasks/", task_api.TaskListCreateApi.as_view(), name="api-task-list"),
    path("api/tasks/<uuid:task_id>/", task_api.TaskDetailApi.as_view(), name="api-task-detail"),
    path("api/tasks/<uuid:task_id>/cancel/", task_api.TaskCancelApi.as_view(), name="api-task-cancel"),
    path("api/tasks/<uuid:task_id>/input/", task_api.TaskInputApi.as_view(), name="api-task-input"),
    path("api/tasks/<uuid:task_id>/events/", task_api.TaskEventsApi.as_view(), name="api-task-events"),
    path("api/tasks/<uuid:task_id>/actions/", task_api.TaskActionsApi.as_view(), name="api-task-actions"),
    path("api/tasks/<uuid:task_id>/attachments/<str:sha256>/", task_api.TaskAttachmentApi.as_view(),
         name="api-task-attachment"),
    path("api/approvals/", approval_api.ApprovalListApi.as_view(), name="api-approval-list"),
    path("api/approvals/<uuid:approval_id>/", approval_api.ApprovalDetailApi.as_view(), name="api-approval-detail"),
    path("api/approvals/<uuid:approval_id>/decision/", approval_api.ApprovalDecisionApi.as_view(),
         name="api-approval-decision"),
    path("api/devices/", device_api.DeviceListApi.as_view(), name="api-device-list"),
    path("api/reconciliation/", reconciliation_api.ReconciliationListApi.as_view(), name="api-reconciliation-list"),
    path("api/reconciliation/<uuid:action_id>/resolution/", reconciliation_api.ReconciliationResolveApi.as_view(),
         name="api-reconciliation-resolve"),
    path("api/compensations/", reconciliation_api.CompensationListApi.as_view(), name="api-compensation-list"),
    path("api/compensations/<uuid:task_id>/decision/", reconciliation_api.CompensationDecisionApi.as_view(),
         name="api-compensation-decision"),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("django-admin/", admin.site.urls),
]
