"""The naive versions' loops over streams (gated_delta, kda): each stream runs on its own, so a stream's bits
never depend on the others in the call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def each_stream(q: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None, bounds: list[int],
                starts: list[int], math_dtype: torch.dtype,
                run: Callable[[int, int, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows bounds[n]:bounds[n+1] of stream n through run(a, b, state, start), for the N streams of `bounds`.

    q [T, H, DK] and v [T, H, DV] give the state's shape [H, DK, DV]; initial_state [N, H, DK, DV] or None (zeros),
    taken in `math_dtype`; a stream without rows keeps its state. Returns the outputs packed again in v's dtype and
    the final states [N, H, DK, DV].
    """
    heads, k_dim, v_dim = v.shape[1], q.shape[-1], v.shape[-1]
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        state = (torch.zeros(heads, k_dim, v_dim, dtype=math_dtype, device=q.device) if initial_state is None
                 else initial_state[n].to(math_dtype))
        if a == b:
            outs.append(v.new_zeros(0, heads, v_dim, dtype=math_dtype))
            finals.append(state.clone())
            continue
        out, final = run(a, b, state, starts[n])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs).to(v.dtype), torch.stack(finals)


def each_slot(v: torch.Tensor, states: torch.Tensor, slots: torch.Tensor | Sequence[int],
              step: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Row i of a decode step through step(i, states[slots[i]]), which updates that state in place and returns the
    row's output; a negative slot is a padded row (out zero, no state touched). Returns out [B, H, DV] in v's dtype."""
    slots = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
    out = v.new_empty(v.shape)
    for i, slot in enumerate(slots):
        if slot < 0:                                                               # a padded row
            out[i] = 0
            continue
        out[i] = step(i, states[slot])
    return out
