"""The --learn-* flags and TF_IMPRINT_VERIFY: read once into Settings, bad values refused together with every other
refusal, --learn-block-rows against the Layout, a --learn-dir that cannot be created or that another server holds
refused by name."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tensorfold.cli import app
from tensorfold.layout import FixedState, LayerLayout, Layout, RowState
from tensorfold.rows.root import release_lock, take_lock
from tensorfold.settings import Settings, read_settings
from tensorfold.startup_checks import layout_refusals, learn_refusals

POOLED = Layout([LayerLayout("mixed", rows=[RowState("k", (2,), "float32"), RowState("p", (4,), "float32", every=4)],
                             fixed=[FixedState("s", (2,), "float32")])])


def test_the_flags_default_to_off_and_the_directory_to_the_cache():
    settings = read_settings({"XDG_CACHE_HOME": "/c", "TF_IMPRINT_VERIFY": "on"}, [])
    assert settings.learn is False and settings.learn_root == Path("/c/tensorfold/learned")
    assert (settings.learn_block_rows, settings.learn_gib, settings.learn_daily_gib, settings.learn_min_free_gib) == (
        256, 32.0, None, 4.0)
    assert settings.switch("TF_IMPRINT_VERIFY") is True and read_settings({}, []).switch("TF_IMPRINT_VERIFY") is False
    assert Settings(learn_dir=Path("~/x")).learn_root == Path.home() / "x"
    assert Settings(learn_gib=2, learn_daily_gib=1).learn_flags_given() == ["--learn-gib", "--learn-daily-gib"]


def test_bad_values_are_refused_whether_or_not_learning_is_on(tmp_path):
    bad = dict(learn_block_rows=0, learn_gib=0, learn_daily_gib=-1.0, learn_min_free_gib=-1.0)
    found = learn_refusals(Settings(**bad))
    assert found == ["--learn-block-rows 0 must be at least 1", "--learn-gib 0 must be above 0",
                     "--learn-daily-gib -1.0 must be above 0 (leave it out for no daily limit)",
                     "--learn-min-free-gib -1.0 must be 0 or above"]
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert learn_refusals(Settings(learn_dir=blocked / "learned")) == []  # off: the directory is not touched
    (refusal,) = learn_refusals(Settings(learn=True, learn_dir=blocked / "learned"))
    assert refusal.startswith(f"--learn-dir {blocked / 'learned'} cannot be created: ")
    assert learn_refusals(Settings(learn=True, learn_dir=tmp_path / "fine")) == []
    assert (tmp_path / "fine").is_dir() and (tmp_path / "fine").stat().st_mode & 0o777 == 0o700


def test_block_rows_must_hold_whole_pooled_entries():
    assert layout_refusals(Settings(learn=True, learn_block_rows=6), POOLED) == [
        "--learn-block-rows 6 must be a multiple of every row state's entry size (1, 4 rows)"]
    assert layout_refusals(Settings(learn=True, learn_block_rows=8), POOLED) == []
    assert layout_refusals(Settings(learn_block_rows=6), POOLED) == []  # off: no disk tier to cut blocks for


def test_serve_refuses_every_learn_problem_at_once_with_the_others(tmp_path):
    runner = CliRunner()
    runner.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = runner.invoke(app, ["serve", "--family", "example", "--model", str(tmp_path / "m"),
                                 "--learn-conversations", "--learn-dir", str(blocked / "learned"), "--learn-gib", "0",
                                 "--prefill-chunk", "0"])
    assert result.exit_code == 2, result.output
    for text in ("--prefill-chunk 0 must be at least 1", "--learn-gib 0.0 must be above 0",
                 f"--learn-dir {blocked / 'learned'} cannot be created"):
        assert text in result.output, result.output


def test_a_learn_dir_another_server_holds_is_refused_by_name(tmp_path):
    runner = CliRunner()
    runner.invoke(app, ["make-tiny", "--family", "example", str(tmp_path / "m")])
    root = tmp_path / "learned"
    root.mkdir()
    held = take_lock(root)
    try:
        result = runner.invoke(app, ["serve", "--family", "example", "--model", str(tmp_path / "m"),
                                     "--learn-conversations", "--learn-dir", str(root)])
    finally:
        release_lock(held)
    assert result.exit_code == 2 and f"--learn-dir: {root} is in use by another tensorfold server" in result.output
