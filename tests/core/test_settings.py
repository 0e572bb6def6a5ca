"""Switches are read once, strictly; settings are frozen."""

from __future__ import annotations

import attrs
import pytest

from tensorfold.settings import SwitchError, read_settings, read_switch


@pytest.mark.parametrize("raw, expected", [("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False),
                                           ("", True), (None, True)])
def test_switch_values(raw, expected):
    environ = {} if raw is None else {"TF_X": raw}
    assert read_switch(environ, "TF_X", default=True) is expected


def test_a_bad_switch_value_names_the_switch():
    with pytest.raises(SwitchError, match=r"TF_X='maybe' is neither on"):
        read_switch({"TF_X": "maybe"}, "TF_X", default=False)


def test_settings_are_frozen_and_hold_only_the_switches_read():
    settings = read_settings({"TF_A": "0", "XDG_CACHE_HOME": "/c"}, [("TF_A", True), ("TF_B", False)], port=9)
    assert settings.switch("TF_A") is False and settings.switch("TF_B") is False
    assert str(settings.cache_dir) == "/c/tensorfold" and settings.port == 9
    with pytest.raises(KeyError):
        settings.switch("TF_C")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.port = 1
