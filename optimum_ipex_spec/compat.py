"""Every difference between the transformers and IPEX releases we support, as one named function each.

The rest of the package asks these functions and never parses a version itself. Lanes (docs/setup.md): IPEX 2.8 /
torch 2.8 / transformers 4.51.3, IPEX 2.7, and no IPEX with transformers 5.x.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def parse_version(version: str):
    """A ``packaging`` ``Version`` of ``version`` without its local part (``2.8.0+cpu`` -> ``2.8.0``)."""
    from packaging.version import Version

    return Version(str(version).split("+")[0])


@functools.lru_cache(maxsize=None)
def transformers_major() -> int:
    """The installed transformers' major version (4 or 5)."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def cache_kwarg() -> str:
    """The name of the cache argument of ``generate()`` / ``forward()``: ``cache`` in transformers 5, else
    ``past_key_values``."""
    return "cache" if transformers_major() >= 5 else "past_key_values"


@functools.lru_cache(maxsize=None)
def logits_to_keep_kwarg() -> str:
    """The name under which transformers' causal-LM ``forward`` takes how many last positions to give logits for:
    ``logits_to_keep`` from 4.50, ``num_logits_to_keep`` before."""
    import transformers

    new = parse_version(transformers.__version__) >= parse_version("4.50")
    return "logits_to_keep" if new else "num_logits_to_keep"


def gguf_config_mapping() -> dict:
    """transformers' table from GGUF metadata keys to config attributes, as the installed release reads a GGUF file's
    config: ``{prefix: {key: attribute or None}}`` with prefixes ``general``, ``tokenizer`` and the architectures
    (``transformers.integrations.ggml.GGUF_CONFIG_MAPPING``, the same in 4.51 and 5.x; which keys each architecture
    maps differs between releases, hence this lookup rather than a copy)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return GGUF_CONFIG_MAPPING


def crop_zero_removes_nothing() -> bool:
    """transformers >= 5 calls ``cache.crop(0)`` meaning "remove 0 tokens"; 4.x never calls it (there it would
    mean "keep 0 tokens", which no caller asks for)."""
    return transformers_major() >= 5


def crop_keep_length(current: int, max_length: int) -> int:
    """How many tokens a cache of ``current`` tokens keeps after ``crop(max_length)``: ``max_length`` when it is
    positive, ``current + max_length`` when negative (drop ``-max_length``), and ``crop(0)`` per
    :func:`crop_zero_removes_nothing`; never more than ``current``. Both our caches crop through this.

    Raises:
        ValueError: more tokens to drop than cached.
    """
    if max_length < 0 or (max_length == 0 and crop_zero_removes_nothing()):
        keep = current + max_length
    else:
        keep = max_length
    if keep < 0:
        raise ValueError(f"cannot crop a cache of {current} tokens by {max_length}")
    return min(keep, current)


def zero_proposals_add_nothing() -> bool:
    """transformers 4.x's assisted decoding adds no token in a round whose candidate (even with zero proposals)
    already meets a stopping criterion; 5.x adds the target's own token."""
    return transformers_major() < 5


def needs_module_crop_hook(transformers_version: str) -> bool:
    """transformers <= 4.53 crops caches through the module function ``_crop_past_key_values`` (only
    ``DynamicCache`` instances via ``.crop``); from 4.54 it calls ``Cache.crop``."""
    return parse_version(transformers_version) < parse_version("4.54")


def static_caches_refuse_assisted() -> bool:
    """transformers 4.x refuses assisted generation for a model whose default cache is static, hybrid or
    sliding-window (Gemma 2/3); 5.x crops those caches itself."""
    return transformers_major() < 5


def returns_attention_weights(attn_implementation: str) -> bool:
    """Whether transformers' forward returns attention weights for ``output_attentions=True`` with this attention
    implementation (``config._attn_implementation``): ``"eager"`` always; ``"sdpa"`` in transformers 4.x, which falls
    back to eager attention for such a call (4.51 checked), not in 5.x, which returns an empty tuple and logs a
    warning (its assisted decoding then fails with an IndexError)."""
    return attn_implementation == "eager" or (attn_implementation == "sdpa" and transformers_major() < 5)


def reads_gemma3_gguf() -> bool:
    """Reading a Gemma 3 GGUF needs transformers >= 5."""
    return transformers_major() >= 5


def same_ipex_release(saved: str, installed: str) -> bool:
    """A graph exported with IPEX ``saved`` loads with IPEX ``installed`` when major.minor agree."""
    return parse_version(saved).release[:2] == parse_version(installed).release[:2]


def major_minor(version: str) -> tuple:
    """``(2, 8)`` for ``"2.8.0+cpu"``."""
    parts = str(version).split("+")[0].split(".")
    return tuple(int(p) for p in parts[:2] if p.isdigit())


def ipex_matches_torch(ipex_version: str, torch_version: str) -> bool:
    """IPEX X.Y imports only next to torch X.Y.* (its wheel does not pin torch)."""
    return major_minor(ipex_version) == major_minor(torch_version)


def torch_at_least(minimum: str) -> bool:
    """True when the installed torch is ``minimum`` or newer (its local part, ``+cpu``, ignored)."""
    import torch

    return parse_version(torch.__version__) >= parse_version(minimum)


def ipex_older_than(ipex_version: str, minimum: str) -> bool:
    """True when IPEX ``ipex_version`` predates ``minimum``."""
    return parse_version(ipex_version) < parse_version(minimum)


def eos_token_tensor(generation_config: Any):
    """The EOS ids transformers prepared for this call (``generation_config._eos_token_tensor``, 4.45-5.x)."""
    return getattr(generation_config, "_eos_token_tensor", None)


def vocabulary_translator(target_tokenizer, assistant_tokenizer, vocab_size: int, assistant_model):
    """transformers' ``AssistantVocabTranslatorCache.get_translator`` for universal speculative sampling, with the
    draft's LM head left whole (4.52+ would prune it in place: a traced graph or our packed decoder cannot take
    that; without pruning, transformers masks the draft's tokens outside the shared vocabulary instead).

    Raises:
        ImportError: transformers < 4.50 (no universal speculative decoding).
    """
    from transformers.generation.candidate_generator import AssistantVocabTranslatorCache

    accepted = inspect.signature(AssistantVocabTranslatorCache.get_translator).parameters
    if "assistant_prune_lm_head" in accepted:
        return AssistantVocabTranslatorCache.get_translator(
            target_tokenizer, assistant_tokenizer, vocab_size, assistant_model=assistant_model,
            assistant_prune_lm_head=False)
    return AssistantVocabTranslatorCache.get_translator(
        target_tokenizer, assistant_tokenizer, vocab_size, assistant_model.device)


def prepare_cache_capacity(args: tuple, default: int = 256) -> int:
    """The ``max_cache_length`` transformers passes to ``_prepare_cache_for_generation`` after ``batch_size``:
    4.x ``(..., assistant_model, batch_size, max_cache_length, device)``, 5.x ``(..., generation_mode, batch_size,
    max_cache_length)``; ``args`` are the arguments after ``batch_size``."""
    return args[0] if args and isinstance(args[0], int) else default

# ---------------------------------------------------------------------------------------------------------------
# What transformers' GenerationMixin.generate reads from PreTrainedModel besides forward. IPEXModelForCausalLM is an
# optimum OptimizedModel (not a PreTrainedModel), so it supplies these members itself. transformers 4.4x-4.5x read
# few of them; 5.x reads more (experts switching, compiled calls, multimodal checks). Each answers as a plain
# text-only causal LM without MoE or tensor parallelism.


class GenerationCompatMixin:
    """PreTrainedModel members read by ``GenerationMixin.generate`` (transformers 4.48-5.x)."""

    input_modalities = ("text",)
    tp_plan = None
    hf_quantizer = None

    @property
    def base_model(self):
        return self

    def get_experts_implementation(self) -> dict:
        """No mixture-of-experts layers: nothing to switch for decoding (5.x ``_optimize_model_for_decode``)."""
        return {}

    def set_experts_implementation(self, *args, **kwargs) -> None:
        return None

    def get_compiled_call(self, compile_config):
        """Our forward is already a traced graph (IPEX) or the chosen PyTorch path; generate() calls it as is."""
        return self.__call__

    def is_remote_code(self) -> bool:
        return False

    def get_input_embeddings(self):
        return self._eager_module("get_input_embeddings")

    def get_output_embeddings(self):
        """Raises NotImplementedError: the LM head is baked into the traced graph (IPEX) or packed for the
        decoder (PyTorch path). transformers >= 4.52 asks for it when a *transformers* target samples with an
        ``IPEXModelForCausalLM`` draft of another tokenizer (it prunes the draft's head in place)."""
        raise NotImplementedError(
            "IPEXModelForCausalLM does not expose its LM head for replacement. Universal speculative sampling "
            "(do_sample=True, tokenizer= and assistant_tokenizer=) with a transformers target prunes the draft's "
            "LM head: use an IPEXModelForCausalLM target (it keeps the head and masks instead), a transformers "
            "draft, or greedy decoding"
        )

    def _eager_module(self, name):
        getter = getattr(getattr(self, "model", None), name, None)
        if getter is None:
            raise NotImplementedError(
                f"{name}() is not available on the IPEX backend (the weights live inside the traced graph); "
                "load with backend='torch' to reach the embeddings"
            )
        return getter()
