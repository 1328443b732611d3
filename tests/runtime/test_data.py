"""The texts the commands default to ship inside the package (src/infinigen/data) and are found from
any working directory; $INFINIGEN_DATA comes first; nothing beside the checkout or the working directory
is ever read."""
from __future__ import annotations

from pathlib import Path

import pytest

import infinigen
from infinigen import paths
from infinigen.errors import UserError

NOVELS = ["emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility"]
PACKAGE = Path(infinigen.__file__).resolve().parent


def _decoys(root: Path) -> None:
    """Texts where the package used to look (shared/data beside the checkout or the working directory,
    ./data): any of them being read is a bug."""
    for parts in ("shared data austen", "shared data", "data austen", "data"):  # the old lookups
        folder = root.joinpath(*parts.split())
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "emma.txt").write_text("decoy", encoding="utf-8")
        (folder / "decoynovel.txt").write_text("decoy", encoding="utf-8")
    task = root.joinpath(*"shared data bigbench decoytask".split())
    task.mkdir(parents=True)
    (task / "task.json").write_text('{"examples": []}', encoding="utf-8")


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The working directory is a folder with decoys in it and beside it, and INFINIGEN_DATA is unset."""
    _decoys(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    _decoys(work)
    monkeypatch.chdir(work)
    monkeypatch.delenv("INFINIGEN_DATA", raising=False)
    return work


def test_corpus_names_resolve_to_the_package_data(elsewhere):
    assert paths.PACKAGE_DATA == PACKAGE / "data"
    assert all(d.is_relative_to(paths.PACKAGE_DATA) for d in paths.data_dirs() + paths.bigbench_dirs())
    assert paths.corpus_names() == NOVELS
    for name in NOVELS:
        for spelling in (name, f"{name}.txt", f"austen/{name}"):
            assert paths.resolve_text(spelling) == paths.PACKAGE_DATA / "austen" / f"{name}.txt"
    assert "It is a truth universally acknowledged" in paths.load_text("prideprejudice")[:2000]
    with pytest.raises(UserError, match="decoynovel"):
        paths.resolve_text("decoynovel")


def test_default_calibration_text_is_the_packaged_emma(elsewhere):
    from infinigen.skew import resolve_text
    emma = resolve_text(None)
    assert emma == paths.PACKAGE_DATA / "austen" / "emma.txt"
    assert emma.read_text(encoding="utf-8").count("Emma") > 500


def test_bigbench_tasks_are_the_packaged_ones(elsewhere):
    from infinigen.eval.fewshot import find_root
    root = find_root()
    assert root == paths.PACKAGE_DATA / "bigbench"
    assert len(list(root.glob("*/task.json"))) == 13 and (root / "cause_and_effect" / "task.json").is_file()


def test_unknown_name_lists_the_shipped_corpora(elsewhere):
    with pytest.raises(UserError) as e:
        paths.resolve_text("no-such-novel")
    msg = str(e.value)
    assert "'no-such-novel'" in msg and all(n in msg for n in NOVELS) and "\n" not in msg


def test_user_data_comes_first(elsewhere, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / "austen").mkdir(parents=True)
    (mine / "emma.txt").write_text("my emma", encoding="utf-8")
    (mine / "austen" / "persuasion.txt").write_text("my persuasion", encoding="utf-8")
    (mine / "bigbench" / "mytask").mkdir(parents=True)
    (mine / "bigbench" / "mytask" / "task.json").write_text('{"examples": []}', encoding="utf-8")
    monkeypatch.setenv("INFINIGEN_DATA", str(mine))
    assert paths.resolve_text("emma") == mine / "emma.txt"
    assert paths.resolve_text("persuasion") == mine / "austen" / "persuasion.txt"
    assert paths.resolve_text("prideprejudice") == paths.PACKAGE_DATA / "austen" / "prideprejudice.txt"
    assert paths.corpus_names() == sorted(NOVELS + ["persuasion"])
    from infinigen.eval.fewshot import find_root
    assert find_root() == mine / "bigbench"
    # a user's own path is used as given, wherever it is
    assert paths.resolve_text(str(tmp_path / "data" / "emma.txt")) == tmp_path / "data" / "emma.txt"


def test_sources_name_every_shipped_folder():
    """Each shipped corpus has its source and licence written down beside it."""
    sources = (paths.PACKAGE_DATA / "SOURCES.md").read_text(encoding="utf-8")
    shipped = sorted(p.name for p in paths.PACKAGE_DATA.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert {"austen", "bigbench"} <= set(shipped)
    rows = {line.split("|")[1].strip(" `"): line for line in sources.splitlines() if line.startswith("| `")}
    for name in shipped:
        cells = [c.strip() for c in rows[f"{name}/"].strip().strip("|").split("|")]  # folder, what, source, licence
        assert len(cells) == 4 and all(cells), cells
    assert "public domain" in rows["austen/"] and "Apache-2.0" in rows["bigbench/"]
