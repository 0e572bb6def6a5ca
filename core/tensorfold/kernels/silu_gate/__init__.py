"""The elementwise gates: SwiGLU's silu(gate)·up (with GLM's optional swiglu_limit clamp) and the sigmoid output
gate x·sigmoid(gate) (gated attention, the shared expert's gate).

Shapes: N rows (every stream's rows of a step), F features. Results in the inputs' dtype, rounded where the
model's torch code rounds (after the activation, after the product).
"""

from __future__ import annotations

import torch

from tensorfold.kernels.backend import use_triton

__all__ = ["sigmoid_mul", "silu_mul"]


def _check_rows(op: str, name: str, a: torch.Tensor) -> None:
    """a is a floating [N, F]."""
    if a.dim() != 2 or not a.dtype.is_floating_point:
        raise ValueError(f"{op}: {name} must be a floating [N, F] tensor, got {list(a.shape)} {a.dtype}")


def _check_pair(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, per_row: bool) -> None:
    """a is a floating [N, F]; b has a's dtype, device and shape (or [N, 1] when per_row is allowed)."""
    _check_rows(op, a_name, a)
    N, F = a.shape
    shapes = [(N, F), (N, 1)] if per_row else [(N, F)]
    if tuple(b.shape) not in shapes or b.dtype != a.dtype or b.device != a.device:
        wanted = " or ".join(str(list(shape)) for shape in shapes)
        raise ValueError(f"{op}: {b_name} must be {wanted} {a.dtype} on {a.device} like {a_name}, "
                         f"got {list(b.shape)} {b.dtype} on {b.device}")


def silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate, up [N, F] (same dtype; strided rows allowed, e.g. halves of a fused gate_up) -> silu(gate)·up [N, F];
    with limit L > 0: silu(gate.clamp(max=L)) · up.clamp(-L, L)."""
    _check_pair("silu_mul", "gate", gate, "up", up, per_row=False)
    if limit is not None and not limit > 0:
        raise ValueError(f"silu_mul: limit must be positive or None, got {limit}")
    if use_triton(gate):
        from tensorfold.kernels.silu_gate import triton_gate
        return triton_gate.silu_mul(gate, up, limit)
    from tensorfold.kernels.silu_gate import naive
    return naive.silu_mul(gate, up, limit)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [N, F], gate [N, F], [N, 1] (one gate per row) or [N, H, D] with H·D = F (a gate of heads, e.g. the gate
    halves interleaved with q in a fused projection's columns: read in place, no copy), same dtype ->
    x·sigmoid(gate) [N, F]."""
    if gate.dim() == 3:
        _check_rows("sigmoid_mul", "x", x)
        N, F = x.shape
        if gate.shape[0] != N or gate.shape[1] * gate.shape[2] != F or gate.dtype != x.dtype or gate.device != x.device:
            raise ValueError(f"sigmoid_mul: gate [N, H, D] must have N = {N} rows and H·D = F = {F} features, "
                             f"{x.dtype} on {x.device} like x, got {list(gate.shape)} {gate.dtype} on {gate.device}")
    else:
        _check_pair("sigmoid_mul", "x", x, "gate", gate, per_row=True)
    if use_triton(x):
        from tensorfold.kernels.silu_gate import triton_gate
        return triton_gate.sigmoid_mul(x, gate)
    from tensorfold.kernels.silu_gate import naive
    return naive.sigmoid_mul(x, gate)
