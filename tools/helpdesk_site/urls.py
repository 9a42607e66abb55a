from django.contrib import admin
from django.urls import include, path

from tools.helpdesk_site.bridge.views import TicketAttachmentsView, TicketByCustomFieldView, TicketDetailView

urlpatterns = [
    path("admin/", admin.site.urls),
    # ours: must come before helpdesk's include so nothing shadows it
    path(
        "helpdesk/api/faultdesk/tickets/by-custom-field/",
        TicketByCustomFieldView.as_view(),
        name="faultdesk-ticket-by-custom-field",
    ),
    path(
        "helpdesk/api/faultdesk/tickets/<int:pk>/",
        TicketDetailView.as_view(),
        name="faultdesk-ticket-detail",
    ),
    path(
        "helpdesk/api/faultdesk/tickets/<int:pk>/attachments/",
        TicketAttachmentsView.as_view(),
        name="faultdesk-ticket-attachments",
    ),
    path("helpdesk/", include("helpdesk.urls", namespace="helpdesk")),
]
