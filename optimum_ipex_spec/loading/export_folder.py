"""Reading and writing an export folder's own files: ``ipex_export.json`` (what was exported, with which
versions, and the model facts the export was built for), the manifest (:mod:`~optimum_ipex_spec.loading.manifest`), and
the TorchScript archives of export formats 1 and 2. transformers' ``config.json`` / ``generation_config.json`` and the
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
import re
from typing import Optional

from ..backends.ipex.export import IPEXGraphs, load_ipex_graphs
from ..compat import parse_version, same_ipex_release
from ..facts import (
    DATA_ONLY_FORMAT_VERSION,
    EXPORT_CONFIG_NAME,
    EXPORT_DTYPES,
    EXPORT_FORMAT_VERSION,
    IPEX_GRAPH_NAME,
    MANIFEST_NAME,
    IPEX_PIP_COMMAND,
    IPEX_VERIFY_GRAPH_NAME,
)
from ..utils import import_utils
from ..utils.fs import link_or_copy
from ..utils.import_utils import IPEXNotAvailableError
from .manifest import TOKENIZER_SUFFIXES, HashCheck, check_folder, check_names, is_unread

logger = logging.getLogger("optimum_ipex_spec")

#: configuration fields an export records as it was built (``ipex_export.json``, "facts"); loading refuses a
#: config.json that says otherwise: IPEX's rotary tables, the position guard and the vocabulary check are built
#: from them
RECORDED_CONFIG_FIELDS = ("vocab_size", "max_position_embeddings", "n_positions", "num_hidden_layers", "hidden_size",
                          "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling")
#: the recorded facts every export has in every transformers release (the others are compared where both the
#: record and this release's config have them: 5.x keeps rope_theta in rope_parameters)
REQUIRED_FACTS = ("vocab_size", "max_position_embeddings", "n_positions", "num_hidden_layers", "hidden_size")


def check_save_target(target) -> None:
    """Refuse a ``save_pretrained`` / CLI output that saving would wrongly replace (the folder is replaced whole): a
    file; a symbolic link (the link would be replaced, or its target deleted); the working directory, one of its
    parents, the home folder or the root; a folder that holds anything but an export of ours and files loading never
    reads (a tokenizer saved there first, a README: they are carried over into the new export, :func:`carry_over`).

    Raises:
        ValueError: naming the path and the fix.
    """
    path = os.path.abspath(str(target))
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link; saving replaces the folder it names: pass the real folder "
                         f"({os.path.realpath(path)}) or a new one")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} is a file; pass a folder to save the export into")
    real, cwd = os.path.realpath(path), os.path.realpath(os.getcwd())
    if real in (cwd, os.path.realpath(os.path.expanduser("~")), os.path.abspath(os.sep)) or (
            os.path.commonpath([real, cwd]) == real):
        raise ValueError(f"{path} is the working directory, one of its parents, the home folder or the root: saving "
                         "replaces its folder whole; pass a new folder, e.g. ./exported")
    others = foreign_files(path)
    if others:
        raise ValueError(f"{path} holds files that are not part of an export ({', '.join(others[:5])}); saving "
                         "replaces the whole folder (a tokenizer, docs and subfolders are kept): save into a new or "
                         "empty folder, or move those files first")


#: the tokenizer's files by name (:func:`is_tokenizer_file`)
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.json")
#: files an export folder of any format may hold (besides its manifest's, tokenizer files, docs and subfolders)
EXPORT_FILE_NAMES = ("config.json", "generation_config.json", EXPORT_CONFIG_NAME, MANIFEST_NAME, IPEX_GRAPH_NAME,
                     IPEX_VERIFY_GRAPH_NAME, "model.safetensors", "model.safetensors.index.json")


def foreign_files(folder: str) -> list:
    """The entries of ``folder`` that a save over it would delete and that are not an export's. In a folder holding an
    export of ours (``ipex_export.json``): everything but :data:`EXPORT_FILE_NAMES`, weight shards, files its manifest
    lists, files loading never reads and subfolders (the last two are carried over). In any other folder (a
    checkpoint, a folder of folders): everything but files loading never reads (a tokenizer saved there first).
    Empty for a folder that does not exist."""
    if not os.path.isdir(folder):
        return []
    if not has_export(folder):
        return sorted(entry.name for entry in os.scandir(folder)
                      if entry.is_dir(follow_symlinks=False) or entry.is_symlink() or not is_unread(entry.name))
    listed = set()
    if os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        try:
            with open(os.path.join(folder, MANIFEST_NAME)) as f:
                listed = set((json.load(f) or {}).get("files") or {})
        except (OSError, ValueError, RecursionError, AttributeError, TypeError):
            listed = set()
    return sorted(entry.name for entry in os.scandir(folder)
                  if not entry.is_dir(follow_symlinks=False) and not is_unread(entry.name)
                  and entry.name not in EXPORT_FILE_NAMES and entry.name not in listed
                  and not re.fullmatch(r"model-\d+-of-\d+\.safetensors", entry.name))


def carry_over(old: str, new: str, skip: tuple = ()) -> list:
    """Keep in the new export ``new`` what the old folder ``old`` held besides its export (:func:`carried_over`), as
    hard links (copies where links cannot be made): the files share the old folder's inodes, which the swap then
    deletes. The old tokenizer's files only when the new save wrote none (a tokenizer is kept whole, never mixed);
    ``skip``: names the caller writes itself (the CLI's ``draft-bf16``). Returns the names carried."""
    new_has_tokenizer = any(is_tokenizer_file(name) for name in os.listdir(new))
    carried = []
    for name in carried_over(old):
        if name in skip or (new_has_tokenizer and is_tokenizer_file(name)):
            continue
        if not os.path.lexists(os.path.join(new, name)):
            link_or_copy(os.path.join(old, name), os.path.join(new, name))
            carried.append(name)
    return carried


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_NAMES or name.endswith(TOKENIZER_SUFFIXES)


def carried_over(folder: str) -> list:
    """The entries of an existing export folder (or of one holding only files loading never reads) that a new save
    keeps: files loading never reads (a tokenizer saved beside the model, a README) and subfolders (the CLI's
    ``draft-bf16``, an export with its own manifest); never hidden entries (a killed save's leftovers, caches) or
    links."""
    if not os.path.isdir(folder):
        return []
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.name != MANIFEST_NAME and not entry.name.startswith(".") and not entry.is_symlink()
                  and (entry.is_dir() or (entry.is_file() and is_unread(entry.name))))


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
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {str(exc)[:200]}); {reexport_hint({})}") from exc
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


def check_subfolder(subfolder: Optional[str], model_id: Optional[str] = None) -> None:
    """Refuse a ``subfolder`` that leads out of the folder it names a part of (absolute, with a ``..`` part, or,
    for a local ``model_id``, a link to elsewhere).

    Raises:
        ValueError: naming the subfolder and the fix.
    """
    if not subfolder:
        return
    parts = subfolder.replace("\\", "/").split("/")
    outside = os.path.isabs(subfolder) or subfolder.startswith("~") or ".." in parts
    if not outside and model_id and os.path.isdir(model_id):
        root = os.path.realpath(model_id)
        outside = os.path.commonpath([root, os.path.realpath(os.path.join(model_id, subfolder))]) != root
    if outside:
        raise ValueError(f"subfolder={subfolder!r} leads out of the model folder; a subfolder is a relative path "
                         "inside it (no '..', not absolute, not a link to elsewhere)")


def is_data_only(meta: dict) -> bool:
    """True for an export of a format that holds data only (format 3 on): no TorchScript archive."""
    return meta.get("format_version", 1) >= DATA_ONLY_FORMAT_VERSION


def check_export_files(folder: str, model_id: str) -> Optional[HashCheck]:
    """Before anything else of a folder is read (its config.json too): when it holds an export with a manifest, check
    every file against it (:func:`~optimum_ipex_spec.loading.manifest.check_folder`; whatever format the folder claims):
    all of them now but the sha256 of the weights, which runs while the load reads them (returned: pass it to
    :func:`~optimum_ipex_spec.loading.manifest.checked_while_loading` around the load); then the weight files
    transformers will read (:func:`weight_files`) and config.json (no remote code). Other folders are left alone (None).

    Raises:
        ManifestError (a ``ValueError``): a file missing, changed, added or linked out of the folder, or no manifest
            in a data-only export.
        ValueError: an unreadable ``ipex_export.json``; weights outside the safetensors files of the folder; a
            config.json that asks for remote code.
    """
    if not has_export(folder):
        return None
    meta = read_export_meta(folder, model_id)
    hint = reexport_hint(meta)
    check = None
    graph_archives = () if is_data_only(meta) else (IPEX_GRAPH_NAME, IPEX_VERIFY_GRAPH_NAME)  # trust_torchscript
    check_names(folder, hint, allowed=graph_archives)
    if is_data_only(meta) or os.path.lexists(os.path.join(folder, MANIFEST_NAME)):
        check = check_folder(folder, hint, deferred_suffix=".safetensors", allowed=graph_archives)
    if is_data_only(meta) or meta["backend"] == "torch":  # formats 1-2 of IPEX hold a graph archive instead
        weight_files(folder, hint)
    _check_no_remote_code(folder, hint)
    return check


def weight_files(folder: str, hint: str) -> list:
    """The weight files transformers reads from an export folder, in its order of preference: ``model.safetensors``,
    else the shards ``model.safetensors.index.json`` names. Each must be a plain ``*.safetensors`` name of a file in
    the folder (a shard name could otherwise lead out of it, or to a pickle: transformers ``torch.load``s any other
    suffix).

    Raises:
        FileNotFoundError: no safetensors weights (a pickle-only folder included).
        ValueError: an unreadable index, or a shard name that is not a plain ``*.safetensors`` file of the folder.
    """
    from .checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    root = os.path.realpath(folder)

    def inside(name: str) -> bool:
        path = os.path.realpath(os.path.join(folder, name))
        return os.path.commonpath([root, path]) == root and os.path.isfile(path)

    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
        if not inside(SAFE_WEIGHTS_NAME):
            raise ValueError(f"{os.path.join(folder, SAFE_WEIGHTS_NAME)} is a link out of the folder; {hint}")
        return [SAFE_WEIGHTS_NAME]
    index = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{folder} holds no safetensors weights ({SAFE_WEIGHTS_NAME} or "
                                f"{SAFE_WEIGHTS_INDEX_NAME}); an export holds no other kind: {hint}")
    try:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is unreadable ({exc}); {hint}") from exc
    for name in shards:
        if not (isinstance(name, str) and name.endswith(".safetensors") and "/" not in name and "\\" not in name
                and name not in (".", "..") and inside(name)):
            raise ValueError(f"{index} names the weight file {name!r}: not a .safetensors file of the folder (a shard "
                             f"must be one); {hint}")
    return shards


def _check_no_remote_code(folder: str, hint: str) -> None:
    """An export's config.json names no remote code (``auto_map``): transformers would fetch and run it under
    ``trust_remote_code=True``."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path} is unreadable ({type(exc).__name__}); {hint}") from exc
    if not isinstance(config, dict) or "auto_map" in config:
        raise ValueError(f"{path} names remote code (auto_map); an export runs transformers' own classes and never "
                         f"loads code: {hint}")
    if "quantization_config" in config:
        raise ValueError(f"{path} declares a quantization_config; an export holds plain fp32/bf16 weights: {hint}")


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
    for name in RECORDED_CONFIG_FIELDS:
        value = json.loads(json.dumps(getattr(config, name, None)))
        if value is not None and name in REQUIRED_FACTS and facts.get(name) is None:
            raise ValueError(f"{os.path.join(folder, EXPORT_CONFIG_NAME)} does not record {name} (config.json has "
                             f"{value!r}); {hint}")
        recorded = facts.get(name)
        if value is None or recorded is None:
            continue  # a field one transformers release keeps elsewhere (5.x: rope_theta in rope_parameters)
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
    """Every floating tensor of the weight files transformers reads is in ``dtype_name`` (headers only)."""
    from safetensors import safe_open

    names = weight_files(folder, hint)
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
    unsupported = import_utils.ipex_dtype_unsupported(str(meta.get("torch_dtype")))
    if unsupported:
        raise ValueError(
            f"{model_id} holds an IPEX graph exported in {meta.get('torch_dtype')}, and {unsupported}. Export the "
            "original checkpoint again on this machine: torch_dtype=torch.float32 keeps IPEX; bf16 runs on the "
            "pure-PyTorch path (backend='auto' or 'torch')"
        )


def load_graphs(folder: str, meta: dict):
    """The IPEX graphs of an export folder: :class:`~optimum_ipex_spec.backends.ipex.export.IPEXGraphs` (format 2: one
    archive; format 1: the verification graph from its own file, ``verify`` None when that file is absent).

    Raises:
        FileNotFoundError: ``ipex_model.pt`` missing.
        ValueError: a file that TorchScript cannot load.
    """
    graphs = _load_graph_file(folder, IPEX_GRAPH_NAME, meta, required=True)
    if graphs.verify is None:  # export format 1
        legacy = _load_graph_file(folder, IPEX_VERIFY_GRAPH_NAME, meta, required=False)
        graphs = IPEXGraphs(decode=graphs.decode, verify=legacy.decode if legacy is not None else None)
    return graphs


def _load_graph_file(folder: str, name: str, meta: dict, required: bool):
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
