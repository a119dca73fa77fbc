"""Where ``from_pretrained(..., weights="gguf")`` finds its GGUF file, config and generation config, and the checks
it makes before any tensor is read. The model itself is built by
:func:`~optimum_ipex_spec.backends.pytorch.gguf_weights.load_gguf_model`.

Three ways to name the file, as transformers users name one (its ``gguf_file=`` keyword):

* a provisioned model name with ``weights="gguf"``: the GGUF its package ships
  (:func:`~optimum_ipex_spec.provisioning.provision.gguf_source`, called by ``from_pretrained``), with the
  provisioned folder's config, generation config and tokenizer;
* a folder and ``gguf_file="name.gguf"`` inside it: the folder's ``config.json`` when it has one, else the config
  transformers reads from the GGUF's metadata;
* a path to a ``.gguf`` file.

Unlike transformers (which dequantizes a GGUF to the dtype asked for), the blocks stay as the file holds them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.pytorch.gguf_weights import ARCHITECTURES
from ..compat import gguf_config_mapping
from ..kernels.gguf import MODES

logger = logging.getLogger(__name__)


@dataclass
class GGUFSource:
    """A GGUF file to load: ``path``, and ``folder`` (a transformers folder for its config, generation config and
    tokenizer) or None."""

    path: str
    folder: Optional[str]


def wants_gguf(model_id: str, kwargs: dict) -> bool:
    """True when a ``from_pretrained`` call asks for GGUF weights: ``weights="gguf"``, ``gguf_file=``, ``gguf_mode=``
    without another ``weights`` (``weights="int4"`` runs on the same kernels), or a path to a ``.gguf`` file."""
    return (kwargs.get("weights") == "gguf" or kwargs.get("gguf_file") is not None
            or (kwargs.get("gguf_mode") is not None and kwargs.get("weights", "gguf") == "gguf")
            or (str(model_id).endswith(".gguf") and os.path.isfile(str(model_id))))


def locate(model_id: str, gguf_file: Optional[str]) -> GGUFSource:
    """The GGUF file and config folder that ``model_id`` / ``gguf_file`` name (module docstring); a provisioned
    name is resolved by :func:`~optimum_ipex_spec.provisioning.provision.gguf_source`.

    Raises:
        FileNotFoundError: no such file or folder; a folder without ``gguf_file`` and with no ``.gguf`` file, or
            with several (the message lists them).
        ValueError: ``gguf_file`` is not a plain file name inside the folder.
    """
    model_id = str(model_id)
    if os.path.isfile(model_id):
        if gguf_file is not None:
            raise ValueError("pass either a path to a .gguf file or a folder with gguf_file=, not both")
        folder = os.path.dirname(os.path.abspath(model_id))
        return GGUFSource(model_id, folder if os.path.isfile(os.path.join(folder, "config.json")) else None)
    if not os.path.isdir(model_id):
        raise FileNotFoundError(f"{model_id} is neither a GGUF file, a folder, nor a provisioned model name "
                                "(weights='gguf' reads a local .gguf file; the hub is not searched)")
    if gguf_file is None:
        found = sorted(name for name in os.listdir(model_id) if name.endswith(".gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f"{model_id} holds {len(found)} .gguf files ({', '.join(found[:5]) or 'none'}), and "
                                    "weights='gguf' / gguf_mode= load one: name it with gguf_file=")
        gguf_file = found[0]
    if os.path.basename(gguf_file) != gguf_file or gguf_file in (".", ".."):
        raise ValueError(f"gguf_file={gguf_file!r} must be the name of a file inside {model_id}, not a path")
    path = os.path.join(model_id, gguf_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_id} has no file {gguf_file}")
    return GGUFSource(path, model_id if os.path.isfile(os.path.join(model_id, "config.json")) else None)


def check_options(torch_dtype, backend: str, kwargs: dict) -> None:
    """Refuse what GGUF weights cannot honour, before the file is read.

    Raises:
        ValueError: a dtype other than fp32 (the kernel multiplies fp32 activations; the blocks are the weights'
            precision); ``backend="ipex"``; ``export=False``; options of a hub download (``revision``, ``subfolder``,
            ``token``...) or ``trust_remote_code``; a ``gguf_mode`` other than "exact" and "fast".
    """
    mode = kwargs.get("gguf_mode")
    if mode is not None and mode not in MODES:
        raise ValueError(f"gguf_mode must be one of {MODES}, got {mode!r}")
    if torch_dtype not in (None, "auto", "float32", torch.float32):
        raise ValueError(f"weights='gguf' multiplies fp32 activations by the file's blocks; got torch_dtype="
                         f"{torch_dtype!r}. Leave torch_dtype out (or pass torch.float32)")
    if backend == "ipex":
        raise ValueError("weights='gguf' runs on our pure-PyTorch decoder: pass backend='auto' or 'torch'")
    if kwargs.get("export") is False:
        raise ValueError("weights='gguf' builds the model from the file (there is no export to load): drop "
                         "export=False")
    hub = [name for name in ("revision", "subfolder", "token", "cache_dir", "force_download", "trust_remote_code",
                             "trust_torchscript", "config") if kwargs.get(name)]
    if hub:
        raise ValueError(f"weights='gguf' reads a local GGUF file; {', '.join(hub)} do not apply to it")


def config_from_metadata(gguf):
    """The transformers config of a GGUF file's metadata (``gguf``: a
    :class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFFile`)
    as the installed transformers builds it for a ``llama`` or ``qwen2`` file: its key table
    (:func:`~optimum_ipex_spec.compat.gguf_config_mapping`) over the ``general``, architecture and ``tokenizer`` keys,
    the head tied where the file has no ``output.weight``, the vocabulary's length where the metadata has no
    ``vocab_size``, a one-element array read as its element. None for another architecture, and for a ``llama`` file
    whose ``general.name`` mentions Mistral (transformers may read it as Mistral): the caller then asks transformers.

    transformers reads the same metadata with gguf-py's reader, which spends about 9 s on a 151,936-token vocabulary;
    our header reader steps over it (:mod:`~optimum_ipex_spec.kernels.gguf_header`). A test compares both configs on
    every provisioned file."""
    from transformers import AutoConfig

    fields, architecture = gguf.fields, gguf.architecture
    name = fields.get("general.name")
    mapping = gguf_config_mapping()
    if (architecture not in ARCHITECTURES or architecture not in mapping
            or (isinstance(name, str) and "mistral" in name)):
        return None
    values = {"tie_word_embeddings": "output.weight" not in gguf.tensors}
    for prefix in ("general", architecture, "tokenizer"):
        for key, attribute in mapping.get(prefix, {}).items():
            if attribute not in (None, -1) and f"{prefix}.{key}" in fields:
                value = fields[f"{prefix}.{key}"]
                values[attribute] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in gguf.array_lengths:
        values["vocab_size"] = gguf.array_lengths["tokenizer.ggml.tokens"]
    config = AutoConfig.for_model(**values)
    config._name_or_path = os.path.dirname(os.path.abspath(gguf.path))  # as from_pretrained(folder, gguf_file=) sets
    return config


def read_config(source: GGUFSource, gguf=None):
    """``(config, generation_config)`` for ``source``: the folder's, or those of the GGUF's metadata
    (:func:`config_from_metadata` on ``gguf``, the file already read; else transformers'
    ``AutoConfig.from_pretrained(..., gguf_file=...)``)."""
    from transformers import AutoConfig, GenerationConfig

    if source.folder is not None:
        config = AutoConfig.from_pretrained(source.folder)
        try:
            generation = GenerationConfig.from_pretrained(source.folder)
        except OSError:  # no generation_config.json
            generation = GenerationConfig.from_model_config(config)
        return config, generation
    config = config_from_metadata(gguf) if gguf is not None else None
    if config is None:
        folder, name = os.path.split(os.path.abspath(source.path))
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    return config, GenerationConfig.from_model_config(config)
