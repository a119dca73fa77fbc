"""Facts every other module reads: supported architectures, tasks, dtypes, backends, export file names, pins.

Each fact is defined here once. This module imports nothing heavy (``optimum-cli --help`` reads it): torch is
imported inside :func:`resolve_dtype` only.
"""

from __future__ import annotations

from typing import Any, Optional

#: transformers model classes we validate token-exact on IPEX's fused path and run on our pure-PyTorch decoder
#: (pre-norm decoder layers, rotary positions, grouped-query attention). Others run on transformers' forward.
LLAMA_FAMILY_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

#: export tasks (``optimum-cli export ipex --task``); both export a causal LM with its KV cache
TASKS = ("text-generation", "text-generation-with-past")

#: dtype names accepted by ``torch_dtype=`` (and the CLI's ``--torch_dtype``), with the canonical name of each
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
#: canonical dtype names an export can have
EXPORT_DTYPES = ("float32", "bfloat16")

#: ``backend=`` values: "auto" (IPEX when usable, else the pure-PyTorch path), "ipex", "torch"
BACKENDS = ("auto", "ipex", "torch")

#: how the pure-PyTorch decoder holds its weights: "dense" (the model's dtype), "int8" (weight-only, per-channel
#: scales, bf16 activations: ``from_pretrained(..., weights="int8")``, ``self_draft(weights="int8")``), "int4"
#: (quantized at load into ggml Q4_K / Q4_1 blocks, fp32 activations,
#: :mod:`~optimum_ipex_spec.backends.pytorch.int4_weights`) or
#: "gguf" (a GGUF file's blocks as shipped, fp32 activations: ``from_pretrained(..., weights="gguf")``,
#: :mod:`~optimum_ipex_spec.backends.pytorch.gguf_weights`)
WEIGHT_FORMATS = ("dense", "int8", "int4", "gguf")
#: the formats whose projections are :class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFLinear` blocks
BLOCK_WEIGHT_FORMATS = ("int4", "gguf")

#: files of an export folder (besides transformers' config.json / generation_config.json)
EXPORT_CONFIG_NAME = "ipex_export.json"
IPEX_GRAPH_NAME = "ipex_model.pt"
#: export format 1 only: the frozen verification graph in a file of its own
IPEX_VERIFY_GRAPH_NAME = "ipex_verify_model.pt"
#: every file of an export folder with its size and sha256, written last (format 3)
MANIFEST_NAME = "manifest.json"
#: 1: frozen decode graph in ipex_model.pt, frozen verification graph in ipex_verify_model.pt;
#: 2: both traces, unfrozen and sharing their weights, in ipex_model.pt;
#: 3: data only: the weights in safetensors (both backends), JSON, and the manifest; IPEX's graphs are traced again
#: where they are loaded. 1 and 2 hold TorchScript programs: read only with ``trust_torchscript=True``
EXPORT_FORMAT_VERSION = 3
#: the first format whose folders hold no program (the manifest is required from it on)
DATA_ONLY_FORMAT_VERSION = 3
#: attribute set on a transformers model that an export handed to ``ipex.llm.optimize`` (modified in place)
IPEX_OPTIMIZED_MARK = "_optimum_ipex_spec_optimized"

#: model names that :mod:`optimum_ipex_spec.provisioning.provision` builds from package-index wheels (accepted wherever
#: a model id is), and their short aliases
PROVISIONED_MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-1.5b-instruct",
                      "qwen2.5-coder-0.5b-instruct")
MODEL_ALIASES = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m", "qwen-1.5b": "qwen2.5-coder-1.5b-instruct",
                 "qwen-0.5b": "qwen2.5-coder-0.5b-instruct"}

#: the IPEX lane this package is validated on (docs/setup.md, "Version lanes")
IPEX_PIP_COMMAND = (
    'pip install "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" "transformers==4.51.3"'
    "   # or: pip install 'optimum-ipex-spec[ipex]'"
)
#: assisted generation with an IPEX model needs this IPEX or newer (the fused cache layout we crop)
MIN_IPEX_FOR_ASSISTED = "2.4"


def is_provisioned_name(name: str) -> bool:
    """True for a name (or alias) in :data:`PROVISIONED_MODELS`."""
    return MODEL_ALIASES.get(name, name) in PROVISIONED_MODELS


def canonical_dtype_name(torch_dtype: Any) -> str:
    """``"float32"`` or ``"bfloat16"`` for a ``torch.dtype`` or a name in :data:`DTYPE_NAMES`.

    Raises:
        ValueError: any other dtype (IPEX's fused path and our decoder are validated for fp32 and bf16 only).
    """
    name = torch_dtype if isinstance(torch_dtype, str) else str(torch_dtype).replace("torch.", "")
    if name not in DTYPE_NAMES:
        raise ValueError(f"torch_dtype={torch_dtype!r} is not supported; use torch.float32 or torch.bfloat16")
    return DTYPE_NAMES[name]


def resolve_dtype(torch_dtype: Any, config: Optional[Any] = None):
    """Map ``torch_dtype`` (None, "auto", a name in :data:`DTYPE_NAMES` or a ``torch.dtype``) to
    ``torch.float32`` or ``torch.bfloat16``. None means fp32; "auto" reads ``config.torch_dtype`` (fp32 when it
    is neither).

    Raises:
        ValueError: any other dtype.
    """
    import torch

    if torch_dtype is None:
        return torch.float32
    if torch_dtype == "auto":
        configured = getattr(config, "torch_dtype", None) if config is not None else None
        try:
            return getattr(torch, canonical_dtype_name(configured)) if configured is not None else torch.float32
        except ValueError:
            return torch.float32
    return getattr(torch, canonical_dtype_name(torch_dtype))


def dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32`` (transformers' spelling in config files)."""
    return str(dtype).replace("torch.", "")


def check_causal_lm_config(config: Any, model_id: str) -> None:
    """Raise ``ValueError`` when ``config`` does not describe a causal (decoder-only) language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = getattr(config, "architectures", None) or []
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if getattr(config, "is_encoder_decoder", False) or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{model_id} is a {config.model_type!r} model ({', '.join(archs) or 'no architectures'}), not a causal "
            "language model: IPEXModelForCausalLM loads decoder-only text-generation models such as Llama, "
            "Mistral or Qwen2. Use the matching transformers AutoModel class for this model."
        )
    if archs and not any(a in causal_names or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"{model_id} declares architectures {archs}: not a causal language model. "
            "IPEXModelForCausalLM needs a decoder-only *ForCausalLM checkpoint (Llama, Mistral, Qwen2, ...)."
        )
