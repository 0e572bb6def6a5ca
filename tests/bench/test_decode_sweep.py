"""bench/decode_sweep.py: a variant's text names the module constants it sets, and they are restored after."""

from __future__ import annotations

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
