"""SpareTrain-style dual modular redundancy: every op of a training iteration executed twice and compared
(naive, piggyback on activation-checkpoint recompute, deferred into idle windows, AGC segments), planned
from a profile, with rollback and re-execution of the iteration on a mismatch."""

from trainguard.sdc.dmr.profile import OpRecord, Profile, Window

__all__ = ["OpRecord", "Profile", "Window"]
