"""``IPEXModelForCausalLM``: a transformers-compatible causal LM running IPEX's fused, traced graph.

Data flow: :mod:`.exporters.ipex` turns a transformers model into traced TorchScript graphs with
IPEX's fused kernels; this module wraps the graph (or, without IPEX, the eager model) in an
optimum ``OptimizedModel`` that is also a transformers ``GenerationMixin``, so ``generate()``,
streamers, stopping criteria and ``pipeline("text-generation")`` work as with transformers.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import transformers
from optimum.modeling_base import OptimizedModel
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GenerationMixin, PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache import IPEXFusedCache
from .candidates import (
    AdaptivePromptLookupCandidateGenerator,
    IPEXDraftCandidateGenerator,
    StoppingCriteriaAwareCandidates,
    stop_proposals_at_stopping_criteria,
)
from .generation_compat import GenerationCompatMixin
from .exporters.ipex import (
    IPEX_FUSED_ARCHITECTURES,
    IPEXGraphs,
    export_to_ipex,
    first_architecture,
    ipex_supports,
    load_ipex_graphs,
    save_ipex_graph,
    save_ipex_graphs,
)
from .patching import generation_patches, register_for_pipelines
from .torch_cache import PreallocatedKVCache
from .torch_model import SUPPORTED_ARCHITECTURES as DECODER_ARCHITECTURES, TorchCausalLMDecoder
from .utils.fs import looks_like_local_path
from .utils.import_utils import ipex_status, log_fallback_once, parse_version, require_ipex, transformers_major

logger = logging.getLogger("optimum_ipex_spec")

def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: logits at position t predict labels at t+1; -100 is ignored."""
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, -logits.shape[1]:][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


#: TorchScript's profiling executor re-specializes a graph for each new input shape (2 static
#: specializations, then dynamic ones). Speculative decoding feeds ever-changing shapes (cache length,
#: chunk length); going dynamic at once avoids repeated re-optimization: measured on a tiny Llama,
#: 85 ms -> 0.6 ms per decode step; on SmolLM2 the steady decode is unchanged (35-36 ms). Applied only
#: around our graph calls and restored after each.
GRAPH_FUSION_STRATEGY = [("DYNAMIC", 20)]

EXPORT_CONFIG_NAME = "ipex_export.json"
#: attribute set on a transformers model that an export handed to ``ipex.llm.optimize`` (modified in place)
IPEX_OPTIMIZED_MARK = "_optimum_ipex_spec_optimized"
IPEX_GRAPH_NAME = "ipex_model.pt"
IPEX_VERIFY_GRAPH_NAME = "ipex_verify_model.pt"
#: 1: frozen decode graph in ipex_model.pt, frozen verification graph in ipex_verify_model.pt;
#: 2: both traces, unfrozen and sharing their weights, in ipex_model.pt (read: 1 and 2)
EXPORT_FORMAT_VERSION = 2
BACKENDS = ("auto", "ipex", "torch")
#: transformers 5 renamed generate()'s and forward()'s ``past_key_values`` to ``cache``.
TRANSFORMERS_MAJOR = transformers_major()
CACHE_KWARG = "cache" if TRANSFORMERS_MAJOR >= 5 else "past_key_values"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(torch_dtype: Union[None, str, torch.dtype], config: Optional[PretrainedConfig] = None) -> torch.dtype:
    """Map ``torch_dtype`` (None, "auto", "float32", "bfloat16" or a ``torch.dtype``) to fp32 or bf16.

    Raises:
        ValueError: any other dtype (IPEX's fused path is validated for fp32 and bf16 only).
    """
    if torch_dtype is None:
        return torch.float32
    if torch_dtype == "auto":
        configured = getattr(config, "torch_dtype", None) if config is not None else None
        if isinstance(configured, str):
            configured = _DTYPES.get(configured)
        return configured if configured in (torch.float32, torch.bfloat16) else torch.float32
    if isinstance(torch_dtype, str):
        if torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype={torch_dtype!r} is not supported; use torch.float32 or torch.bfloat16")
        return _DTYPES[torch_dtype]
    if torch_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"torch_dtype={torch_dtype} is not supported; use torch.float32 or torch.bfloat16")
    return torch_dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_causal_lm_config(config: PretrainedConfig, model_id: str) -> None:
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


@functools.lru_cache(maxsize=None)
def _log_eager_once(architecture: str) -> None:
    logger.warning(
        "%s runs transformers' own forward on the pure-PyTorch path (our preallocated-cache decoder covers %s)",
        architecture, ", ".join(DECODER_ARCHITECTURES),
    )


def _decoder_can_run(cache, kwargs) -> bool:
    """The pure-PyTorch decoder serves plain forwards on its own cache; anything else (a transformers cache,
    embeddings as input, attentions/hidden states/loss requested) goes to transformers' forward."""
    if cache is not None and not isinstance(cache, PreallocatedKVCache):
        return False
    wants = ("inputs_embeds", "labels", "output_attentions", "output_hidden_states", "head_mask")
    return not any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in wants)


def _universal_sampling_generator(target, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                  assistant_model, target_tokenizer, assistant_tokenizer):
    """transformers' universal speculative decoding (sampling with different tokenizers; Timor et al. 2025,
    transformers PR #35029), with the draft's LM head left whole.

    From 4.52 transformers prunes the draft's LM head to the vocabulary intersection, in place: a traced graph
    or our packed decoder cannot take that, and it would change a transformers draft for later calls. Without
    pruning, transformers masks the draft's tokens outside the intersection with a logits processor instead:
    the same proposals and probabilities."""
    import inspect

    try:
        from transformers.generation.candidate_generator import (
            AssistantVocabTranslatorCache,
            UniversalSpeculativeDecodingGenerator,
        )
    except ImportError:
        raise ValueError(
            "sampling (do_sample=True) with a draft of another tokenizer needs transformers >= 4.50 (universal "
            f"speculative decoding); transformers {transformers.__version__} is installed. Use greedy decoding "
            "(do_sample=False), a draft with the target's tokenizer, or a newer transformers."
        ) from None

    vocab_size = target.config.get_text_config().vocab_size
    accepted = inspect.signature(AssistantVocabTranslatorCache.get_translator).parameters
    if "assistant_prune_lm_head" in accepted:
        translator = AssistantVocabTranslatorCache.get_translator(
            target_tokenizer, assistant_tokenizer, vocab_size, assistant_model=assistant_model,
            assistant_prune_lm_head=False)
    else:
        translator = AssistantVocabTranslatorCache.get_translator(
            target_tokenizer, assistant_tokenizer, vocab_size, assistant_model.device)
    return UniversalSpeculativeDecodingGenerator(
        input_ids=input_ids, assistant_model=assistant_model, generation_config=generation_config,
        model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
        target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer, atm_translator=translator)


#: generate() arguments that transformers' assisted generation reads from the draft's own generation config
DRAFT_ARGUMENTS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
#: ... and those that only universal assisted generation (draft of another tokenizer) reads, also from the draft
UNIVERSAL_ARGUMENTS = ("assistant_lookbehind", "target_lookbehind")


def _assisted_arguments(generation_config, kwargs, candidate_generator) -> Dict[str, Any]:
    """Check the assisted-decoding arguments of a ``generate()`` call and return those the draft's generation config
    must carry for this call (``DRAFT_ARGUMENTS`` and ``UNIVERSAL_ARGUMENTS`` passed as keywords, which are removed
    from ``kwargs``, or set to a non-default value in a ``generation_config=`` passed to the call).

    Raises:
        ValueError: an argument without the strategy it configures: a draft argument without ``assistant_model``
            (or with ``candidate_generator``, which chooses its own proposals), a lookbehind without ``tokenizer=``
            and ``assistant_tokenizer=``, ``max_matching_ngram_size`` without ``prompt_lookup_num_tokens``, or
            ``prompt_lookup_num_tokens`` together with ``assistant_model`` (transformers would silently drop the
            draft).
    """
    assistant = kwargs.get("assistant_model")
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(kwargs.get("generation_config"), "prompt_lookup_num_tokens",
                                                            None))
    if assistant is not None and lookup is not None:
        raise ValueError(
            "pass either assistant_model (a draft model) or prompt_lookup_num_tokens (prompt lookup), not both: "
            "they are two different sources of draft tokens"
        )
    if kwargs.get("max_matching_ngram_size") is not None and lookup is None and candidate_generator is None:
        raise ValueError("max_matching_ngram_size configures prompt lookup: pass prompt_lookup_num_tokens=... too")
    if candidate_generator is not None and kwargs.get("max_matching_ngram_size") is not None:
        raise ValueError("max_matching_ngram_size configures prompt lookup; a candidate_generator makes its own "
                         "proposals: drop the argument")
    passed = {name: kwargs[name] for name in DRAFT_ARGUMENTS + UNIVERSAL_ARGUMENTS if kwargs.get(name) is not None}
    user_config = kwargs.get("generation_config")
    if user_config is not None and assistant is not None:
        defaults = GenerationConfig()
        for name in DRAFT_ARGUMENTS + UNIVERSAL_ARGUMENTS:
            configured = getattr(user_config, name, None)
            if (name not in passed and configured is not None and configured != getattr(defaults, name, None)
                    and configured != getattr(assistant.generation_config, name, None)):
                passed[name] = configured
    if not passed:
        return {}
    names = ", ".join(sorted(passed))
    if candidate_generator is not None:
        raise ValueError(f"{names} configure(s) a draft model (assistant_model=...); a candidate_generator makes its "
                         "own proposals: drop the argument(s) or configure your generator")
    if assistant is None:
        source = "prompt lookup counts its proposals with prompt_lookup_num_tokens" if lookup is not None else (
            "this call has no draft")
        raise ValueError(f"{names} configure(s) the draft model of speculative decoding: pass assistant_model=... "
                         f"({source})")
    universal = [name for name in UNIVERSAL_ARGUMENTS if name in passed]
    if universal and (kwargs.get("tokenizer") is None or kwargs.get("assistant_tokenizer") is None):
        raise ValueError(f"{', '.join(universal)} configure(s) universal assisted generation (a draft of another "
                         "tokenizer): pass tokenizer=... and assistant_tokenizer=... too")
    for name in passed:
        kwargs.pop(name, None)
    return passed


def _same_size_different_vocabularies(target, assistant, tokenizer, assistant_tokenizer) -> bool:
    """True when target and draft have the same vocabulary size but their tokenizers map tokens to different
    ids: plain assisted generation would feed the draft ids it reads as other tokens (correct output, but
    almost nothing accepted); universal assisted generation is the right strategy."""
    if assistant is None or tokenizer is None or assistant_tokenizer is None or tokenizer is assistant_tokenizer:
        return False
    sizes = (target.config.get_text_config().vocab_size, assistant.config.get_text_config().vocab_size)
    return sizes[0] == sizes[1] and tokenizer.get_vocab() != assistant_tokenizer.get_vocab()


class IPEXModelForCausalLM(GenerationCompatMixin, OptimizedModel, GenerationMixin):
    """A causal LM whose forward runs IPEX's fused kernels and fused KV cache from a traced graph.

    Create it with :meth:`from_pretrained` (``export=True`` for a transformers checkpoint or hub id,
    or a folder written by :meth:`save_pretrained`). It behaves like a transformers causal LM:

    * ``model(input_ids)`` returns ``CausalLMOutputWithPast`` with ``logits`` ``[batch, seq, vocab]``
      (model dtype) and ``past_key_values`` (an :class:`~optimum_ipex_spec.cache.IPEXFusedCache`);
    * ``model.generate(...)`` is transformers' ``GenerationMixin.generate``: greedy, sampling,
      streamers, stopping criteria, ``pipeline("text-generation", model=..., tokenizer=...)``.

    Attributes:
        backend: ``"ipex"`` (fused traced graph) or ``"torch"`` (pure-PyTorch path, used when IPEX
            is missing/mismatched or the architecture is not on IPEX's fused path).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
    """

    auto_model_class = AutoModelForCausalLM
    export_feature = "text-generation"
    main_input_name = "input_ids"
    base_model_prefix = "ipex_model"
    _supports_cache_class = True
    _is_stateful = False
    _supports_static_cache = False

    def __init__(
        self,
        model: Union[torch.jit.ScriptModule, torch.nn.Module],
        config: PretrainedConfig,
        backend: str,
        dtype: torch.dtype = torch.float32,
        generation_config: Optional[GenerationConfig] = None,
        model_save_dir: Optional[Union[str, Path]] = None,
        warmup: bool = True,
        verify_model: Optional[torch.jit.ScriptModule] = None,
        source: Optional[str] = None,
    ):
        if backend not in ("ipex", "torch"):
            raise ValueError(f"backend must be 'ipex' or 'torch', got {backend!r}")
        super().__init__(model, config)
        self.backend = backend
        self.verify_model = verify_model
        self.source = source
        #: SpeculationStats of the last assisted generate() that drafted with this model (greedy, IPEX draft).
        self.last_speculation_stats = None
        self._custom_candidates = threading.local()  # per-thread user candidate generator during generate()
        self._dtype = dtype
        self.model_save_dir = model_save_dir
        self.generation_config = generation_config or GenerationConfig.from_model_config(config)
        self._num_layers = config.get_text_config().num_hidden_layers
        #: pure-PyTorch decoder over a preallocated cache (torch backend, Llama-family architectures); else None
        self.decoder = None
        if backend == "torch":
            if TorchCausalLMDecoder.supports(model):
                self.decoder = TorchCausalLMDecoder(model)
            else:
                _log_eager_once(type(model).__name__)
        if backend == "ipex" and warmup:
            self._warmup()

    # ------------------------------------------------------------------ properties transformers reads
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def to(self, *args, **kwargs):
        """Accepts only the CPU (a no-op). dtype changes need a new export.

        Raises:
            ValueError: another device or a dtype.
        """
        for value in list(args) + list(kwargs.values()):
            if isinstance(value, torch.dtype):
                raise ValueError(
                    f"IPEXModelForCausalLM cannot change dtype in place ({self._dtype} -> {value}); export again with "
                    "from_pretrained(checkpoint, export=True, torch_dtype=...)"
                )
            if value is not None and not isinstance(value, bool) and torch.device(value).type != "cpu":
                raise ValueError(f"IPEXModelForCausalLM runs on the CPU only; got device={value}")
        return self

    def eval(self):
        return self

    def __repr__(self) -> str:
        return (
            f"IPEXModelForCausalLM(architecture={first_architecture(self.config)}, backend={self.backend}, "
            f"dtype={_dtype_name(self._dtype)}, layers={self._num_layers})"
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Union[IPEXFusedCache, PreallocatedKVCache, DynamicCache]] = None,
        position_ids: Optional[torch.LongTensor] = None,
        use_cache: bool = True,
        return_dict: bool = True,
        cache: Optional[Union[IPEXFusedCache, PreallocatedKVCache, DynamicCache]] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Run the model on ``input_ids`` int64 ``[batch, q]`` on top of ``past_key_values``.

        Args:
            input_ids: new tokens, int64 ``[batch, q]``.
            attention_mask: int64 ``[batch, past + q]`` (1 = attend, 0 = left padding); default all ones.
            past_key_values: cache from a previous call (IPEXFusedCache on the IPEX backend), or None.
            position_ids: int64 ``[batch, q]``; default derived from ``attention_mask``.

        Returns:
            ``CausalLMOutputWithPast`` with ``logits`` ``[batch, q, vocab]`` in the model dtype and the
            updated cache in ``past_key_values`` (None when ``use_cache=False``).

            labels: optional int64 ``[batch, past + q]``-aligned targets as in transformers (``-100`` ignored);
                the shifted cross-entropy is returned in ``loss``.

        Raises:
            TypeError: a cache of the wrong class for this backend; non-integer ``input_ids``.
            ValueError: (IPEX backend) empty or non-2-D ``input_ids``, token ids outside the vocabulary, a cache
                of another batch size or layer count, an ``attention_mask`` of the wrong length, more positions
                than ``config.max_position_embeddings`` (IPEX's rotary tables end there: the logits would be
                NaN), or ``output_attentions`` / ``output_hidden_states`` (the fused graph does not return them).
        """
        if past_key_values is None:
            past_key_values = cache  # transformers >= 5 spells it ``cache``
        if self.backend == "torch":
            if self.decoder is not None and _decoder_can_run(past_key_values, kwargs):
                return self._decoder_forward(input_ids, attention_mask, past_key_values, position_ids, use_cache,
                                             return_dict)
            outputs = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                return_dict=True,
                **{CACHE_KWARG: past_key_values},
                **kwargs,
            )
            return outputs if return_dict else outputs.to_tuple()

        labels = kwargs.pop("labels", None)
        for unsupported in ("output_attentions", "output_hidden_states"):
            if kwargs.get(unsupported):
                raise ValueError(f"{unsupported}=True is not available on the IPEX backend (the fused graph does not "
                                 "return them); load with backend='torch' to get them")
        cache = self._checked_cache(input_ids, past_key_values)
        batch, q = input_ids.shape
        past = cache.get_seq_length()
        attention_mask, position_ids, unpadded = self._mask_and_positions(attention_mask, position_ids, batch, past, q)
        graph = self.model
        if past > 0 and q > 1:
            # IPEX's fused attention is wrong for a chunk on a non-empty cache: use the verify graph.
            if self.verify_model is None or batch != 1 or not unpadded:
                logits = self._chunk_token_by_token(input_ids, attention_mask, position_ids, cache)
                out = CausalLMOutputWithPast(logits=logits, past_key_values=cache if use_cache else None)
                return out if return_dict else out.to_tuple()
            graph = self.verify_model
        previous = torch.jit.set_fusion_strategy(GRAPH_FUSION_STRATEGY)
        try:
            logits, layers = graph(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache.ipex_layers,
                position_ids=position_ids,
            )
        finally:
            torch.jit.set_fusion_strategy(previous)
        cache.replace(layers)
        loss = _causal_lm_loss(logits, labels) if labels is not None else None
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache if use_cache else None)
        return out if return_dict else out.to_tuple()

    def _mask_and_positions(self, attention_mask, position_ids, batch: int, past: int, q: int):
        """Default or check ``attention_mask`` int64 ``[batch, past + q]``; derive ``position_ids`` ``[batch, q]``
        from it when not given; return both and whether nothing is padded (one reduction per step).

        Raises:
            ValueError: ``attention_mask`` of another shape.
        """
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + q, dtype=torch.long)
        elif tuple(attention_mask.shape) != (batch, past + q):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {past + q}) = "
                "(batch, cached tokens + new tokens)"
            )
        unpadded = bool(attention_mask.all())
        if position_ids is None:
            position_ids = self._position_ids(attention_mask, past, q, unpadded)
        return attention_mask, position_ids, unpadded

    def new_cache(self, batch_size: int = 1, capacity: int = 256):
        """An empty KV cache for this model's forward: :class:`~optimum_ipex_spec.cache.IPEXFusedCache` (IPEX
        backend) or :class:`~optimum_ipex_spec.torch_cache.PreallocatedKVCache` (PyTorch path).

        Raises:
            NotImplementedError: an architecture that runs transformers' own forward (use its ``DynamicCache``).
        """
        if self.backend == "ipex":
            return IPEXFusedCache(self._num_layers, batch_size, self._dtype)
        if self.decoder is None:
            raise NotImplementedError(f"{first_architecture(self.config)} runs transformers' forward: use DynamicCache()")
        return self.decoder.new_cache(batch_size, capacity, self._dtype)

    def _decoder_forward(self, input_ids, attention_mask, cache, position_ids, use_cache, return_dict):
        """The pure-PyTorch path: :class:`~optimum_ipex_spec.torch_model.TorchCausalLMDecoder` over a
        :class:`~optimum_ipex_spec.torch_cache.PreallocatedKVCache` (created here when none is passed)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError("input_ids must be a non-empty 2-D tensor [batch, sequence]")
        batch, q = input_ids.shape
        if cache is None:
            cache = self.decoder.new_cache(batch, q, self._dtype)
        elif cache.batch_size != batch and cache.get_seq_length() == 0:
            cache.resize_batch(batch)
        elif cache.batch_size != batch:
            raise ValueError(f"the cache holds batch {cache.batch_size}; this call has batch {batch}")
        past = cache.get_seq_length()
        attention_mask, position_ids, unpadded = self._mask_and_positions(attention_mask, position_ids, batch, past, q)
        logits = self.decoder(input_ids, position_ids, attention_mask, cache, unpadded)
        out = CausalLMOutputWithPast(logits=logits, **{CACHE_KWARG: cache if use_cache else None})
        return out if return_dict else out.to_tuple()

    def _checked_cache(self, input_ids, past_key_values) -> IPEXFusedCache:
        """Validate inputs before they reach IPEX's kernels, which crash the process (SIGFPE/SIGSEGV/SIGABRT)
        or return NaN instead of raising on bad shapes."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a 2-D tensor [batch, sequence]")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        batch, q = input_ids.shape
        if batch == 0 or q == 0:
            raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); pass at least one token")
        vocab = self.config.get_text_config().vocab_size
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}) for this model; got values in [{low}, {high}]")
        if past_key_values is None:
            past_key_values = self.new_cache(batch)
        if not isinstance(past_key_values, IPEXFusedCache):
            raise TypeError(
                f"past_key_values must be an IPEXFusedCache for the IPEX backend, got {type(past_key_values).__name__}"
            )
        if past_key_values.batch_size != batch or past_key_values.num_layers != self._num_layers:
            raise ValueError(
                f"past_key_values was made for batch {past_key_values.batch_size} and {past_key_values.num_layers} "
                f"layers; this call has batch {batch} and the model {self._num_layers} layers"
            )
        limit = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        total = past_key_values.get_seq_length() + q
        if limit and total > limit:
            raise ValueError(
                f"{total} positions exceed max_position_embeddings={limit} of this model: IPEX's rotary tables end "
                "there and would return NaN. Shorten the prompt or max_new_tokens."
            )
        return past_key_values

    def _chunk_token_by_token(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Exact but slow path for a chunk on a cache (no verify graph, padded batch): one token per call."""
        _warn_once(
            "A chunk of several tokens on a non-empty IPEX cache without the exact verify graph (or with a padded "
            "batch) runs one token per forward: exact, but slower."
        )
        past = cache.get_seq_length()
        logits = []
        for i in range(input_ids.shape[1]):
            step = self.forward(
                input_ids[:, i : i + 1],
                attention_mask=attention_mask[:, : past + i + 1],
                past_key_values=cache,
                position_ids=position_ids[:, i : i + 1],
            )
            logits.append(step.logits)
        return torch.cat(logits, dim=1)

    @staticmethod
    def _position_ids(attention_mask: torch.Tensor, past: int, q: int, unpadded: bool) -> torch.Tensor:
        if unpadded:
            return torch.arange(past, past + q, dtype=torch.long).unsqueeze(0).expand(attention_mask.shape[0], -1)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        return position_ids[:, -q:]

    def _warmup(self, steps: int = 3) -> None:
        """Run the graph on a short prompt and a few decode steps so TorchScript's profiling
        executor specializes it before the first user call (IPEX's one-time "JIT pass will be
        deprecated" warning is emitted here and silenced)."""
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids = torch.ones(1, 8, dtype=torch.long)
            out = self.forward(ids)
            for _ in range(steps):
                self.forward(ids[:, :1], past_key_values=out.past_key_values)
            if self.verify_model is not None:
                # the first chunk calls of the verification graph compile its dynamic-shape fusions (~1 s)
                for chunk in (4, 2, 5):
                    self.forward(ids[:, :chunk], past_key_values=out.past_key_values)

    # ------------------------------------------------------------------ generation hooks
    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values=None,
        attention_mask: Optional[torch.LongTensor] = None,
        **kwargs,
    ) -> Dict[str, Any]:
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)
        if self.backend == "torch" and not (
            self.decoder is not None and (past_key_values is None or isinstance(past_key_values, PreallocatedKVCache))
        ):
            return self.model.prepare_inputs_for_generation(
                input_ids, attention_mask=attention_mask, **{CACHE_KWARG: past_key_values}, **kwargs
            )
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        inputs = {
            "input_ids": input_ids[:, past:],
            "attention_mask": attention_mask,
            CACHE_KWARG: past_key_values,
            "use_cache": kwargs.get("use_cache", True),
        }
        return inputs

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, assistant_model, batch_size, *args):
        # 4.x: (..., assistant_model, batch_size, max_cache_length, device); 5.x: (..., generation_mode, batch_size,
        # max_cache_length). batch_size counts the prompts; generate() expands each to num_return_sequences (or
        # num_beams) rows after this call, as transformers sizes its own static caches.
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        if self.backend == "torch" and self.decoder is not None:
            user_cache = model_kwargs.get(CACHE_KWARG)
            if user_cache is not None or generation_config.use_cache is False:
                return
            capacity = args[0] if args and isinstance(args[0], int) else 256
            model_kwargs[CACHE_KWARG] = self.decoder.new_cache(rows, capacity, self._dtype)
            return
        if self.backend == "torch":
            return self.model._prepare_cache_for_generation(
                generation_config, model_kwargs, assistant_model, batch_size, *args
            )
        user_cache = model_kwargs.get("past_key_values")
        if user_cache is not None:
            if not isinstance(user_cache, IPEXFusedCache):
                raise TypeError(
                    "past_key_values passed to generate() must be an IPEXFusedCache for the IPEX backend, "
                    f"got {type(user_cache).__name__}"
                )
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["past_key_values"] = self.new_cache(rows)

    def _get_stopping_criteria(self, *args, **kwargs):
        """transformers' stopping criteria of this ``generate()`` call (``max_length``, EOS, ``stop_strings``,
        ``max_time``, the user's), remembered so that :meth:`_get_candidate_generator` can cut every proposal at the
        first stopping point (transformers builds them before the candidate generator, in 4.4x-5.x)."""
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        self._custom_candidates.all_stopping_criteria = criteria
        return criteria

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """The candidate generator for assisted generation (see :meth:`_select_candidate_generator`), whatever its
        source, cut at the first point where a stopping criterion of the call stops
        (:func:`~optimum_ipex_spec.candidates.cut_at_stopping_point`): no proposal reaches past ``max_new_tokens``,
        EOS, ``stop_strings``, ``max_time`` or a user ``StoppingCriteria``, so the output is plain decoding's."""
        custom = getattr(self._custom_candidates, "generator", None)
        criteria = getattr(self._custom_candidates, "all_stopping_criteria", None) or []
        keep_stopping_token = bool(generation_config.do_sample)
        if custom is not None:  # a user-written generator: give it the attributes transformers 5 reads too
            return StoppingCriteriaAwareCandidates(custom, criteria, keep_stopping_token)
        generator = self._select_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model,
            target_tokenizer, assistant_tokenizer)
        draft_config = getattr(generator, "generation_config", None)  # transformers' drafts: a copy of the target's
        if draft_config is not None and getattr(draft_config, "stop_strings", None) is not None:
            # the draft's nested generate() gets no tokenizer and would refuse stop_strings; the proposals are cut
            # at the stop strings here instead
            draft_config.stop_strings = None
        return stop_proposals_at_stopping_criteria(generator, criteria, keep_stopping_token) if criteria else generator

    def _select_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                    assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """Use :class:`~optimum_ipex_spec.candidates.IPEXDraftCandidateGenerator` for greedy drafting
        with a same-tokenizer IPEX draft and
        :class:`~optimum_ipex_spec.candidates.AdaptivePromptLookupCandidateGenerator` for
        ``prompt_lookup_num_tokens``; every other strategy is transformers' own.

        transformers 4.x and 5.x both call this with keyword arguments (their positional orders differ)."""
        if assistant_tokenizer is None:  # set aside by generate(): same vocabulary size, different vocabularies
            assistant_tokenizer = getattr(self._custom_candidates, "assistant_tokenizer", None)
        different_tokenizers = target_tokenizer is not None and assistant_tokenizer is not None
        if (
            isinstance(assistant_model, IPEXModelForCausalLM)
            and (assistant_model.backend == "ipex" or assistant_model.decoder is not None)
            and not generation_config.do_sample
            and not different_tokenizers
            and generation_config.prompt_lookup_num_tokens is None
            and getattr(generation_config, "assistant_early_exit", None) is None
        ):
            return IPEXDraftCandidateGenerator(
                input_ids=input_ids,
                assistant_model=assistant_model,
                generation_config=generation_config,
                model_kwargs=model_kwargs,
                inputs_tensor=inputs_tensor,
                logits_processor=logits_processor,
            )
        if different_tokenizers and generation_config.do_sample and assistant_model is not None:
            return _universal_sampling_generator(self, generation_config, input_ids, inputs_tensor, logits_processor,
                                                 model_kwargs, assistant_model, target_tokenizer, assistant_tokenizer)
        if generation_config.prompt_lookup_num_tokens is not None and getattr(
            generation_config, "assistant_early_exit", None
        ) is None:
            generator = AdaptivePromptLookupCandidateGenerator(
                eos_token_id=generation_config._eos_token_tensor,
                num_output_tokens=generation_config.prompt_lookup_num_tokens,
                max_matching_ngram_size=generation_config.max_matching_ngram_size,
                max_length=generation_config.max_length,
                logits_processor=logits_processor,
                vocab_size=self.config.get_text_config().vocab_size,
            )
            self.last_speculation_stats = generator.stats
            return generator
        return super()._get_candidate_generator(
            generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
            target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer,
        )

    def _supports_default_dynamic_cache(self) -> bool:
        return self.backend == "torch" and self.decoder is None

    def generate(self, *args, candidate_generator=None, **kwargs):
        """transformers' ``generate``; see ``GenerationMixin.generate``.

        Args:
            candidate_generator: optional user-written candidate generator with transformers' two-method
                interface (``get_candidates(input_ids) -> (candidate_ids [1, L + n], logits or None)`` and
                ``update_candidate_strategy(input_ids, scores, num_matches)``). Generation then runs
                transformers' assisted decoding with these candidates, verified by this model (lossless).
                Batch size 1, as all assisted generation in transformers.

        The assisted-decoding arguments transformers documents are honoured when passed here (transformers reads
        the first three from the draft's own generation config and ignores them on ``generate()``):
        ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` (with
        ``assistant_model``), ``assistant_lookbehind`` and ``target_lookbehind`` (universal assisted generation:
        ``tokenizer=`` and ``assistant_tokenizer=``), ``prompt_lookup_num_tokens`` and ``max_matching_ngram_size``
        (prompt lookup). They apply to this call only: the draft's generation config is left as it was.

        Raises:
            ValueError: ``num_beams > 1`` on the IPEX backend (IPEXFusedCache does not reorder beams); contrastive
                search; speculative decoding with more than one prompt; ``candidate_generator`` together with
                ``assistant_model`` or ``prompt_lookup_num_tokens``; an assisted-decoding argument without the
                strategy it configures (e.g. ``num_assistant_tokens`` without ``assistant_model``).
            TypeError: ``candidate_generator`` lacks the two methods.
        """
        generation_config = kwargs.get("generation_config") or self.generation_config
        num_beams = kwargs.get("num_beams", getattr(generation_config, "num_beams", 1)) or 1
        if self.backend == "ipex" and num_beams > 1:
            raise ValueError(
                "Beam search (num_beams > 1) is not supported on the IPEX backend: IPEXFusedCache does not reorder "
                "beams. Use greedy decoding, sampling, or assisted generation."
            )
        self._check_generation_mode(generation_config, args, kwargs, candidate_generator)
        draft_overrides = _assisted_arguments(generation_config, kwargs, candidate_generator)
        if draft_overrides:
            # transformers reads these from the draft's generation config: give the draft a copy that carries them,
            # for this call only (the heuristic schedule's write-back then lands in the copy too)
            assistant = kwargs["assistant_model"]
            original = assistant.generation_config
            assistant.generation_config = copy.deepcopy(original)
            for name, value in draft_overrides.items():
                setattr(assistant.generation_config, name, value)
            try:
                return self.generate(*args, candidate_generator=candidate_generator, **kwargs)
            finally:
                assistant.generation_config = original
        if candidate_generator is not None:
            for method in ("get_candidates", "update_candidate_strategy"):
                if not callable(getattr(candidate_generator, method, None)):
                    raise TypeError(
                        f"candidate_generator must implement {method}() (transformers' CandidateGenerator "
                        f"interface); got {type(candidate_generator).__name__}"
                    )
            if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") is not None:
                raise ValueError("pass either candidate_generator or assistant_model/prompt_lookup_num_tokens, not both")
            # prompt_lookup_num_tokens only switches transformers into assisted decoding; the candidates come
            # from candidate_generator (see _get_candidate_generator)
            kwargs["prompt_lookup_num_tokens"] = 1
            self._custom_candidates.generator = candidate_generator
            try:
                return self.generate(*args, **kwargs)
            finally:
                self._custom_candidates.generator = None
        assistant = kwargs.get("assistant_model")
        if _same_size_different_vocabularies(self, assistant, kwargs.get("tokenizer"), kwargs.get("assistant_tokenizer")):
            # transformers tells tokenizers apart by vocabulary size only and would refuse assistant_tokenizer
            # here; set it aside past that check so universal assisted generation re-encodes the text
            self._custom_candidates.assistant_tokenizer = kwargs.pop("assistant_tokenizer")
            try:
                return self.generate(*args, **kwargs)
            finally:
                self._custom_candidates.assistant_tokenizer = None
        if self.backend == "torch" and (assistant is not None or kwargs.get("prompt_lookup_num_tokens") is not None):
            self._dynamic_cache_for_assisted(args, kwargs)
        ipex_involved = self.backend == "ipex" or getattr(assistant, "backend", None) == "ipex"
        if not ipex_involved:
            return super().generate(*args, **kwargs)
        # assisted as target, or continuing a cache (how transformers drives an assistant model)
        assisted = (
            assistant is not None
            or kwargs.get("prompt_lookup_num_tokens") is not None
            or isinstance(kwargs.get("past_key_values"), IPEXFusedCache)
        )
        with generation_patches(assisted=assisted):
            return super().generate(*args, **kwargs)

    def _check_generation_mode(self, generation_config, args, kwargs, candidate_generator) -> None:
        """Refuse, naming the mode, what this model cannot run.

        Raises:
            ValueError: contrastive search (``penalty_alpha > 0`` with ``top_k > 1``); speculative decoding
                (``assistant_model``, ``prompt_lookup_num_tokens`` or ``candidate_generator``) with more than one
                prompt or more than one returned sequence.
        """
        def value(name):
            return kwargs[name] if name in kwargs else getattr(generation_config, name, None)

        if (value("penalty_alpha") or 0) > 0 and (value("top_k") or 0) > 1 and not value("do_sample"):
            raise ValueError(
                f"contrastive search (penalty_alpha={value('penalty_alpha')} with top_k={value('top_k')}) is not "
                "supported by IPEXModelForCausalLM: it re-ranks candidates by the hidden states of every step, which "
                "the fused graph and our cache do not provide. Use greedy decoding, sampling or speculative decoding "
                "(assistant_model=...), or transformers' own model for contrastive search."
            )
        speculative = (kwargs.get("assistant_model") is not None or candidate_generator is not None
                       or kwargs.get("prompt_lookup_num_tokens") is not None)
        if not speculative:
            return
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        batch = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1
        if batch > 1:
            raise ValueError(
                f"speculative decoding (assistant_model, prompt_lookup_num_tokens or candidate_generator) runs one "
                f"prompt at a time (transformers' assisted generation is batch size 1 only); got a batch of {batch}. "
                "Generate each prompt separately, or the batch without speculative decoding."
            )
        if (value("num_return_sequences") or 1) > 1:
            raise ValueError(
                "speculative decoding (assistant_model, prompt_lookup_num_tokens or candidate_generator) returns one "
                f"sequence per prompt; got num_return_sequences={value('num_return_sequences')}. Call generate() "
                "several times, or sample the sequences without speculative decoding."
            )

    def _dynamic_cache_for_assisted(self, args, kwargs) -> None:
        """transformers 4.x refuses assisted generation for models whose default cache is static, hybrid or
        sliding-window (Gemma 2/3): those caches cannot be cropped. A ``DynamicCache`` can, and is exact as
        long as the sequence stays within the sliding window, so pass one in that case.

        Raises:
            ValueError: prompt + new tokens exceed the sliding window (4.x's DynamicCache path masks the
                window wrongly past it; transformers >= 5 handles it: use the ``torch-current`` lane).
        """
        text_config = self.config.get_text_config()
        implementation = getattr(self.generation_config, "cache_implementation", None) or getattr(
            text_config, "cache_implementation", None)
        if (TRANSFORMERS_MAJOR >= 5 or kwargs.get("past_key_values") is not None
                or implementation not in ("static", "hybrid", "sliding_window", "hybrid_chunked")):
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        generation_config = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens", generation_config.max_new_tokens)
        total = (ids.shape[-1] + max_new) if (ids is not None and max_new is not None) else kwargs.get(
            "max_length", generation_config.max_length)
        window = getattr(text_config, "sliding_window", None)
        if window is not None and total > window:
            raise ValueError(
                f"{type(self.model).__name__} uses a {implementation!r} cache with a {window}-token sliding window; "
                f"with transformers {transformers.__version__} assisted generation / prompt lookup is exact only up "
                f"to {window} tokens (prompt + max_new_tokens), got {total}. Shorten the request or use "
                "transformers >= 5 (the torch-current lane), whose caches crop sliding windows."
            )
        kwargs["past_key_values"] = DynamicCache()

    def self_draft(self, torch_dtype: Union[str, torch.dtype] = torch.bfloat16, backend: str = "auto"):
        """A cheaper copy of this model to use as its own draft: ``generate(assistant_model=...)``.

        The same checkpoint exported again in ``torch_dtype`` (default bf16). Same tokenizer, so
        transformers' plain assisted generation applies; output stays the target's (every draft token is
        verified). Measured on SmolLM2-135M (docs/benchmarks.md): the bf16 copy agrees with the fp32
        target's next token ~99% of the time and decodes ~2.3x faster. Weight-only int8/int4 copies were
        3-4x slower than fp32 on this CPU (field notes), so they are not offered.

        Raises:
            ValueError: the model was not exported from a checkpoint path or id (``source`` unknown).
        """
        if not self.source:
            raise ValueError(
                "self_draft() needs the checkpoint this model was exported from; export it with "
                "IPEXModelForCausalLM.from_pretrained(model_id, export=True) or load the draft yourself"
            )
        if resolve_dtype(torch_dtype) == self._dtype:
            raise ValueError(
                f"this model is already {_dtype_name(self._dtype)}: a {_dtype_name(self._dtype)} copy is not a cheaper "
                "draft. Use an fp32 target with the default bf16 draft, or pick another draft model."
            )
        draft = type(self).from_pretrained(self.source, export=True, torch_dtype=torch_dtype, backend=backend)
        # A copy of the target agrees with it almost always: stopping a draft block early on low draft
        # confidence (transformers' default threshold 0.4) only costs extra rounds; the heuristic
        # schedule grows the block while everything is accepted.
        draft.generation_config.assistant_confidence_threshold = 0.0
        draft.generation_config.num_assistant_tokens = 8
        draft.generation_config.num_assistant_tokens_schedule = "heuristic"
        return draft

    # ------------------------------------------------------------------ loading / export
    @classmethod
    def from_pretrained(cls, model_id: Union[str, Path], *args, **kwargs) -> "IPEXModelForCausalLM":
        """Load an exported folder, or export a transformers checkpoint with ``export=True``.

        Args:
            model_id: a local folder (transformers checkpoint or one written by ``save_pretrained``)
                or a hub model id.
            export: export from a transformers checkpoint (``ipex.llm.optimize`` + trace). A folder
                without an export is exported automatically.
            torch_dtype: ``torch.float32`` (default), ``torch.bfloat16`` or ``"auto"``.
            backend: ``"auto"`` (IPEX when usable, else the pure-PyTorch path, logged once),
                ``"ipex"`` (raise if IPEX is unusable) or ``"torch"``.

        Raises:
            FileNotFoundError: ``model_id`` looks like a local path that does not exist.
            ValueError: not a causal LM; unsupported dtype; unknown backend; ``backend="ipex"`` with
                an architecture outside IPEX's fused path.
            IPEXNotAvailableError: ``backend="ipex"`` without a usable IPEX (the message has the pip command).
        """
        from .provision import resolve_model  # a provisioned name (e.g. "smollm2-135m-instruct") -> its folder

        model_id = resolve_model(str(model_id))
        if not os.path.isdir(model_id) and (looks_like_local_path(model_id) or os.path.exists(model_id)):
            if os.path.isfile(model_id):
                raise FileNotFoundError(f"{model_id} is a file; pass the folder that contains config.json")
            raise FileNotFoundError(
                f"model folder {model_id} does not exist; pass a transformers checkpoint folder, a folder written by "
                "IPEXModelForCausalLM.save_pretrained, or a hub model id"
            )
        if os.path.isdir(model_id) and not os.path.isfile(os.path.join(model_id, "config.json")):
            raise FileNotFoundError(f"{model_id} has no config.json: it is not a transformers model folder")
        backend = kwargs.get("backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return super().from_pretrained(model_id, *args, **kwargs)

    @classmethod
    def _choose_backend(cls, backend: str, config: PretrainedConfig) -> str:
        if backend == "torch":
            return "torch"
        if backend == "ipex":
            require_ipex()
            if not ipex_supports(config):
                raise ValueError(
                    f"backend='ipex': architecture {first_architecture(config)} is not on IPEX's fused path "
                    f"(supported: {', '.join(IPEX_FUSED_ARCHITECTURES)}); use backend='auto' or 'torch'"
                )
            return "ipex"
        status = ipex_status()
        if not status.available:
            log_fallback_once(status.reason)
            return "torch"
        if not ipex_supports(config):
            logger.warning(
                "Architecture %s is not on IPEX's fused path (supported: %s); running the pure-PyTorch path.",
                first_architecture(config),
                ", ".join(IPEX_FUSED_ARCHITECTURES),
            )
            return "torch"
        return "ipex"

    @classmethod
    def _export(
        cls,
        model_id: str,
        config: PretrainedConfig,
        revision: Optional[str] = None,
        cache_dir: Optional[str] = None,
        force_download: bool = False,
        token=None,
        subfolder: str = "",
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        torch_dtype: Union[None, str, torch.dtype] = None,
        backend: str = "auto",
        **kwargs,
    ) -> "IPEXModelForCausalLM":
        check_causal_lm_config(config, model_id)
        folder = os.path.join(model_id, subfolder) if subfolder else model_id
        if os.path.isfile(os.path.join(folder, EXPORT_CONFIG_NAME)):
            raise ValueError(
                f"{model_id} is already an IPEX export (it has {EXPORT_CONFIG_NAME}): load it without export=True, "
                "or export the original transformers checkpoint"
            )
        dtype = resolve_dtype(torch_dtype, config)
        load_kwargs = dict(
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            token=token,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
            torch_dtype=dtype,
        )
        if subfolder:
            load_kwargs["subfolder"] = subfolder
        eager = AutoModelForCausalLM.from_pretrained(model_id, **load_kwargs)
        generation_config = eager.generation_config
        return cls.from_transformers_model(
            eager, dtype=dtype, backend=backend, generation_config=generation_config, source=model_id
        )

    @classmethod
    def from_transformers_model(
        cls,
        model: torch.nn.Module,
        dtype: Union[None, str, torch.dtype] = None,
        backend: str = "auto",
        generation_config: Optional[GenerationConfig] = None,
        source: Optional[str] = None,
    ) -> "IPEXModelForCausalLM":
        """Export an in-memory transformers causal LM. IPEX modifies ``model`` in place: pass a copy
        if you still need the eager model, or want to export it again.

        Raises:
            ValueError: not a causal LM, unsupported dtype or backend; ``model`` was already optimized by IPEX
                (an earlier export of the same object): IPEX rewrote its modules in place and it cannot be traced
                again.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if _ipex_optimized(model):
            raise ValueError(
                f"this {type(model).__name__} object was already optimized by IPEX (an earlier export, or "
                "ipex.llm.optimize): IPEX rewrites the model in place, so it cannot be exported again. Reuse the "
                "first IPEXModelForCausalLM, export a fresh copy (from_transformers_model(copy.deepcopy(model)) "
                "before the first export), or load the checkpoint again with from_pretrained(..., export=True)."
            )
        config = model.config
        if not getattr(config, "architectures", None):
            config.architectures = [type(model).__name__]
        check_causal_lm_config(config, type(model).__name__)
        dtype = resolve_dtype(dtype if dtype is not None else model.dtype, config)
        model = model.to(dtype).eval()
        generation_config = generation_config or getattr(model, "generation_config", None)
        chosen = cls._choose_backend(backend, config)
        if chosen == "ipex":
            setattr(model, IPEX_OPTIMIZED_MARK, True)  # set before: a failed export leaves the model modified too
            graphs = export_to_ipex(model, dtype)
            return cls(graphs.decode, config, backend="ipex", dtype=dtype, generation_config=generation_config,
                       verify_model=graphs.verify, source=source)
        return cls(model, config, backend="torch", dtype=dtype, generation_config=generation_config, source=source)

    @classmethod
    def _from_pretrained(
        cls,
        model_id: str,
        config: PretrainedConfig,
        revision: Optional[str] = None,
        cache_dir: Optional[str] = None,
        force_download: bool = False,
        token=None,
        subfolder: str = "",
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        torch_dtype: Union[None, str, torch.dtype] = None,
        backend: str = "auto",
        **kwargs,
    ) -> "IPEXModelForCausalLM":
        folder = os.path.join(model_id, subfolder) if subfolder else model_id
        export_file = os.path.join(folder, EXPORT_CONFIG_NAME)
        if not os.path.isdir(folder) or not os.path.isfile(export_file):
            logger.info("%s holds no IPEX export (%s missing): exporting it now.", model_id, EXPORT_CONFIG_NAME)
            return cls._export(
                model_id,
                config,
                revision=revision,
                cache_dir=cache_dir,
                force_download=force_download,
                token=token,
                subfolder=subfolder,
                local_files_only=local_files_only,
                trust_remote_code=trust_remote_code,
                torch_dtype=torch_dtype,
                backend=backend,
            )
        meta = _read_export_meta(export_file, model_id)
        saved_backend = meta["backend"]
        dtype = _DTYPES[meta["torch_dtype"]]
        if torch_dtype not in (None, "auto") and resolve_dtype(torch_dtype) != dtype:
            raise ValueError(
                f"{model_id} was exported in {meta['torch_dtype']}; torch_dtype={torch_dtype} would need a new "
                "export from the original checkpoint"
            )
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = GenerationConfig.from_model_config(config)
        if saved_backend == "ipex":
            if backend == "torch":
                raise ValueError(
                    f"{model_id} holds an IPEX graph; backend='torch' needs the original transformers checkpoint"
                )
            status = ipex_status()
            if not status.available:
                raise _ipex_missing_for_load_error(model_id, meta, status.reason)
            saved = meta.get("ipex_version")
            if saved and parse_version(saved).release[:2] != parse_version(status.ipex_version).release[:2]:
                raise RuntimeError(
                    f"{model_id} was exported with IPEX {saved} but IPEX {status.ipex_version} is installed; "
                    "re-export it with IPEXModelForCausalLM.from_pretrained(original_checkpoint, export=True)"
                )
            graphs = _load_graph_file(folder, IPEX_GRAPH_NAME, meta, required=True)
            graph, verify = graphs.decode, graphs.verify
            if verify is None:  # export format 1: the frozen verification graph in a file of its own
                legacy = _load_graph_file(folder, IPEX_VERIFY_GRAPH_NAME, meta, required=False)
                verify = legacy.decode if legacy is not None else None
            model = cls(graph, config, backend="ipex", dtype=dtype, generation_config=generation_config,
                        model_save_dir=folder, verify_model=verify, source=meta.get("source"), warmup=False)
            try:
                model._warmup()
            except RuntimeError as exc:  # e.g. a config.json that does not match the graph
                raise ValueError(
                    f"the graph in {folder} does not run with its config.json ({str(exc).splitlines()[0]}); "
                    f"{_reexport_hint(meta)}"
                ) from exc
            return model
        if backend == "ipex":
            raise ValueError(
                f"{model_id} holds a pure-PyTorch export (backend 'torch'); backend='ipex' needs a new export from "
                f"the original checkpoint: {_reexport_hint(meta)}"
            )
        eager = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
        return cls(eager.eval(), config, backend="torch", dtype=dtype, generation_config=generation_config,
                   model_save_dir=folder, source=meta.get("source"))

    def _save_pretrained(self, save_directory: Union[str, Path]) -> None:
        save_directory = str(save_directory)
        status = ipex_status()
        meta = {
            "format_version": EXPORT_FORMAT_VERSION,
            "backend": self.backend,
            "torch_dtype": _dtype_name(self._dtype),
            "torch_version": torch.__version__,
            "ipex_version": status.ipex_version if self.backend == "ipex" else None,
            "architecture": first_architecture(self.config),
            "source": self.source,
        }
        if self.backend == "ipex":
            path = os.path.join(save_directory, IPEX_GRAPH_NAME)
            if self.verify_model is not None:
                save_ipex_graphs(IPEXGraphs(decode=self.model, verify=self.verify_model), path)
            else:
                save_ipex_graph(self.model, path)
        else:
            self.model.save_pretrained(save_directory)
        self.generation_config.save_pretrained(save_directory)
        with open(os.path.join(save_directory, EXPORT_CONFIG_NAME), "w") as f:
            json.dump(meta, f, indent=2)


def _ipex_optimized(model: torch.nn.Module) -> bool:
    """True when ``ipex.llm.optimize`` already rewrote ``model`` in place: IPEX swaps in its own module classes
    (decoder layers, attention, linear) and our export marks the model (:data:`IPEX_OPTIMIZED_MARK`)."""
    if getattr(model, IPEX_OPTIMIZED_MARK, False):
        return True
    return any(type(module).__module__.startswith("intel_extension_for_pytorch") for module in model.modules())


register_for_pipelines(IPEXModelForCausalLM.__name__)


def _reexport_hint(meta: dict) -> str:
    source = meta.get("source") if isinstance(meta, dict) else None
    target = repr(source) if source else "the original checkpoint"
    return f"re-export it with IPEXModelForCausalLM.from_pretrained({target}, export=True)"


def _read_export_meta(path: str, model_id: str) -> dict:
    """Read and check ``ipex_export.json``; raise ValueError naming the file and the fix."""
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is unreadable ({exc}); {_reexport_hint({})}") from exc
    if not isinstance(meta, dict) or meta.get("backend") not in ("ipex", "torch") or meta.get("torch_dtype") not in (
        "float32", "bfloat16"
    ):
        raise ValueError(
            f"{path} is not a valid export description (needs backend 'ipex'|'torch' and torch_dtype "
            f"'float32'|'bfloat16'); {_reexport_hint(meta)}"
        )
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or version > EXPORT_FORMAT_VERSION:
        raise ValueError(
            f"{model_id} was written by a newer optimum-ipex-spec (export format {version}, this one reads <= "
            f"{EXPORT_FORMAT_VERSION}); upgrade optimum-ipex-spec or {_reexport_hint(meta)}"
        )
    if meta.get("ipex_version") is not None:
        try:
            parse_version(str(meta["ipex_version"]))
        except Exception as exc:
            raise ValueError(f"{path}: ipex_version {meta['ipex_version']!r} is not a version; "
                             f"{_reexport_hint(meta)}") from exc
    return meta


def _load_graph_file(folder: str, name: str, meta: dict, required: bool):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path} is missing; {_reexport_hint(meta)}")
        return None
    try:
        return load_ipex_graphs(path)
    except RuntimeError as exc:
        raise ValueError(f"{path} is not a loadable TorchScript graph (truncated or corrupted?); "
                         f"{_reexport_hint(meta)}") from exc


def _ipex_missing_for_load_error(model_id: str, meta: dict, reason: str) -> Exception:
    from .utils.import_utils import IPEX_PIP_COMMAND, IPEXNotAvailableError

    return IPEXNotAvailableError(
        f"{model_id} holds a graph exported with IPEX {meta.get('ipex_version')} (torch {meta.get('torch_version')}), "
        f"but IPEX cannot be used here: {reason}. Install it ({IPEX_PIP_COMMAND}) or re-export the original "
        "checkpoint with backend='torch'."
    )
