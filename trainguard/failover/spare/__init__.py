"""SPARe: stacked redundant shards over data-parallel groups with adaptive reordering.

* :mod:`.placement` -- cyclic Golomb-ruler placement (:func:`make_placement`, :class:`Placement`, rulers up to
  28 marks, :func:`supported_redundancies`) and failure-domain layouts (:func:`domain_layout`)
* :mod:`.controller` -- the reordering controller ReCtlr (:class:`ReCtlr`, :func:`reorder`,
  :class:`ControllerResult`)

Relies on numpy and scipy. The torchft runtime that calls the controller lives in ``runtime.py``.
"""

from trainguard.failover.spare.controller import ControllerResult, ReCtlr, reorder, validate_state
from trainguard.failover.spare.placement import (
    GOLOMB_RULERS,
    MAX_REDUNDANCY,
    OPTIMAL_LENGTHS,
    DomainLayout,
    Placement,
    check_supported,
    contiguous_layout,
    domain_layout,
    golomb_ruler,
    hosts_in_distinct_domains,
    is_modular_golomb,
    make_placement,
    max_supported_redundancy,
    min_groups_sufficient,
    replication_layout,
    supported_redundancies,
)

__all__ = [
    "GOLOMB_RULERS",
    "MAX_REDUNDANCY",
    "OPTIMAL_LENGTHS",
    "ControllerResult",
    "DomainLayout",
    "Placement",
    "ReCtlr",
    "check_supported",
    "contiguous_layout",
    "domain_layout",
    "golomb_ruler",
    "hosts_in_distinct_domains",
    "is_modular_golomb",
    "make_placement",
    "max_supported_redundancy",
    "min_groups_sufficient",
    "reorder",
    "replication_layout",
    "supported_redundancies",
    "validate_state",
]
