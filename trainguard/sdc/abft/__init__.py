"""ATTNChecker-style ABFT for attention: checksums, EEC-ABFT correction, protected attention, adapters.

Relies on ``torch`` (and ``transformers`` for the HF adapters, imported lazily). See docs/abft.md.

    handle = protect(model, ABFTConfig(frequencies=(1.0, 1.0, 1.0), backward=False))
    handle.set_step(i); ...; handle.counters; unprotect(model)
"""

from trainguard.sdc.abft.attention import BACKWARD_PRODUCTS, NONGEMM_PRODUCTS, PRODUCTS, SECTION_OF, SECTIONS
from trainguard.sdc.abft.protect import ABFTConfig, ABFTHandle, handle_of, protect, section_due, unprotect

__all__ = [
           "BACKWARD_PRODUCTS",
           "NONGEMM_PRODUCTS",
           "PRODUCTS",
           "SECTIONS",
           "SECTION_OF",
           "ABFTConfig",
           "ABFTHandle",
           "handle_of",
           "protect",
           "section_due",
           "unprotect",
]
