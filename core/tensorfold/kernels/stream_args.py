"""Argument checks shared by the ops over streams with a float32 state (gated_delta, kda): one stream or N packed
by cu_seqlens for the chunked op, a pool and its slots for the decode step. They raise ValueError with the same
messages for every op, and read nothing back from a device (that would sync)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_streams(rows: int, state_shape: tuple[int, ...], device: torch.device,
                  initial_state: torch.Tensor | None, start: int, cu_seqlens: Sequence[int] | torch.Tensor | None,
                  starts: Sequence[int] | torch.Tensor | None) -> tuple[list[int] | None, list[int] | None]:
    """The chunked op's stream arguments: one stream (cu_seqlens None; `start`; a state of `state_shape`) or N
    packed (cu_seqlens N+1 offsets rising from 0 to `rows`; `starts`; states [N, *state_shape]).

    Returns cu_seqlens and starts as host ints, each None where it was None.
    """
    if cu_seqlens is None:
        if starts is not None:
            raise ValueError("starts goes with cu_seqlens; one stream takes `start`")
        if int(start) < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        if initial_state is not None:
            check_state(initial_state, state_shape, device, "initial_state")
        return None, None
    if start:
        raise ValueError("with cu_seqlens, give each stream's start in `starts`")
    bounds = host_ints(cu_seqlens, "cu_seqlens")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != rows or any(
            b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={rows} (at least one stream), got {bounds}")
    streams = len(bounds) - 1
    if starts is not None:
        starts = host_ints(starts, "starts")
        if len(starts) != streams or min(starts) < 0:
            raise ValueError(f"starts must give {streams} positions >= 0, got {starts}")
    if initial_state is not None:
        check_state(initial_state, (streams, *state_shape), device, "initial_state")
    return bounds, starts


def as_packed(rows: int, initial_state: torch.Tensor | None, start: int, cu_seqlens: Sequence[int] | None,
              starts: Sequence[int] | None) -> tuple[torch.Tensor | None, list[int], list[int]]:
    """One stream's arguments as a batch of one, or N streams' as host ints, so one code path runs both: returns
    the initial states [N, ...] or None, the N+1 bounds and the N starts (None: all 0)."""
    if cu_seqlens is None:
        return None if initial_state is None else initial_state[None], [0, rows], [start]
    bounds = [int(c) for c in cu_seqlens]
    return initial_state, bounds, ([0] * (len(bounds) - 1) if starts is None else [int(s) for s in starts])


def check_pool(states: torch.Tensor, state_shape: tuple[int, ...], device: torch.device) -> None:
    """A decode step's state pool: [S, *state_shape] float32 on the inputs' device, contiguous."""
    check_state(states, (None, *state_shape), device, "states")
    if not states.is_contiguous():
        raise ValueError("states must be contiguous")


def check_slots(slots: torch.Tensor | Sequence[int], rows: int, states: torch.Tensor,
                read_back: bool) -> list[int] | None:
    """A decode step's `rows` slots into the pool `states`: distinct and in range, negative for a padded row.

    Returns them as host ints, checked, when given as host ints or a CPU tensor, or when `read_back` allows
    reading a device tensor back; else None (a device tensor is left unchecked).
    """
    if isinstance(slots, torch.Tensor):
        if slots.shape != (rows,) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be an int tensor [{rows}], got {slots.dtype} {tuple(slots.shape)}")
        if slots.device != states.device:
            raise ValueError(f"slots on {slots.device}, states on {states.device}")
        host = slots.tolist() if slots.device.type == "cpu" or read_back else None
    else:
        host = host_ints(slots, "slots")
        if len(host) != rows:
            raise ValueError(f"slots must give {rows} slots, got {len(host)}")
    if host is not None:
        live = [s for s in host if s >= 0]
        if len(set(live)) != len(live) or any(s >= states.shape[0] for s in live):
            raise ValueError(f"slots must be distinct and in [0, {states.shape[0]}) (negative: padded), got {host}")
    return host


def check_state(state: torch.Tensor, shape: tuple, device: torch.device, name: str) -> None:
    """A float32 state of `shape` (None: any size) on `device`."""
    if state.dim() != len(shape) or any(want is not None and got != want
                                        for got, want in zip(state.shape, shape, strict=True)):
        raise ValueError(f"{name} must be {['*' if s is None else s for s in shape]}, got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name} on {state.device}, inputs on {device}")


def host_ints(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """Values given on the host as ints; a device tensor is refused (reading it would sync)."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the host (a device tensor would sync)")
        values = values.tolist()
    return [int(x) for x in values]
