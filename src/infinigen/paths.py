"""Where infinigen reads and writes: the cache folder, the data folders, and text names -> files.

One place for these so every command finds the same corpora and writes to the same cache.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from .errors import UserError

# The texts shipped inside the package (in the wheel; sources and licences in data/SOURCES.md). Found
# beside this module, so an installed package and a checkout read the same files from any directory.
PACKAGE_DATA = Path(__file__).resolve().parent / "data"


# ---- the cache -------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """$INFINIGEN_CACHE, else ~/.cache/infinigen (converted GGUF checkpoints, skew artifacts)."""
    env = os.environ.get("INFINIGEN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "infinigen"


def writable_cache(sub: str) -> Path:
    """`cache_dir()/sub`, created and checked writable now: a read-only cache fails before the work,
    not after it."""
    folder = cache_dir() / sub
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write to the cache folder {folder} ({e.strerror or e}); "
                        "set INFINIGEN_CACHE to a writable folder")
    return folder


def partial_name() -> str:
    """Prefix of a folder being written (renamed into place when complete); holds our pid so the next
    run can tell a killed writer's leftovers from a live one's."""
    return f".partial-{os.getpid()}-"


def remove_stale_partials(folder: Path, max_age_s: float = 3600.0) -> None:
    """Remove `.partial-*` leftovers of killed writers: their pid is gone (or, for names without a pid,
    they are older than `max_age_s`)."""
    if not folder.is_dir():
        return
    for p in folder.glob(".partial-*"):
        pid = p.name.split("-")[1] if p.name.count("-") >= 2 else ""
        if pid.isdigit():
            stale = not _alive(int(pid))
        else:
            try:
                stale = time.time() - p.stat().st_mtime > max_age_s
            except OSError:
                continue
        if stale:
            shutil.rmtree(p, ignore_errors=True)


def remove_dead_owners(folder: Path, prefix: str) -> None:
    """Remove the entries `<prefix><pid>-...` of `folder` (files or folders) whose process is gone: what a
    killed run left behind, told from a live run's by the pid in the name."""
    try:
        entries = list(Path(folder).glob(f"{prefix}*"))
    except OSError:
        return
    for p in entries:
        pid = p.name[len(prefix):].split("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        except OSError:  # another user's (a shared temp dir): theirs to remove
            pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


# ---- data --------------------------------------------------------------------------------------------
def _user_data() -> Path | None:
    env = os.environ.get("INFINIGEN_DATA")
    return Path(env).expanduser() if env else None


def data_dirs() -> list[Path]:
    """Where text names are looked up, in order: $INFINIGEN_DATA and its austen/, then the package's own
    data (data/austen, data). Nothing else: not the working directory, not beside the checkout."""
    user = _user_data()
    dirs = [user, user / "austen"] if user else []
    return dirs + [PACKAGE_DATA / "austen", PACKAGE_DATA]


def bigbench_dirs() -> list[Path]:
    """Candidate BIG-bench task folders, in order: $INFINIGEN_DATA/bigbench, $INFINIGEN_DATA, then the
    package's own data/bigbench."""
    user = _user_data()
    dirs = [user / "bigbench", user] if user else []
    return dirs + [PACKAGE_DATA / "bigbench"]


def corpus_names() -> list[str]:
    return sorted({p.stem for d in data_dirs() if d.is_dir() for p in d.glob("*.txt")})


def resolve_text(text: str | os.PathLike | None, default: str | None = None) -> Path:
    """A text file: a path, or a corpus name ("emma", "austen/emma", "prideprejudice.txt") looked up in
    `data_dirs()`. None or "" means `default`."""
    s = str(text) if text not in (None, "") else (default or "")
    if not s:
        raise UserError("no text given (a file path, or a corpus name such as 'emma')")
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if p.exists():
        raise UserError(f"{p} is not a text file")
    if not p.is_absolute():  # a corpus name, or a path relative to a data folder ("austen/emma")
        name = s if s.endswith(".txt") else s + ".txt"
        for d in data_dirs():
            if (d / name).is_file():
                return d / name
    have = ", ".join(corpus_names()) or f"none found: the package data {PACKAGE_DATA} is missing"
    raise UserError(f"text {s!r} is neither a file nor a bundled corpus name (available: {have})")


def load_text(text: str | os.PathLike | None, default: str | None = None) -> str:
    path = resolve_text(text, default)
    try:
        body = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}")
    if not body.strip():
        raise UserError(f"{path} is empty")
    return body


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` completely or not at all (a temp file beside it, renamed into place)."""
    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}")
