"""Service levels (due dates and SLA): when a request must be answered (``respond``) and its ticket
resolved (``resolve``), by priority, counted in the tenant's business hours — its working days,
hours and holidays, in its time zone — or around the clock for the priorities that say so.

The calendar arithmetic here is pure (no database): :func:`due_at` adds business minutes to a
moment. :func:`apps.tickets.selectors.sla_policy_for` reads a tenant's
:class:`~apps.tickets.models.SlaPolicy`, or these defaults when it has none. A priority is the
ticket's (``P1`` … ``P4``); before the agent has proposed one, a request's urgency stands for it
(:data:`URGENCY_PRIORITY`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

PRIORITIES = ("P1", "P2", "P3", "P4")
#: the priority a request's urgency stands for until a ticket's priority is proposed
URGENCY_PRIORITY = {"critical": "P1", "high": "P2", "normal": "P3", "low": "P4"}
#: minutes to respond and to resolve, and whether the clock runs around the clock (24×7)
DEFAULT_TARGETS = {
    "P1": {"respond": 15, "resolve": 4 * 60, "around_the_clock": True},
    "P2": {"respond": 60, "resolve": 8 * 60, "around_the_clock": False},
    "P3": {"respond": 4 * 60, "resolve": 3 * 9 * 60, "around_the_clock": False},
    "P4": {"respond": 8 * 60, "resolve": 5 * 9 * 60, "around_the_clock": False},
}
#: the longest stretch :func:`due_at` looks through for working time before it gives up
_HORIZON_DAYS = 3 * 366


class SlaConfigError(ValueError):
    """A calendar or targets that cannot produce a due date (no working day, an empty working
    day, an unknown time zone, a target that is not a non-negative whole number of minutes)."""


@dataclass(frozen=True)
class Calendar:
    """Business hours: ``workdays`` (Monday = 0 … Sunday = 6), each day from ``day_start`` to
    ``day_end`` (local time in ``timezone``, an IANA name), except ``holidays`` (local dates)."""

    timezone: str = "UTC"
    workdays: tuple[int, ...] = (0, 1, 2, 3, 4)
    day_start: time = time(9, 0)
    day_end: time = time(18, 0)
    holidays: frozenset[date] = field(default_factory=frozenset)

    def zone(self) -> ZoneInfo:
        """The time zone; :class:`SlaConfigError` when its name is unknown."""
        try:
            return ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise SlaConfigError(f"unknown time zone {self.timezone!r}") from exc

    def check(self) -> None:
        """:class:`SlaConfigError` unless the calendar has working time."""
        self.zone()
        if not self.workdays or any(d not in range(7) for d in self.workdays):
            raise SlaConfigError("workdays must name at least one day, Monday = 0 … Sunday = 6")
        if self.day_end <= self.day_start:
            raise SlaConfigError("the working day must end after it starts")

    def works_on(self, day: date) -> bool:
        return day.weekday() in self.workdays and day not in self.holidays


def check_targets(targets: object) -> dict:
    """``targets`` as ``{priority: {"respond": minutes, "resolve": minutes, "around_the_clock":
    bool}}`` for every priority (missing ones from :data:`DEFAULT_TARGETS`); :class:`SlaConfigError`
    on anything else."""
    if not isinstance(targets, dict) or set(targets) - set(PRIORITIES):
        raise SlaConfigError(f"targets must be an object with keys among {', '.join(PRIORITIES)}")
    out = {}
    for priority in PRIORITIES:
        given = targets.get(priority, DEFAULT_TARGETS[priority])
        if not isinstance(given, dict) or set(given) - {"respond", "resolve", "around_the_clock"}:
            raise SlaConfigError(f"{priority}: give respond, resolve (minutes) and around_the_clock")
        merged = {**DEFAULT_TARGETS[priority], **given}
        for kind in ("respond", "resolve"):
            value = merged[kind]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 366 * 24 * 60:
                raise SlaConfigError(f"{priority}.{kind} must be whole minutes between 0 and a year")
        if merged["respond"] > merged["resolve"]:
            raise SlaConfigError(f"{priority}: respond by must not be later than resolve by")
        if not isinstance(merged["around_the_clock"], bool):
            raise SlaConfigError(f"{priority}.around_the_clock must be true or false")
        out[priority] = merged
    return out


def due_at(start: datetime, minutes: int, calendar: Calendar, *, around_the_clock: bool = False) -> datetime:
    """The moment ``minutes`` of working time after ``start`` (an aware datetime): around the
    clock, simply ``start + minutes``; otherwise only the calendar's working hours count — time
    before a working day starts, after it ends, on a day off or a holiday is skipped, in the
    calendar's local time (daylight-saving changes included). Returns an aware datetime in UTC.
    Raises :class:`SlaConfigError` for a calendar without working time, ``ValueError`` for a
    naive ``start`` or negative ``minutes``."""
    if start.tzinfo is None:
        raise ValueError("start must be an aware datetime")
    if minutes < 0:
        raise ValueError("minutes must not be negative")
    utc = UTC
    if around_the_clock:
        return (start + timedelta(minutes=minutes)).astimezone(utc)
    calendar.check()
    zone = calendar.zone()
    start = start.astimezone(utc)
    left = timedelta(minutes=minutes)
    day = start.astimezone(zone).date()
    for _ in range(_HORIZON_DAYS):
        if calendar.works_on(day):
            # compared in UTC: in local time, an hour that repeats when the clocks go back
            # compares equal to its first pass
            opens, closes = _working_hours(day, calendar, zone)
            begin = max(opens, start)
            if begin < closes:
                available = closes - begin
                if left <= available:
                    return begin + left
                left -= available
        day += timedelta(days=1)
    raise SlaConfigError(f"no working time within {_HORIZON_DAYS} days of {start.isoformat()}")


def working_time_between(start: datetime, end: datetime, calendar: Calendar) -> timedelta:
    """The working time (in ``calendar``) from ``start`` to ``end`` (aware datetimes); zero when
    ``end`` is not after ``start``. The inverse of :func:`due_at`: ``working_time_between(s,
    due_at(s, m, c), c) == m minutes``. Raises :class:`SlaConfigError` as :func:`due_at` does."""
    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("start and end must be aware datetimes")
    if end <= start:
        return timedelta(0)
    calendar.check()
    zone = calendar.zone()
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    total = timedelta(0)
    day, last = start.astimezone(zone).date(), end.astimezone(zone).date()
    while day <= last:
        if calendar.works_on(day):
            opens, closes = _working_hours(day, calendar, zone)
            lo, hi = max(opens, start), min(closes, end)
            if lo < hi:
                total += hi - lo
        day += timedelta(days=1)
    return total


def _working_hours(day: date, calendar: Calendar, zone: ZoneInfo) -> tuple[datetime, datetime]:
    """``day``'s working hours as UTC instants (a local time that happens twice reads as its first
    pass, one that never happens as the instant after the jump)."""
    opens = datetime.combine(day, calendar.day_start, tzinfo=zone).astimezone(UTC)
    closes = datetime.combine(day, calendar.day_end, tzinfo=zone).astimezone(UTC)
    return opens, closes


@dataclass(frozen=True)
class Deadlines:
    """A request's due dates: ``respond_by`` and ``resolve_by`` (aware, UTC) for ``priority``."""

    priority: str
    respond_by: datetime
    resolve_by: datetime


@dataclass(frozen=True)
class Policy:
    """A tenant's service levels: its :class:`Calendar` and targets by priority."""

    calendar: Calendar = field(default_factory=Calendar)
    targets: dict = field(default_factory=lambda: check_targets({}))

    def deadlines(self, start: datetime, priority: str) -> Deadlines:
        """Due dates of a request filed at ``start`` with ``priority`` (an unknown priority counts
        as the lowest, ``P4``)."""
        priority = priority if priority in PRIORITIES else "P4"
        target = self.targets[priority]
        clock = target["around_the_clock"]
        return Deadlines(priority=priority,
                         respond_by=due_at(start, target["respond"], self.calendar, around_the_clock=clock),
                         resolve_by=due_at(start, target["resolve"], self.calendar, around_the_clock=clock))


def request_priority(state: dict | None, urgency: str | None) -> str:
    """The priority a request's clock runs by: its proposed ticket's, else its draft's (a report
    joining another report's ticket proposes a comment, which carries no priority of its own),
    else the one it proposed before it deferred to that ticket (``state["coalesce"]``), else its
    urgency's."""
    state = state or {}
    proposal = state.get("proposal") or {}
    draft = (state.get("draft") or {}).get("ticket") or {}
    for priority in ((proposal.get("params") or {}).get("priority"), draft.get("priority"),
                     (state.get("coalesce") or {}).get("priority")):
        if priority in PRIORITIES:
            return priority
    return URGENCY_PRIORITY.get(urgency or "", "P3")
