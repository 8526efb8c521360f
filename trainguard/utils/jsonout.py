"""JSON output: every benchmark or campaign command prints one JSON object as the last line of stdout.

JSON has no NaN or infinity, so non-finite floats become strings; tuples become lists; numpy and torch
scalars become Python numbers. Relies on the standard library only.
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with NaN/inf as strings, tuples as lists, numpy/torch scalars as Python numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return json_safe(value.item())
    return value


def emit_json(result: dict) -> None:
    """Print ``result`` as one JSON object on one line of stdout."""
    print(json.dumps(json_safe(result), sort_keys=False), flush=True)
