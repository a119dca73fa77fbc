"""Which backend can run here: IPEX (fused kernels + fused KV cache) or the pure-PyTorch path.

IPEX X.Y imports only next to torch X.Y.*; its wheel does not pin torch, so a mismatch is common.
This module finds out once per process, without raising, and logs the fallback once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import io
import os
import sys
import tempfile
import importlib.util
import logging
from dataclasses import dataclass
from typing import Optional

from ..compat import ipex_matches_torch, major_minor
from ..facts import IPEX_PIP_COMMAND  # noqa: F401  (re-exported: the message of every IPEX error)

logger = logging.getLogger("optimum_ipex_spec")


class IPEXNotAvailableError(ImportError):
    """Raised when ``backend="ipex"`` is requested but IPEX cannot be used in this environment."""


@dataclass(frozen=True)
class IPEXStatus:
    """Result of probing the environment for a usable IPEX.

    Attributes:
        available: True when ``intel_extension_for_pytorch`` imported and matches torch's major.minor.
        ipex_version: installed IPEX version string, or None when not installed.
        torch_version: installed torch version string.
        reason: why IPEX is not usable (None when it is).
    """

    available: bool
    ipex_version: Optional[str]
    torch_version: str
    reason: Optional[str]


@functools.lru_cache(maxsize=None)
def ipex_status() -> IPEXStatus:
    """Probe (once per process) whether IPEX is installed, matches torch, and imports."""
    import torch

    torch_version = torch.__version__
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return IPEXStatus(False, None, torch_version, "intel_extension_for_pytorch is not installed")
    try:
        ipex_version = importlib.metadata.version("intel_extension_for_pytorch")
    except importlib.metadata.PackageNotFoundError:
        ipex_version = "unknown"
    if ipex_version != "unknown" and not ipex_matches_torch(ipex_version, torch_version):
        return IPEXStatus(
            False,
            ipex_version,
            torch_version,
            f"intel_extension_for_pytorch {ipex_version} needs torch "
            f"{'.'.join(map(str, major_minor(ipex_version)))}.*, but torch {torch_version} is installed",
        )
    try:
        with _captured_stderr_fd() as captured:
            import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # IPEX raises plain Exception/RuntimeError on mismatches
        detail = captured.getvalue().strip().splitlines()[-3:] if captured.getvalue() else []
        return IPEXStatus(
            False, ipex_version, torch_version, f"importing intel_extension_for_pytorch failed: {exc} {' '.join(detail)}"
        )
    return IPEXStatus(True, ipex_version, torch_version, None)


@contextlib.contextmanager
def _captured_stderr_fd():
    """Capture what C++ code writes to file descriptor 2 (IPEX's import prints dozens of
    "Overriding a previously registered kernel" lines that are not actionable)."""
    buffer = io.StringIO()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, io.UnsupportedOperation, ValueError):
        yield buffer
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield buffer
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            buffer.write(tmp.read().decode(errors="replace"))


@functools.lru_cache(maxsize=None)
def log_fallback_once(reason: str) -> None:
    """Log, once per distinct reason and process, that the pure-PyTorch path is used."""
    logger.warning("IPEX is not used (%s); falling back to the pure-PyTorch path. To use IPEX: %s", reason, IPEX_PIP_COMMAND)


@functools.lru_cache(maxsize=None)
def ipex_dtype_unsupported(dtype_name: str) -> Optional[str]:
    """Why IPEX's CPU kernels cannot run ``dtype_name`` (a :data:`~optimum_ipex_spec.facts.DTYPE_NAMES` entry) on
    this CPU, or None when they can. IPEX prepacks bf16 weights only where oneDNN has bf16 (AVX512-BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU such as AMD Zen 3 has neither) and otherwise fails an assertion inside
    ``ipex.llm.optimize``. Probed once per process; IPEX must be importable (:func:`ipex_status`)."""
    if dtype_name != "bfloat16":
        return None
    import torch
    import intel_extension_for_pytorch._C as ipex_core

    if ipex_core.onednn_has_bf16_support():
        return None
    return (
        "IPEX's bf16 kernels need a CPU with AVX512-BW/VL/DQ or AVX-NE-CONVERT, and this one offers "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )


def require_ipex_dtype(dtype_name: str) -> None:
    """Raises:
        ValueError: IPEX's kernels cannot run ``dtype_name`` on this CPU (:func:`ipex_dtype_unsupported`), with the
            two fixes: fp32, or the pure-PyTorch path."""
    unsupported = ipex_dtype_unsupported(dtype_name)
    if unsupported:
        raise ValueError(f"backend='ipex' with torch_dtype={dtype_name}: {unsupported}. Use torch_dtype=torch.float32, "
                         "or backend='auto' or 'torch' (the pure-PyTorch path)")


@functools.lru_cache(maxsize=None)
def log_dtype_fallback_once(reason: str) -> None:
    """Log, once per distinct reason and process, that a dtype IPEX cannot run here uses the pure-PyTorch path."""
    logger.warning("%s; this bf16 model runs on the pure-PyTorch path instead (torch_dtype=torch.float32 keeps IPEX).",
                   reason)


def require_ipex() -> IPEXStatus:
    """Return the IPEX status or raise :class:`IPEXNotAvailableError` with the pip command that fixes it."""
    status = ipex_status()
    if not status.available:
        raise IPEXNotAvailableError(
            f'backend="ipex" was requested but IPEX cannot be used: {status.reason}. Install a matching set: '
            f"{IPEX_PIP_COMMAND}; or pass backend=\"auto\" to fall back to the pure-PyTorch path."
        )
    return status
