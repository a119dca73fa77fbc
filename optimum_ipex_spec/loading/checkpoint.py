"""Loading a transformers checkpoint straight into the export dtype, holding its weights once (issue 14).

transformers' ``from_pretrained(folder, torch_dtype=bf16)`` of an fp32 safetensors checkpoint maps the file,
touches every page of it and converts each tensor: while it runs, the process holds the fp32 file pages *and* the
bf16 copy, 3x the bf16 weights at its peak (9.95 GB for Qwen2.5-Coder-1.5B, whose bf16 weights are 3.3 GB). When
the checkpoint is a local folder of safetensors whose tensors are in another dtype than the one asked for,
:func:`load_causal_lm` builds the model with transformers (``from_config`` under ``no_init_weights``, so the
parameters are allocated, not initialised, and the buffers are what transformers computes for that dtype), then
reads each tensor from the file in 64 MiB pieces with plain reads (page cache, not this process's memory) and
converts it into its parameter with ``copy_``: the same round-to-nearest-even as transformers' ``.to(dtype)``. The
peak is the weights in the export dtype plus one piece. The result equals transformers' load, parameters, buffers
and dtypes (tests compare every tensor with ``torch.equal`` for each supported architecture and the real
checkpoints).

Anything else goes to transformers' ``from_pretrained`` unchanged: an architecture outside
:data:`VERIFIED_ARCHITECTURES`, a checkpoint already in the dtype asked for
(transformers maps it, no copy), a hub id, ``.bin`` weights, GGUF, quantized or remote-code models, models that
keep modules in fp32, a ``subfolder``, a folder without ``generation_config.json``, a file not marked
``format: pt`` or whose byte ranges are not its shapes (transformers refuses those), or a file whose tensor names or
shapes are not exactly the model's (renamed, missing or extra keys, which transformers knows how to handle). The
safetensors layout read here is the format's own
specification: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
offsets, then the data (https://github.com/huggingface/safetensors#format).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from ..compat import transformers_major
from ..facts import LLAMA_FAMILY_ARCHITECTURES

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PIECE_BYTES = 64 << 20  # one read; the peak above the converted weights
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# what transformers' from_pretrained accepts and means the same for a local folder
LOCAL_NEUTRAL_KWARGS = ("revision", "cache_dir", "force_download", "token", "local_files_only", "trust_remote_code",
                        "use_safetensors")

#: architectures whose converting load is tested equal to transformers' in both lanes. Others go to transformers: a
#: model may compute a buffer at construction that transformers 5's from_pretrained computes otherwise (GPT-J's
#: rotary table came out in bf16 precision, where transformers' is fp32-exact)
VERIFIED_ARCHITECTURES = LLAMA_FAMILY_ARCHITECTURES + ("Gemma3ForCausalLM", "GPT2LMHeadModel")

TensorEntry = Tuple[str, int, torch.dtype, Tuple[int, ...], int, int]  # file, data start, dtype, shape, begin, end


def checkpoint_folder(model_id: str, subfolder: Optional[str] = None) -> str:
    """The folder a local ``model_id`` holds its checkpoint in: ``model_id/subfolder``, or ``model_id`` without one."""
    return os.path.join(model_id, subfolder) if subfolder else model_id


def load_causal_lm(model_id: str, dtype: torch.dtype, **kwargs) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(model_id, torch_dtype=dtype, **kwargs)``, with the peak memory of the
    weights in ``dtype`` when ``model_id`` is a local safetensors folder in another dtype (see the module docstring;
    otherwise exactly transformers' call).

    Args:
        model_id: a local folder or a hub id (``subfolder`` in ``kwargs`` as transformers takes it).
        dtype: the dtype of the loaded model's floating parameters.
        kwargs: transformers' ``from_pretrained`` keywords (hub options, ``subfolder``, ``trust_remote_code``).

    Returns:
        The transformers model in eval mode, its ``generation_config`` read from the folder as transformers does.

    Weights are read from safetensors only (``use_safetensors=True`` unless the caller passes it): a pickled
    checkpoint could run code when loaded.

    Raises:
        ValueError: a local folder whose weights are pickles only (``pytorch_model.bin``, ...), naming the conversion;
            one holding a PEFT adapter, or an index naming shards that are not ``.safetensors`` files of the folder.
        Whatever transformers' ``from_pretrained`` raises for the checkpoint (the converting path checks first
        and hands every case it does not cover to transformers); OSError if a weights file is shorter than its
        header says.
    """
    folder = checkpoint_folder(model_id, kwargs.get("subfolder"))
    kwargs.setdefault("use_safetensors", True)  # a pickle (pytorch_model.bin) is never loaded: it can run code
    if os.path.isdir(folder) and _safetensors_files(folder) is None:
        pickled = sorted(name for name in os.listdir(folder) if name.endswith((".bin", ".pt", ".pth", ".ckpt")))
        if pickled:
            raise ValueError(
                f"{folder} holds its weights only as pickles ({', '.join(pickled[:3])}); loading a pickle can run "
                "code, and optimum-ipex-spec reads safetensors only. Convert the checkpoint once, where you trust it: "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder, safe_serialization=True)")
    if os.path.isdir(folder):
        _check_local_files(folder)
    plan = conversion_plan(folder, dtype, kwargs)
    if plan is None:
        return AutoModelForCausalLM.from_pretrained(model_id, **{**kwargs, _dtype_kwarg(): dtype})
    config, entries = plan
    model = _build_uninitialised(config, dtype)
    reason = "an unverified class, or modules kept in fp32" if model is None else _mismatch(model, entries)
    if reason is not None:
        logger.debug("%s: loaded by transformers (%s)", model_id, reason)
        del model
        return AutoModelForCausalLM.from_pretrained(model_id, **{**kwargs, _dtype_kwarg(): dtype})
    logger.debug("%s: converting its safetensors to %s while reading them", model_id, dtype)
    _read_into(model, entries)
    model.generation_config = GenerationConfig.from_pretrained(folder)  # conversion_plan required the file
    return model.eval()


def _check_local_files(folder: str) -> None:
    """What transformers would follow out of a local checkpoint folder, refused: a PEFT adapter (it names a base model
    and may hold pickled weights) and an index whose shard names are not ``.safetensors`` files of the folder."""
    from .export_folder import weight_files
    from .manifest import FOLLOWED_NAMES

    adapters = [name for name in FOLLOWED_NAMES if os.path.lexists(os.path.join(folder, name))]
    if adapters:
        raise ValueError(f"{folder} holds a PEFT adapter ({adapters[0]}): transformers would load the base model it "
                         "names, and its weights may be pickled. Merge the adapter into its base model where you trust "
                         "it (peft's merge_and_unload(), then save_pretrained) and pass that folder")
    weight_files(folder, "a checkpoint's weights must be .safetensors files of its own folder")


def conversion_plan(folder: str, dtype: torch.dtype, kwargs: dict) -> Optional[Tuple[object, Dict[str, TensorEntry]]]:
    """The config and the tensor table for the converting load, or ``None`` where transformers should load it
    (the reason is logged at debug level)."""
    def decline(reason: str):
        logger.debug("%s: loaded by transformers (%s)", folder, reason)
        return None

    if not os.path.isdir(folder):
        return decline("not a local folder")
    extra = sorted(set(kwargs) - set(LOCAL_NEUTRAL_KWARGS))  # subfolder too: transformers names the config after it
    if extra:
        return decline(f"keywords {extra}")
    files = _safetensors_files(folder)
    if files is None:
        return decline("no safetensors weights")
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return decline("no generation_config.json: transformers' defaults for it differ between releases")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        return decline(f"config: {exc}")
    if getattr(config, "auto_map", None) or getattr(config, "quantization_config", None):
        return decline("remote code or a quantized checkpoint")
    architectures = getattr(config, "architectures", None) or []
    if not architectures or any(name not in VERIFIED_ARCHITECTURES for name in architectures):
        return decline(f"architecture {architectures} not among {VERIFIED_ARCHITECTURES}")
    try:
        entries = _tensor_table(folder, files)
    except (OSError, ValueError, KeyError) as exc:
        return decline(f"unreadable header: {exc}")
    if all(entry[2] == dtype or not entry[2].is_floating_point for entry in entries.values()):
        return decline(f"already {dtype}: transformers maps it without a copy")
    return config, entries


def _dtype_kwarg() -> str:
    return "dtype" if transformers_major() >= 5 else "torch_dtype"


def _safetensors_files(folder: str) -> Optional[List[str]]:
    """The weight files transformers would read, in its order of preference: one file, else the sharded index."""
    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
        return [SAFE_WEIGHTS_NAME]
    if os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)):
        with open(os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME)) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return None


def _tensor_table(folder: str, files: List[str]) -> Dict[str, TensorEntry]:
    """Every tensor of the checkpoint: name -> (file, data start, dtype, shape, begin, end) from the headers."""
    entries = {}
    for name in files:
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        if (header.get("__metadata__") or {}).get("format") != "pt":
            raise ValueError(f"{name} is not marked a PyTorch safetensors file (transformers 4 refuses it)")
        for key, info in header.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{key} has dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            size = torch.empty((), dtype=SAFETENSORS_DTYPES[info["dtype"]]).element_size()
            for extent in info["shape"]:
                size *= extent
            if end - begin != size:
                raise ValueError(f"{key}: {end - begin} bytes for shape {info['shape']}")
            entries[key] = (path, 8 + length, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), begin, end)
    return entries


def _build_uninitialised(config, dtype: torch.dtype) -> Optional[PreTrainedModel]:
    """The model transformers builds for ``config`` in ``dtype``, parameters allocated but not initialised; ``None``
    for a class outside :data:`VERIFIED_ARCHITECTURES` or one that keeps modules in fp32."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, **{_dtype_kwarg(): dtype})
    if type(model).__name__ not in VERIFIED_ARCHITECTURES:  # the class comes from model_type, not "architectures"
        return None
    model.tie_weights()  # transformers 5 ties in from_pretrained, after the weights are read
    if transformers_major() < 5:
        model.config.torch_dtype = dtype  # what 4.x's from_pretrained records (5's from_config does)
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        return None
    return model


def _mismatch(model: PreTrainedModel, entries: Dict[str, TensorEntry]) -> Optional[str]:
    """Why the checkpoint's tensors are not exactly the model's (names, shapes, one per tensor), or ``None``."""
    targets = model.state_dict(keep_vars=True)
    names_of = {}  # a tied head is one tensor under two names; the checkpoint must hold it under one
    for name, tensor in targets.items():
        names_of.setdefault(tensor.data_ptr(), []).append(name)
    for name, entry in entries.items():
        if name not in targets:
            return f"the model has no {name}"
        if tuple(targets[name].shape) != entry[3]:
            return f"{name} is {entry[3]} in the checkpoint, {tuple(targets[name].shape)} in the model"
    for names in names_of.values():
        held = [name for name in names if name in entries]
        if len(held) != 1:
            return f"the checkpoint holds {held or 'none'} of {names}"
    return None


def _read_into(model: PreTrainedModel, entries: Dict[str, TensorEntry]) -> None:
    """Read each checkpoint tensor into the model's tensor of that name, converting piece by piece (in the
    tensor's byte order in the file: reads move forward)."""
    targets = model.state_dict(keep_vars=True)
    piece = torch.empty(PIECE_BYTES, dtype=torch.uint8)
    view = piece.numpy()
    by_file: Dict[str, List[str]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry[0], []).append(name)
    for path, names in by_file.items():
        with open(path, "rb", buffering=0) as f:
            for name in sorted(names, key=lambda n: entries[n][4]):
                _, start, source_dtype, _, begin, end = entries[name]
                target = targets[name].data.view(-1)
                item = torch.empty((), dtype=source_dtype).element_size()
                count, done = (end - begin) // item, 0
                while done < count:
                    n = min(PIECE_BYTES // item, count - done)
                    f.seek(start + begin + done * item)
                    if f.readinto(view[: n * item]) != n * item:
                        raise OSError(f"{path} ends inside {name}")
                    target[done:done + n].copy_(piece[: n * item].view(source_dtype))
                    done += n
