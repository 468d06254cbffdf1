"""The datasources part's platform tables, as SQLAlchemy Core metadata.

The integrator builds the Alembic migrations from this `metadata`; it is the one place the
`datasources` and `datasource_locations` tables are defined (`registry` owns both).

A row is either a datasource the platform declared (`register_datasource`, tenant
`PLATFORM_DECLARED`: every tenant may name it, and its options may declare `allow_overwrite`) or the
registration a tenant's first publication to a datasource recorded before its dispatch could be
authorized (`register_target`: the run's tenant, `created_by_run`, empty options). Names are per
tenant: two tenants' `analytics.totals` are two rows, and neither can see or block the other's.
"""

from __future__ import annotations

from sqlalchemy import Boolean, Column, DateTime, MetaData, PrimaryKeyConstraint, String, Table, Text, false

# Bounds for the registry's text columns; a named datasource is an identifier, not a document.
DATASOURCE_NAME_CHARS_MAX = 200
PROVIDER_NAME_CHARS_MAX = 100
LOCATION_CHARS_MAX = 2000
TENANT_CHARS_MAX = 128  # as dataflow_runs.tenant
RUN_ID_CHARS_MAX = 36  # as dataflow_runs.run_id
# The tenant of a datasource the platform declared for every tenant, and of every row recorded before
# registrations had a tenant (migration 0006). No real tenant can be named so (core.names.TENANT_PATTERN
# refuses it; it is the platform operator token's PLATFORM_TENANT).
PLATFORM_DECLARED = "*"

metadata = MetaData()

datasources = Table(
    "datasources",
    metadata,
    Column("tenant", String(TENANT_CHARS_MAX), nullable=False),
    Column("name", String(DATASOURCE_NAME_CHARS_MAX), nullable=False),
    Column("provider", String(PROVIDER_NAME_CHARS_MAX), nullable=False),
    Column("location", String(LOCATION_CHARS_MAX), nullable=False),
    # Canonical JSON of the options; secret values never appear here, only {"secret": NAME}.
    Column("options_json", Text, nullable=False),
    # When the row was recorded: the declaration, or the registration of the first publication.
    Column("registered_at", DateTime(timezone=True), nullable=False),
    # The run whose first publication registered the datasource; None for a declaration.
    Column("created_by_run", String(RUN_ID_CHARS_MAX), nullable=True),
    # True for a datasource registered by a publication before locations were recorded (migration
    # 0010 sets it): a place of it where nothing is found may be one the platform created and lost,
    # so it is not created there until a platform operator forgets its locations.
    Column("locations_unrecorded", Boolean, nullable=False, server_default=false()),
    PrimaryKeyConstraint("tenant", "name", name="pk_datasources"),
)

# A place a datasource was created at: the digest of the provider's resolved description of the
# location (a folder's absolute path, a database and table; never stored as such) and the provider's
# own identity for what it created there (a Parquet folder's marker id, a Delta table's id, the
# PostgreSQL record table's system identifier and oid). One datasource can have several places: runs
# from different base directories resolve one location to different folders.
PLACE_DIGEST_CHARS_MAX = 71  # "sha256:" + 64 hex digits
LOCATION_IDENTITY_CHARS_MAX = 200

datasource_locations = Table(
    "datasource_locations",
    metadata,
    Column("tenant", String(TENANT_CHARS_MAX), nullable=False),
    Column("name", String(DATASOURCE_NAME_CHARS_MAX), nullable=False),
    Column("place_digest", String(PLACE_DIGEST_CHARS_MAX), nullable=False),
    Column("identity", String(LOCATION_IDENTITY_CHARS_MAX), nullable=False),
    # The run whose prepare created (or first found) the location at this place.
    Column("created_by_run", String(RUN_ID_CHARS_MAX), nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False),
    PrimaryKeyConstraint("tenant", "name", "place_digest", name="pk_datasource_locations"),
)
