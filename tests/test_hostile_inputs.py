"""Input files other than the deck are read as boundedly as a deck (app/deck_yaml.py
`read_yaml_file` / `read_yaml_bytes`): a machine file (`--machine`, run.machine) and the deck a
checkpoint stores. Each hostile case ends in one gridlm line and exit 2, within seconds and
200 MB, where /dev/zero grew a dry run to 8 GB, a FIFO hung it, and an alias bomb in a
checkpoint's 2 KB deck attribute took 57 s and 1.2 GB."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, app_env, run_app

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)


def _bounded(cmd: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd` under /usr/bin/time: (the result, its peak RSS in kB)."""
    out = subprocess.run(["/usr/bin/time", "-f", "RSS_KB %M", *cmd], cwd=REPO, env=app_env(), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    rss = int(next(line for line in out.stderr.splitlines() if line.startswith("RSS_KB")).split()[1])
    return out, rss


def _machine_case(tmp_path, case: str) -> str:
    path = tmp_path / "machine.yaml"
    if case in ("/dev/zero", "/dev/urandom"):
        return case
    if case == "fifo":
        os.mkfifo(path)
    elif case == "huge":
        with open(path, "wb") as f:
            f.truncate(300_000_000)  # sparse: 300 MB that reads as zeros
    elif case == "alias bomb":
        path.write_text(ALIAS_BOMB)
    elif case == "latin-1":
        path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    elif case == "deep":
        path.write_text("[" * 50_000)
    return str(path)


@pytest.mark.parametrize("case", ["/dev/zero", "/dev/urandom", "fifo", "huge", "alias bomb", "latin-1", "deep"])
def test_a_hostile_machine_file_is_one_line_and_exit_2(tmp_path, case):
    machine = _machine_case(tmp_path, case)
    cmd = [sys.executable, "-m", "app", "inputs/gpt_tiny.yaml", "--dry-run", "--world-size", "4", "--machine", machine]
    out, rss = _bounded(cmd)
    lines = [line for line in out.stderr.splitlines() if not line.startswith("RSS_KB")]
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and any(f"machine file {machine}" in line for line in lines), out.stderr
    assert rss < 200_000, rss


@pytest.mark.full
def test_an_alias_bomb_in_a_checkpoint_s_stored_deck_is_refused_quickly(tmp_path):
    """A checkpoint written before the header digest (the attribute removed here), its deck
    attribute replaced by an alias bomb: inspect and a resume refuse it in one line, bounded."""
    import h5py

    run_dir = tmp_path / "run"
    sets = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16", "train.steps=1",
            "train.global_batch=4", "train.micro_batch=2", f"run.dir={run_dir}"]  # fmt: skip
    assert run_app(1, "inputs/gpt_tiny.yaml", *(a for s in sets for a in ("--set", s))).returncode == 0
    path = run_dir / "checkpoints" / "step_0000001.h5"
    with h5py.File(path, "r+") as f:
        del f.attrs["header_sha256"]
        f.attrs["deck"] = ALIAS_BOMB
    out, rss = _bounded([sys.executable, "-m", "app.checkpoint", "inspect", str(path)])
    assert out.returncode == 2 and "its stored deck: " in out.stderr and "alias" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    # The tool imports torch (about 220 MB here): the bomb may add little on top of that import.
    _, baseline = _bounded([sys.executable, "-c", "import app.checkpoint.__main__, app.checkpoint.io"])
    assert rss < baseline + 100_000, (rss, baseline)


@pytest.mark.parametrize("case", ["empty index", "nested metadata", "vocab_size true", "huge metadata", "latin-1"])
def test_a_hostile_token_file_is_a_data_error(tmp_path, case):
    """A token file's metadata and index: an empty PREFIX.idx.npy (was an EOFError traceback),
    deeply nested JSON (a RecursionError), "vocab_size": true (accepted as 1), an oversized or
    non-UTF-8 PREFIX.json: each a DataError naming the file."""
    import json

    from test_goldfish import write_tokens

    from app.data.memmap import MemmapTokens
    from app.errors import DataError

    prefix = tmp_path / "data"
    write_tokens(str(prefix), [[1, 2, 3] * 20])
    meta = tmp_path / "data.json"
    if case == "empty index":
        (tmp_path / "data.idx.npy").write_bytes(b"")
    elif case == "nested metadata":
        meta.write_text("[" * 100_000 + "]" * 100_000)
    elif case == "vocab_size true":
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "vocab_size": True}))
    elif case == "huge metadata":
        meta.write_text(" " * (2 << 20) + "{}")
    elif case == "latin-1":
        meta.write_bytes(meta.read_bytes().replace(b'"byte"', '"b\u00fcte"'.encode("latin-1")))
    with pytest.raises(DataError, match=r"data file .*data\.(json|idx\.npy)"):
        MemmapTokens(str(prefix), 16, 512, seed=1)


def test_a_yaml_merge_key_in_a_deck_is_refused(tmp_path):
    """`<<: {steps: 7}` beside `steps: 300` trained 300 steps; now refused, naming the section."""
    from app.deck import load_deck
    from app.errors import DeckError

    deck = tmp_path / "deck.yaml"
    deck.write_text((REPO / "inputs/gpt_tiny.yaml").read_text().replace("train:\n", "train:\n  <<: {steps: 7}\n", 1))
    with pytest.raises(DeckError, match=r"train = '<<': a YAML merge key \(<<\) at line \d+: not accepted"):
        load_deck(deck)
