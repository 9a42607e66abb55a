"""Page rendering shared by the people's pages (DESIGN.md §1): the full page for a normal request
and for an htmx history restore, only the page's fragment for an htmx request, and
``Vary: HX-Request`` on every answer so no cache hands one to the other."""

from __future__ import annotations

from django.shortcuts import render
from django.utils.cache import patch_vary_headers


def is_fragment_request(request) -> bool:
    """Does this request want a fragment — an htmx request that is not a history restore (a
    restore needs the whole page, ``base.html`` included)?"""
    htmx = getattr(request, "htmx", None)
    return bool(htmx) and not htmx.history_restore_request


def render_fragment(request, template: str, context: dict, *, status: int = 200):
    """Render ``template`` as it is (a fragment an htmx request swaps in) with ``Vary: HX-Request``."""
    response = render(request, template, context, status=status)
    patch_vary_headers(response, ("HX-Request",))
    return response


def render_page(request, template: str, context: dict, *, status: int = 200, fragment: str | None = None):
    """Render the page ``template`` in full or, for a fragment request (:func:`is_fragment_request`),
    only part of it: the template ``fragment`` when given, else ``template``'s content block
    (``template`` extends ``base_template``, which is ``_fragment.html`` then)."""
    partial = is_fragment_request(request)
    if partial and fragment is not None:
        return render_fragment(request, fragment, context, status=status)
    base = "_fragment.html" if partial else "base.html"
    return render_fragment(request, template, {**context, "base_template": base}, status=status)
