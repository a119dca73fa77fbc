"""Small filesystem helpers shared by provisioning, export and the CLI."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def looks_like_local_path(model_id: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything rooted or deeper is meant as a folder."""
    return model_id.startswith((".", "/", "~")) or model_id.count("/") > 1


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``target``; when the body succeeds, it replaces ``target``
    (world-readable), otherwise it is removed. Either way no half-written ``target`` is left behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.chmod(0o755)  # mkdtemp makes it private
        for path in staging.rglob("*"):  # safetensors writes its files owner-only
            path.chmod(0o755 if path.is_dir() else 0o644)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
