"""Switches are read once, strictly; settings are frozen."""

from __future__ import annotations

import json

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


# -- --host-cache-gib: the host tier's budget ---------------------------------------------------------------------


def test_the_host_cache_defaults_to_a_share_of_available_ram(tmp_path):
    from tensorfold.boot import host_cache_bytes
    from tensorfold.memory_plan import HOST_CACHE_SHARE, available_ram, default_host_cache
    from tensorfold.settings import Settings

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_ram(meminfo) == 8000000 * 1024
    assert default_host_cache(meminfo) == int(8000000 * 1024 * HOST_CACHE_SHARE)
    assert available_ram(tmp_path / "missing") > 0  # no /proc/meminfo: the free pages
    assert read_settings({}, [], port=9).host_cache_gib is None
    assert read_settings({}, [], host_cache_gib=0.5).host_cache_gib == 0.5
    assert host_cache_bytes(Settings(host_cache_gib=0.5)) == 2**29 and host_cache_bytes(Settings(host_cache_gib=0)) == 0
    assert host_cache_bytes(Settings()) > 0
    # at --tp N every rank keeps its part of each state in the same host's memory: the default is one rank's share
    assert host_cache_bytes(Settings(tensor_parallel=2), meminfo) == default_host_cache(meminfo) // 2
    assert host_cache_bytes(Settings(tensor_parallel=2, host_cache_gib=0.5)) == 2**29   # given: per rank


def test_boot_builds_the_host_tier_shows_it_in_the_plan_and_turns_it_off_at_zero(example, tiny_dir):
    from tensorfold.boot import boot
    from tensorfold.settings import Settings
    from tensorfold.tiers import DeviceTier, HostTier

    switches = {"TF_KV_PAGES": True, "TF_KV_POISON": False, "TF_EXAMPLE_REQUEST_STARTS": True}
    loaded = boot(Settings(family="example", model=tiny_dir, context=64, switches=switches), example)
    engine = loaded.engine
    assert isinstance(engine.host, HostTier) and isinstance(engine.tier, DeviceTier)
    assert engine.tiers == (engine.tier, engine.host) and engine.host.pin is False  # CPU: ordinary memory
    assert loaded.service.plan["host_cache_bytes"] == engine.host.budget > 0
    now = engine.snapshot()
    assert now["host_cache_budget"] == engine.host.budget and set(now["tiers"]) == {"device", "host"}
    sized = boot(Settings(family="example", model=tiny_dir, context=64, host_cache_gib=0.25, switches=switches),
                 example)
    assert sized.engine.host.budget == 2**28
    off = boot(Settings(family="example", model=tiny_dir, context=64, host_cache_gib=0, switches=switches), example)
    assert off.engine.host is None and off.engine.tiers == (off.engine.tier,)
    alone = boot(Settings(family="example", model=tiny_dir, context=64, prompt_cache_gib=0, switches=switches),
                 example)
    assert alone.engine.tier is None and alone.engine.tiers == (alone.engine.host,)


def test_a_negative_host_cache_is_refused_by_name(tmp_path):
    from typer.testing import CliRunner

    from tensorfold.cli import app

    runner = CliRunner()
    runner.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    result = runner.invoke(app, ["serve", "--family", "example", "--model", str(tmp_path / "m"),
                                 "--host-cache-gib", "-1"])
    assert result.exit_code == 2 and "--host-cache-gib -1.0 must be 0 (off) or above" in result.output, result.output
    plan = runner.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m"), "--json",
                               "--host-cache-gib", "0.5"])
    assert json.loads(plan.output)["host_cache_bytes"] == 2**29
    text = runner.invoke(app, ["explain", "--family", "example", "--model", str(tmp_path / "m"),
                               "--host-cache-gib", "0"]).output
    assert "host tier          off" in text


# -- API keys: --api-key, --api-key-file and TF_API_KEY, read once ---------------------------------------------


def test_api_keys_come_from_the_flags_the_file_and_the_environment_once_each(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-b\n\n  key-c  \nkey-a\n")
    settings = read_settings({"TF_API_KEY": "key-env"}, [], api_key=["key-a"], api_key_file=keys)
    assert settings.api_keys == ("key-a", "key-b", "key-c", "key-env")
    assert "key-a" not in repr(settings)  # keys never reach a log line through the record
    assert read_settings({}, []).api_keys == ()


@pytest.mark.parametrize("text, why", [("", "holds no key"), ("# only a comment\n", "holds no key"),
                                       ("two words\n", "without spaces")])
def test_an_api_key_file_without_usable_keys_is_refused_by_name(tmp_path, text, why):
    keys = tmp_path / "keys"
    keys.write_text(text)
    with pytest.raises(ValueError, match=why):
        read_settings({}, [], api_key_file=keys)
    with pytest.raises(ValueError, match="cannot be read"):
        read_settings({}, [], api_key_file=tmp_path / "missing")


def test_the_body_limit_defaults_from_the_context():
    from tensorfold.settings import MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN, Settings

    assert Settings(context=4096).request_bytes == MIN_REQUEST_BYTES
    assert Settings(context=1 << 20).request_bytes == REQUEST_BYTES_PER_TOKEN << 20
    assert Settings(context=4096, max_request_bytes=5000).request_bytes == 5000


def test_front_door_settings_are_refused_together(tiny_dir):
    from typer.testing import CliRunner

    from tensorfold.cli import app

    result = CliRunner().invoke(app, ["serve", "--family", "example", "--model", str(tiny_dir),
                                      "--max-request-bytes", "10", "--header-timeout", "0", "--body-timeout", "-1",
                                      "--max-connections", "0", "--isolate-cache-by-key"])
    assert result.exit_code == 2
    for said in ("--max-request-bytes 10 must be at least 1024", "--header-timeout 0 must be above 0",
                 "--body-timeout -1 must be above 0", "--max-connections 0 must be at least 1",
                 "--isolate-cache-by-key needs API keys"):
        assert said in result.output
