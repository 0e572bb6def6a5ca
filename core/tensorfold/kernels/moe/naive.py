"""The routed experts in plain torch: the CPU path and the reference the Triton kernels are tested against.

Shapes: T rows, E hidden size, F expert intermediate size, N experts, k experts per row. It is tensorfold_qwen's
`mlp.moe` loop op for op (each expert's SwiGLU on the rows that chose it, in x's dtype, weighted, then
`index_add_` in ascending expert order), so on the CPU it agrees with the family's code bit for bit. The loop
reads the chosen experts back to the host: fine on the CPU, a sync on a GPU (the Triton path has none). The
float32 sum (`float32_sum`, `shared_last`: the package docstring) is tensorfold_glm's reference sum: each expert's
output in x's dtype, `.float() * weight`, added in ascending expert order into a float32 total, cast once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, activation: str = "silu_gate", limit: float | None = None,
                   float32_sum: bool = False, shared_last: bool = False) -> torch.Tensor:
    """x [T, E], chosen [T, k], weights [T, k], gate_up [N, 2F, E], down [N, E, F] -> [T, E]:
    Σ_j weights[t, j] · down[e] @ (silu(g) · u), [g | u] = gate_up[e] @ x[t], e = chosen[t, j].
    With activation "relu2", gate_up is the up weights [N, F, E] alone: Σ_j weights[t, j] · down[e] @ relu(u)²,
    u = gate_up[e] @ x[t] (HF nemotron_h's experts: relu, then torch.square, in x's dtype). With `limit`, g and u
    are clamped first: silu(min(g, limit)) · clamp(u, -limit, limit) (GLM-5's swiglu_limit). float32_sum: weights
    float32, the sum in float32, cast once; shared_last: each row's last pair (largest id) added after the cast."""
    if shared_last:
        chosen, order = chosen.sort(dim=1, stable=True)
        weights = weights.gather(1, order)
        routed = routed_experts(x, chosen[:, :-1], weights[:, :-1], gate_up, down, activation, limit, True)
        return routed + routed_experts(x, chosen[:, -1:], weights[:, -1:], gate_up, down, activation, limit, True)
    out = torch.zeros(x.shape, dtype=torch.float32 if float32_sum else x.dtype, device=x.device)   # [T, E]
    for expert in chosen.unique().tolist():
        rows, rank = (chosen == expert).nonzero(as_tuple=True)          # which rows chose it, at which rank
        picked = x[rows]                                                # [t, E]
        if activation == "relu2":
            hidden = torch.square(F.relu(F.linear(picked, gate_up[expert])))        # [t, F]
        else:
            gate, up = gate_up[expert].chunk(2)                         # [F, E] each
            g, u = F.linear(picked, gate), F.linear(picked, up)         # [t, F] each
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            hidden = F.silu(g) * u
        y = F.linear(hidden, down[expert])                              # [t, E] x's dtype
        out.index_add_(0, rows, (y.float() if float32_sum else y) * weights[rows, rank, None])
    return out.to(x.dtype)
