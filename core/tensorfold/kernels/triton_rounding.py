"""Rounding a float32 value to a narrower dtype inside Triton kernels, nearest-even, so a kernel's bf16 results
round where the torch reference rounds (triton's interpreter truncates on a plain bf16 cast)."""

import triton
import triton.language as tl


@triton.jit
def round_to(v, ty: tl.constexpr):
    """float32 v rounded to nearest-even in dtype ty, kept as float32 (exact when stored as ty)."""
    if ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(ty).to(tl.float32)

