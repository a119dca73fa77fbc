"""Reading and writing an export folder's own files: ``ipex_export.json`` (what was exported, with which
versions) and the IPEX graph archive. transformers' ``config.json`` / ``generation_config.json`` and a
pure-PyTorch export's weights are written by transformers.

Every problem with a folder is a ``ValueError`` / ``FileNotFoundError`` naming the file and the fix
(re-export from the original checkpoint).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from .compat import parse_version, same_ipex_release
from .facts import (
    EXPORT_CONFIG_NAME,
    EXPORT_DTYPES,
    EXPORT_FORMAT_VERSION,
    IPEX_GRAPH_NAME,
    IPEX_PIP_COMMAND,
    IPEX_VERIFY_GRAPH_NAME,
)


def has_export(folder: str) -> bool:
    """True when ``folder`` holds an export written by ``IPEXModelForCausalLM.save_pretrained``."""
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, EXPORT_CONFIG_NAME))


def reexport_hint(meta: Optional[dict]) -> str:
    source = meta.get("source") if isinstance(meta, dict) else None
    target = repr(source) if source else "the original checkpoint"
    options = meta.get("source_options") if source and isinstance(meta.get("source_options"), dict) else None
    target += "".join(f", {key}={value!r}" for key, value in (options or {}).items())
    return f"re-export it with IPEXModelForCausalLM.from_pretrained({target}, export=True)"


def export_meta(backend: str, dtype_name: str, architecture: str, source: Optional[str],
                ipex_version: Optional[str], source_options: Optional[dict] = None) -> dict:
    """The content of ``ipex_export.json`` for an export made in this environment. ``source``: the checkpoint it was
    exported from (a local path or hub id); ``source_options``: the hub options that name it (``revision``,
    ``subfolder``)."""
    import torch

    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "backend": backend,
        "torch_dtype": dtype_name,
        "torch_version": torch.__version__,
        "ipex_version": ipex_version if backend == "ipex" else None,
        "architecture": architecture,
        "source": source,
        "source_options": dict(source_options or {}),
    }


def write_export_meta(folder: str, meta: dict) -> None:
    with open(os.path.join(folder, EXPORT_CONFIG_NAME), "w") as f:
        json.dump(meta, f, indent=2)


def read_export_meta(folder: str, model_id: str) -> dict:
    """Read and check ``folder/ipex_export.json``.

    Raises:
        ValueError: unreadable or invalid file, a format newer than this package reads, a malformed IPEX version.
    """
    path = os.path.join(folder, EXPORT_CONFIG_NAME)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is unreadable ({exc}); {reexport_hint({})}") from exc
    if not isinstance(meta, dict) or meta.get("backend") not in ("ipex", "torch") or (
            meta.get("torch_dtype") not in EXPORT_DTYPES):
        raise ValueError(
            f"{path} is not a valid export description (needs backend 'ipex'|'torch' and torch_dtype "
            f"'float32'|'bfloat16'); {reexport_hint(meta)}"
        )
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{model_id} was written by a newer optimum-ipex-spec (export format {version}, this one reads <= "
            f"{EXPORT_FORMAT_VERSION}); upgrade optimum-ipex-spec or {reexport_hint(meta)}"
        )
    if meta.get("ipex_version") is not None:
        try:
            parse_version(str(meta["ipex_version"]))
        except Exception as exc:
            raise ValueError(f"{path}: ipex_version {meta['ipex_version']!r} is not a version; "
                             f"{reexport_hint(meta)}") from exc
    options = meta.get("source_options")  # absent from exports written before it was recorded
    if options is not None and not (isinstance(options, dict) and all(
            key in ("revision", "subfolder") and isinstance(value, str) for key, value in options.items())):
        raise ValueError(f"{path}: source_options {options!r} is not a mapping of revision/subfolder to strings; "
                         f"{reexport_hint({})}")
    return meta


def check_ipex_for_saved_graph(model_id: str, meta: dict, status) -> None:
    """Check that the installed IPEX (``status``: :class:`~optimum_ipex_spec.utils.import_utils.IPEXStatus`) can
    run the graph ``meta`` describes.

    Raises:
        IPEXNotAvailableError: IPEX unusable here (the message has the pip command).
        RuntimeError: exported with another IPEX release (major.minor).
        ValueError: a bf16 graph on a CPU whose oneDNN has no bf16 (AVX2 only): IPEX cannot run it here.
    """
    from .utils.import_utils import IPEXNotAvailableError, ipex_dtype_unsupported

    if not status.available:
        raise IPEXNotAvailableError(
            f"{model_id} holds a graph exported with IPEX {meta.get('ipex_version')} (torch "
            f"{meta.get('torch_version')}), but IPEX cannot be used here: {status.reason}. Install it "
            f"({IPEX_PIP_COMMAND}) or re-export the original checkpoint with backend='torch'."
        )
    saved = meta.get("ipex_version")
    if saved and not same_ipex_release(saved, status.ipex_version):
        raise RuntimeError(
            f"{model_id} was exported with IPEX {saved} but IPEX {status.ipex_version} is installed; "
            "re-export it with IPEXModelForCausalLM.from_pretrained(original_checkpoint, export=True)"
        )
    unsupported = ipex_dtype_unsupported(str(meta.get("torch_dtype")))
    if unsupported:
        raise ValueError(
            f"{model_id} holds an IPEX graph exported in {meta.get('torch_dtype')}, and {unsupported}. Export the "
            "original checkpoint again on this machine: torch_dtype=torch.float32 keeps IPEX; bf16 runs on the "
            "pure-PyTorch path (backend='auto' or 'torch')"
        )


def load_graphs(folder: str, meta: dict):
    """The IPEX graphs of an export folder: :class:`~optimum_ipex_spec.exporters.ipex.IPEXGraphs` (format 2: one
    archive; format 1: the verification graph from its own file, ``verify`` None when that file is absent).

    Raises:
        FileNotFoundError: ``ipex_model.pt`` missing.
        ValueError: a file that TorchScript cannot load.
    """
    from .exporters.ipex import IPEXGraphs

    graphs = _load_graph_file(folder, IPEX_GRAPH_NAME, meta, required=True)
    if graphs.verify is None:  # export format 1
        legacy = _load_graph_file(folder, IPEX_VERIFY_GRAPH_NAME, meta, required=False)
        graphs = IPEXGraphs(decode=graphs.decode, verify=legacy.decode if legacy is not None else None)
    return graphs


def save_graphs(folder: str, graphs) -> None:
    """Write ``graphs`` (:class:`~optimum_ipex_spec.exporters.ipex.IPEXGraphs`) to ``folder/ipex_model.pt``."""
    from .exporters.ipex import save_ipex_graph, save_ipex_graphs

    path = os.path.join(folder, IPEX_GRAPH_NAME)
    if graphs.verify is not None:
        save_ipex_graphs(graphs, path)
    else:
        save_ipex_graph(graphs.decode, path)


def _load_graph_file(folder: str, name: str, meta: dict, required: bool):
    from .exporters.ipex import load_ipex_graphs

    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path} is missing; {reexport_hint(meta)}")
        return None
    try:
        return load_ipex_graphs(path)
    except RuntimeError as exc:
        raise ValueError(f"{path} is not a loadable TorchScript graph (truncated or corrupted?); "
                         f"{reexport_hint(meta)}") from exc
