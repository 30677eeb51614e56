"""Command-line arguments refused in one line, exit status 2, naming the cause and the fix: empty or
directory-only paths that fell back to defaults, conflicting modes, unbounded sizes, raw OS errors,
and messages that named the wrong file, option or tool. Serial and fast: the tools' main functions
in-process, or a subprocess refused before any checkpoint or data is read."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from app.data import prepare
from app.data.tokenizer import HFTokenizer, load_tokenizer
from app.deck import apply_override
from app.errors import DataError, DeckError
from conftest import REPO, app_env
from launch import study as study_cli
from launch import submit
from postprocess import compare, scaling

TINY = REPO / "inputs" / "gpt_tiny.yaml"
STRONG = REPO / "inputs" / "studies" / "perlmutter_strong.yaml"
PUBLISHED = REPO / "inputs" / "published" / "megatron_sc21_table1.csv"


def one_line(err: str) -> str:
    """The single message line of stderr (notes of submit.py aside); fails on a traceback."""
    lines = [line for line in err.splitlines() if line and "note:" not in line and "warning:" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_module(module: str, *args: str, cwd: Path) -> tuple[int, str]:
    """`python -m module args` in cwd (no launcher): (status, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=app_env(), capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stderr


@pytest.fixture
def text_input(tmp_path: Path) -> Path:
    doc = tmp_path / "in" / "doc.txt"
    doc.parent.mkdir()
    doc.write_text("hello gridlm, a few words to tokenise\n")
    return doc


# A. Empty paths, and a prefix that names a directory, are refused: no default, no hidden files.


def test_eval_refuses_an_empty_out(tmp_path):
    status, err = run_module(
        "app.eval", str(TINY), "--checkpoint", str(tmp_path / "none.h5"), "--out", "", cwd=tmp_path
    )
    line = one_line(err)
    assert status == 2 and "--out '': an empty path" in line and "pass --out FILE" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("out", ["", "dir/", "."])
def test_prepare_refuses_an_out_without_a_file_name(tmp_path, monkeypatch, capsys, text_input, out):
    monkeypatch.chdir(tmp_path)
    assert prepare.main([str(text_input), "--out", out]) == 2
    line = one_line(capsys.readouterr().err)
    assert ("an empty prefix" if not out else "names a directory, not a file prefix") in line and "fix:" in line
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no hidden .bin/.idx.npy/.json


def test_memorization_refuses_an_empty_data(tmp_path):
    status, err = run_module("app.memorization", str(tmp_path / "none.h5"), "--data", "", cwd=tmp_path)
    line = one_line(err)
    assert status == 2 and "--data '': an empty prefix" in line and "fix: pass --data PREFIX" in line


@pytest.mark.parametrize("tool", ["scaling", "compare"])
def test_postprocess_refuses_an_empty_out(tmp_path, monkeypatch, capsys, tool):
    monkeypatch.chdir(tmp_path)
    if tool == "scaling":
        status = scaling.main([str(tmp_path / "run"), "--kind", "strong", "--out", ""])
    else:
        status = compare.main([str(tmp_path / "results"), "--published", str(PUBLISHED), "--out", ""])
    line = one_line(capsys.readouterr().err)
    assert status == 2 and line == f"{tool}: --out '': an empty path; pass --out DIR, e.g. --out results/NAME/"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--out", "--time"])
def test_submit_refuses_an_empty_out_or_time(tmp_path, monkeypatch, capsys, option):
    monkeypatch.chdir(tmp_path)
    assert submit.main([str(TINY), "--nodes", "1", "--machine", "perlmutter", option, ""]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == f"submit: {option} '': empty; pass a value, or omit {option} for the default"
    assert not (tmp_path / "jobs").exists()


# B. --train-tokenizer has an upper bound (the deck's model.vocab_size maximum), not an OverflowError.


def test_prepare_bounds_train_tokenizer(tmp_path, capsys, text_input):
    status = prepare.main([str(text_input), "--out", str(tmp_path / "t"), "--train-tokenizer", "99999999999999999999"])
    line = one_line(capsys.readouterr().err)
    assert status == 2 and "at most 16,777,216" in line and "N <= 16777216" in line


# C. launch.study: conflicting modes, and options a mode ignores, are refused.


def test_study_refuses_predict_with_run_local(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert study_cli.main([str(STRONG), "--out", str(tmp_path / "o"), "--predict", "--run-local"]) == 2
    assert one_line(capsys.readouterr().err).startswith("study: --predict and --run-local: one at a time")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("mode", ["--predict", "--run-local"])
def test_study_refuses_options_its_mode_ignores(tmp_path, monkeypatch, capsys, mode):
    monkeypatch.chdir(tmp_path)
    status = study_cli.main([str(STRONG), "--out", str(tmp_path / "o"), mode, "--time", "01:00:00", "--account", "x"])
    line = one_line(capsys.readouterr().err)
    assert status == 2 and line.startswith(f"study: --time, --account: not used by {mode}") and "drop them" in line


# D. launch/local.sh checks RANKS before setup and mpirun.


@pytest.mark.parametrize("ranks", ["0", "-1", "abc", ""])
def test_local_sh_refuses_a_rank_count_that_is_not_a_positive_integer(tmp_path, ranks):
    env = {**app_env(), "RANKS": ranks}
    done = subprocess.run(
        [str(REPO / "launch" / "local.sh"), str(TINY), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode == 2 and line.startswith(f"launch/local.sh: RANKS='{ranks}': not a positive integer")


# E. An --out that cannot be written is explained: what is wrong with the path and the fix.


def test_submit_explains_an_out_it_cannot_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    base = [str(TINY), "--nodes", "1", "--machine", "perlmutter", "--out"]
    assert submit.main([*base, "/proc/x/j.sh"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("submit: --out /proc/x/j.sh: its directory /proc/x does not exist and cannot be created")
    assert "pass a path in an existing, writable directory" in line and "[Errno" not in line
    assert submit.main([*base, str(tmp_path / "afile" / "j.sh")]) == 2
    assert f"{tmp_path / 'afile'} is a file, not a directory" in one_line(capsys.readouterr().err)
    assert submit.main([*base, str(tmp_path)]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"submit: --out {tmp_path}: a directory, not a file")


def test_path_problem_names_a_read_only_file_system(tmp_path):
    err = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "j.sh"))
    assert submit.path_problem(tmp_path / "j.sh", False, err) == f"{tmp_path} is on a read-only file system"


def test_study_explains_an_out_that_is_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert study_cli.main([str(STRONG), "--out", str(afile)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"study: --out {afile}: {afile} is a file, not a directory") and "[Errno" not in line


# F. Messages name the right thing: a directory, a tool's own options, the tool, the empty key.


def test_tokenizer_directory_is_called_a_directory(tmp_path):
    with pytest.raises(DataError, match="a directory, not a file; fix: pass the tokenizer.json file itself"):
        load_tokenizer(str(tmp_path))


def test_bad_tokenizer_json_suggests_nothing_one_tool_lacks(tmp_path):
    empty = tmp_path / "tokenizer.json"
    empty.write_text("")
    with pytest.raises(DataError) as err:
        HFTokenizer(str(empty))
    assert "--train-tokenizer" not in str(err.value) and "a tokenizer.json written by app.data.prepare" in str(
        err.value
    )


def test_memorization_set_message_names_memorization(tmp_path):
    status, err = run_module(
        "app.memorization", str(tmp_path / "none.h5"), "--data", str(tmp_path / "d"), "--set", "train.steps=1",
        cwd=tmp_path,
    )  # fmt: skip
    line = one_line(err)
    assert status == 2 and "memorization takes the model from the checkpoint" in line and "generation" not in line


@pytest.mark.parametrize(
    ("given", "empty"), [("=5", "key"), (" =5", "key"), (".steps=1", "section"), ("train.=1", "key")]
)
def test_set_with_an_empty_name_says_so(given, empty):
    with pytest.raises(DeckError) as err:
        apply_override({}, given)
    message = str(err.value)
    assert f"the {empty} is empty; write --set section.key=value" in message and "deck error:  =" not in message
