"""`tensorfold learned`: what the rows store holds on disk, checked and tidied without a model loaded.

    ls       every identity: its states, bytes, and the model it belongs to
    show     one identity (a hash prefix): its facts and every state (rows, cuts, blocks, bytes, age, hits)
    verify   every byte of every file: trailers, hashes, the tokens against the names; nothing is removed
    gc       under the store's lock: leftover `.part` files, and everything verify finds: states that fail any
             check (or list a block that does) with the blocks only they list, damaged blocks, blocks no state lists
    rm       under the store's lock: one identity (a hash prefix) or one state (a key prefix), with its blocks

ls, show and verify take no lock, so they work beside a running server (a file it is writing may show as a
`.part`); gc and rm are refused while a server holds the store, and on a root another user could write to
(rows/guard.py; a root of ours open to group or others is set to 0700 first).

A tensor-parallel server's ranks keep their parts in stores of their own, rank k's in `rank-<k>/` under the root
(tiers/disk_mirror.py): every command covers them too, each rank's store under its own lock, and `rm` of a part
removes every rank's part of that identity (one part alone can never be resumed).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from pathlib import Path

import attrs

from tensorfold.rows.api import Damaged, StateEntry, StoreRefused
from tensorfold.rows.assemble import check_names
from tensorfold.rows.files import BLOCK, STATE, read_file, real_dir
from tensorfold.rows.guard import guard_root
from tensorfold.rows.opening import remove_parts
from tensorfold.rows.root import is_identity, list_identities, release_lock, take_lock
from tensorfold.rows.shelf import Shelf, unlink
from tensorfold.tiers.disk_mirror import rank_root


@attrs.frozen
class Identity:
    """One identity directory as the command shows it."""

    name: str
    facts: dict
    states: tuple[StateEntry, ...]
    nbytes: int                         # bytes of its files on disk (shared blocks once)
    store: Path                         # the store it is in: the root, or a tensor-parallel rank's `rank-<k>/`
    rank_folder: str = ""               # "" in the root's store, else the rank's folder name

    @property
    def label(self) -> str:
        """Its hash, behind its rank's folder when it is in one."""
        return f"{self.rank_folder}/{self.name}" if self.rank_folder else self.name

    @property
    def folder(self) -> Path:
        return self.store / self.name

    def is_part_of(self, other: Identity) -> bool:
        """Whether both are parts of one tensor-parallel identity (the same facts but the rank's)."""
        if self.facts.get("tp_world", "1") == "1":
            return False
        rest = {k: v for k, v in self.facts.items() if k != "tp_rank"}
        return rest == {k: v for k, v in other.facts.items() if k != "tp_rank"}


_RANK = re.compile(r"rank-[0-9]+")


def stores(root: Path) -> list[Path]:
    """The root's store, then each tensor-parallel rank's under it (`rank-<k>/`, real folders only), by rank."""
    root = Path(root)
    ranks = sorted(int(p.name.split("-")[1]) for p in root.iterdir() if _RANK.fullmatch(p.name) and real_dir(p)) \
        if real_dir(root) else []
    return [root, *(rank_root(root, k) for k in ranks)]


def identities(root: Path) -> list[Identity]:
    """Every identity under the root and its ranks' stores, read without the lock."""
    return [Identity(name, facts, tuple(states), _bytes(store / name), store, "" if n == 0 else store.name)
            for n, store in enumerate(stores(root)) for name, facts, states in list_identities(store)]


def pick(root: Path, prefix: str) -> Identity:
    """The one identity whose hash starts with `prefix`; ValueError naming the choices otherwise."""
    found = [i for i in identities(root) if i.name.startswith(prefix)]
    if len(found) != 1:
        names = ", ".join(i.name[:12] for i in identities(root)) or "none"
        raise ValueError(f"{len(found)} identities under {root} start with {prefix!r} (there are: {names})")
    return found[0]


def describe_model(facts: dict) -> str:
    """A short line naming what an identity belongs to, from whichever facts it has."""
    keys = ("family", "model_type", "dtype", "device")
    named = " ".join(f"{k}={facts[k]}" for k in keys if k in facts) or "(no facts)"
    if facts.get("tp_world", "1") != "1":
        named += f" tp={facts['tp_world']} rank {facts.get('tp_rank', '?')}"
    return named


def age(seconds_then: float, now: float | None = None) -> str:
    """How long ago, in the largest whole unit."""
    delta = max(0.0, (now if now is not None else time.time()) - seconds_then)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if delta >= size:
            return f"{int(delta // size)}{unit}"
    return f"{int(delta)}s"


@attrs.frozen
class Damage:
    """What a full check of one identity's indexed states found: every (file, problem), the states that fail or
    list a block that fails, and the blocks that fail."""

    problems: list[tuple[str, str]]
    states: frozenset[str]
    blocks: frozenset[str]


def check_shelf(shelf: Shelf) -> Damage:
    """Every indexed state of a loaded shelf and each block it lists (once), every byte: header and trailer, sha256,
    the tokens against the state's name and its blocks' names; and blocks no state lists (a problem, not damage)."""
    problems: list[tuple[str, str]] = []
    states: set[str] = set()
    failed: dict[str, bool] = {}
    for entry in shelf.states.values():
        path = shelf.state_path(entry.key)
        try:
            words, body = read_file(path, STATE)
            check_names(path, shelf.directory.name, words, body, entry)
        except Damaged as error:
            problems.append((error.path or str(path), error.problem or str(error)))
            states.add(entry.key)
            continue
        for name in entry.blocks:
            if name not in failed:
                block = shelf.block_path(name)
                try:
                    read_file(block, BLOCK)
                    failed[name] = False
                except Damaged as error:
                    problems.append((error.path or str(block), error.problem or str(error)))
                    failed[name] = True
            if failed[name]:
                states.add(entry.key)
    for path in sorted((shelf.directory / "blocks").glob("*.blk")) if real_dir(shelf.directory / "blocks") else ():
        if path.stem not in shelf.refs:
            problems.append((str(path), "no state lists this block"))
    return Damage(problems, frozenset(states), frozenset(n for n, bad in failed.items() if bad))


def verify_identity(folder: Path) -> list[tuple[str, str]]:
    """(file, problem) for every file of one identity that fails: header and trailer, every byte's hash, the
    tokens against the state's name and its blocks' names, and blocks no state lists."""
    shelf = Shelf(folder)
    problems = shelf.load(None, repair=False)
    return sorted(set(problems + check_shelf(shelf).problems))


def verify(root: Path) -> dict[str, list[tuple[str, str]]]:
    """Every identity's problems, by its label (its hash, behind a rank's folder)."""
    return {i.label: verify_identity(i.folder) for i in identities(root)}


def gc(root: Path) -> dict[str, int]:
    """`gc_store` on the root's store and each rank's: the counts and bytes freed, summed."""
    done = [gc_store(store) for store in stores(root)]
    return {key: sum(d[key] for d in done) for key in done[0]}


def gc_store(root: Path) -> dict[str, int]:
    """Tidy one store under its lock until verify finds nothing: `.part` files; states that fail a header check,
    any byte's hash or their names, or list a block that fails, each with the blocks only it lists; the blocks that
    fail; blocks no state lists. Returns counts and bytes freed."""
    root = Path(root)
    guard_root(root, create=False)
    fd = take_lock(root)
    try:
        before = _bytes(root)
        counts = {"parts": len(remove_parts(root)), "states_forgotten": 0, "damaged_blocks": 0, "orphan_blocks": 0}
        for folder in sorted(p for p in root.iterdir() if is_identity(p)):
            if not (real_dir(folder / "states") and real_dir(folder / "blocks")):
                continue
            shelf = Shelf(folder)
            counts["states_forgotten"] += len(shelf.load(None, repair=True))
            counts["orphan_blocks"] += shelf.orphans_removed
            damage = check_shelf(shelf)
            for key in damage.states:
                shelf.drop(key)
            for name in damage.blocks:
                unlink(shelf.block_path(name))
            counts["states_forgotten"] += len(damage.states)
            counts["damaged_blocks"] += len(damage.blocks)
        return {**counts, "bytes_freed": before - _bytes(root)}
    finally:
        release_lock(fd)


def rm(root: Path, identity: str, state: str | None = None) -> int:
    """Remove one identity, or one of its states (a key prefix) with the blocks no other state lists, each store
    under its lock; a tensor-parallel part goes with every rank's part of it. Returns the bytes freed."""
    chosen = pick(root, identity)
    parts = [chosen, *(i for i in identities(root) if i.folder != chosen.folder and i.is_part_of(chosen))]
    if state is None:
        return sum(_remove(part, None) for part in parts)
    keys = [e for e in chosen.states if e.key.startswith(state)]
    if len(keys) != 1:
        raise ValueError(f"{len(keys)} states of {chosen.name[:12]} start with {state!r}")
    return sum(_remove(part, key) for part, key in zip(parts, same_state(parts, keys[0]), strict=True))


def same_state(parts: list[Identity], entry: StateEntry) -> list[str]:
    """The key of `entry`'s part in each identity of `parts` (the first holds `entry`). A rank's key names its own
    identity, so parts are paired by the rows and cuts they cover, and only where that pairing is unique in every
    part: a follower's part whose rank-0 part is gone can never be resumed, so pairing it by mistake loses nothing."""
    keys = [entry.key]
    twins = sum(1 for e in parts[0].states if (e.at, e.cuts) == (entry.at, entry.cuts))
    for part in parts[1:]:
        alike = [e.key for e in part.states if (e.at, e.cuts) == (entry.at, entry.cuts)]
        if len(alike) != 1 or twins != 1:
            raise ValueError(f"the state {entry.key[:12]} ({entry.at} rows) cannot be told apart from another of "
                             f"the same rows and cuts in {part.label[:20]}: remove the whole identity instead")
        keys.append(alike[0])
    return keys


def _remove(part: Identity, key: str | None) -> int:
    """Remove one identity folder, or its state `key`, under its store's lock."""
    guard_root(part.store, create=False)
    fd = take_lock(part.store)
    try:
        before = _bytes(part.folder)
        if key is None:
            shutil.rmtree(part.folder)
            return before
        shelf = Shelf(part.folder)
        shelf.load(None, repair=False)
        shelf.drop(key)
        shelf.save_usage()
        return before - _bytes(part.folder)
    finally:
        release_lock(fd)


def _bytes(root: Path) -> int:
    """Bytes of the regular files under the root (no link followed)."""
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


__all__ = ["Damage", "Identity", "StoreRefused", "age", "describe_model", "check_shelf", "gc", "identities", "pick",
           "rm", "stores", "verify", "verify_identity"]
