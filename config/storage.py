"""Where faultdesk keeps files (the settings' ``STORAGES``): the attachments of fault reports on the
file system or on S3-compatible object storage, chosen by the environment."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from config.env import VAR_DIR, env


def attachment_storage(kind: str) -> dict:
    """The ``STORAGES`` entry attachments are kept in: ``filesystem`` (the default, under
    ``FAULTDESK_ATTACHMENT_DIR``) or ``s3`` (any S3-compatible store through django-storages:
    bucket, endpoint, keys and region from ``FAULTDESK_ATTACHMENT_S3_*``). Raises
    ``ImproperlyConfigured`` for another kind or an S3 store without a bucket."""
    if kind == "filesystem":
        return {"BACKEND": "django.core.files.storage.FileSystemStorage",
                "OPTIONS": {"location": env("FAULTDESK_ATTACHMENT_DIR", default=str(VAR_DIR / "attachments")),
                            "base_url": None}}
    if kind == "s3":
        bucket = env("FAULTDESK_ATTACHMENT_S3_BUCKET", default="")
        if not bucket:
            raise ImproperlyConfigured("FAULTDESK_ATTACHMENT_STORAGE=s3 needs FAULTDESK_ATTACHMENT_S3_BUCKET")
        return {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
            "bucket_name": bucket,
            "endpoint_url": env("FAULTDESK_ATTACHMENT_S3_ENDPOINT_URL", default=None),
            "access_key": env("FAULTDESK_ATTACHMENT_S3_ACCESS_KEY_ID", default=None),
            "secret_key": env("FAULTDESK_ATTACHMENT_S3_SECRET_ACCESS_KEY", default=None),
            "region_name": env("FAULTDESK_ATTACHMENT_S3_REGION", default=None),
            "location": env("FAULTDESK_ATTACHMENT_S3_PREFIX", default="attachments"),
            # private objects, never overwritten (a key is a tenant and a digest), no public URLs
            "default_acl": "private", "file_overwrite": False, "querystring_auth": True,
        }}
    raise ImproperlyConfigured(f"FAULTDESK_ATTACHMENT_STORAGE must be filesystem or s3, not {kind!r}")
