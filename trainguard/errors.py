"""Errors that reach users. The CLI prints ``TrainguardError`` as one line and exits with code 2."""


class TrainguardError(Exception):
    """A problem with the user's input (config, CLI argument, checkpoint, corpus, shape)."""

    exit_code = 2


class ConfigError(TrainguardError):
    """Unknown key, wrong type or impossible value in a config or override."""


class CheckpointError(TrainguardError):
    """A checkpoint that is missing, incomplete or fails its content checksum."""


class DataError(TrainguardError):
    """A corpus that is missing, empty or too small for the requested sequence length."""


class ShapeError(TrainguardError):
    """A tensor shape that a protected kernel cannot handle (refused, never silently skipped)."""


class StepAborted(TrainguardError):
    """A step guard asked to abort the run (or retries of one step were exhausted)."""

    exit_code = 4


class SuspectedHardwareFault(TrainguardError):
    """The same guard site failed on consecutive re-executions of one step: likely a persistent fault of that
    device, which re-executing on it will not cure. The message names rank and site."""

    exit_code = 3


class Terminated(TrainguardError):
    """The command was sent SIGTERM while its worker processes ran; they were stopped (the shell's 128 + 15)."""

    exit_code = 143
