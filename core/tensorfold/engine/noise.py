"""Counter-based Gumbel noise: a draw is a pure function of (seed, token index, vocab position), so a stream's tokens
never depend on which streams share its step, its row, or the size its batch was padded to.

    root(seed)        mix(seed mod 2⁶⁴)                         once per request, at admission
    key(root, t)      mix(root + (t + 1)·γ)                     the t-th output of splitmix64 seeded with the root
    bits(key, v)      mix(key + (v + 1)·γ)                      the v-th output of splitmix64 seeded with the key
    u                 (bits >> 12 + ½) / 2⁵²                    in (0, 1): never 0, never 1
    gumbel            -log(-log u), float64
with mix splitmix64's finaliser and γ its golden-ratio increment. Everything up to u is wrapping int64 arithmetic
(torch's int64 ops on CPU and GPU give the same bits); the two logs are float64, elementwise.
"""

from __future__ import annotations

import torch

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
WORD = 1 << 64
FRACTION_BITS = 52


def signed(value: int) -> int:
    """An integer mod 2⁶⁴ as the int64 that holds the same bits (so any seed in [-2⁶³, 2⁶⁴) is one word)."""
    value %= WORD
    return value - WORD if value >= 1 << 63 else value


def _shifted(z: torch.Tensor, by: int) -> torch.Tensor:
    """z >> by as unsigned words: int64's shift copies the sign bit in, so it is masked off."""
    return torch.bitwise_right_shift(z, by).bitwise_and_((1 << (64 - by)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 words, in place (z must be a tensor the caller owns)."""
    z.bitwise_xor_(_shifted(z, 30)).mul_(signed(MIX1))
    z.bitwise_xor_(_shifted(z, 27)).mul_(signed(MIX2))
    return z.bitwise_xor_(_shifted(z, 31))


def root(seed: int) -> int:
    """A request's root word from its seed (one word: mix in Python integers, as `mix` does over tensors)."""
    z = seed % WORD
    z = ((z ^ (z >> 30)) * MIX1) % WORD
    z = ((z ^ (z >> 27)) * MIX2) % WORD
    return signed(z ^ (z >> 31))


def keys(roots: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Each row's key for its token index: int64 [R] from int64 roots [R] and token indices [R]."""
    return mix(roots + (counters + 1) * signed(GAMMA))


def positions(vocab: int, device: torch.device | str) -> torch.Tensor:
    """(v + 1)·γ for each vocab position v, int64 [V]: the counter part of every row's bits."""
    return (torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * signed(GAMMA))


def uniforms(row_keys: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64 [R, V], for int64 keys [R] on the device of `at` = positions(V)."""
    bits = mix(row_keys[:, None] + at[None, :])
    u = _shifted(bits, 64 - FRACTION_BITS).double()
    return u.add_(0.5).mul_(2.0 ** -FRACTION_BITS)


def gumbel(row_keys: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, float64 [R, V]: adding it to log-probabilities and taking the argmax draws a token."""
    return uniforms(row_keys, at).log_().neg_().log_().neg_()
