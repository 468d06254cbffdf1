"""The one rule for a tenant's name, shared by every part that takes one (runs, tokens, schedules,
datasource declarations): a token names it, and it is part of stored keys, so it is plain ASCII."""

from __future__ import annotations

import re

from durable_dataflow.core.errors import InputError

TENANT_CHARS_MAX = 128
TENANT_PATTERN = re.compile(rf"^[A-Za-z0-9_-]{{1,{TENANT_CHARS_MAX}}}$")


def check_tenant(tenant: str) -> str:
    """``tenant`` when it is 1 to 128 ASCII letters, digits, '-' or '_'; else an InputError (which
    never repeats the value)."""
    if not TENANT_PATTERN.fullmatch(tenant):
        raise InputError(f"the tenant must be 1 to {TENANT_CHARS_MAX} letters, digits, '-' or '_'")
    return tenant
