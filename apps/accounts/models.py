"""Tenants, memberships and roles (DESIGN.md §3 ``accounts``; spec §16.1: identity and
permissions come from the authenticated principal, never from natural language)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import models
from django.utils.translation import gettext_lazy as _

from apps.accounts.scoping import TenantScopedManager


class AccessScope(models.TextChoices):
    """Knowledge access scopes (DESIGN.md §9)."""

    PUBLIC = "public", "Public"
    TIER2 = "tier2", "Tier 2"
    SECURITY = "security", "Security"


class Role(models.TextChoices):
    REQUESTER = "requester", _("Requester")
    APPROVER = "approver", _("Approver")
    ADMIN = "admin", _("Admin")


class TicketSystem(models.TextChoices):
    """The external ticket system a tenant's tickets go to (DESIGN.md §11)."""

    REFERENCE = "reference", "Reference ticket service"
    HELPDESK = "helpdesk", "django-helpdesk"


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    ticket_system = models.CharField(max_length=16, choices=TicketSystem.choices, default=TicketSystem.REFERENCE,
                                     help_text="where this tenant's tickets are created; an action keeps the "
                                               "system it was committed for")
    # Quotas on top of each task's own budget (runtime-invariants.md §1.2): empty means the
    # service default (settings.FAULTDESK TENANT_*).
    daily_budget_units = models.PositiveIntegerField(
        null=True, blank=True, help_text="cost units this tenant's tasks may use per UTC day (empty: default)")
    daily_token_limit = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="model tokens this tenant's tasks may use per UTC day (empty: default)")
    max_active_tasks = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests this tenant may have open at once (empty: default)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = _("tenant")
        verbose_name_plural = _("tenants")
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def quota(self) -> dict:
        """``{"money", "tokens", "active_tasks"}``: this tenant's limits, defaults filled in."""
        conf = settings.FAULTDESK
        return {
            "money": self.daily_budget_units if self.daily_budget_units is not None
            else conf["TENANT_DAILY_BUDGET_UNITS"],
            "tokens": self.daily_token_limit if self.daily_token_limit is not None
            else conf["TENANT_DAILY_TOKEN_LIMIT"],
            "active_tasks": self.max_active_tasks if self.max_active_tasks is not None
            else conf["TENANT_MAX_ACTIVE_TASKS"],
        }


def _default_scopes() -> list[str]:
    return [AccessScope.PUBLIC]


class Membership(models.Model):
    """A user's role in one tenant, and the knowledge scopes that role may read."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    scopes = ArrayField(models.CharField(max_length=32, choices=AccessScope.choices), default=_default_scopes)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = TenantScopedManager()

    class Meta:
        verbose_name = _("membership")
        verbose_name_plural = _("memberships")
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_uniq")]
        ordering = ["tenant", "user"]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"

    def save(self, *args, **kwargs) -> None:
        """Refuses a superuser's membership with :class:`ValidationError` (see :meth:`clean`)."""
        if self.user.is_superuser:
            raise ValidationError("a platform superuser cannot be a member of a tenant")
        super().save(*args, **kwargs)

    def clean(self) -> None:
        """A platform admin (a superuser) is never a member of a tenant (apps.accounts.roles)."""
        super().clean()
        if self.user_id is not None and self.user.is_superuser:
            raise ValidationError({"user": "a platform superuser cannot be a member of a tenant"})


class LanguagePreference(models.Model):
    """The language a user chose for pages, messages and answers (one of ``settings.LANGUAGES``).
    Read once at sign-in into the session (:mod:`apps.accounts.language`), never per request."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="language_preference")
    language = models.CharField(max_length=16, choices=settings.LANGUAGES)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = _("language preference")
        verbose_name_plural = _("language preferences")

    def __str__(self) -> str:
        return f"{self.user}: {self.language}"
