"""Base settings shared by every environment (local, test, production).

Values come from the environment through ``config.env.env``. With no ``DATABASE_URL`` the
embedded PostgreSQL is used and with no ``REDIS_URL`` the embedded Redis (DESIGN.md §2).
"""

from __future__ import annotations

from datetime import timedelta

from config import embedded
from config.cache import coordination_cache
from config.database import binding_options, timeout_options
from config.env import BASE_DIR, VAR_DIR, env
from config.gateway import gateway_settings
from config.logs import configure_structlog, logging_config
from config.storage import attachment_storage

#: The published development value of each secret (the defaults below, for the embedded stack):
#: the deploy checks (config/deploy_checks.py) refuse every one of them in production.
DEV_SECRETS = {
    "DJANGO_SECRET_KEY": "faultdesk-insecure-dev-key-change-me",
    "REFSERVICE_API_KEY": "faultdesk-refservice-dev-key",
    "REFSERVICE_WEBHOOK_SECRET": "faultdesk-webhook-dev-secret",
    "HELPDESK_API_TOKEN": "faultdeskhelpdeskdevtoken000000000000000",
    "FAULTDESK_MODEL_API_KEY": "faultdesk-model-dev-key",
}
SECRET_KEY = env("DJANGO_SECRET_KEY", default=DEV_SECRETS["DJANGO_SECRET_KEY"])
DEBUG = env.bool("DJANGO_DEBUG", default=False)
ALLOWED_HOSTS = env.list("DJANGO_ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "django_htmx",
    "csp",
    "axes",
    "apps.accounts",
    "apps.devices",
    "apps.evidence",
    "apps.events",
    "apps.tasks",
    "apps.attachments",
    "apps.actions",
    "apps.approvals",
    "apps.outbox",
    "apps.tickets",
    "apps.llm",
    "apps.agent",
    "apps.traces",
    "apps.notifications",
    "apps.retention",
    "apps.gateway",
    "config.apps.FaultdeskConfig",
]

MIDDLEWARE = [
    "apps.accounts.middleware.RequestLogContextMiddleware",
    "apps.accounts.middleware.ApiJsonErrorsMiddleware",
    "apps.accounts.middleware.RejectMalformedRequestsMiddleware",
    # before anything reads a multipart form: attachment names as sent, and a size cap per file
    "apps.attachments.uploads.UploadLimitsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.locale.LocaleMiddleware",
    "django.middleware.common.CommonMiddleware",
    "apps.accounts.middleware.RejectNulBytesMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "apps.accounts.language.UserLanguageMiddleware",  # a signed-in user's saved language wins
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # a database refusal for now (lock or statement timeout, deadlock) is a 503 with Retry-After
    "apps.accounts.middleware.DatabaseBusyMiddleware",
    "axes.middleware.AxesMiddleware",  # last: it turns a locked-out sign-in into its 429 answer
]

# Content-Security-Policy on every page (django-csp): scripts only from this origin (htmx is served
# from static files; no page has an inline script or handler), no plugins, no framing, forms post
# only here. Inline styles stay allowed: htmx adds its indicator style, the Django admin uses style
# attributes; a style cannot run code.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "frame-ancestors": ["'none'"],
        "form-action": ["'self'"],
    },
}

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "apps.accounts.context_processors.principal",
            ],
        },
    },
]

DATABASES = {
    "default": env.db("DATABASE_URL", default=embedded.postgres_url()),
}
# Persistent connections: a Celery task or a request used to open its own connection — a
# new PostgreSQL backend each time, five or six per report. Kept for 60 s and checked before reuse,
# see docs/performance.md for what it changed.
PERSISTENT_CONNECTIONS = {"CONN_MAX_AGE": env.int("DATABASE_CONN_MAX_AGE", default=60), "CONN_HEALTH_CHECKS": True}
DATABASES["default"] = {**PERSISTENT_CONNECTIONS, **DATABASES["default"]}  # the URL's own options win
DATABASES["default"]["ATOMIC_REQUESTS"] = False
# Session timeouts on every connection (config/database.py), in milliseconds.
DATABASE_TIMEOUTS = {
    "statement_ms": env.int("DATABASE_STATEMENT_TIMEOUT_MS", default=30_000),
    "lock_ms": env.int("DATABASE_LOCK_TIMEOUT_MS", default=10_000),
    "idle_in_transaction_ms": env.int("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT_MS", default=60_000),
}
DATABASES["default"] = timeout_options(DATABASES["default"], **DATABASE_TIMEOUTS)
# Statements prepared once per connection (0 turns preparing off): config/database.py
DATABASE_PREPARE_THRESHOLD = env.int("DATABASE_PREPARE_THRESHOLD", default=5)
DATABASES["default"] = binding_options(DATABASES["default"], prepare_threshold=DATABASE_PREPARE_THRESHOLD)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Failed sign-ins (django-axes), on the login page, the Django admin and HTTP Basic on the API: after
# AXES_FAILURE_LIMIT failures for one username from one address, that pair is locked out for the
# cool-off, even with the right password; a success resets the count. Recorded in PostgreSQL, so
# every web process sees the same count.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.int("FAULTDESK_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("FAULTDESK_LOGIN_COOLOFF_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "apps.accounts.lockout.lockout_response"
AXES_USERNAME_CALLABLE = "apps.accounts.lockout.lockout_username"
AXES_CLIENT_IP_CALLABLE = "apps.accounts.lockout.client_ip"
AXES_VERBOSE = False

# Two languages, chosen per user (apps/accounts/language.py): the signed-in user's saved choice, else
# the language cookie, else Accept-Language, else English. The catalogue is config/locale, compiled
# by the install step (python -m tools.i18n compile).
LANGUAGE_CODE = "en"
LANGUAGES = [("en", "English"), ("zh-hans", "简体中文")]
LOCALE_PATHS = [BASE_DIR / "config" / "locale"]
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# where collectstatic puts them (an image collects them at build time, outside its data volume)
STATIC_ROOT = env("DJANGO_STATIC_ROOT", default=str(VAR_DIR / "staticfiles"))
STATICFILES_DIRS = [BASE_DIR / "static"]


STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    # attachments of fault reports (apps/attachments): read only through faultdesk's access checks
    "attachments": attachment_storage(env("FAULTDESK_ATTACHMENT_STORAGE", default="filesystem")),
}
# Files larger than this go to a temporary file while a request is read, not to memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
# Django's own refusal (400) of a form with far more files than any report could take; below it,
# the attachment checks refuse "too many files" with the form kept.
DATA_UPLOAD_MAX_NUMBER_FILES = 100

# Django's database sessions, the row read by a statement written once (apps/accounts/sessions.py)
SESSION_ENGINE = "apps.accounts.sessions"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "apps.accounts.lockout.LockoutAwareBasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "apps.accounts.api.exception_handler",
    # JSON bodies nested deeper than MAX_JSON_DEPTH are a 400, never a RecursionError (apps.accounts.parsers).
    "DEFAULT_PARSER_CLASSES": [
        "apps.accounts.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "apps.attachments.parsers.AttachmentMultiPartParser",  # file names as sent (attachment checks)
    ],
    # Per signed-in user and per anonymous address (cache-backed: per web process with the default
    # local-memory cache); over the rate, 429 with Retry-After.
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.AnonRateThrottle",
        "rest_framework.throttling.UserRateThrottle",
    ],
    # Proxies in front of the web process that append X-Forwarded-For (0: none — the address is the
    # peer's, and a client-sent X-Forwarded-For is ignored; set 1 behind one TLS proxy).
    "NUM_PROXIES": env.int("FAULTDESK_TRUSTED_PROXIES", default=0),
    "DEFAULT_THROTTLE_RATES": {
        "anon": env("FAULTDESK_API_RATE_ANON", default="60/minute"),
        "user": env("FAULTDESK_API_RATE_USER", default="600/minute"),
    },
}

SPECTACULAR_SETTINGS = {
    "TITLE": "faultdesk API",
    "DESCRIPTION": "File device fault requests, decide approvals, read task state and evidence.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Several models have a ``status`` with their own choices: name each enum after its model.
    "ENUM_NAME_OVERRIDES": {
        "TaskStatusEnum": "apps.tasks.models.Task.STATUS_CHOICES",
        "ActionStatusEnum": "apps.actions.models.ActionStatus",
        "ApprovalStatusEnum": "apps.approvals.models.ApprovalStatus",
    },
}

# --- Celery (DESIGN.md §2): the broker is a hint to run, PostgreSQL is the truth -------------------
# The broker: CELERY_BROKER_URL (redis://… or amqp://… for RabbitMQ), else REDIS_URL, else the embedded
# Redis. REDIS_URL stays the coordination cache's store whichever broker carries the messages.
REDIS_URL = env("REDIS_URL", default=embedded.redis_url())
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="") or REDIS_URL
CELERY_TASK_IGNORE_RESULT = True


CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "coordination": coordination_cache(REDIS_URL),
}
# Workers log through Django's LOGGING (structured JSON), not Celery's own plain-text root handler.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# On RabbitMQ a worker whose broker connection drops has its unacknowledged messages redelivered to
# another consumer at once; the tasks it was still running are cancelled rather than finished twice
# (a late finisher would be fenced out anyway). Celery 6's default; Celery 5 warns without it.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "agent"
# Celery tasks are addressed by name (apps/core/queue.py); each name is routed to its queue here.
CELERY_TASK_ROUTES = {
    "agent_step": {"queue": "agent"},
    "read_context": {"queue": "tools"},
    "read_step": {"queue": "tools"},
    "sweep_leases": {"queue": "agent"},
    "dispatch_pending": {"queue": "outbox"},
    "reconcile_unknown": {"queue": "outbox"},
    "settle_receipts": {"queue": "agent"},
    "expire_approvals": {"queue": "agent"},
    "mark_sla_breaches": {"queue": "agent"},
    "refresh_term_statistics": {"queue": "tools"},
    "deliver_attachments": {"queue": "outbox"},
    "send_notifications": {"queue": "outbox"},
    # the retention purge has a worker of its own: its batches never take a slot of the hot path
    "purge_expired": {"queue": "maintenance"},
}
CELERY_BEAT_SCHEDULE = {
    "outbox-tick": {"task": "dispatch_pending", "schedule": timedelta(seconds=2)},
    "lease-sweeper": {
        "task": "sweep_leases",
        "schedule": timedelta(seconds=env.float("FAULTDESK_SWEEP_EVERY_SECONDS", default=5.0)),
    },
    "reconciler": {"task": "reconcile_unknown", "schedule": timedelta(seconds=5)},
    "approval-expiry": {"task": "expire_approvals", "schedule": timedelta(seconds=30)},
    "sla-breaches": {"task": "mark_sla_breaches", "schedule": timedelta(seconds=60)},
    "term-statistics": {"task": "refresh_term_statistics", "schedule": timedelta(seconds=60)},
    "attachment-deliveries": {"task": "deliver_attachments", "schedule": timedelta(seconds=10)},
    # notifications: the approvers' due digests, and rows left PENDING or whose sender died
    "notify-tick": {
        "task": "send_notifications",
        "schedule": timedelta(seconds=env.float("FAULTDESK_NOTIFY_TICK_SECONDS", default=10.0)),
    },
}
CELERY_BEAT_SCHEDULE["retention-purge"] = {
    "task": "purge_expired",
    "schedule": timedelta(seconds=env.float("FAULTDESK_PURGE_EVERY_SECONDS", default=300.0)),
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "run" / "celerybeat-schedule")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes every database connection around every task, whatever CONN_MAX_AGE
# says (celery/celery#9824). With this it (almost) never does; config/celery.py applies Django's own
# rule instead around each task — close_old_connections(): past CONN_MAX_AGE, unusable, or failed
# health check — as Django does around each request.
CELERY_DB_REUSE_MAX = 2**31

# --- faultdesk ------------------------------------------------------------------------------
FAULTDESK = {
    # Attachments of a fault report (apps/attachments): how many, the largest file, all of them.
    "ATTACHMENTS_MAX_FILES": env.int("FAULTDESK_ATTACHMENTS_MAX_FILES", default=5),
    "ATTACHMENT_MAX_BYTES": env.int("FAULTDESK_ATTACHMENT_MAX_BYTES", default=10 * 2**20),
    "ATTACHMENTS_MAX_TOTAL_BYTES": env.int("FAULTDESK_ATTACHMENTS_MAX_TOTAL_BYTES", default=25 * 2**20),
    # Sending attachments to the ticket system: attempts before FAILED, the lease of one send.
    "ATTACHMENT_DELIVERY_MAX_ATTEMPTS": env.int("FAULTDESK_ATTACHMENT_DELIVERY_MAX_ATTEMPTS", default=8),
    "ATTACHMENT_DELIVERY_LEASE_SECONDS": env.float("FAULTDESK_ATTACHMENT_DELIVERY_LEASE_SECONDS", default=60.0),
    # Reference ticket service (DESIGN.md §11); the tool gateway (apps/gateway) injects this credential,
    # read from the value or from the file *_FILE names (a mounted secret; the file wins).
    "REFSERVICE_URL": env("REFSERVICE_URL", default="http://127.0.0.1:8765"),
    "REFSERVICE_API_KEY": env("REFSERVICE_API_KEY", default=DEV_SECRETS["REFSERVICE_API_KEY"]),
    "REFSERVICE_API_KEY_FILE": env("REFSERVICE_API_KEY_FILE", default=""),
    "REFSERVICE_TIMEOUT_SECONDS": env.float("REFSERVICE_TIMEOUT_SECONDS", default=5.0),
    # reuse connections to the reference service (it sets TCP_NODELAY; see tickets.connectors: a
    # connection the service closed is seen before reuse and dropped)
    "REFSERVICE_KEEPALIVE": env.bool("REFSERVICE_KEEPALIVE", default=True),
    # the most new tickets the outbox sends in one POST /ticket-batches (each item keeps its own
    # idempotency key and fencing token); 1 sends every create alone
    "REFSERVICE_BATCH_SIZE": env.int("REFSERVICE_BATCH_SIZE", default=50),
    # django-helpdesk, the second ticket system (tools/helpdesk_site): REST API token, the
    # queue tickets go to, and how long a request can still take effect after it was sent
    # (its gunicorn --timeout 30 s plus a margin).
    "HELPDESK_URL": env("HELPDESK_URL", default="http://127.0.0.1:8766"),
    "HELPDESK_API_TOKEN": env("HELPDESK_API_TOKEN", default=DEV_SECRETS["HELPDESK_API_TOKEN"]),
    "HELPDESK_API_TOKEN_FILE": env("HELPDESK_API_TOKEN_FILE", default=""),
    "HELPDESK_QUEUE_ID": env.int("HELPDESK_QUEUE_ID", default=1),
    "HELPDESK_TIMEOUT_SECONDS": env.float("HELPDESK_TIMEOUT_SECONDS", default=10.0),
    "HELPDESK_REQUEST_LIFETIME_SECONDS": env.float("HELPDESK_REQUEST_LIFETIME_SECONDS", default=45.0),
    # Inbound webhooks from the reference service: HMAC secret and the accepted clock skew.
    "REFSERVICE_WEBHOOK_SECRET": env("REFSERVICE_WEBHOOK_SECRET", default=DEV_SECRETS["REFSERVICE_WEBHOOK_SECRET"]),
    "WEBHOOK_TOLERANCE_SECONDS": env.int("FAULTDESK_WEBHOOK_TOLERANCE_SECONDS", default=300),
    # Leases (DESIGN.md §5)
    "LEASE_SECONDS": env.int("FAULTDESK_LEASE_SECONDS", default=60),
    "OUTBOX_LEASE_SECONDS": env.int("FAULTDESK_OUTBOX_LEASE_SECONDS", default=30),
    # rows claimed per batch, sent OUTBOX_SEND_CONCURRENCY requests at a time: 192 / 64 is at most
    # three rounds of requests per batch (when every row goes alone), as 20 / 8 was, so a slow ticket
    # system holds a batch no longer than before against the lease; new tickets for the reference
    # service go REFSERVICE_BATCH_SIZE to a request, one round; per-batch work (claim, reads, three
    # transactions, one settle message) is shared by ten times the rows (docs/performance.md)
    "OUTBOX_BATCH": env.int("FAULTDESK_OUTBOX_BATCH", default=192),
    # one dispatcher kick claims batch after batch while they come back full, for at most this
    # long (shorter than the lease, so a failed batch's rows are not claimed again by the same loop)
    "OUTBOX_DRAIN_SECONDS": env.float("FAULTDESK_OUTBOX_DRAIN_SECONDS", default=10.0),
    # a dispatcher kick sent while another still waits is dropped (apps/core/queue.py); the flag
    # saying one waits expires after this long, so a lost kick delays nothing past beat's tick
    "KICK_COALESCE_SECONDS": env.float("FAULTDESK_KICK_COALESCE_SECONDS", default=5.0),
    # A run that commits the intent of an action whose ordering key is its own (a new ticket) claims
    # the outbox row in that commit and delivers it itself right after (one Celery hop instead of
    # three: no dispatcher kick, no settle message); a row whose run dies is claimed by a dispatcher
    # once its lease expires. Off: every row waits for a dispatcher (docs/architecture.md §6).
    "OUTBOX_DIRECT_DELIVERY": env.bool("FAULTDESK_OUTBOX_DIRECT_DELIVERY", default=True),
    # requests of one batch in flight at once (threads of the dispatcher process)
    "OUTBOX_SEND_CONCURRENCY": env.int("FAULTDESK_OUTBOX_SEND_CONCURRENCY", default=64),
    # Retrieval's full-text leg on a second connection, at the same time as the vector leg
    # (apps/evidence/parallel.py): one more database connection per process.
    "RETRIEVAL_PARALLEL_LEGS": env.bool("FAULTDESK_RETRIEVAL_PARALLEL_LEGS", default=True),
    # Task defaults (DESIGN.md §1 step 1, §8)
    "TASK_DEADLINE_SECONDS": env.int("FAULTDESK_TASK_DEADLINE_SECONDS", default=3600),
    "TASK_BUDGET_UNITS": env.int("FAULTDESK_TASK_BUDGET_UNITS", default=100),
    # The ledger's other limits per task (reducer/3): model tokens, tool calls, retries + re-asks.
    "TASK_TOKEN_LIMIT": env.int("FAULTDESK_TASK_TOKEN_LIMIT", default=60000),
    "TASK_TOOL_CALL_LIMIT": env.int("FAULTDESK_TASK_TOOL_CALL_LIMIT", default=40),
    "TASK_RETRY_LIMIT": env.int("FAULTDESK_TASK_RETRY_LIMIT", default=8),
    # Per-tenant quotas on top (a tenant may override each on its admin page): cost units and model
    # tokens per UTC day (charged to the day a task was accepted), and open tasks at a time.
    "TENANT_DAILY_BUDGET_UNITS": env.int("FAULTDESK_TENANT_DAILY_BUDGET_UNITS", default=200000),
    "TENANT_DAILY_TOKEN_LIMIT": env.int("FAULTDESK_TENANT_DAILY_TOKEN_LIMIT", default=50000000),
    "TENANT_MAX_ACTIVE_TASKS": env.int("FAULTDESK_TENANT_MAX_ACTIVE_TASKS", default=2000),
    # Deadline propagation: an activity gets at most (deadline - now - this), and none below the
    # minimum — the time to persist its result and clean up.
    "ACTIVITY_CLEANUP_SECONDS": env.float("FAULTDESK_ACTIVITY_CLEANUP_SECONDS", default=5.0),
    "ACTIVITY_MIN_SECONDS": env.float("FAULTDESK_ACTIVITY_MIN_SECONDS", default=1.0),
    "RETRIEVAL_TOP_K": env.int("FAULTDESK_RETRIEVAL_TOP_K", default=5),
    # reducer/6: the context reads sent to the tools queue as activities of their own — those that call
    # out of the process (the ticket system). The others (the device, retrieval: a row, in-process
    # embedding and SQL) the dispatching run does itself, after the remote ones' messages left.
    "READS_AS_ACTIVITIES": tuple(env.list("FAULTDESK_READS_AS_ACTIVITIES", default=["ticket"])),
    "SNAPSHOT_EVERY": env.int("FAULTDESK_SNAPSHOT_EVERY", default=20),
    # Bounds against runaway work: each ends in an explicit decision with a reason.
    "MAX_EVENTS_PER_TASK": env.int("FAULTDESK_MAX_EVENTS_PER_TASK", default=200),
    "MAX_REDRAFTS": env.int("FAULTDESK_MAX_REDRAFTS", default=2),
    "MAX_REPLANS": env.int("FAULTDESK_MAX_REPLANS", default=5),
    # 412s on conditional writes a task may meet (comments of reports joining one ticket at once)
    "MAX_CONFLICTS": env.int("FAULTDESK_MAX_CONFLICTS", default=25),
    # A compensation gives up (and waits for a person) after this many conflicts + re-plans.
    "MAX_COMPENSATION_REPLANS": env.int("FAULTDESK_MAX_COMPENSATION_REPLANS", default=3),
    # The lease sweeper re-queues runnable tasks idle (no lease, no progress) for this long.
    "SWEEPER_IDLE_SECONDS": env.int("FAULTDESK_SWEEPER_IDLE_SECONDS", default=10),
    # the sweeper re-queues one idle task at most once in this long (a task that waits behind a
    # backlog looks idle; re-queueing it every tick only lengthens the backlog); capped at half
    # the lease, so a worker that died on a re-queued task is replaced soon after its lease expires
    "SWEEPER_REQUEUE_SECONDS": env.float("FAULTDESK_SWEEPER_REQUEUE_SECONDS", default=30.0),
    # Model layer (DESIGN.md §10): the local deterministic drafter needs no network.
    "MODEL_PROVIDER": env("FAULTDESK_MODEL_PROVIDER", default="local"),
    # openai_compatible: any chat-completions endpoint with JSON-schema structured output. The key
    # is injected by the tool gateway and never recorded; base URL and model are pinned on each task.
    "MODEL_BASE_URL": env("FAULTDESK_MODEL_BASE_URL", default="http://127.0.0.1:8767/v1"),
    "MODEL_API_KEY": env("FAULTDESK_MODEL_API_KEY", default=DEV_SECRETS["FAULTDESK_MODEL_API_KEY"]),
    "MODEL_API_KEY_FILE": env("FAULTDESK_MODEL_API_KEY_FILE", default=""),
    "MODEL_NAME": env("FAULTDESK_MODEL_NAME", default="scripted-model"),
    "MODEL_TIMEOUT_SECONDS": env.float("FAULTDESK_MODEL_TIMEOUT_SECONDS", default=30.0),
    "MODEL_MAX_OUTPUT_TOKENS": env.int("FAULTDESK_MODEL_MAX_OUTPUT_TOKENS", default=1200),
    # cost units per 1,000 tokens (prompt and completion alike; the reservation prices its cap)
    "MODEL_UNITS_PER_1K_TOKENS": env.float("FAULTDESK_MODEL_UNITS_PER_1K_TOKENS", default=1.0),
    # The most of a model reply that is read (bytes): a draft is a few KB; more is refused unread.
    "MODEL_MAX_REPLY_BYTES": env.int("FAULTDESK_MODEL_MAX_REPLY_BYTES", default=1024 * 1024),
    # malformed output: re-asks of one draft before the task fails with a clear reason
    "MODEL_MAX_REASKS": env.int("FAULTDESK_MODEL_MAX_REASKS", default=2),
    # how the reply's JSON schema is asked for: "json_schema" (OpenAI, vLLM, Ollama) or "json_object"
    # (llama-cpp-python's server, which applies the schema as a grammar only in that form)
    "MODEL_RESPONSE_FORMAT": env.str("FAULTDESK_MODEL_RESPONSE_FORMAT", default="json_schema"),
    # how often a worker waiting on a model call checks whether its task was cancelled
    "CANCEL_POLL_SECONDS": env.float("FAULTDESK_CANCEL_POLL_SECONDS", default=0.25),
    # use-multilingual-v3 (default; English and Chinese), all-MiniLM-L6-v2 (English only) or
    # openai:<base URL>#<model> (an OpenAI-compatible /v1/embeddings); `manage.py reembed` after a change.
    "EMBEDDING_MODEL": env.str("FAULTDESK_EMBEDDING_MODEL", default="use-multilingual-v3"),
    # the remote embedding model's bearer key (openai:…; injected by the tool gateway) and its call's deadline
    "EMBEDDING_API_KEY": env("FAULTDESK_EMBEDDING_API_KEY", default=""),
    "EMBEDDING_API_KEY_FILE": env("FAULTDESK_EMBEDDING_API_KEY_FILE", default=""),
    "EMBEDDING_TIMEOUT_SECONDS": env.float("FAULTDESK_EMBEDDING_TIMEOUT_SECONDS", default=30.0),
    # torch intra-op threads for embedding one query with all-MiniLM-L6-v2 (0 = torch's default, one per core).
    # One sentence is too small to split: on this 2-core machine, next to the web, PostgreSQL and
    # the other workers, two threads spin-wait on each other and a query took ~175 ms instead of
    # ~18 ms (docs/performance.md). Batches (document ingest) keep torch's default.
    "EMBEDDING_QUERY_THREADS": env.int("FAULTDESK_EMBEDDING_QUERY_THREADS", default=1),
    # Exponential backoff with full jitter for retries and re-sends: base · 2^attempt, capped at 60 s.
    "RETRY_BACKOFF_BASE_SECONDS": env.float("FAULTDESK_RETRY_BACKOFF_BASE_SECONDS", default=1.0),
    # Failed lookups by key before an unknown action is shown as needing a person (DESIGN.md §6).
    "RECONCILE_ESCALATE_AFTER": env.int("FAULTDESK_RECONCILE_ESCALATE_AFTER", default=5),
    # Key retention covers retries + reconciliation + a database-restore window (DESIGN.md §6);
    # `manage.py check` fails (faultdesk.E001) when it is shorter than deadline + both windows.
    "IDEMPOTENCY_KEY_RETENTION_DAYS": env.int("FAULTDESK_IDEMPOTENCY_KEY_RETENTION_DAYS", default=35),
    "RECONCILE_WINDOW_DAYS": env.int("FAULTDESK_RECONCILE_WINDOW_DAYS", default=3),
    "RESTORE_WINDOW_DAYS": env.int("FAULTDESK_RESTORE_WINDOW_DAYS", default=30),
    # Retention (apps.retention): each tenant's policy falls back to these days; the purge runs in
    # batches of PURGE_BATCH rows, gives up a lock after PURGE_LOCK_TIMEOUT_MS and a run after
    # PURGE_TIME_BUDGET_SECONDS (the next run goes on). docs/operations.md "Retention".
    "RETENTION": {
        "excerpts_days": env.int("FAULTDESK_RETENTION_EXCERPTS_DAYS", default=30),
        "payloads_days": env.int("FAULTDESK_RETENTION_PAYLOADS_DAYS", default=180),
        "webhooks_days": env.int("FAULTDESK_RETENTION_WEBHOOKS_DAYS", default=30),
        "attempts_days": env.int("FAULTDESK_RETENTION_ATTEMPTS_DAYS", default=90),
        "outbox_days": env.int("FAULTDESK_RETENTION_OUTBOX_DAYS", default=7),
        "notifications_days": env.int("FAULTDESK_RETENTION_NOTIFICATIONS_DAYS", default=90),
        "gateway_calls_days": env.int("FAULTDESK_RETENTION_GATEWAY_CALLS_DAYS", default=30),
    },
    "PURGE_BATCH": env.int("FAULTDESK_PURGE_BATCH", default=200),
    "PURGE_LOCK_TIMEOUT_MS": env.int("FAULTDESK_PURGE_LOCK_TIMEOUT_MS", default=500),
    "PURGE_TIME_BUDGET_SECONDS": env.float("FAULTDESK_PURGE_TIME_BUDGET_SECONDS", default=60.0),
    "PUBLIC_BASE_URL": env("FAULTDESK_PUBLIC_BASE_URL", default="http://127.0.0.1:8000"),
    # /metrics (Prometheus): when set, scrapers must send "Authorization: Bearer <token>".
    "METRICS_TOKEN": env("FAULTDESK_METRICS_TOKEN", default=""),
    "METRICS_CACHE_SECONDS": env.int("FAULTDESK_METRICS_CACHE_SECONDS", default=10),
    # /healthz answers 503 past these (apps/traces/health.py)
    "HEALTH_MAX_TRANSACTION_SECONDS": env.float("FAULTDESK_HEALTH_MAX_TRANSACTION_SECONDS", default=120.0),
    "HEALTH_MAX_OUTBOX_LAG_SECONDS": env.float("FAULTDESK_HEALTH_MAX_OUTBOX_LAG_SECONDS", default=300.0),
    # Notifications (apps/notifications): an approver's items go out as one digest e-mail at most
    # every NOTIFY_DIGEST_SECONDS (the first of a quiet period at once); a send is leased for
    # NOTIFY_LEASE_SECONDS (a sender that dies is replaced after it), retried with backoff from
    # NOTIFY_RETRY_BASE_SECONDS up to NOTIFY_RETRY_CAP_SECONDS, and FAILED after NOTIFY_MAX_ATTEMPTS.
    "NOTIFY_DIGEST_SECONDS": env.int("FAULTDESK_NOTIFY_DIGEST_SECONDS", default=300),
    "NOTIFY_LEASE_SECONDS": env.int("FAULTDESK_NOTIFY_LEASE_SECONDS", default=60),
    "NOTIFY_MAX_ATTEMPTS": env.int("FAULTDESK_NOTIFY_MAX_ATTEMPTS", default=6),
    "NOTIFY_RETRY_BASE_SECONDS": env.float("FAULTDESK_NOTIFY_RETRY_BASE_SECONDS", default=30.0),
    "NOTIFY_RETRY_CAP_SECONDS": env.float("FAULTDESK_NOTIFY_RETRY_CAP_SECONDS", default=1800.0),
    "NOTIFY_BATCH": env.int("FAULTDESK_NOTIFY_BATCH", default=50),
    "NOTIFY_DRAIN_SECONDS": env.float("FAULTDESK_NOTIFY_DRAIN_SECONDS", default=20.0),
    # the domain of the notification e-mails' Message-IDs (<notification.<id>@domain>)
    "NOTIFY_MESSAGE_ID_DOMAIN": env("FAULTDESK_NOTIFY_MESSAGE_ID_DOMAIN", default="faultdesk.localhost"),
    # the tool gateway's destinations, answer caps and SMTP deadline (config/gateway.py)
    **gateway_settings(env),
}

# E-mail (notifications): config/settings/mail.py
from config.settings.mail import *  # noqa: E402, F403

# Structured logs (config/logs.py): JSON lines by default, LOG_FORMAT=console for a terminal.
LOGGING = logging_config(fmt=env("LOG_FORMAT", default="json"), level=env("LOG_LEVEL", default="INFO"))
configure_structlog()
