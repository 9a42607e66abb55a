"""Small server-rendered SVG charts for the admin pages (no JavaScript, no chart library: the
pages stay fragments htmx can swap, and a screenshot shows them)."""

from __future__ import annotations

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext


def bar_chart(rows: list[tuple[str, int, int]], *, title: str, width: int = 640, height: int = 160) -> SafeString:
    """A stacked bar chart: ``rows`` of ``(label, first, second)`` drawn left to right, the first
    value dark, the second light on top. Returns SVG markup (labels escaped)."""
    if not rows:
        empty = gettext("%(title)s: no data yet.") % {"title": title}
        return mark_safe(f'<p class="muted">{escape(empty)}</p>')  # noqa: S308 - escaped
    top = max(max(a + b for _label, a, b in rows), 1)
    plot_h, bar_w = height - 30, max(4, (width - 40) // len(rows) - 4)
    heading = gettext("%(title)s (max %(top)s)") % {"title": title, "top": top}
    parts = [f'<svg class="chart" role="img" aria-label="{escape(title)}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}"><title>{escape(title)}</title>',
             f'<text x="0" y="12" font-size="11">{escape(heading)}</text>']
    for i, (label, a, b) in enumerate(rows):
        x = 30 + i * (bar_w + 4)
        ha, hb = int(plot_h * a / top), int(plot_h * b / top)
        parts.append(f'<rect x="{x}" y="{height - 14 - ha}" width="{bar_w}" height="{ha}" fill="#2f5d8a">'
                     f'<title>{escape(label)}: {a}</title></rect>')
        if hb:
            parts.append(f'<rect x="{x}" y="{height - 14 - ha - hb}" width="{bar_w}" height="{hb}" fill="#c9a227">'
                         f'<title>{escape(label)}: {b}</title></rect>')
        parts.append(f'<text x="{x}" y="{height - 2}" font-size="9">{escape(label)}</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every text is escaped above


def line_chart(points: list[tuple[int, int, int]], *, total: int, title: str, width: int = 640,
               height: int = 140) -> SafeString:
    """The budget over a task's events: ``points`` of ``(seq, used, used + reserved)`` as two
    step lines under the total ``total``. Returns SVG markup."""
    if not points:
        empty = gettext("%(title)s: no data.") % {"title": title}
        return mark_safe(f'<p class="muted">{escape(empty)}</p>')  # noqa: S308 - escaped
    top = max(total, max(p[2] for p in points), 1)
    last = max(p[0] for p in points) or 1
    plot_h = height - 24

    def xy(seq: int, value: int) -> str:
        return f"{30 + (width - 40) * seq / last:.1f},{height - 12 - plot_h * value / top:.1f}"

    used = " ".join(xy(s, u) for s, u, _held in points)
    held = " ".join(xy(s, h) for s, _used, h in points)
    heading = gettext("%(title)s (B = %(total)s)") % {"title": title, "total": total}
    legend_held, legend_used = gettext("used + reserved"), gettext("used")
    return mark_safe(  # noqa: S308 - numbers and an escaped title only
        f'<svg class="chart" role="img" aria-label="{escape(title)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}"><title>{escape(title)}</title>'
        f'<text x="0" y="10" font-size="11">{escape(heading)}</text>'
        f'<line x1="30" x2="{width - 10}" y1="{height - 12 - plot_h * total / top:.1f}" '
        f'y2="{height - 12 - plot_h * total / top:.1f}" stroke="#999" stroke-dasharray="4 3"/>'
        f'<polyline fill="none" stroke="#c9a227" stroke-width="2" points="{held}">'
        f'<title>{escape(legend_held)}</title></polyline>'
        f'<polyline fill="none" stroke="#2f5d8a" stroke-width="2" points="{used}">'
        f'<title>{escape(legend_used)}</title></polyline></svg>')
