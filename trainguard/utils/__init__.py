"""Small helpers every layer may use (never ``trainguard.cli``): progress reporting on stderr, JSON
output with non-finite numbers made safe, CPU thread choice. Relies on the standard library, torch and
rich."""

from trainguard.utils.jsonout import emit_json, json_safe
from trainguard.utils.progress import TaskBar, pick_threads, progress

__all__ = ["TaskBar", "emit_json", "json_safe", "pick_threads", "progress"]
