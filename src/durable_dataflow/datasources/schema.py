"""The datasources part's platform tables, as SQLAlchemy Core metadata.

The integrator builds the Alembic migrations from this `metadata`; it is the one place the
`datasources` table is defined.
"""

from __future__ import annotations

from sqlalchemy import Column, DateTime, MetaData, String, Table, Text

# Bounds for the registry's text columns; a named datasource is an identifier, not a document.
DATASOURCE_NAME_CHARS_MAX = 200
PROVIDER_NAME_CHARS_MAX = 100
LOCATION_CHARS_MAX = 2000

metadata = MetaData()

datasources = Table(
    "datasources",
    metadata,
    Column("name", String(DATASOURCE_NAME_CHARS_MAX), primary_key=True),
    Column("provider", String(PROVIDER_NAME_CHARS_MAX), nullable=False),
    Column("location", String(LOCATION_CHARS_MAX), nullable=False),
    # Canonical JSON of the options; secret values never appear here, only {"secret": NAME}.
    Column("options_json", Text, nullable=False),
    Column("registered_at", DateTime(timezone=True), nullable=False),
)
