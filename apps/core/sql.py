"""Model rows read by SQL written once (docs/performance.md, "Hot reads in SQL").

On the 2-core machines faultdesk is measured on, building a query through the ORM — a queryset
cloned per filter, the ``WHERE`` tree resolved, joins set up for ``select_related``, the SQL
compiled — costs 0.5–1 ms of CPU per statement, about ten times what the statement itself costs
the process. A report runs about forty statements; the hottest few are written here once per
shape and only their parameters change per call. What comes back is the same model instances the
ORM would build (``Model.from_db``, with the fields' database converters applied, so a JSON
column is a ``dict`` and a timestamp an aware ``datetime``), with the related rows of
``related`` cached on them exactly as ``select_related`` caches them.

Only for reads of fixed shape on hot paths; everything else stays the ORM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import Model


@dataclass(eq=False)
class _Part:
    """One model of a statement: its alias, the fields read, where its columns start in a row, and
    what turns them into an instance (worked out once per statement shape)."""

    model: type[Model]
    alias: str
    fields: tuple
    start: int
    path: tuple[str, ...]  # the relation path from the base model (() for the base)
    nullable: bool
    pk_index: int  # where the primary key is among ``fields`` (None there: no related row)
    attnames: list[str]
    converters: tuple  # ((index, column, converters), …) for the columns that have any
    relation: object  # the field of the parent that caches this part's instance (None for the base)


@cache
def _shape(model: type[Model], related: tuple[str, ...], defer: frozenset[str]) -> tuple[str, str, tuple]:
    """``(select list, FROM … JOIN …, parts)`` for ``model`` with the relation paths ``related``
    (``"device"``, ``"document_version__document"``); ``defer`` names fields not read
    (``"embedding"`` on the base model, ``"document_version__content"`` on a related one)."""
    qn = connection.ops.quote_name
    parts: list[_Part] = []
    joins: list[str] = [f"{qn(model._meta.db_table)} t0"]
    columns: list[str] = []
    aliases = {(): ("t0", model, False)}

    def add(m, alias, path, nullable):
        prefix = "__".join(path)
        fields = tuple(f for f in m._meta.concrete_fields
                       if (f"{prefix}__{f.name}" if prefix else f.name) not in defer)
        pk_index = next(i for i, f in enumerate(fields) if f.primary_key)
        converters = []
        for i, f in enumerate(fields):
            col = f.get_col(alias)
            convs = tuple(connection.ops.get_db_converters(col) + col.get_db_converters(connection))
            if convs:
                converters.append((i, col, convs))
        relation = aliases[path[:-1]][1]._meta.get_field(path[-1]) if path else None
        parts.append(_Part(m, alias, fields, len(columns), path, nullable, pk_index, [f.attname for f in fields],
                           tuple(converters), relation))
        columns.extend(f"{alias}.{qn(f.column)}" for f in fields)

    add(model, "t0", (), False)
    for dotted in related:
        path = tuple(dotted.split("__"))
        for depth in range(1, len(path) + 1):
            sub = path[:depth]
            if sub in aliases:
                continue
            parent_alias, parent_model, parent_nullable = aliases[sub[:-1]]
            field = parent_model._meta.get_field(sub[-1])
            target = field.related_model
            alias = f"t{len(aliases)}"
            nullable = parent_nullable or field.null
            kind = "LEFT JOIN" if nullable else "JOIN"
            joins.append(f"{kind} {qn(target._meta.db_table)} {alias} ON {alias}.{qn(target._meta.pk.column)} = "
                         f"{parent_alias}.{qn(field.column)}")
            aliases[sub] = (alias, target, nullable)
            add(target, alias, sub, nullable)
    return ", ".join(columns), " ".join(joins), tuple(parts)


def _instance(part: _Part, row, conn) -> Model | None:
    values = list(row[part.start:part.start + len(part.fields)])
    if part.nullable and values[part.pk_index] is None:
        return None
    for i, col, convs in part.converters:
        for convert in convs:
            values[i] = convert(values[i], col, conn)
    return part.model.from_db(conn.alias, part.attnames, values)


#: ``rows``'s default ``tenant_id``: no tenant scope (a trusted re-read, e.g. by a worker holding a task)
UNSCOPED = object()


def rows(model: type[Model], where: str, params, *, tenant_id=UNSCOPED, related: tuple[str, ...] = (),
         defer: frozenset[str] = frozenset(), tail: str = "") -> list[Model]:
    """Instances of ``model`` from ``SELECT … FROM model t0 [JOIN related t1 …] WHERE {where}
    {tail}``, ``params`` bound to the ``%s`` of ``where``. The base table's alias is ``t0``; refer
    to its columns as ``t0.column``.

    * ``tail``: ``ORDER BY``, ``LIMIT 1``, ``FOR UPDATE OF t0`` — literal, no parameters
      (``ValueError`` otherwise).
    * ``tenant_id`` adds ``AND t0.tenant_id = tenant_id`` — what ``for_tenant(tenant_id)`` adds, and
      like it raises ``ValueError`` for a tenant id of None (a forgotten scope fails loudly instead
      of reading every tenant's rows). Required in the modules that serve people
      (``tests/test_tenant_isolation.py``); left out, the read is unscoped on purpose.
    * ``related``: ``select_related`` paths (foreign keys, ``__`` for deeper ones; a nullable one is
      a ``LEFT JOIN`` and caches None).
    * ``defer``: fields left unread (deferred on the instances, loaded on first access as the ORM's
      ``defer`` does).

    Raises what the database raises."""
    if "%" in tail:
        raise ValueError("sql.rows: tail takes no parameters (bind values in where)")
    select, source, parts = _shape(model, tuple(related), frozenset(defer))
    if tenant_id is None:
        raise ValueError(f"{model.__name__}: a tenant id is required to scope the query")
    if tenant_id is not UNSCOPED:
        where, params = f"({where}) AND t0.tenant_id = %s", [*params, tenant_id]
    conn = connections[DEFAULT_DB_ALIAS]
    with conn.cursor() as cursor:
        # The select list and the joins come from the models; ``where`` and ``tail`` are the
        # caller's literals, with every value bound as a parameter.
        cursor.execute(f"SELECT {select} FROM {source} WHERE {where} {tail}", params)  # noqa: S608
        fetched = cursor.fetchall()
    return [_assemble(parts, values, conn) for values in fetched]


def row(model: type[Model], where: str, params, **kwargs) -> Model | None:
    """The first of :func:`rows` (add ``LIMIT 1`` in ``tail`` where many could match), or None."""
    found = rows(model, where, params, **kwargs)
    return found[0] if found else None


def written_rows(model: type[Model], write: str, params, *, related: tuple[str, ...] = ()) -> list[Model]:
    """Instances of ``model`` from the rows a write statement leaves — ``write`` is an ``UPDATE``
    or ``INSERT`` of ``model``'s table ending in ``RETURNING *`` — with the related rows of
    ``related`` joined and cached as :func:`rows` caches them, in one statement
    (``WITH t0 AS (write) SELECT … FROM t0 JOIN …``). What comes back is the rows as the write left
    them (the latest version it locked, not the statement's snapshot); the related rows are read
    as of the statement's start. ``params`` bind the ``%s`` or ``%(name)s`` of ``write``. Raises
    what the database raises."""
    select, source, parts = _shape(model, tuple(related), frozenset())
    qn = connection.ops.quote_name
    source = source.replace(f"{qn(model._meta.db_table)} t0", "t0", 1)
    conn = connections[DEFAULT_DB_ALIAS]
    with conn.cursor() as cursor:
        cursor.execute(f"WITH t0 AS ({write}) SELECT {select} FROM {source}", params)  # noqa: S608
        fetched = cursor.fetchall()
    return [_assemble(parts, values, conn) for values in fetched]


def _assemble(parts: tuple, values, conn) -> Model:
    """The base instance of one fetched row, with its related instances cached on it."""
    base, joined = parts[0], parts[1:]
    obj = _instance(base, values, conn)
    made = {(): obj}
    for part in joined:
        parent = made.get(part.path[:-1])
        related_obj = _instance(part, values, conn) if parent is not None else None
        made[part.path] = related_obj
        if parent is not None:
            part.relation.set_cached_value(parent, related_obj)
    return obj


@cache
def _insert_shape(model: type[Model]) -> tuple[str, tuple, object]:
    """``(INSERT statement, fields written, auto primary key field or None)`` for ``model``."""
    qn = connection.ops.quote_name
    pk = model._meta.pk
    auto = pk if getattr(pk, "db_returning", False) else None
    fields = tuple(f for f in model._meta.concrete_fields if f is not auto)
    statement = (f"INSERT INTO {qn(model._meta.db_table)} ({', '.join(qn(f.column) for f in fields)}) "  # noqa: S608
                 f"VALUES ({', '.join(['%s'] * len(fields))})")  # names from the model, values bound
    if auto is not None:
        statement += f" RETURNING {qn(auto.column)}"
    return statement, fields, auto


def insert_statement(obj: Model) -> tuple[str, list]:
    """``(INSERT statement, parameters)`` that :func:`insert` runs for the new row ``obj`` (each
    field's ``pre_save`` applied, so ``auto_now_add`` is set on ``obj``): for a caller that writes
    it inside a larger statement (``WITH t AS (INSERT … RETURNING id) …``). Only for a model
    whose primary key is set before the write (no auto key); ``ValueError`` otherwise."""
    statement, fields, auto = _insert_shape(type(obj))
    if auto is not None:
        raise ValueError(f"{type(obj).__name__}: an auto primary key is read back by insert(), not here")
    return statement, [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]


def insert(obj: Model) -> Model:
    """Write the new row ``obj`` (built with ``Model(...)``, not saved) with one ``INSERT`` whose
    text is made once per model — what ``Model.objects.create`` writes (each field's ``pre_save``,
    so ``auto_now``/``auto_now_add`` are set, and its value prepared for the database), without
    building the query each time. An auto primary key is read back onto ``obj``. Sends no
    signals. Returns ``obj``; raises what the database raises (``IntegrityError``)."""
    statement, fields, auto = _insert_shape(type(obj))
    params = [f.get_db_prep_save(f.pre_save(obj, add=True), connection) for f in fields]
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        if auto is not None:
            setattr(obj, auto.attname, cursor.fetchone()[0])
    obj._state.adding, obj._state.db = False, connection.alias
    return obj


def execute_unprepared(cursor, statement: str, params) -> None:
    """Run ``statement`` on ``cursor`` (a Django cursor of the default connection) planned for these
    parameters every time, never prepared: for a statement whose best plan depends on its
    parameters' values — a full-text leg whose reader may see every chunk or one in a hundred — where
    the one generic plan PostgreSQL settles on for a prepared statement after a few runs on a
    connection would serve the next reader with the last ones' plan (three times slower for a
    selective reader behind readers of everything). Read the rows from ``cursor`` as usual. Runs
    outside Django's execute wrappers (not for the task and event tables, whose writes a run's
    transaction orders through them) and raises what the database raises, wrapped as Django's
    database errors."""
    with cursor.db.wrap_database_errors:
        cursor.cursor.execute(statement, params, prepare=False)
    if cursor.db.queries_logged:
        cursor.db.queries_log.append({"sql": statement, "time": "0.000"})


def execute_bound(statement: str, params) -> int:
    """Run one write ``statement`` (``%s`` or ``%(name)s`` placeholders) on the default connection,
    in its current transaction, with its parameters bound by the server instead of quoted into the
    text: for statements that carry tens of kilobytes of JSON (a task's state, a commit's events),
    where the client-side quoting Django's connections use costs more CPU than the statement — every
    byte escaped in the process, then scanned again by the server's parser. A parameter must have a
    type the server can take from it or from a cast in the text (``%s::jsonb``). Recorded in
    ``connection.queries`` when queries are being logged (tests' ``CaptureQueriesContext``); runs
    outside Django's execute wrappers. Returns the row count; raises what psycopg raises, wrapped
    as Django's database errors."""
    import psycopg

    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(statement, params)
        count = cursor.rowcount
    if connection.queries_logged:
        connection.queries_log.append({"sql": statement, "time": "0.000"})
    return count
