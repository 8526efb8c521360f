"""AGC taping (part of :class:`~trainguard.sdc.dmr.engine.DMREngine`): each AGC segment's ops are taped as they run
(forward, then gradient ops) and the tape is replayed from its boundary tensors in the segment's window
(:mod:`trainguard.sdc.dmr.agc`). Relies on torch.
"""

from __future__ import annotations

from trainguard.sdc.dmr.agc import StaleInput, Tape


class AGCTapes:
    """The engine's AGC tapes (a part of DMREngine: it reads and writes the engine's state)."""

    # ---- AGC segments (replayed from their boundary tensors, agc.py) ------------------------------
    def _tape(self, a) -> Tape:
        tape = self._tapes.get(a.id)
        if tape is None:
            tape = self._tapes[a.id] = Tape(a.id, a.window, len(a.forward_ops) + len(a.bw_ops))
        return tape

    def _tape_record(self, op_id: str, func, args, kwargs, out, strategy: str) -> None:
        a = self._agc_of.get(op_id)
        if a is None:
            return
        if strategy == "naive" and op_id in a.ops:  # could not be taped (in place or random): others read it as boundary
            self._tape(a).seen.add(op_id)
            return
        # (the primary's fingerprints taken later, off the main thread, like the deferred checks' ones)
        self._tape(a).record(op_id, func, args, kwargs, out, self._fp_later, self._is_param, self._produced_here)

    def _tape_alias(self, op_id: str, twin: str, out) -> None:
        a = self._agc_of.get(twin)
        if a is None:
            return
        tape = self._tape(a)
        e = tape.entry_of(twin)
        if e is not None:
            tape.alias(op_id, e.out_slots, out, self._fp_later)

    def _replay(self, tape: Tape, where: str) -> None:
        found: list[str] = []

        def differs() -> None:
            if not found:  # (one detection per segment, as when the replay stops at its first difference)
                found.append(tape.seg_id)
                self._mismatch(tape.seg_id, "agc-segment", "backward", "agc", f"AGC segment {tape.seg_id} replay differs")

        # where flags are read at the verdict the replay runs to its end and each comparison leaves a flag
        agree = self._agree if self._flags is None else (
            lambda name, e, g: self._compare(name, e, g, differs) or True)
        try:
            bad = tape.replay(self._fp, agree)
        except StaleInput:
            self.counts["stale"] += 1
            self.totals["stale"] += 1
            return
        except Exception as err:  # a replay that cannot run is a detection, not a crash of the step
            bad = f"{tape.seg_id} (replay failed: {type(err).__name__})"
        self.counts[f"agc-replayed-in-{where.split(':')[0]}"] += 1
        if bad is not None:
            self._mismatch(bad, "agc-segment", "backward", "agc", f"AGC segment {tape.seg_id} replay differs")
