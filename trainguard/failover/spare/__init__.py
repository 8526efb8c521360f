"""SPARe: stacked redundant shards over data-parallel groups with adaptive reordering.

* :mod:`.placement` -- cyclic Golomb-ruler placement (:func:`make_placement`, :class:`Placement`)
* :mod:`.controller` -- the reordering controller ReCtlr (:class:`ReCtlr`, :func:`reorder`,
  :class:`ControllerResult`)

Relies on numpy and scipy. The torchft runtime that calls the controller lives in ``runtime.py``.
"""

from trainguard.failover.spare.controller import ControllerResult, ReCtlr, reorder, validate_state
from trainguard.failover.spare.placement import (
    GOLOMB_RULERS,
    MAX_REDUNDANCY,
    Placement,
    check_supported,
    golomb_ruler,
    is_modular_golomb,
    make_placement,
    max_supported_redundancy,
    min_groups_sufficient,
)

__all__ = [
    "GOLOMB_RULERS",
    "MAX_REDUNDANCY",
    "ControllerResult",
    "Placement",
    "ReCtlr",
    "check_supported",
    "golomb_ruler",
    "is_modular_golomb",
    "make_placement",
    "max_supported_redundancy",
    "min_groups_sufficient",
    "reorder",
    "validate_state",
]
