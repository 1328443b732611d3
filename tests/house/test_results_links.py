"""A reader who follows a link to a result finds it: every link (and every path named in the text) that points
into results/ from README.md, ARCHITECTURE.md or the results index resolves to a file, and every relative link
in a study's report resolves to something that exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
INDEXES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", RESULTS / "README.md"]

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
NAMED_PATH = re.compile(r"(?<![\w/.])results/[\w./-]*\w")  # `results/study/report.md` in prose or code


def _relative_links(doc: Path) -> list[str]:
    targets = (m.group(1).split("#")[0] for m in LINK.finditer(doc.read_text(encoding="utf-8")))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def _missing(doc: Path, *, files_only: bool) -> list[str]:
    """`doc`'s links into results/ that do not resolve (to a file, with files_only; a folder is a link's
    target only where it ends in "/")."""
    missing = []
    for target in _relative_links(doc):
        path = (doc.parent / target).resolve()
        if files_only and not path.is_relative_to(RESULTS):
            continue
        found = path.is_dir() if target.endswith("/") else path.is_file()
        if not found:
            missing.append(f"{doc.relative_to(ROOT)}: ({target})")
    return missing


def test_every_link_into_results_from_the_readme_architecture_and_index_resolves_to_a_file():
    missing = [m for doc in INDEXES for m in _missing(doc, files_only=True)]
    assert not missing, "links that resolve to nothing: " + ", ".join(missing)


def test_every_results_path_the_readme_architecture_and_index_name_exists():
    missing = []
    for doc in INDEXES[:2]:  # the index names its studies by links, relative to results/
        for named in NAMED_PATH.findall(doc.read_text(encoding="utf-8")):
            if not (ROOT / named).exists():
                missing.append(f"{doc.name}: {named}")
    assert not missing, "paths into results/ that do not exist: " + ", ".join(missing)


def test_every_relative_link_in_a_study_report_resolves():
    missing = [m for doc in sorted(RESULTS.rglob("*.md")) for m in _missing(doc, files_only=False)]
    assert not missing, "links that resolve to nothing: " + ", ".join(missing)


def test_every_study_is_a_folder_named_in_the_index():
    index = (RESULTS / "README.md").read_text(encoding="utf-8")
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    unindexed = sorted(p.name for p in RESULTS.iterdir() if p.is_dir() and f"]({p.name}/" not in index)
    assert not loose, "results/ holds files outside a study's folder: " + ", ".join(loose)
    assert not unindexed, "study folders the index does not link: " + ", ".join(unindexed)
