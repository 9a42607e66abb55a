"""Rows whose committed columns cannot change (DESIGN.md §6-7: what was approved is what is sent):
the ``CREATE TRIGGER`` statement the migrations of such tables run."""

from __future__ import annotations


def immutable_trigger_sql(name: str, table: str, columns: tuple[str, ...]) -> str:
    """``CREATE TRIGGER name`` on ``table`` refusing any UPDATE that changes one of ``columns``
    (the shared PL/pgSQL function ``faultdesk_refuse_immutable_update``, created by ``actions``
    0005, raises ``integrity_constraint_violation`` naming the column).

    The trigger is ``BEFORE UPDATE OF <columns>`` with ``WHEN (ROW(OLD.…) IS DISTINCT FROM
    ROW(NEW.…))``: an UPDATE that sets none of the columns runs no trigger at all, one that sets a
    column to its own value is let through by the ``WHEN`` clause, and the function runs only to
    refuse. (Run for every row, the function turns the old and new rows into JSON once per column:
    about 0.2 ms of PostgreSQL's CPU per row of ``actions_action``.) Returns the SQL text."""
    cols = ", ".join(f'"{c}"' for c in columns)
    old = ", ".join(f'OLD."{c}"' for c in columns)
    new = ", ".join(f'NEW."{c}"' for c in columns)
    args = ", ".join(f"'{c}'" for c in columns)
    return (f"CREATE TRIGGER {name} BEFORE UPDATE OF {cols} ON {table} FOR EACH ROW "
            f"WHEN (ROW({old}) IS DISTINCT FROM ROW({new})) "
            f"EXECUTE FUNCTION faultdesk_refuse_immutable_update({args});")
