"""The record of every outbound call (ADR 0022): one row per call the tool gateway made or refused."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class Outcome(models.TextChoices):
    """How one outbound call ended, as the gateway saw it (never what the caller made of it)."""

    OK = "ok", _("ok (2xx, or accepted by the SMTP server)")
    REDIRECT = "redirect", _("redirect (3xx, not followed)")
    HTTP_4XX = "http_4xx", _("HTTP 4xx")
    HTTP_5XX = "http_5xx", _("HTTP 5xx")
    HTTP_OTHER = "http_other", _("another HTTP status")
    SMTP_4XX = "smtp_4xx", _("SMTP 4xx (temporary refusal)")
    SMTP_5XX = "smtp_5xx", _("SMTP 5xx (permanent refusal)")
    TIMEOUT = "timeout", _("timeout (the call's deadline passed)")
    CONNECT_ERROR = "connect_error", _("no connection (nothing was sent)")
    TRANSPORT_ERROR = "transport_error", _("sent, the answer was lost")
    TOO_LARGE = "too_large", _("answer over the size cap (cut, not read further)")
    REFUSED_DESTINATION = "refused_destination", _("destination not allowed (no connection opened)")
    BAD_CREDENTIAL = "bad_credential", _("credential unreadable or not sendable (nothing was sent)")


class GatewayCall(models.Model):
    """One outbound call: the tool, where it went (scheme, host, port; the path without its query
    string), the method, its outcome class, the HTTP status, the bytes of the answer read, how long
    it took, and the tenant and task when the caller had them bound (``config.logs.bind``).

    Written by :func:`apps.gateway.records.call_record` on a connection of its own, outside the
    caller's transaction, so a caller that rolls back still leaves its calls recorded. Never holds a
    header, a body or a credential. ``tenant`` has no database constraint (the row is written
    outside the transaction that may have created the tenant's rows); ``task_id`` is the task's id
    as a value, not a reference (the gateway sits below the task app)."""

    at = models.DateTimeField(_("at"), db_index=True, help_text=_("When the call started."))
    tool = models.CharField(_("tool"), max_length=40)
    scheme = models.CharField(_("scheme"), max_length=10)
    host = models.CharField(_("host"), max_length=255)
    port = models.PositiveIntegerField(_("port"))
    method = models.CharField(_("method"), max_length=10)
    path = models.CharField(_("path"), max_length=500, blank=True)
    outcome = models.CharField(_("outcome"), max_length=24, choices=Outcome.choices)
    http_status = models.PositiveSmallIntegerField(_("status"), null=True, blank=True)
    bytes_received = models.BigIntegerField(_("bytes received"), default=0)
    duration_ms = models.PositiveIntegerField(_("duration (ms)"), default=0)
    tenant = models.ForeignKey("accounts.Tenant", null=True, blank=True, on_delete=models.DO_NOTHING,
                               db_constraint=False, related_name="+", verbose_name=_("tenant"))
    task_id = models.UUIDField(_("task"), null=True, blank=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("outbound call")
        verbose_name_plural = _("outbound calls")
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["tenant", "at"], name="gateway_call_tenant_at")]

    def __str__(self) -> str:
        return f"{self.tool} {self.method} {self.scheme}://{self.host}:{self.port}{self.path} → {self.outcome}"
