"""factory_boy factories shared by the test suite."""

from __future__ import annotations

import factory
from django.contrib.auth import get_user_model

from apps.accounts.models import AccessScope, Membership, Role, Tenant
from apps.devices.models import Device


class TenantFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Tenant
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"tenant{n}")
    name = factory.LazyAttribute(lambda o: o.slug.title())


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("pw-for-tests")


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    tenant = factory.SubFactory(TenantFactory)
    role = Role.REQUESTER
    scopes = factory.LazyFunction(lambda: [AccessScope.PUBLIC, AccessScope.TIER2])


class DeviceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Device

    tenant = factory.SubFactory(TenantFactory)
    asset_tag = factory.Sequence(lambda n: f"PRN-{1000 + n}")
    name = "Test MFP"
    kind = "printer"
    site = "HQ-3E"
    state = "fault"
    alert_code = "PRN-FUSER-50.2"
    alert_message = "Fuser temperature low"
    version = 17
