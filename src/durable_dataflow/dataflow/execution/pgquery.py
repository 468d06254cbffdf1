"""The one-statement gate of a PostgreSQL source's query, on sqlglot's PostgreSQL dialect.

``rule_broken(query)`` names the rule a query breaks, or None for exactly one read statement:
SELECT, WITH … SELECT, VALUES or TABLE, with no data-modifying CTE, no SELECT INTO and no FOR
UPDATE/SHARE. sqlglot's tokenizer reads quotes, dollar quotes and (nested) comments as the server
does with ``standard_conforming_strings`` on, which the source's session enforces; whatever it cannot
read is refused. Imported only when a definition has a postgres source (sqlglot is slow to import).
"""

from __future__ import annotations

from typing import Any

import sqlglot
from sqlglot import TokenType, exp
from sqlglot.errors import SqlglotError

# The query's first token: anything else is not a read query (and sqlglot would log it as a Command).
_READ_QUERY_STARTS = frozenset({TokenType.SELECT, TokenType.WITH, TokenType.VALUES, TokenType.TABLE, TokenType.L_PAREN})
_READ_QUERY_KINDS = (exp.Select, exp.SetOperation, exp.Values, exp.Subquery)
# Nodes that write, lock rows, create a table or are not a query, anywhere in the tree.
_WRITING_NODES = (exp.DML, exp.DDL, exp.Command, exp.Into, exp.Lock, exp.Transaction, exp.Commit, exp.Rollback,
                  exp.Set)


def rule_broken(query: str) -> str | None:
    """Which rule the query breaks, or None for exactly one read statement."""
    unreadable = "cannot be read as one PostgreSQL statement (an unterminated quote or comment, or unknown syntax)"
    try:
        tokens = sqlglot.Dialect.get_or_raise("postgres").tokenize(query)
    except SqlglotError:
        return unreadable
    statements = _statement_count(tokens)
    if statements != 1:
        return f"must be exactly one statement (found {statements}, separated by ';')"
    first = next(t for t in tokens if t.token_type != TokenType.SEMICOLON)
    if first.token_type not in _READ_QUERY_STARTS:
        return "must be a read query: SELECT, WITH … SELECT, VALUES or TABLE"
    try:
        # A comment after the last ';' comes back as a Semicolon node, an empty statement as None.
        expressions = [e for e in sqlglot.parse(query, read="postgres") if e is not None]
    except (SqlglotError, RecursionError):
        return unreadable
    statements_parsed = [e for e in expressions if not isinstance(e, exp.Semicolon)]
    if len(statements_parsed) != 1:
        return f"must be exactly one statement (found {len(statements_parsed)}, separated by ';')"
    [parsed] = statements_parsed
    if not isinstance(parsed, _READ_QUERY_KINDS):
        return "must be a read query: SELECT, WITH … SELECT, VALUES or TABLE"
    if any(isinstance(node, _WRITING_NODES) for node in parsed.walk()):
        return ("must not write or lock: no INSERT, UPDATE, DELETE or MERGE (also inside WITH), no SELECT INTO, "
                "no FOR UPDATE/SHARE")
    return None


def _statement_count(tokens: list[Any]) -> int:
    """Non-empty runs of tokens between semicolons (comments are not tokens)."""
    count, pending = 0, False
    for token in tokens:
        if token.token_type == TokenType.SEMICOLON:
            count, pending = count + pending, False
        else:
            pending = True
    return count + pending
