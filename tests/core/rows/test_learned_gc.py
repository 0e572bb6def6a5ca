"""`tensorfold learned gc` removes what `verify` finds damaged, on real files a real store wrote: a block whose bytes
no longer hash takes down every state listing it, a state whose body no longer hashes goes with the blocks only
it lists, and verify passes after; what is whole stays and reads back."""

from __future__ import annotations

from pathlib import Path

from rows_cases import FACTS, image, open_store, tokens, write
from typer.testing import CliRunner

from tensorfold import learned
from tensorfold.learned_cli import app
from tensorfold.rows.api import identity_hash
from tensorfold.rows.files import TRAILER

RUNNER = CliRunner()


def flip_last_body_byte(path: Path) -> None:
    """Flip the body's last byte: the header and sizes still check, the sha256 does not."""
    data = bytearray(path.read_bytes())
    data[len(data) - TRAILER - 1] ^= 0x5A
    path.write_bytes(bytes(data))


def test_gc_removes_what_verify_finds_damaged_and_verify_passes_after(tmp_path):
    root = tmp_path / "learned"
    folder = root / identity_hash(FACTS)
    with open_store(root) as store:
        shared = tokens(1, 40)
        short, long = write(store, shared, 24), write(store, shared, 40)
        apart = write(store, tokens(2, 30), 17)
        whole = write(store, tokens(3, 30), 16)
    block = folder / "blocks" / f"{short.blocks[0]}.blk"
    state = folder / "states" / f"{apart.key}.st"
    assert short.blocks[0] == long.blocks[0]              # one block two states list
    flip_last_body_byte(block)
    flip_last_body_byte(state)

    result = RUNNER.invoke(app, ["verify", "--learn-dir", str(root)])
    assert result.exit_code == 1, result.output
    assert f"{block}: sha256 of the payload differs from its trailer" in result.output
    assert f"{state}: sha256 of the payload differs from its trailer" in result.output
    assert block.exists() and state.exists()             # verify removes nothing

    result = RUNNER.invoke(app, ["gc", "--learn-dir", str(root)])
    assert result.exit_code == 0, result.output
    assert "removed 0 .part files, 3 damaged states, 0 orphan blocks, 1 damaged blocks;" in result.output
    assert not block.exists() and not state.exists()
    left = {p.stem for p in (folder / "states").glob("*.st")}
    assert left == {whole.key}
    assert {p.stem for p in (folder / "blocks").glob("*.blk")} == set(whole.blocks)

    result = RUNNER.invoke(app, ["verify", "--learn-dir", str(root)])
    assert result.exit_code == 0 and "0 problems" in result.output, result.output
    with open_store(root) as store:
        assert [e.key for e in store.entries()] == [whole.key] and store.stats().damaged == 0
        assert store.read(store.entries()[0]) == image(tokens(3, 30), 16)


def test_gc_counts_header_damage_hash_damage_and_orphans_apart(tmp_path):
    root = tmp_path / "learned"
    folder = root / identity_hash(FACTS)
    with open_store(root) as store:
        cut = write(store, tokens(1, 30), 16)
        bad = write(store, tokens(2, 30), 17)
    (folder / "states" / f"{cut.key}.st").write_bytes(b"TFST")              # a header that fails at load
    flip_last_body_byte(folder / "states" / f"{bad.key}.st")
    done = learned.gc(root)
    assert (done["parts"], done["states_forgotten"], done["orphan_blocks"], done["damaged_blocks"]) == (0, 2, 2, 0)
    assert done["bytes_freed"] > 0
    assert learned.verify(root) == {identity_hash(FACTS): []}
    assert list((folder / "states").iterdir()) == [] and list((folder / "blocks").iterdir()) == []
