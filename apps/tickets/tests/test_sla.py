"""Due dates in business hours (apps/tickets/sla.py): working days and hours in the tenant's time
zone, holidays, around-the-clock priorities, daylight-saving changes, and the policy's checks."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.tickets.selectors import sla_policy_for
from apps.tickets.sla import (
    Calendar,
    Policy,
    SlaConfigError,
    check_targets,
    due_at,
    request_priority,
    working_time_between,
)

SHANGHAI = ZoneInfo("Asia/Shanghai")
WEEKDAYS = Calendar(timezone="Asia/Shanghai")  # Monday–Friday 09:00–18:00 Beijing time


def at(y, m, d, hh, mm=0, zone=SHANGHAI):
    return datetime(y, m, d, hh, mm, tzinfo=zone)


def test_friday_afternoon_plus_four_business_hours_is_monday_morning():
    # Friday 2026-12-04 16:00 Beijing: two hours left on Friday, two more on Monday 09:00–11:00
    due = due_at(at(2026, 12, 4, 16), 4 * 60, WEEKDAYS)
    assert due == at(2026, 12, 7, 11).astimezone(UTC)
    assert due.tzinfo == UTC


def test_a_report_filed_on_saturday_starts_its_clock_on_monday_at_nine():
    assert due_at(at(2026, 12, 5, 22), 60, WEEKDAYS) == at(2026, 12, 7, 10).astimezone(UTC)
    assert due_at(at(2026, 12, 5, 22), 0, WEEKDAYS) == at(2026, 12, 7, 9).astimezone(UTC)


def test_before_opening_and_after_closing_count_from_the_next_opening():
    assert due_at(at(2026, 12, 8, 7), 30, WEEKDAYS) == at(2026, 12, 8, 9, 30).astimezone(UTC)
    assert due_at(at(2026, 12, 8, 19), 30, WEEKDAYS) == at(2026, 12, 9, 9, 30).astimezone(UTC)


def test_holidays_are_skipped_like_weekends():
    new_year = Calendar(timezone="Asia/Shanghai", holidays=frozenset({date(2027, 1, 1)}))
    # Thursday 2026-12-31 17:00: one hour that day; Friday 1 January is a holiday; then Monday
    assert due_at(at(2026, 12, 31, 17), 3 * 60, new_year) == at(2027, 1, 4, 11).astimezone(UTC)


def test_around_the_clock_ignores_the_calendar():
    start = at(2026, 12, 5, 23)  # Saturday night
    assert due_at(start, 240, WEEKDAYS, around_the_clock=True) == (start + timedelta(hours=4)).astimezone(UTC)


def test_daylight_saving_changes_count_real_working_time():
    berlin = Calendar(timezone="Europe/Berlin", day_start=time(0, 0), day_end=time(23, 59), workdays=tuple(range(7)))
    # the night of 2027-03-28 has 23 hours in Berlin: 02:00 jumps to 03:00
    start = datetime(2027, 3, 28, 1, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    due = due_at(start, 120, berlin)
    assert due - start.astimezone(UTC) == timedelta(hours=2)
    assert due.astimezone(ZoneInfo("Europe/Berlin")).hour == 4


@pytest.mark.parametrize("calendar, message", [
    (Calendar(workdays=()), "workdays"),
    (Calendar(workdays=(7,)), "workdays"),
    (Calendar(day_start=time(18), day_end=time(9)), "end after"),
    (Calendar(timezone="Mars/Olympus"), "time zone"),
])
def test_a_calendar_without_working_time_is_refused(calendar, message):
    with pytest.raises(SlaConfigError, match=message):
        due_at(datetime(2026, 12, 4, tzinfo=UTC), 10, calendar)


def test_a_calendar_whose_every_day_is_a_holiday_gives_up_with_a_clear_error():
    start = date(2026, 12, 4)
    every_day = Calendar(holidays=frozenset(start + timedelta(days=i) for i in range(3 * 366 + 2)))
    with pytest.raises(SlaConfigError, match="no working time"):
        due_at(datetime(2026, 12, 4, tzinfo=UTC), 10, every_day)


def test_naive_or_negative_inputs_are_refused():
    with pytest.raises(ValueError):
        due_at(datetime(2026, 12, 4), 10, WEEKDAYS)
    with pytest.raises(ValueError):
        due_at(datetime(2026, 12, 4, tzinfo=UTC), -1, WEEKDAYS)


@pytest.mark.parametrize("targets", [[], {"P5": {}}, {"P1": {"respond": -1}}, {"P1": {"respond": 1.5}},
                                     {"P1": {"respond": True}}, {"P2": {"respond": 90, "resolve": 60}},
                                     {"P3": {"around_the_clock": "yes"}}, {"P4": {"colour": "red"}}])
def test_targets_must_be_whole_minutes_by_known_priority(targets):
    with pytest.raises(SlaConfigError):
        check_targets(targets)


def test_missing_priorities_take_the_defaults():
    targets = check_targets({"P1": {"respond": 5, "resolve": 60}})
    assert targets["P1"] == {"respond": 5, "resolve": 60, "around_the_clock": True}
    assert set(targets) == {"P1", "P2", "P3", "P4"}


def test_a_requests_priority_is_its_proposals_else_its_urgencys():
    assert request_priority({"proposal": {"params": {"priority": "P2"}}}, "low") == "P2"
    assert request_priority({"proposal": None}, "critical") == "P1"
    assert request_priority({}, None) == "P3"
    assert request_priority({"proposal": {"params": {"priority": "P9"}}}, "low") == "P4"


def test_policy_deadlines_use_each_prioritys_clock():
    policy = Policy(calendar=WEEKDAYS)
    friday_evening = at(2026, 12, 4, 20)
    p1 = policy.deadlines(friday_evening, "P1")
    assert p1.respond_by == (friday_evening + timedelta(minutes=15)).astimezone(UTC)
    p2 = policy.deadlines(friday_evening, "P2")
    assert p2.respond_by == at(2026, 12, 7, 10).astimezone(UTC)
    assert p2.resolve_by == at(2026, 12, 7, 17).astimezone(UTC)


@pytest.mark.django_db
def test_a_tenant_without_a_policy_gets_the_defaults_and_one_with_a_policy_its_own(tenant):
    from apps.tickets.models import SlaPolicy

    assert sla_policy_for(tenant.pk) == Policy()
    SlaPolicy.objects.create(tenant=tenant, timezone="Asia/Shanghai", holidays=[date(2027, 1, 1)],
                             targets={"P2": {"respond": 30, "resolve": 120, "around_the_clock": False}})
    policy = sla_policy_for(tenant.pk)
    assert policy.calendar.timezone == "Asia/Shanghai" and date(2027, 1, 1) in policy.calendar.holidays
    assert policy.targets["P2"]["respond"] == 30


@given(start=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2030, 12, 31),
                          timezones=st.just(UTC)),
       minutes=st.integers(min_value=0, max_value=20 * 9 * 60))
def test_due_at_adds_exactly_the_working_time_asked_for(start, minutes):
    due = due_at(start, minutes, WEEKDAYS)
    assert due >= start
    assert working_time_between(start, due, WEEKDAYS) == timedelta(minutes=minutes)


def test_an_hour_that_repeats_when_the_clocks_go_back_is_counted_once():
    """New York, 2027-11-07: 01:00–02:00 happens twice. A working day ending at 01:30 has ended
    for a start at 01:15 on the second pass (already 06:15 UTC): the next opening is the due date."""
    new_york = Calendar(timezone="America/New_York", workdays=tuple(range(7)), day_start=time(0, 0),
                        day_end=time(1, 30))
    start = datetime(2027, 11, 7, 6, 15, tzinfo=UTC)
    assert due_at(start, 0, new_york) == datetime(2027, 11, 8, 5, 0, tzinfo=UTC)


@pytest.mark.django_db
def test_the_policy_form_refuses_targets_the_calendar_cannot_hold(tenant):
    from django.core.exceptions import ValidationError

    from apps.tickets.models import SlaPolicy

    one_minute_days = SlaPolicy(tenant=tenant, day_start=time(9, 0), day_end=time(9, 1))
    with pytest.raises(ValidationError, match="no working time"):
        one_minute_days.full_clean()
    a_year = SlaPolicy(tenant=tenant, targets={"P4": {"respond": 480, "resolve": 366 * 24 * 60,
                                                     "around_the_clock": False}})
    with pytest.raises(ValidationError):
        a_year.full_clean()
    SlaPolicy(tenant=tenant).full_clean()  # the defaults are fine


def test_a_comment_runs_by_its_drafts_priority_not_its_urgency():
    joining = {"proposal": {"tool": "ticket.comment", "params": {"ticket_id": "REF-1", "body": "..."}},
               "draft": {"ticket": {"priority": "P1"}}}
    assert request_priority(joining, "normal") == "P1"
    assert request_priority({"coalesce": {"priority": "P2"}}, "low") == "P2"
