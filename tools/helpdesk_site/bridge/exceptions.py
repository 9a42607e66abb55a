"""DRF exception handler: a DB uniqueness violation becomes 409, not an HTML 500.

Hit when a create repeats a custom-field value that carries a unique index
(see hd_bootstrap --unique-field). set_rollback() makes ATOMIC_REQUESTS roll
the whole request back: without it SQLite would COMMIT the ticket row that
TicketForm.save() wrote before the custom-field insert failed.
"""
from django.db import IntegrityError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback


def exception_handler(exc, context):
    if isinstance(exc, IntegrityError):
        set_rollback()
        return Response(
            {"detail": "conflict: unique value already used", "error": str(exc)},
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)
