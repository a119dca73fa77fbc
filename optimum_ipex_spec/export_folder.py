"""Reading and writing an export folder's own files: ``ipex_export.json`` (what was exported, with which
versions, and the model facts the export was built for), the manifest (:mod:`~optimum_ipex_spec.manifest`), and the
TorchScript archives of export formats 1 and 2. transformers' ``config.json`` / ``generation_config.json`` and the
weights (safetensors, both backends, format 3) are written by transformers.

A folder is untrusted input: format 3 holds data only, and loading checks it before reading it
(:func:`check_export_folder`); the archives of formats 1 and 2 are TorchScript programs, loaded only when the caller
passes ``trust_torchscript=True`` (docs/security.md).

Every problem with a folder is a ``ValueError`` / ``FileNotFoundError`` naming the file and the fix
(re-export from the original checkpoint).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Optional

from .compat import parse_version, same_ipex_release
from .facts import (
    DATA_ONLY_FORMAT_VERSION,
    EXPORT_CONFIG_NAME,
    EXPORT_DTYPES,
    EXPORT_FORMAT_VERSION,
    IPEX_GRAPH_NAME,
    IPEX_PIP_COMMAND,
    IPEX_VERIFY_GRAPH_NAME,
)
from .manifest import HashCheck, check_folder

logger = logging.getLogger("optimum_ipex_spec")

#: configuration fields an export records as it was built (``ipex_export.json``, "facts"); loading refuses a
#: config.json that says otherwise: IPEX's rotary tables, the position guard and the vocabulary check are built
#: from them
RECORDED_CONFIG_FIELDS = ("vocab_size", "max_position_embeddings", "n_positions", "num_hidden_layers", "hidden_size",
                          "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling")


def check_save_target(target) -> None:
    """Refuse a ``save_pretrained`` / CLI output that saving would wrongly replace: a file, a symbolic link (the
    link would be replaced, or its target deleted), or a folder that holds anything but an export of ours (the
    folder is replaced whole).

    Raises:
        ValueError: naming the path and the fix.
    """
    path = str(target)
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; saving replaces the folder it names: pass the real folder "
                         f"({os.path.realpath(path)}) or a new one")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; pass a folder to save the export into")
    if os.path.isdir(path) and os.listdir(path) and not has_export(path):
        raise ValueError(f"{path} is not empty and holds no export ({EXPORT_CONFIG_NAME} missing); saving replaces "
                         "the whole folder: save into a new or empty folder, or remove its files first")


@functools.lru_cache(maxsize=None)
def log_unchecked_export_once(folder: str) -> None:
    """Warn (once per folder) that a pure-PyTorch export of format 1/2 has no manifest to check it against."""
    logger.warning("%s was saved before exports had a manifest: its files are not checked for damage (its weights "
                   "are read from safetensors only). Save it again to write one.", folder)


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
                ipex_version: Optional[str], source_options: Optional[dict] = None, config=None) -> dict:
    """The content of ``ipex_export.json`` for an export made in this environment. ``source``: the checkpoint it was
    exported from (an absolute local path or a hub id); ``source_options``: the hub options that name it
    (``revision``, ``subfolder``); ``config``: the model's config, whose :data:`RECORDED_CONFIG_FIELDS` are
    recorded."""
    import torch

    facts = {name: getattr(config, name) for name in RECORDED_CONFIG_FIELDS if hasattr(config, name)}
    return {
        "format_version": EXPORT_FORMAT_VERSION,
        "backend": backend,
        "torch_dtype": dtype_name,
        "torch_version": torch.__version__,
        "ipex_version": ipex_version if backend == "ipex" else None,
        "architecture": architecture,
        "source": source,
        "source_options": dict(source_options or {}),
        "facts": json.loads(json.dumps(facts)),
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
    try:
        check_subfolder((options or {}).get("subfolder"))
    except ValueError as exc:
        raise ValueError(f"{path}: source_options: {exc}; {reexport_hint({})}") from exc
    if not isinstance(meta.get("source", ""), (str, type(None))):
        raise ValueError(f"{path}: source {meta['source']!r} is not a path or hub id; {reexport_hint({})}")
    return meta


def check_subfolder(subfolder: Optional[str]) -> None:
    """Refuse a ``subfolder`` that leads out of the folder it names a part of (absolute, or with a ``..`` part).

    Raises:
        ValueError: naming the subfolder and the fix.
    """
    if not subfolder:
        return
    parts = subfolder.replace("\\", "/").split("/")
    if os.path.isabs(subfolder) or subfolder.startswith("~") or ".." in parts:
        raise ValueError(f"subfolder={subfolder!r} leads out of the model folder; a subfolder is a relative path "
                         "inside it (no '..', not absolute)")


def is_data_only(meta: dict) -> bool:
    """True for an export of a format that holds data only (format 3 on): no TorchScript archive."""
    return meta.get("format_version", 1) >= DATA_ONLY_FORMAT_VERSION


def check_export_files(folder: str, model_id: str) -> Optional[HashCheck]:
    """Before anything else of a folder is read (its config.json too): when it holds a data-only export, check every
    file against its manifest (:func:`~optimum_ipex_spec.manifest.check_folder`): all of them now but the sha256 of
    the weights, which runs in a thread while the load reads them (returned: pass it to
    :func:`~optimum_ipex_spec.manifest.checked_while_loading` around the load). Other folders are left alone (None).

    Raises:
        ManifestError (a ``ValueError``): a file missing, changed, added or linked out of the folder, or no manifest.
        ValueError: an unreadable ``ipex_export.json``.
    """
    if not has_export(folder):
        return None
    meta = read_export_meta(folder, model_id)
    if not is_data_only(meta):
        return None
    return check_folder(folder, reexport_hint(meta), deferred_suffix=".safetensors")


def check_export_folder(folder: str, meta: dict, config) -> None:
    """Check what a data-only export recorded against what it holds (its files were checked against the manifest
    first, :func:`check_export_files`): the recorded facts against ``config`` (read from the folder's config.json)
    and the weights' dtype (from the safetensors headers) against the recorded ``torch_dtype``.

    Raises:
        ValueError: config.json or the weights disagree with what the export recorded.
    """
    hint = reexport_hint(meta)
    facts = meta.get("facts")
    if not isinstance(facts, dict):
        raise ValueError(f"{os.path.join(folder, EXPORT_CONFIG_NAME)} records no model facts; {hint}")
    for name, recorded in facts.items():
        if name not in RECORDED_CONFIG_FIELDS:
            continue
        value = json.loads(json.dumps(getattr(config, name, None)))
        if value != recorded:
            raise ValueError(
                f"{os.path.join(folder, 'config.json')} says {name}={value!r}, but the export was built with "
                f"{recorded!r} ({EXPORT_CONFIG_NAME}); the folder was changed after it was saved: {hint}")
    architectures = getattr(config, "architectures", None) or [None]
    if architectures[0] != meta.get("architecture"):
        raise ValueError(f"{os.path.join(folder, 'config.json')} names architecture {architectures[0]!r}, the export "
                         f"recorded {meta.get('architecture')!r}; {hint}")
    _check_weight_dtypes(folder, meta["torch_dtype"], hint)


def _check_weight_dtypes(folder: str, dtype_name: str, hint: str) -> None:
    """Every floating tensor of the folder's safetensors files is in ``dtype_name`` (headers only, no data read)."""
    from safetensors import safe_open

    names = [name for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")]
    if not names:
        raise FileNotFoundError(f"{folder} holds no safetensors weights; {hint}")
    expected = {"float32": "F32", "bfloat16": "BF16"}[dtype_name]
    for name in names:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                found = f.get_slice(key).get_dtype()
                if found in ("F64", "F32", "F16", "BF16") and found != expected:
                    raise ValueError(f"{os.path.join(folder, name)}: {key} is {found}, but the export recorded "
                                     f"torch_dtype {dtype_name!r}; {hint}")


def legacy_archive_refusal(folder: str, meta: dict) -> str:
    """The message refusing a format 1/2 IPEX export without ``trust_torchscript=True``."""
    return (f"{folder} is an IPEX export of format {meta.get('format_version', 1)}: its {IPEX_GRAPH_NAME} is a "
            "TorchScript program, and loading it runs code from the folder. Re-export it from its checkpoint (the new "
            f"format holds data only): {reexport_hint(meta)}; or, only for a folder you made yourself, pass "
            "trust_torchscript=True (docs/security.md)")


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
