"""The e-mail part of the settings (notifications, apps/notifications; sent through the tool gateway's
SMTP backend, apps/gateway/smtp.py). Imported by :mod:`config.settings.base`."""

from config.env import VAR_DIR, env

# E-mail (notifications): SMTP when EMAIL_HOST is set; otherwise each message is written as a file
# under var/mail/ (development). EMAIL_BACKEND names another backend outright (e.g. the console's).
EMAIL_HOST = env("EMAIL_HOST", default="")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env("EMAIL_HOST_PASSWORD", default="")
EMAIL_HOST_PASSWORD_FILE = env("EMAIL_HOST_PASSWORD_FILE", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", default=False)
EMAIL_TIMEOUT = env.float("EMAIL_TIMEOUT", default=10.0)
# SMTP goes through the tool gateway (apps/gateway/smtp.py), which injects the login.
EMAIL_BACKEND = env("EMAIL_BACKEND", default="apps.gateway.smtp.GatewayEmailBackend" if EMAIL_HOST
                    else "django.core.mail.backends.filebased.EmailBackend")
EMAIL_FILE_PATH = env("EMAIL_FILE_PATH", default=str(VAR_DIR / "mail"))
DEFAULT_FROM_EMAIL = env("DEFAULT_FROM_EMAIL", default="faultdesk <faultdesk@localhost>")
