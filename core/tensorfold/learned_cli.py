"""The `tensorfold learned` commands (learned.py does the work; this prints it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from tensorfold import learned
from tensorfold.rows.api import StoreRefused
from tensorfold.rows.guard import path_problem
from tensorfold.settings import read_settings

app = typer.Typer(help="The kept states on disk (--learn-conversations): list, show, verify, tidy, remove.",
                  no_args_is_help=True, add_completion=False)
DirOption = typer.Option(None, "--learn-dir", help="the rows store's directory (default: `learned` under the cache "
                                                   "directory, as `serve` uses it)")


def _root(directory: Path | None, existing: bool = False) -> Path:
    """--learn-dir, or serve's default, resolved by the settings module (the one place the environment is read);
    a path that can never be a store (empty: the working directory; `/`; a file) is refused by name, and with
    `existing` one that does not exist (verify, gc and rm would report a clean store that is not there)."""
    root = read_settings(os.environ, (), learn_dir=directory).learn_root
    problem = path_problem(root)
    if problem is None and existing and not root.is_dir():
        problem = f"{root} does not exist: no rows store is there (serve --learn-conversations writes one)"
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="--learn-dir")
    return root


@app.command("ls")
def ls(learn_dir: Path | None = DirOption, as_json: bool = typer.Option(False, "--json")) -> None:
    """Every identity: its states and bytes, and what it belongs to."""
    found = learned.identities(_root(learn_dir))
    if as_json:
        typer.echo(json.dumps([{"identity": i.name, "store": i.rank_folder or ".", "states": len(i.states),
                                "bytes": i.nbytes, "facts": i.facts} for i in found]))
        return
    if not found:
        typer.echo(f"nothing kept under {_root(learn_dir)}")
    for i in found:
        typer.echo(f"{i.name[:12]}  {len(i.states):5d} states  {i.nbytes / 2**20:10.1f} MiB  "
                   f"{learned.describe_model(i.facts)}{'  in ' + i.rank_folder + '/' if i.rank_folder else ''}")


@app.command("show")
def show(identity: str = typer.Argument(..., help="an identity hash or its prefix"), learn_dir: Path | None = DirOption,
         as_json: bool = typer.Option(False, "--json")) -> None:
    """One identity's facts and every state: rows, cuts, blocks, bytes, age, hits."""
    chosen = _pick(learn_dir, identity)
    if as_json:
        typer.echo(json.dumps({"identity": chosen.name, "facts": chosen.facts, "bytes": chosen.nbytes,
                               "states": [{"key": e.key, "tokens": e.at, "cuts": list(e.cuts),
                                           "blocks": len(e.blocks), "bytes": e.nbytes, "written": e.written,
                                           "used": e.used, "hits": e.hits} for e in chosen.states]}))
        return
    typer.echo(f"identity {chosen.label}")
    for key, value in sorted(chosen.facts.items()):
        typer.echo(f"  {key}: {value}")
    now = time.time()
    typer.echo(f"{len(chosen.states)} states, {chosen.nbytes / 2**20:.1f} MiB (least recently used first):")
    for e in chosen.states:
        typer.echo(f"  {e.key[:12]}  {e.at:8d} tokens  {len(e.blocks):4d} blocks  {e.nbytes / 2**20:9.1f} MiB  "
                   f"written {learned.age(e.written, now)} ago  used {learned.age(e.used, now)} ago  "
                   f"{e.hits} hits")


@app.command("verify")
def verify(learn_dir: Path | None = DirOption) -> None:
    """Read every byte of every file; exit 1 when any fails (nothing is removed: `gc` does that)."""
    problems = learned.verify(_root(learn_dir, existing=True))
    bad = 0
    for name, found in problems.items():
        for file, problem in found:
            typer.echo(f"{name[:12]}  {file}: {problem}")
            bad += 1
    typer.echo(f"{len(problems)} identities checked, {bad} problems")
    raise typer.Exit(1 if bad else 0)


@app.command("gc")
def gc(learn_dir: Path | None = DirOption) -> None:
    """Remove leftover .part files and everything verify finds: damaged states (and the states listing a damaged
    block), damaged blocks, blocks no state lists."""
    try:
        done = learned.gc(_root(learn_dir, existing=True))
    except StoreRefused as error:
        _refused(error)
    typer.echo(f"removed {done['parts']} .part files, {done['states_forgotten']} damaged states, "
               f"{done['orphan_blocks']} orphan blocks, {done['damaged_blocks']} damaged blocks; "
               f"{done['bytes_freed'] / 2**20:.1f} MiB freed")


@app.command("rm")
def rm(identity: str = typer.Argument(..., help="an identity hash or its prefix"),
       state: str = typer.Option(None, "--state", help="only this state (a key or its prefix)"),
       learn_dir: Path | None = DirOption) -> None:
    """Remove one identity, or one of its states with the blocks no other state lists."""
    try:
        freed = learned.rm(_root(learn_dir, existing=True), identity, state)
    except StoreRefused as error:
        _refused(error)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    typer.echo(f"{freed / 2**20:.1f} MiB freed")


def _refused(error: StoreRefused) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(1)


def _pick(learn_dir: Path | None, identity: str) -> learned.Identity:
    try:
        return learned.pick(_root(learn_dir), identity)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="IDENTITY") from None
