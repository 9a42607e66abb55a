"""Template context: the current principal (or None) as ``principal``."""

from apps.accounts.principal import NoMembership, principal_for_user


def principal(request):
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"principal": None}
    try:
        return {"principal": principal_for_user(user)}
    except NoMembership:
        return {"principal": None}
