"""Tenant admins are staff in the "Tenant admins" group, never superusers (apps.accounts.roles).
Earlier, a tenant admin was made a Django superuser; every superuser who holds a membership is
turned into such a staff member here. The group's permissions are granted after migrate (the
permission rows of later apps do not exist yet at this point)."""

from django.db import migrations


def demote_member_superusers(apps, schema_editor):
    User = apps.get_model("auth", "User")
    Group = apps.get_model("auth", "Group")
    Membership = apps.get_model("accounts", "Membership")
    group, _ = Group.objects.get_or_create(name="Tenant admins")
    member_ids = Membership.objects.values_list("user_id", flat=True)
    for user in User.objects.filter(is_superuser=True, pk__in=member_ids):
        admin = Membership.objects.filter(user_id=user.pk, role="admin", is_active=True).exists()
        User.objects.filter(pk=user.pk).update(is_superuser=False, is_staff=admin)
        if admin:
            user.groups.add(group)


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0003_tenant_quota"),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [migrations.RunPython(demote_member_superusers, migrations.RunPython.noop)]
