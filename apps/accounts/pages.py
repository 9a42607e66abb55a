"""Page rendering shared by the people's pages (issue 8 item 6; DESIGN.md §1): the full page for a
normal request and for an htmx history restore, only the page's content block for an htmx request,
and ``Vary: HX-Request`` on both so no cache hands one to the other."""

from __future__ import annotations

from django.shortcuts import render
from django.utils.cache import patch_vary_headers


def render_page(request, template: str, context: dict, *, status: int = 200):
    """Render ``template`` (which extends ``base_template``) as a full page or, for an htmx
    request that is not a history restore, as its content block only."""
    htmx = getattr(request, "htmx", None)
    fragment = bool(htmx) and not htmx.history_restore_request
    response = render(request, template, {**context, "base_template": "_fragment.html" if fragment else "base.html"},
                      status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response
