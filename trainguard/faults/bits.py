"""Fault models on one tensor element: bit flips (fp32 / bf16 / fp16 layouts), +-INF, NaN, near-INF, values.

Bits are flipped on an integer view of the storage (``int32`` for fp32, ``int16`` for bf16 / fp16), so
exactly one bit changes and nothing else. Bit 0 is the least significant mantissa bit; the sign is the
top bit. Relies on torch only.

near-INF follows ATTNChecker: flip the most significant exponent bit. For a value whose exponent MSB
is 0 (|x| < 2 for fp32) this multiplies it by 2^(2^(e-1)) (~1e38 for fp32): a huge but finite number.
For a value whose exponent MSB is already 1 the flip would make it *smaller*; the model then sets the
exponent to its largest finite value instead (|x| becomes ~2^127 in fp32, ~65504 in fp16), so the
fault is always near-INF (the record's ``new`` value shows what was written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainguard.errors import TrainguardError

# (total bits, exponent bits, mantissa bits, integer view dtype)
LAYOUTS: dict[torch.dtype, tuple[int, int, int, torch.dtype]] = {
    torch.float32: (32, 8, 23, torch.int32),
    torch.bfloat16: (16, 8, 7, torch.int16),
    torch.float16: (16, 5, 10, torch.int16),
}
KINDS = ("bitflip", "inf", "-inf", "nan", "near-inf", "value")
FIELDS = ("any", "sign", "exponent", "mantissa")


def layout(dtype: torch.dtype) -> tuple[int, int, int, torch.dtype]:
    if dtype not in LAYOUTS:
        raise TrainguardError(f"bit-level faults support fp32, bf16 and fp16 tensors, not {dtype}")
    return LAYOUTS[dtype]


def field_bits(dtype: torch.dtype, field: str) -> range:
    """Bit positions of a field (0 = least significant)."""
    total, exp, man, _ = layout(dtype)
    if field == "mantissa":
        return range(0, man)
    if field == "exponent":
        return range(man, man + exp)
    if field == "sign":
        return range(total - 1, total)
    if field == "any":
        return range(0, total)
    raise TrainguardError(f"unknown bit field {field!r} (choose from {', '.join(FIELDS)})")


def flip_bit(tensor: torch.Tensor, flat_index: int, bit: int) -> None:
    """Flip one bit of one element in place."""
    total, _, _, int_dtype = layout(tensor.dtype)
    if not 0 <= bit < total:
        raise TrainguardError(f"bit {bit} out of range for {tensor.dtype} ({total} bits)")
    view = tensor.detach().view(-1).view(int_dtype)
    mask = 1 << bit
    if bit == total - 1:  # sign bit: the int's sign; xor with the two's-complement minimum
        mask = -(1 << (total - 1))
    view[flat_index] ^= mask


def _max_exponent(tensor: torch.Tensor, flat_index: int) -> None:
    """Set the element's exponent field to its largest finite value (all ones but the lowest bit)."""
    _, exp, man, int_dtype = layout(tensor.dtype)
    view = tensor.detach().view(-1).view(int_dtype)
    field = ((1 << exp) - 1) << man
    largest = ((1 << exp) - 2) << man
    view[flat_index] = (view[flat_index] & ~field) | largest


def _element(tensor: torch.Tensor, flat_index: int) -> torch.Tensor:
    """A one-element view of ``tensor`` at row-major position ``flat_index`` (any strides)."""
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tensor.shape))
    return tensor.detach()[idx].view(1)


@dataclass
class FaultModel:
    """What to do to one element. ``kind``: bitflip | inf | -inf | nan | near-inf | value.

    For ``bitflip``: ``bit`` (an explicit position) or a random bit within ``field``
    (any | sign | exponent | mantissa) drawn from the generator given to ``apply``.
    """

    kind: str = "bitflip"
    bit: int | None = None
    field: str = "any"
    value: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TrainguardError(f"unknown fault kind {self.kind!r} (choose from {', '.join(KINDS)})")
        if self.field not in FIELDS:
            raise TrainguardError(f"unknown bit field {self.field!r} (choose from {', '.join(FIELDS)})")

    def apply(self, tensor: torch.Tensor, flat_index: int, generator: torch.Generator | None = None) -> tuple[float, float, int | None]:
        """Corrupt ``tensor.view(-1)[flat_index]`` in place; returns (old, new, bit flipped or None)."""
        if not tensor.is_floating_point():
            raise TrainguardError(f"faults target floating-point tensors, not {tensor.dtype}")
        n = tensor.numel()
        if not 0 <= flat_index < n:
            raise TrainguardError(f"element index {flat_index} out of range for a tensor of {n} elements")
        if not tensor.is_contiguous():  # (a transposed op output): work on the one element, in place
            return self.apply(_element(tensor, flat_index), 0, generator)
        flat = tensor.detach().view(-1)
        old = float(flat[flat_index])
        bit = None
        if self.kind == "bitflip":
            bits = field_bits(tensor.dtype, self.field)
            bit = self.bit if self.bit is not None else bits[int(torch.randint(len(bits), (1,), generator=generator))]
            flip_bit(tensor, flat_index, bit)
        elif self.kind == "near-inf":
            _, _, man, _ = layout(tensor.dtype)
            bit = man + layout(tensor.dtype)[1] - 1  # exponent MSB
            before = flat[flat_index].clone()
            flip_bit(tensor, flat_index, bit)
            if flat[flat_index].abs() < before.abs():  # MSB was already set: max finite exponent instead
                flat[flat_index] = before
                _max_exponent(tensor, flat_index)
        else:
            flat[flat_index] = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}.get(self.kind, self.value)
        return old, float(flat[flat_index]), bit


def random_index(tensor: torch.Tensor, generator: torch.Generator | None = None) -> int:
    return int(torch.randint(tensor.numel(), (1,), generator=generator))
