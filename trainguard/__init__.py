"""trainguard: keep large-language-model training correct and moving when hardware fails.

Layers (dependencies point down only; see docs/architecture.md):

    cli -> report -> sdc.{dmr,abft} / failover / sim -> train -> faults -> models, data
"""

__version__ = "0.1.0"

from trainguard.errors import ConfigError, TrainguardError  # noqa: F401
