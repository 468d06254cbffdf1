"""Stored results are kept uncompressed out of line on PostgreSQL (issue 29, finding 3).

``run_results.bytes`` takes ``STORAGE EXTERNAL``: TOAST keeps each value out of line but does not
compress it, so a chunked read (``results.open_stored``: ``substring(bytes from :start for :n)``)
fetches only the TOAST chunks of its own slice. Under the default (``EXTENDED``) a compressible result
is compressed, and every slice decompresses the value from its start up to the slice's end: reading a
result in n chunks cost the server about n/2 decompressions of the whole value (a 100 MiB result in
4 MiB chunks, 25 reads: ≈ 1.25 GB decompressed per verification). The price is disk: results are
stored at their Arrow IPC size. Values stored before this revision keep their compression until they
are rewritten (results never are); SQLite has no such setting and is unchanged.

Revision ID: 0014_result_storage
Revises: 0013_workers
"""

from __future__ import annotations

from alembic import op

revision = "0014_result_storage"
down_revision = "0013_workers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE run_results ALTER COLUMN bytes SET STORAGE EXTERNAL")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE run_results ALTER COLUMN bytes SET STORAGE EXTENDED")
