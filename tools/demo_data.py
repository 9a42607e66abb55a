"""Demo data: the ``acme`` tenant with a requester, an approver and an admin, a fleet of devices
with states and object versions; a second tenant ``globex`` (to show isolation); and a third,
``initech``, whose tickets go to django-helpdesk (the demo's second ticket system, DESIGN.md §11).

:func:`seed` creates (or keeps) all of it and ingests the knowledge base; ``python -m tools.seed_demo``
runs it from the command line (``make demo`` does), the tests' demo stack calls it in-process."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction

from apps.accounts.models import AccessScope, Membership, Role, Tenant, TicketSystem
from apps.approvals.policy import policy_current
from apps.devices.models import Device
from apps.evidence.corpus import KB_DIR
from apps.evidence.services import document_ingest, path_ingest

DEMO_DEVICE = "PRN-0417"

USERS = [
    # username, role, scopes
    ("riley", Role.REQUESTER, [AccessScope.PUBLIC, AccessScope.TIER2]),
    ("avery", Role.APPROVER, [AccessScope.PUBLIC, AccessScope.TIER2, AccessScope.SECURITY]),
    ("adele", Role.ADMIN, [AccessScope.PUBLIC, AccessScope.TIER2, AccessScope.SECURITY]),
]

#: tenant ``initech`` (tickets in django-helpdesk): username, role, scopes
INITECH_USERS = [
    ("ines", Role.REQUESTER, [AccessScope.PUBLIC, AccessScope.TIER2]),
    ("ivan", Role.APPROVER, [AccessScope.PUBLIC, AccessScope.TIER2]),
    ("iris", Role.ADMIN, [AccessScope.PUBLIC, AccessScope.TIER2]),
]
INITECH_DEVICE = "PRN-0811"
#: initech's own copy of the printer procedures (tenants share nothing): (scope, file name)
INITECH_KB = [
    (AccessScope.TIER2, "laser-printer-fuser-error-replacement.md"),
    (AccessScope.PUBLIC, "laser-printer-paper-jam.md"),
    (AccessScope.PUBLIC, "mfp-toner-and-drum-replacement.md"),
    (AccessScope.PUBLIC, "mfp-scan-to-email-failure.md"),
]
#: globex's own small copy of the public printer procedures (file names under ``kb/public/``)
GLOBEX_KB = ("laser-printer-paper-jam.md", "mfp-toner-and-drum-replacement.md", "mfp-scan-to-email-failure.md")

# asset_tag, name, kind, model, site, criticality, state, alert_code, alert_message, version
FLEET = [
    ("PRN-0417", "3rd floor MFP east", "printer", "LaserMax 9050", "HQ-3E", "medium", "fault", "PRN-FUSER-50.2",
     "Fuser temperature low: 142 C after 90 s warm-up", 17),
    ("PRN-0102", "Reception printer", "printer", "LaserMax 4200", "HQ-1", "low", "degraded", "PRN-TONER-LOW-31",
     "Black toner at 8%", 5),
    ("PRN-0233", "Finance MFP", "printer", "LaserMax 9050", "HQ-2W", "medium", "degraded", "PRN-JAM-13.B",
     "Jam at fuser exit, tray 2", 9),
    ("LBL-0011", "Shipping label printer", "label_printer", "TagLine 410", "WH-1", "high", "fault",
     "LBL-RIBBON-OUT-03", "Ribbon out", 12),
    ("UPS-0007", "Server room UPS A", "ups", "PowerGuard 10kVA", "DC-1", "high", "degraded", "UPS-BATT-017",
     "Battery self-test failed: string B voltage 11.2 V", 23),
    ("UPS-0012", "Network closet UPS 2F", "ups", "PowerGuard 3kVA", "HQ-2", "medium", "ok", "", "", 4),
    ("PDU-0031", "Rack A4 PDU left", "pdu", "RackPower 32A", "DC-1", "high", "degraded", "PDU-OC-WARN-10",
     "Phase B at 27.8 A (warning 25.6 A)", 8),
    ("SW-0101", "Access switch 1F", "switch", "NetCore 2948", "HQ-1", "medium", "degraded", "SW-PORT-ERRDIS",
     "Gi1/0/14 err-disabled (bpduguard)", 31),
    ("SW-0202", "Access switch 2F PoE", "switch", "NetCore 2948P", "HQ-2", "medium", "degraded", "SW-POE-BUDGET",
     "PoE budget 370 W of 370 W allocated; port 22 denied", 14),
    ("SW-CORE-01", "Core switch", "switch", "NetCore 9500", "DC-1", "high", "ok", "", "", 52),
    ("WAP-0305", "AP conference wing", "wireless_ap", "AirWave 6", "HQ-3", "medium", "offline", "WAP-HB-LOST",
     "No heartbeat for 14 minutes", 6),
    ("FW-EDGE-01", "Edge firewall", "firewall", "Bastion 3100", "DC-1", "high", "degraded", "FW-VPN-IKE-P2",
     "Tunnel to plant-2 down: phase 2 proposal mismatch", 40),
    ("SAN-0001", "Primary SAN", "disk_array", "StorVault 8000", "DC-1", "high", "degraded", "RAID-DEG-02",
     "Disk group DG2 degraded: drive 0:14 failed", 27),
    ("NAS-0002", "Department NAS", "nas", "FileBox 12", "HQ-B1", "medium", "degraded", "NAS-VOL-FULL-90",
     "Volume vol_dept at 91%", 11),
    ("SRV-0420", "ERP app server", "server", "RackPro 2U", "DC-1", "high", "degraded", "BMC-PSU-REDUN-LOST",
     "PSU 2 input lost: redundancy degraded", 19),
    ("BDG-0044", "Badge reader lobby door", "badge_reader", "SecureTap R40", "HQ-1", "high", "fault",
     "BADGE-TAMPER-3", "Reader tamper switch open", 7),
    ("DOOR-0009", "Server room door controller", "door_controller", "AccessHub 2", "DC-1", "high", "degraded",
     "DOOR-HELD-02", "Door held open 95 s", 15),
    ("CAM-0120", "Loading dock camera", "ip_camera", "Vista 4K", "WH-1", "medium", "fault", "CAM-VLOSS",
     "Video loss on stream 1", 10),
    ("HVAC-0003", "AHU-3 controller", "hvac_controller", "ClimaLogic BC-200", "HQ-roof", "medium", "degraded",
     "HVAC-SUPPLY-HI", "Supply air 19.8 C, setpoint 13 C", 21),
    ("ENV-0017", "DC-1 row C temperature sensor", "env_sensor", "EnviroSense T2", "DC-1", "high", "degraded",
     "ENV-TEMP-HI-27", "Inlet temperature 28.4 C", 33),
    ("ENV-0021", "DC-1 underfloor leak cable", "env_sensor", "EnviroSense L1", "DC-1", "high", "ok", "", "", 3),
    ("AV-0301", "Boardroom display", "av", "ConfView 86", "HQ-3", "low", "degraded", "AV-HDMI-NOSIG",
     "No signal on HDMI 1", 4),
    ("TC-0150", "Call centre thin client 50", "thin_client", "SlimDesk 5", "HQ-2", "low", "fault",
     "TC-VDI-BROKER-503", "Broker returned 503", 2),
    ("BCS-0008", "Warehouse scanner 8", "barcode_scanner", "ScanPro 3", "WH-1", "low", "degraded",
     "BCS-PAIR-LOST", "Lost pairing with cradle", 6),
]


def _set_user(username: str, tenant: Tenant, role: str, scopes: list[str], password: str | None) -> str | None:
    User = get_user_model()
    user, created = User.objects.get_or_create(username=username, defaults={"email": f"{username}@example.test"})
    new_password = None
    if created or password is not None:
        new_password = password or secrets.token_urlsafe(9)
        user.set_password(new_password)
        user.save()
    # An admin membership makes the user staff in the tenant-admin group (apps.accounts.roles),
    # never a superuser.
    Membership.objects.update_or_create(user=user, tenant=tenant, defaults={"role": role, "scopes": scopes})
    return new_password


def demo_seed(*, credentials_path: Path) -> dict:
    """Create (or keep) the demo tenants, users and devices. Returns ``{username: password}``,
    read from and written to ``credentials_path`` so the passwords stay stable across runs (a
    user missing from the file, or from the database, gets a new one)."""
    creds: dict = json.loads(credentials_path.read_text()) if credentials_path.exists() else {}

    def member(username: str, tenant: Tenant, role: str, scopes: list[str]) -> None:
        pw = _set_user(username, tenant, role, scopes, None if username in creds else secrets.token_urlsafe(9))
        if pw:
            creds[username] = pw

    with transaction.atomic():
        acme, _ = Tenant.objects.get_or_create(slug="acme", defaults={"name": "ACME Manufacturing"})
        globex, _ = Tenant.objects.get_or_create(slug="globex", defaults={"name": "Globex Logistics"})
        initech, _ = Tenant.objects.get_or_create(
            slug="initech", defaults={"name": "Initech Facilities", "ticket_system": TicketSystem.HELPDESK})
        for username, role, scopes in USERS:
            member(username, acme, role, scopes)
        member("gus", globex, Role.REQUESTER, [AccessScope.PUBLIC])
        for username, role, scopes in INITECH_USERS:
            member(username, initech, role, scopes)
        for tag, name, kind, model, site, crit, state, code, msg, version in FLEET:
            Device.objects.get_or_create(
                tenant=acme, asset_tag=tag,
                defaults={"name": name, "kind": kind, "model": model, "site": site, "criticality": crit,
                          "state": state, "alert_code": code, "alert_message": msg, "version": version},
            )
        Device.objects.get_or_create(
            tenant=globex, asset_tag="PRN-0417",
            defaults={"name": "Globex depot printer", "kind": "printer", "site": "GX-1", "state": "fault",
                      "alert_code": "PRN-JAM-13.1", "alert_message": "Jam in tray 1", "version": 3},
        )
        Device.objects.get_or_create(
            tenant=initech, asset_tag=INITECH_DEVICE,
            defaults={"name": "Initech 2nd floor MFP", "kind": "printer", "model": "LaserMax 9050", "site": "IN-2",
                      "criticality": "medium", "state": "fault", "alert_code": "PRN-FUSER-50.2",
                      "alert_message": "Fuser temperature low: 139 C after 90 s warm-up", "version": 4},
        )
        for tenant in (acme, globex, initech):
            policy_current(tenant_id=tenant.pk)
    credentials_path.parent.mkdir(parents=True, exist_ok=True)
    credentials_path.write_text(json.dumps(creds, indent=2))
    credentials_path.chmod(0o600)
    return creds


def seed(*, credentials_path: Path, kb: bool = True, write=print) -> dict:
    """Seed the demo tenants, users, devices and (unless not ``kb``) the knowledge base: acme gets
    every scope folder of ``KB_DIR``, globex and initech their own copies of a few printer procedures
    (tenants share nothing). Passwords are kept in ``credentials_path`` (see :func:`demo_seed`);
    progress goes to ``write``, one line per call. Returns ``{username: password}``."""
    creds = demo_seed(credentials_path=credentials_path)
    write("Demo users (tenant acme; gus is in tenant globex; ines, ivan and iris in tenant "
          "initech, whose tickets go to django-helpdesk):")
    for username, password in creds.items():
        write(f"  {username:6s} password: {password}")
    if not kb:
        return creds
    acme = Tenant.objects.get(slug="acme")
    for scope in AccessScope.values:
        report = path_ingest(
            tenant=acme, path=KB_DIR / scope, scope=scope,
            progress=lambda i, n, src, outcome: write(f"  [{i}/{n}] {outcome:9s} {src}"),
        )
        write(f"knowledge base {scope}: {report.created} created, {report.updated} updated, "
              f"{report.unchanged} unchanged, {report.chunks_embedded} chunks embedded")
    globex = Tenant.objects.get(slug="globex")
    for name in GLOBEX_KB:
        document_ingest(tenant=globex, source=f"public/{name}", raw=(KB_DIR / "public" / name).read_text(),
                        scope=AccessScope.PUBLIC)
    write(f"knowledge base globex: {len(GLOBEX_KB)} public printer documents")
    initech = Tenant.objects.get(slug="initech")
    for scope, name in INITECH_KB:
        document_ingest(tenant=initech, source=f"{scope}/{name}", raw=(KB_DIR / scope / name).read_text(),
                        scope=scope)
    write(f"knowledge base initech: {len(INITECH_KB)} printer documents")
    return creds
