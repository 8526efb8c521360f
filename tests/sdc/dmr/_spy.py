"""Every mismatch a DMR engine reports, with the strategy that found it (the engine clears its own list each
attempt, and a test asks which comparison found a fault). Shared by the engine tests and the pipeline worker."""

from __future__ import annotations


def spy_mismatches(eng) -> list[tuple[str, str]]:
    """From here on, each mismatch ``eng`` reports is appended to the returned list as (op id, strategy), then
    reported as before."""
    found, report = [], eng._mismatch

    def spy(op_id, name, phase, strategy, detail):
        found.append((op_id, strategy))
        report(op_id, name, phase, strategy, detail)

    eng._mismatch = spy
    return found
