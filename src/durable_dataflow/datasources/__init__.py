"""Datasources: the datasource registry, the provider-adapter contract (DESIGN §9) and the providers.

Imports only `durable_dataflow.core`. Optional providers (Delta needs `deltalake`) are found
through the entry-point group `durable_dataflow.providers`; a missing one is a
`MissingCapability`, not an import crash.
"""

from durable_dataflow.datasources.contract import (
    Absent,
    AlreadyPublished,
    Capability,
    Fenced,
    Inconclusive,
    InspectOutcome,
    MissingCapability,
    Present,
    PublicationRefs,
    Published,
    PublishOutcome,
    PublishTarget,
    Rejected,
    Undecided,
)
from durable_dataflow.datasources.contract import Provider as Provider
from durable_dataflow.datasources.registry import (
    Datasource,
    Registration,
    explain_undecided,
    get_datasource,
    list_datasources,
    load_provider,
    register_datasource,
    register_provider,
    register_target,
    require_capabilities,
    unregister_provider,
)

__all__ = [
    "Absent",
    "AlreadyPublished",
    "Capability",
    "Datasource",
    "Fenced",
    "Inconclusive",
    "InspectOutcome",
    "MissingCapability",
    "Present",
    "Provider",
    "PublicationRefs",
    "PublishOutcome",
    "PublishTarget",
    "Published",
    "Registration",
    "Rejected",
    "Undecided",
    "explain_undecided",
    "get_datasource",
    "list_datasources",
    "load_provider",
    "register_datasource",
    "register_provider",
    "register_target",
    "require_capabilities",
    "unregister_provider",
]
