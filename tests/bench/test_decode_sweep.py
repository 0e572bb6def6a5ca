"""bench/decode_sweep.py: a variant's text names the module constants it sets, and they are restored after."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import decode_sweep  # noqa: E402  (bench/ is not a package)


def test_a_variant_names_its_settings_as_literals():
    name, settings = decode_sweep.parse_variant(
        "wide=tensorfold.kernels.linear_norm:ONE_SLICE_FROM=4096,tensorfold_qwen.decode:INPUT_GEMV=False")
    assert name == "wide"
    assert [(s.module, s.attribute, s.value) for s in settings] == [
        ("tensorfold.kernels.linear_norm", "ONE_SLICE_FROM", 4096), ("tensorfold_qwen.decode", "INPUT_GEMV", False)]


@pytest.mark.parametrize("text", ["=a:b=1", "x=a:b", "x=a=1"])
def test_a_malformed_variant_is_refused(text):
    with pytest.raises(SystemExit):
        decode_sweep.parse_variant(text)


def test_settings_are_applied_and_restorable():
    from tensorfold.kernels import linear_norm

    before = linear_norm.ONE_SLICE_FROM
    _, settings = decode_sweep.parse_variant("v=tensorfold.kernels.linear_norm:ONE_SLICE_FROM=7")
    restore = decode_sweep.applied(settings)
    assert linear_norm.ONE_SLICE_FROM == 7
    for module, attribute, value in restore:
        setattr(module, attribute, value)
    assert linear_norm.ONE_SLICE_FROM == before
    with pytest.raises(SystemExit, match="has no NOPE"):
        decode_sweep.applied(decode_sweep.parse_variant("v=tensorfold.kernels.linear_norm:NOPE=1")[1])


def test_the_combined_variant_takes_the_winners_fastest_first():
    """Medians against the base's (10 ms) with a 1% margin: b (9.0) and a (9.5) win, c (9.95) does not; a and b
    both set X, so b (the faster) stands and a is left out whole; an a setting only Y joins b."""
    variants = [("base", ())] + [decode_sweep.parse_variant(text) for text in (
        "a=m:X=1,m:Y=2", "b=m:X=3", "c=m:Z=4")]
    times = {"base": [10.0, 10.2, 9.9], "a": [9.5, 9.4, 9.6], "b": [9.0, 9.1, 8.9], "c": [9.95, 9.95, 9.95]}
    together = decode_sweep.combined(variants, times, 0.01)
    assert [(s.attribute, s.value) for s in together] == [("X", 3)]
    variants[1] = decode_sweep.parse_variant("a=m:Y=2")
    together = decode_sweep.combined(variants, times, 0.01)
    assert [(s.attribute, s.value) for s in together] == [("X", 3), ("Y", 2)]
    assert decode_sweep.combined(variants, times, 0.2) == ()


def test_a_sigterm_ends_the_sweep_with_what_was_timed():
    """A real SIGTERM to this process on the fifth timing: four timings kept, the sweep marked cut short, the
    handler before it back in place."""
    variants = [("base", ())] + [decode_sweep.parse_variant("a=tensorfold.kernels.linear_norm:ONE_SLICE_FROM=7")]
    calls = []

    def measure() -> float:
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return 0.001 * len(calls)

    before = signal.getsignal(signal.SIGTERM)
    timed, times, cut_short = decode_sweep.sweep(variants, 3, 0.0, measure)
    assert cut_short and times == {"base": [0.001, 0.003], "a": [0.002, 0.004]}
    assert [name for name, _ in timed] == ["base", "a"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_combined_rounds_follow_the_variants_rounds():
    """No signal: every round of every variant, then base_again and combined for as many rounds (a is slower than
    the base, so combined sets nothing)."""
    variants = [("base", ())] + [decode_sweep.parse_variant("a=tensorfold.kernels.linear_norm:ONE_SLICE_FROM=7")]
    clock = iter(range(1, 100))
    timed, times, cut_short = decode_sweep.sweep(variants, 2, 0.0, lambda: float(next(clock)))
    assert not cut_short
    assert [name for name, _ in timed] == ["base", "a", "base_again", "combined"]
    assert times == {"base": [1.0, 3.0], "a": [2.0, 4.0], "base_again": [5.0, 7.0], "combined": [6.0, 8.0]}
    assert timed[3][1] == ()
