"""``IN`` conditions for the hot statements, without SQLAlchemy's "expanding" parameters.

``column.in_([...])`` becomes an expanding parameter: SQLAlchemy re-renders the statement's SQL at every
execution to fit the list's length (``_process_parameters_for_postcompile``: ~16% of the server's CPU
under agent load, py-spy). A fixed set of values is written into the SQL instead (``state_in``; it also
lets SQLite match a partial index, which bound values do not); a list that varies per request is bound
as one parameter (``in_list``): a JSON array read by ``json_each`` on SQLite, an array compared with
``= ANY`` on PostgreSQL. Measured on one ``UPDATE ... WHERE state IN (2 states)``: 50 -> 27 us; a select by
16 chain hashes: ~150 -> 45 us.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import ARRAY, String, any_, bindparam, text
from sqlalchemy.sql.elements import ColumnElement, TextClause

from shared.api import MessageState


def state_in(*states: MessageState) -> TextClause:
    """``messages.state IN ('a', 'b')`` with the values written in (they are enum values, not input)."""
    return text("messages.state IN (" + ", ".join(f"'{s.value}'" for s in states) + ")")


def in_list(column: ColumnElement[Any], name: str, dialect: str) -> ColumnElement[bool] | TextClause:
    """``column IN <the list bound as parameter name>`` for ``dialect`` (bind the list with ``list_param``)."""
    if dialect == "postgresql":
        return column == any_(bindparam(name, type_=ARRAY(String)))
    table = column.table.name
    return text(f"{table}.{column.name} IN (SELECT value FROM json_each(:{name}))").bindparams(
        bindparam(name, type_=String)
    )


def list_param(values: list[str], dialect: str) -> Any:
    """The parameter value ``in_list`` expects on ``dialect``."""
    return values if dialect == "postgresql" else json.dumps(values)
