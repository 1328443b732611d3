"""INT4 (or any bit width) group-wise asymmetric quantization of the KV cache, FlexGen style: full
attention over a quantized store. The codec itself lives in `infinigen.codecs`."""
from __future__ import annotations

from dataclasses import dataclass

from ..codecs import KVCodec, QuantCodec, dequantize, fake_quantize, quantize  # noqa: F401 (re-exported)
from ..errors import UserError
from .base import Policy


@dataclass(frozen=True)
class Int4(Policy):
    """Full attention over a quantized KV cache (the paper's INT4 baseline; group 64)."""
    name = "int4"
    needs_query = False  # every entry, every step (read through the codec)
    bits: int = 4
    group: int = 64

    def validate(self):
        if not (1 <= self.bits <= 8 or self.bits >= 16):
            raise UserError(f"INT4 bits must be 1..8 (or >= 16 for no quantization), got {self.bits}")
        if self.group < 1:
            raise UserError(f"quantization group must be >= 1, got {self.group}")

    def continues_prefill(self) -> bool:
        # the store holds 4-bit values: a prefill continuing a cached prefix would attend over them, where a
        # prefill of the whole prompt attends over the values it computed
        return False

    def codec(self) -> KVCodec | None:
        return None if self.bits >= 16 else QuantCodec(self.bits, self.group)
