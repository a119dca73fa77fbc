"""Small filesystem helpers shared by provisioning, export and the CLI."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, List, Optional

#: renameat2's flag that swaps two paths in one step (Linux >= 3.15, glibc >= 2.28)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


#: the environment variable naming the models' cache folder (provisioned folders, verified digests)
CACHE_ENV = "OPTIMUM_IPEX_SPEC_CACHE"


def default_cache_dir() -> Path:
    """``$OPTIMUM_IPEX_SPEC_CACHE`` or ``~/.cache/optimum_ipex_spec/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "optimum_ipex_spec" / "models"


def looks_like_local_path(model_id: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything rooted or deeper is meant as a folder."""
    return model_id.startswith((".", "/", "~")) or model_id.count("/") > 1


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_directory(target: Path, honour_umask: bool = False, keep: Optional[List[str]] = None) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target`` (hidden: ``.<name>-…``); when the body succeeds, it takes
    ``target``'s place by :func:`replace_directory`, otherwise it is removed. A process killed in the body leaves
    ``target`` as it was, and the hidden sibling. The result is world-readable, or with ``honour_umask`` has the modes
    the process's umask gives new files (mkdtemp makes the sibling private, safetensors its files owner-only); entries
    the body names in ``keep`` (files it carried over as hard links of the user's) keep their modes. Safe against a
    killed process, not a power loss (nothing is fsync'ed)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    mask = current_umask() if honour_umask else 0o022
    kept = keep if keep is not None else []
    try:
        yield staging
        staging.chmod(0o777 & ~mask)
        for path in staging.rglob("*"):
            if path.relative_to(staging).parts[0] not in kept and not path.is_symlink():
                path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
        replace_directory(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def replace_directory(new: Path, target: Path) -> None:
    """Put folder ``new`` in ``target``'s place. An existing ``target`` is swapped with ``new`` in one step where the
    system can (``renameat2(RENAME_EXCHANGE)``), then removed; elsewhere it is renamed aside first, so a process
    killed between the two renames leaves the old folder beside the path, never a half-written one in it."""
    if not os.path.lexists(target):
        new.rename(target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # now the old folder
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
    aside.rmdir()
    target.rename(aside)
    try:
        new.rename(target)
    except BaseException:
        aside.rename(target)  # the old folder back in its place
        raise
    shutil.rmtree(aside, ignore_errors=True)


def link_or_copy(source: Path, destination: Path) -> None:
    """``destination`` as a hard link of file ``source`` (or, for a folder, a tree of hard links), copying where links
    cannot be made. A link shares the original's inode: meant for files whose old folder is about to be deleted."""
    def one(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return dst

    if os.path.isdir(source):
        shutil.copytree(source, destination, symlinks=True, copy_function=one)
    else:
        one(source, destination)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where renameat2 is unavailable or refuses (the caller renames instead)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0
