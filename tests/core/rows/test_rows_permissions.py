"""The rows store's root on real files, real links and real mode bits (as root here, so what is tested is what the
code checks, modes, owners and O_NOFOLLOW, not what root may do): a planted `lock` link (or hard link, or FIFO) is
refused by name and its target left untouched, by the server's startup checks, the store and `tensorfold learned
gc/rm`; a root of ours open to group or others is set to 0700 and says so; one of another user, or one that holds
files no store makes, is refused by name; the store's other files and folders are never written or read through a
link; `--learn-dir ""`, `/` and a file are refused."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
from rows_cases import FACTS, files, open_store, tokens, write
from typer.testing import CliRunner

from tensorfold import learned
from tensorfold.learned_cli import app
from tensorfold.rows.api import StoreRefused, identity_hash
from tensorfold.rows.root import release_lock, take_lock
from tensorfold.settings import Settings
from tensorfold.startup_checks import learn_refusals

SECRET = b"root:x:0:0:a file the lock must never touch\n"
NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def refusals(root: Path) -> list[str]:
    return learn_refusals(Settings(learn=True, learn_dir=root))


@pytest.fixture
def target(tmp_path) -> Path:
    """A file outside the store that a planted link points at."""
    path = tmp_path / "elsewhere" / "passwd"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def root(tmp_path) -> Path:
    path = tmp_path / "learned"
    path.mkdir(mode=0o700)
    return path


def test_a_lock_that_is_a_link_is_refused_by_name_everywhere_and_its_target_is_untouched(root, target):
    """The issue's case: a world-writable --learn-dir of ours with `lock` planted as a link to a file root may write."""
    write_some(root)
    (root / "lock").unlink()
    (root / "lock").symlink_to(target)
    os.chmod(root, 0o777)
    named = f"{root / 'lock'} is a symbolic link"
    assert refusals(root) == [f"--learn-dir: {named}: the rows store's lock must be a regular file, and the store "
                              "follows no link; remove it"]
    assert mode(root) == 0o700                          # tightened first, then the lock refused
    with pytest.raises(StoreRefused, match=named):
        take_lock(root)
    with pytest.raises(StoreRefused, match=named):
        open_store(root)
    with pytest.raises(StoreRefused, match=named):
        learned.gc(root)
    result = CliRunner().invoke(app, ["rm", identity_hash(FACTS)[:8], "--learn-dir", str(root)])
    assert result.exit_code == 1 and named in " ".join(result.output.split()), result.output
    assert target.read_bytes() == SECRET and (root / "lock").is_symlink()
    assert len(files(root, ".st")) == 1                 # nothing was removed either


def test_a_dangling_lock_link_is_refused_and_its_target_is_not_created(root, tmp_path):
    (root / "lock").symlink_to(tmp_path / "made-by-nobody")
    with pytest.raises(StoreRefused, match="is a symbolic link"):
        open_store(root)
    assert not (tmp_path / "made-by-nobody").exists()


def test_a_lock_that_is_a_hard_link_or_a_fifo_is_refused_by_name(root, target):
    os.link(target, root / "lock")
    with pytest.raises(StoreRefused, match=f"{root / 'lock'} is a file of 2 hard links"):
        open_store(root)
    assert target.read_bytes() == SECRET
    (root / "lock").unlink()
    os.mkfifo(root / "lock")
    with pytest.raises(StoreRefused, match=f"{root / 'lock'} is not a regular file"):
        take_lock(root)
    (root / "lock").unlink()
    (root / "lock").mkdir()
    with pytest.raises(StoreRefused, match=f"{root / 'lock'} is a directory"):
        take_lock(root)


def test_the_lock_descriptor_is_not_inherited(root):
    fd = take_lock(root)
    try:
        assert os.get_inheritable(fd) is False and (root / "lock").read_text() == f"{os.getpid()}\n"
    finally:
        release_lock(fd)


def test_a_world_writable_root_of_ours_is_set_to_0700_and_the_log_says_so(root, caplog):
    write_some(root)
    os.chmod(root, 0o777)
    with caplog.at_level(logging.WARNING, logger="tensorfold.rows.guard"):
        assert refusals(root) == []
    assert mode(root) == 0o700
    assert f"rows store: {root} was mode 0777, open to group and others (writable): set to 0700" in caplog.text
    os.chmod(root, 0o750)
    with open_store(root) as store:
        assert len(store.entries()) == 1
    assert mode(root) == 0o700


def test_a_new_root_is_made_0700(tmp_path):
    assert refusals(tmp_path / "a" / "new") == [] and mode(tmp_path / "a" / "new") == 0o700
    with open_store(tmp_path / "b" / "new"):
        pass
    assert mode(tmp_path / "b" / "new") == 0o700


@pytest.mark.parametrize("bits, open_to", [(0o777, "group and others (writable)"), (0o770, "group (writable)"),
                                           (0o705, "others (readable)")])
def test_a_root_of_another_user_open_to_group_or_others_is_refused_by_name(root, bits, open_to):
    os.chown(root, NOBODY, NOBODY)
    os.chmod(root, bits)
    why = (f"{root} is open to {open_to}, mode 0{bits:03o}, and owned by uid {NOBODY}, not this user "
           f"(uid {os.geteuid()}): kept conversations must be private")
    (refusal,) = refusals(root)
    assert refusal.startswith(f"--learn-dir: {why}") and f"chmod 700 {root}" in refusal
    with pytest.raises(StoreRefused, match=why.replace("(", r"\(").replace(")", r"\)")):
        open_store(root)
    result = CliRunner().invoke(app, ["gc", "--learn-dir", str(root)])
    assert result.exit_code == 1 and "owned by uid 65534" in result.output
    assert mode(root) == bits and list(root.iterdir()) == []      # nothing changed, nothing made
    os.chmod(root, 0o700)
    assert refusals(root) == []                   # another user's root closed to everyone else is used


def test_an_open_root_that_holds_files_no_store_makes_is_refused_and_left_alone(root):
    (root / "notes.txt").write_text("mine")
    os.chmod(root, 0o1777)
    (refusal,) = refusals(root)
    assert refusal == (f"--learn-dir: {root} is open to group and others (writable), mode 01777, and holds "
                       "'notes.txt', which no rows store makes: it is not a directory of the store's own (which the "
                       "store would set to mode 0700); choose one")
    assert mode(root) == 0o1777


def test_format_that_is_a_link_is_refused_even_when_it_names_our_format(root, tmp_path):
    (tmp_path / "format").write_text("1\n")
    (root / "FORMAT").symlink_to(tmp_path / "format")
    with pytest.raises(StoreRefused, match=f"{root / 'FORMAT'} cannot be read: a symbolic link, never followed"):
        open_store(root)


def test_planted_part_and_json_links_are_replaced_never_written_through(root, target):
    (root / "FORMAT.part").symlink_to(target)
    (root / "budget.json").symlink_to(target)
    with open_store(root, daily_bytes=1 << 30) as store:
        assert (root / "FORMAT").read_text() == "1\n" and not (root / "FORMAT.part").exists()
        usage = store.directory / "usage.json.part"
        usage.symlink_to(target)                        # planted after startup's `.part` sweep
        write(store, tokens(1, 20), 16)
        assert not (root / "budget.json").is_symlink() and store._budget.spent() > 0
    assert not usage.is_symlink() and (store.directory / "usage.json").is_file()
    assert target.read_bytes() == SECRET


def test_identity_folders_that_are_links_are_refused_or_left_alone(root, tmp_path):
    outside = tmp_path / "outside"
    (outside / "states").mkdir(parents=True)
    (outside / "blocks").mkdir()
    (outside / "states" / "x.st").write_bytes(b"not a state")
    (outside / "blocks" / ("0" * 64 + ".blk")).write_bytes(b"not a block")
    (root / ("ab" * 16)).symlink_to(outside)               # another identity's name: never followed
    with open_store(root) as store:
        assert store.entries() == []
    assert sorted(p.name for p in outside.rglob("*")) == sorted(["states", "blocks", "x.st", "0" * 64 + ".blk"])
    assert [i.name for i in learned.identities(root)] == [identity_hash(FACTS)]     # the link is not listed
    assert learned.gc(root)["states_forgotten"] == 0
    assert (outside / "states" / "x.st").exists()
    mine = root / identity_hash(FACTS)
    shutil.rmtree(mine)
    mine.symlink_to(outside)
    with pytest.raises(StoreRefused, match=f"{mine} is a symbolic link: the rows store follows none"):
        open_store(root)
    mine.unlink()
    (mine / "states").mkdir(parents=True)
    (mine / "blocks").symlink_to(outside / "blocks")
    with pytest.raises(StoreRefused, match=f"{mine / 'blocks'} is a symbolic link"):
        open_store(root)
    assert (outside / "blocks" / ("0" * 64 + ".blk")).exists()


def test_a_state_file_that_is_a_link_is_never_read_through(root, target):
    with open_store(root) as store:
        entry = write(store, tokens(1, 20), 16)
    state = root / identity_hash(FACTS) / "states" / f"{entry.key}.st"
    kept = state.read_bytes()
    (target.parent / "copy.st").write_bytes(kept)        # a valid state file, but reached through a link
    state.unlink()
    state.symlink_to(target.parent / "copy.st")
    problems = learned.verify(root)[identity_hash(FACTS)]
    assert (str(state), "cannot be read (a symbolic link, never followed)") in problems
    with open_store(root) as store:
        assert store.entries() == [] and store.stats().damaged == 1
    assert not state.exists() and (target.parent / "copy.st").read_bytes() == kept


@pytest.mark.parametrize("given, why, word", [
    ("", "an empty path (or '.') is the working directory: give the store a directory of its own", "working"),
    (".", "an empty path (or '.') is the working directory", "working"),
    ("/", "/ is the file system's root: give the store a directory of its own", "system's"),
])
def test_an_empty_learn_dir_or_the_file_system_root_is_refused(tmp_path, monkeypatch, given, why, word):
    monkeypatch.chdir(tmp_path)
    (refusal,) = refusals(Path(given))
    assert refusal.startswith(f"--learn-dir: {why}")
    for command in ("gc", "verify", "ls"):
        result = CliRunner().invoke(app, [command, "--learn-dir", given])
        assert result.exit_code == 2 and word in result.output, result.output
    assert list(tmp_path.iterdir()) == []               # nothing was made in the working directory


def test_a_learn_dir_that_is_a_file_is_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("x")
    assert refusals(tmp_path / "file") == [f"--learn-dir: {tmp_path / 'file'} exists and is not a directory"]
    assert refusals(tmp_path / "file") == learn_refusals(Settings(learn=True, learn_dir=tmp_path / "file"))


def write_some(root: Path) -> None:
    with open_store(root) as store:
        write(store, tokens(1, 20), 16)
    assert len(files(root, ".st")) == 1
