"""The package as a user gets it: the repository built into a wheel, installed (not editable) into a fresh
virtualenv, run from an empty directory with an empty cache and no INFINIGEN_DATA. Everything it reads
must come from the wheel (the calibration text included) or from the cache it fills itself.

The virtualenv reuses this interpreter's installed dependencies (torch, transformers, the default model's
package), so nothing is downloaded: a `_parent_env.pth` appends their folder to the venv's path, after the
venv's own site-packages, so the wheel's `infinigen` shadows this checkout's. (`venv --system-site-packages`
would not do: created from a virtualenv's interpreter it exposes the base Python's packages, not the
virtualenv's.) A .pth line only adds the folder: that folder's own .pth files, such as an editable
install's path hook, are not run.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from support.cli import REPO

pytestmark = pytest.mark.slow

SRC_DATA = REPO / "src" / "infinigen" / "data"


def _run(argv, cwd, env=None, timeout=600):
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The repository's wheel, built from a copy (a build writes build/ and *.egg-info beside its sources,
    and a stale build/ of the checkout would leak into the wheel)."""
    copy = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, copy / name)
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: the build backend (setuptools, a dependency of torch) is here already, no download
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, copy], cwd=out)
    (whl,) = out.glob("infinigen-*.whl")
    return whl


def _clean_env(**extra) -> dict:
    """This environment without anything that points Python or infinigen at the checkout or a data folder."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "INFINIGEN_DATA", "INFINIGEN_CACHE",
                        "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"  # nor the user's site-packages
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed (`pip install --no-deps`, from an empty directory)."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root)
    empty = tmp_path_factory.mktemp("empty")
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         cwd=empty, env=_clean_env())
    assert list(empty.iterdir()) == []
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=empty, env=_clean_env()).stdout.strip())
    # installed after the wheel, so pip saw only the venv: the dependencies come from this interpreter
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "_parent_env.pth").write_text("\n".join(parents) + "\n", encoding="utf-8")
    return root


def test_wheel_ships_the_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"infinigen/data/{p.relative_to(SRC_DATA).as_posix()}" for p in SRC_DATA.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert "infinigen/data/SOURCES.md" in shipped and "infinigen/data/austen/emma.txt" in shipped
    assert len([n for n in shipped if n.endswith("/task.json")]) >= 13
    assert shipped <= names, sorted(shipped - names)


def test_installed_package_reads_its_own_data(venv, tmp_path):
    """Not the checkout's copy: the installed package's, from an unrelated working directory."""
    probe = ("import json, infinigen, infinigen.paths as p, infinigen.skew as s\n"
             "from infinigen.eval.fewshot import find_root\n"
             "print(json.dumps(dict(package=infinigen.__file__, calib=str(s.resolve_text(None)),\n"
             "    novel=str(p.resolve_text('prideprejudice')), bigbench=str(find_root()), names=p.corpus_names())))")
    out = json.loads(_run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, env=_clean_env()).stdout)
    package = Path(out["package"]).parent
    assert package.is_relative_to(venv) and not package.is_relative_to(REPO), out
    assert out["calib"] == str(package / "data" / "austen" / "emma.txt")
    assert out["novel"] == str(package / "data" / "austen" / "prideprejudice.txt")
    assert out["bigbench"] == str(package / "data" / "bigbench")
    assert out["names"] == ["emma", "mansfieldpark", "northangerabbey", "prideprejudice", "sensesensibility"]


@pytest.mark.integration
def test_generate_infinigen_on_a_fresh_install(venv, tmp_path):
    """`infinigen generate --policy infinigen` with an empty cache converts the default model and takes its
    calibration (skew matrices and settings) from the wheel: nothing is calibrated, then it answers. (Quiet,
    about 30 s on 2 cores; the timeout is 20x that.)"""
    cache, work = tmp_path / "cache", tmp_path / "work"
    cache.mkdir()
    work.mkdir()
    r = _run([venv / "bin" / "infinigen", "generate", "--policy", "infinigen", "-p", "The capital of France is",
              "-n", "8"], cwd=work, env=_clean_env(INFINIGEN_CACHE=str(cache)))
    assert "Paris" in r.stdout, (r.stdout, r.stderr)
    assert "InfiniGen calibrated (shipped)" in r.stderr and "calibrating" not in r.stderr, r.stderr
    assert not (cache / "skew").exists()  # nothing computed, so nothing cached
    assert list(work.iterdir()) == []  # nothing written where it ran


def test_calibrate_a_model_on_a_fresh_install(venv, tiny_checkpoint, text_file, tmp_path):
    """A model the wheel has no calibration for calibrates on the wheel's own code and caches it: `infinigen
    calibrate` computes it once (seconds on the tiny checkpoint; the timeout is 600 s), then reads it back
    for another dtype."""
    from safetensors import safe_open
    cache, work = tmp_path / "cache", tmp_path / "work"
    cache.mkdir()
    work.mkdir()
    knobs = ["--knob", "budget_ref=64", "--knob", f"calibrate_text={text_file}", "--knob", "calibrate_bound=0.8",
             "--knob", "min_fetch=0"]  # the skew on the wheel's own emma.txt
    argv = [venv / "bin" / "infinigen", "calibrate", "--model", tiny_checkpoint, *knobs, "--json"]
    env = _clean_env(INFINIGEN_CACHE=str(cache))
    first = json.loads(_run(argv, cwd=work, env=env).stdout)
    assert first["source"] == "computed" and Path(first["artifact"]).parent == cache / "skew"
    with safe_open(first["artifact"], "pt") as f:
        meta = f.metadata()
    assert Path(meta["calibration"]).is_relative_to(venv) and meta["calibration"].endswith("austen/emma.txt")
    again = json.loads(_run(argv + ["--dtype", "bfloat16", "--weights", "auto"], cwd=work, env=env).stdout)
    assert again["source"] == "cached" and again["calibration"]["chosen"] == first["calibration"]["chosen"]
    assert list(work.iterdir()) == []
