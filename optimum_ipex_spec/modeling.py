"""``IPEXModelForCausalLM``: the transformers / optimum surface of a causal LM that runs IPEX's fused, traced graph.

Data flow: :mod:`.backends.ipex.export` turns a transformers model into traced TorchScript graphs with IPEX's
fused kernels (or, without IPEX, the model stays a PyTorch module); a runner (:mod:`.backends`, chosen once per
model) runs the forward over its cache; :mod:`.speculative.strategy` picks the candidate generator of assisted
generation; this
module is the optimum ``OptimizedModel`` that is also a transformers ``GenerationMixin``, so ``generate()``,
streamers, stopping criteria and ``pipeline("text-generation")`` work as with transformers.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch
import transformers
from optimum.modeling_base import OptimizedModel
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin, PretrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .backends.ipex.cache import IPEXFusedCache
from .speculative.candidates import StoppingCriteriaAwareCandidates, stop_proposals_at_stopping_criteria
from .loading.checkpoint import checkpoint_folder, load_causal_lm
from .compat import GenerationCompatMixin, returns_attention_weights
from .backends.pytorch.compiled_step import check_torch_compile, check_torch_compile_flag
from .speculative.cost_model import COST_SCHEDULE, CostModel, SamplingTimes, speculate_by_cost
from .backends.dense_weights import onednn_bf16_available
from .loading.export_folder import (
    check_export_files,
    check_export_folder,
    check_ipex_for_saved_graph,
    carry_over,
    check_save_target,
    check_subfolder,
    export_meta,
    has_export,
    is_data_only,
    legacy_archive_refusal,
    load_graphs,
    log_unchecked_export_once,
    read_export_meta,
    reexport_hint,
    write_export_meta,
)
from .backends.ipex.export import (
    IPEX_FUSED_ARCHITECTURES,
    export_to_ipex,
    first_architecture,
    ipex_converted,
    ipex_supports,
)
from .facts import (
    BACKENDS,
    EXPORT_CONFIG_NAME,
    check_causal_lm_config,
    dtype_name,
    is_provisioned_name,
    resolve_dtype,
    WEIGHT_FORMATS,
)
from .loading.gguf import check_options as check_gguf_options, locate as locate_gguf, wants_gguf
from .loading.gguf import read_config as read_gguf_config
from .backends.pytorch.gguf_weights import load_gguf_model, read_gguf
from .backends.pytorch.int4_weights import activation_dtype, check_load_options, quantize_model_int4
from .limits import call_input_ids, fit_to_positions
from .backends.ipex.patching import generation_patches, register_for_pipelines
from .backends import make_runner
from .backends.base import check_token_ids, requested_layer_outputs, whole_call_arguments
from .backends.eager import dynamic_cache_for_assisted
from .backends.pytorch.runner import preallocated_cache_refused
from .speculative.strategy import (
    DRAFT_ARGUMENTS,
    GenerationRequest,
    Strategy,
    assisted_arguments,
    build_candidate_generator,
    call_generation_config,
    check_draft_arguments,
    current_request,
    draft_generation_config,
    lookup_arguments,
    request_scope,
    same_size_different_vocabularies,
    select_strategy,
    uses_cost_model,
)
from .backends.pytorch.cache import PreallocatedKVCache
from .backends.pytorch.decoder import SUPPORTED_ARCHITECTURES, TorchCausalLMDecoder
from .loading.manifest import HashCheck, checked_while_loading, write_manifest
from .utils.fs import looks_like_local_path, staged_directory
from .utils.import_utils import (
    ipex_dtype_unsupported, ipex_status, log_dtype_fallback_once, log_fallback_once, require_ipex,
)

logger = logging.getLogger("optimum_ipex_spec")

#: transformers' default ``num_assistant_tokens`` (4.x and 5.x), the cap of the cost model when a draft sets none
DEFAULT_NUM_ASSISTANT_TOKENS = 20
#: the longest round the cost model considers (verification cost beyond it is extrapolated too far)
MAX_DRAFT_TOKENS = 16


@functools.lru_cache(maxsize=None)
def _warn_emulated_bf16_draft(capability: str) -> None:
    logger.warning(
        "This CPU (%s) has no native bf16 (oneDNN bf16: AVX512-BF16/AMX or AVX512-BW/VL/DQ): a bf16 self-draft "
        "computes hardly faster than its fp32 target, so speculating with it gains little (SmolLM2 on AVX2: x0.95-1.20 "
        "end to end per prompt, the draft reading the target's KV cache; x0.48-0.74 drafting from its own cache), "
        "though output stays exact. Use a smaller draft model, or decode without one.", capability)


class IPEXModelForCausalLM(GenerationCompatMixin, OptimizedModel, GenerationMixin):
    """A causal LM whose forward runs IPEX's fused kernels and fused KV cache from a traced graph.

    Create it with :meth:`from_pretrained` (``export=True`` for a transformers checkpoint or hub id,
    or a folder written by :meth:`save_pretrained`). It behaves like a transformers causal LM:

    * ``model(input_ids)`` returns ``CausalLMOutputWithPast`` with ``logits`` ``[batch, seq, vocab]``
      (model dtype) and ``past_key_values`` (an :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache`);
    * ``model.generate(...)`` is transformers' ``GenerationMixin.generate``: greedy, sampling,
      streamers, stopping criteria, ``pipeline("text-generation", model=..., tokenizer=...)``.

    Attributes:
        backend: ``"ipex"`` (fused traced graph) or ``"torch"`` (pure-PyTorch path, used when IPEX
            is missing/mismatched or the architecture is not on IPEX's fused path).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        runner: the :class:`~optimum_ipex_spec.backends.base.Runner` that runs the forward (chosen once).
        last_speculation_stats: :class:`~optimum_ipex_spec.speculative.candidates.SpeculationStats` of the last assisted
            ``generate()`` that drafted with this model (our draft generator) or ran prompt lookup on it.
        last_strategy: the :class:`~optimum_ipex_spec.speculative.strategy.Strategy` value of the last assisted
            ``generate()`` this model was the target of ("draft", "prompt-lookup", ...), else None.
        last_cost_model: the :class:`~optimum_ipex_spec.speculative.cost_model.CostModel` that chose the draft lengths
            of the last assisted ``generate()`` with a draft model (``.report()``: its measurements), else None.
        share_target_kv: as a draft of a target exported from the same checkpoint (``self_draft()``), fill this
            model's KV cache from the target's instead of running its own prefill and catch-up
            (:mod:`~optimum_ipex_spec.speculative.shared_kv`; default True; set False to draft from its own cache).
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
        weights: str = "dense",
        torch_compile: bool = False,
        source_options: Optional[dict] = None,
        origin: Optional[Tuple[str, dict]] = None,
    ):
        if backend not in ("ipex", "torch"):
            raise ValueError(f"backend must be 'ipex' or 'torch', got {backend!r}")
        super().__init__(model, config)
        self.backend = backend
        self.source = source
        #: hub options that name ``source``'s checkpoint (``revision``, ``subfolder``), passed on by self_draft()
        self.source_options = dict(source_options or {})
        self._origin = (origin[0], dict(origin[1] or {})) if origin and origin[0] else None
        self.last_speculation_stats = None
        self.last_strategy = None
        self.last_cost_model = None
        self._sampling_times = SamplingTimes()  # the cost model's times for sampling calls (reproducible seeds)
        self.share_target_kv = True
        self._dtype = dtype
        self.model_save_dir = model_save_dir
        self.generation_config = generation_config or GenerationConfig.from_model_config(config)
        self._num_layers = config.get_text_config().num_hidden_layers
        self.weights = weights
        self.runner = make_runner(backend, model, config, dtype, verify_model, weights=weights,
                                  torch_compile=torch_compile)
        if warmup:
            self.runner.warmup()

    #: a draft's per-call arguments reach it through
    #: :func:`~optimum_ipex_spec.speculative.strategy.call_generation_config`
    per_call_generation_config = True

    @property
    def generation_config(self) -> GenerationConfig:
        """The model's generation config; inside a ``generate()`` call that passed draft arguments for this model as
        its draft (``num_assistant_tokens=...``), that call's copy carrying them (seen by that call only)."""
        return call_generation_config(self) or self._generation_config

    @generation_config.setter
    def generation_config(self, value: GenerationConfig) -> None:
        self._generation_config = value

    @property
    def origin(self) -> Tuple[Optional[str], dict]:
        """The checkpoint this model's weights were first exported from, ``(path or hub id, hub options)``: its
        ``source`` and ``source_options``, except for a model loaded from a saved export (its ``source`` is then the
        export's folder, which holds its weights) or a self-draft of one: then what the export recorded. Written to
        ``ipex_export.json`` by ``save_pretrained`` and compared by KV sharing (a saved target and its saved draft
        share; a folder that claims another origin can only cost the draft its acceptance, never the output)."""
        return self._origin or (self.source, dict(self.source_options))

    @property
    def verify_model(self) -> Optional[torch.jit.ScriptModule]:
        """The exact verify graph (IPEX backend), else None."""
        return getattr(self.runner, "verify", None)

    @property
    def decoder(self):
        """Our pure-PyTorch decoder (torch backend, Llama-family architectures), else None."""
        return getattr(self.runner, "decoder", None)

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
            f"dtype={dtype_name(self._dtype)}, layers={self._num_layers})"
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
        logits_to_keep: Union[int, torch.Tensor] = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Run the model on ``input_ids`` int64 ``[batch, q]`` on top of ``past_key_values``.

        Args:
            input_ids: new tokens, int64 ``[batch, q]``.
            attention_mask: int64 ``[batch, past + q]`` (1 = attend, 0 = left padding); default all ones.
            past_key_values: cache from a previous call (IPEXFusedCache on the IPEX backend), or None.
            position_ids: int64 ``[batch, q]``; default derived from ``attention_mask``.
            labels: optional int64 ``[batch, past + q]``-aligned targets as in transformers (``-100`` ignored);
                the shifted cross-entropy is returned in ``loss``.
            logits_to_keep: as in transformers: 0 returns logits for all ``q`` positions, ``n > 0`` for the last
                ``n``, a 1-D int64 tensor for those positions. ``generate()`` passes 1 for the prompt and ``k + 1``
                for a verification of k draft tokens; the pure-PyTorch decoder then runs the LM head on those
                positions only (the IPEX graphs compute all and are sliced). An ``n > 1`` on an empty cache (batch 1:
                speculative decoding's first round, the prompt and its first ``n - 1`` candidates; ``n = q`` on a
                1-token prompt) runs as two calls, the prompt alone and then the candidates, so that the first
                token's logits are plain decoding's bit for bit; not with labels, hidden states or attentions.

        Returns:
            ``CausalLMOutputWithPast`` with ``logits`` ``[batch, q, vocab]`` (``q`` cut by ``logits_to_keep``) in
            the model dtype and the
            updated cache in ``past_key_values`` (None when ``use_cache=False``).

        Raises:
            TypeError: a cache of the wrong class for this backend; non-integer ``input_ids``.
            ValueError: (IPEX backend) empty or non-2-D ``input_ids``, token ids outside the vocabulary, a cache
                of another batch size or layer count, an ``attention_mask`` of the wrong length, more positions
                than ``config.max_position_embeddings`` (IPEX's rotary tables end there: the logits would be
                NaN), or ``output_attentions`` / ``output_hidden_states`` (the fused graph does not return them).
                (pure-PyTorch path) ``output_hidden_states``, ``output_attentions``, ``labels`` and the other
                arguments of transformers' forward with a ``PreallocatedKVCache`` (transformers' forward would
                see none of its tokens: pass no cache, or a ``DynamicCache``), or on a model with int8 weights.
        """
        if past_key_values is None:
            past_key_values = cache  # transformers >= 5 spells it ``cache``
        if _prefill_with_candidates(input_ids, past_key_values, logits_to_keep, use_cache, kwargs):
            out = self._prefill_then_verify(input_ids, attention_mask, past_key_values, position_ids, logits_to_keep,
                                            kwargs)
            return out if return_dict else out.to_tuple()
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.runner.forward(input_ids, attention_mask, past_key_values, position_ids, use_cache, kwargs)
        return out if return_dict else out.to_tuple()

    def _prefill_then_verify(self, input_ids, attention_mask, cache, position_ids, logits_to_keep: int, kwargs):
        """A first call of speculative decoding (an empty cache; the prompt, then ``logits_to_keep - 1`` candidates):
        the prompt is prefilled alone, as plain decoding does, then the candidates run on its cache as any later
        verification does. In one call the prompt's last logits would come from a product of more rows than plain
        decoding's prefill, which can round differently in the last bits (a near-tie could then give another first
        token); split, the first token's logits are plain decoding's bit for bit, and the candidates' logits those
        of the graph that verifies every later round. Logits ``[1, logits_to_keep, vocab]``."""
        prompt = input_ids.shape[1] - logits_to_keep + 1
        # per-token arguments of transformers' forward (the eager runner's): each part gets its own positions
        head = {name: value[..., :prompt] for name, value in kwargs.items() if name in _PER_TOKEN_ARGUMENTS
                and isinstance(value, torch.Tensor)}
        tail = {name: value[..., prompt:] for name, value in kwargs.items() if name in head}
        first = self.runner.forward(input_ids[:, :prompt],
                                    None if attention_mask is None else attention_mask[:, :prompt], cache,
                                    None if position_ids is None else position_ids[:, :prompt], True,
                                    {**kwargs, **head, "logits_to_keep": 1})
        out = self.runner.forward(input_ids[:, prompt:], attention_mask, first.past_key_values,
                                  None if position_ids is None else position_ids[:, prompt:], True,
                                  {**kwargs, **tail, "logits_to_keep": logits_to_keep - 1})
        out.logits = torch.cat([first.logits, out.logits], dim=1)
        return out

    def new_cache(self, batch_size: int = 1, capacity: int = 256):
        """An empty KV cache for this model's forward: :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache`
        (IPEX backend) or :class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache` (PyTorch path).

        Raises:
            NotImplementedError: an architecture that runs transformers' own forward (use its ``DynamicCache``).
        """
        return self.runner.new_cache(batch_size, capacity)

    def reset_sampling_times(self) -> None:
        """Forget the round times that this target's sampling calls with a draft or prompt lookup decide their draft
        lengths on (measured once per draft by the first such call, so that a seed gives the same output on every
        call: :class:`~optimum_ipex_spec.speculative.cost_model.SamplingTimes`); the next sampling call measures them
        again. For after a change of thread count or machine load, or a first call that ran slowed down (its lengths
        then stay short, or off, for every later call). Outputs of seeded calls before and after may differ."""
        self._sampling_times.clear()

    def compile_chunk_step(self) -> bool:
        """With ``torch_compile=True``: compile the 4-token graph now (tens of seconds; 40-100 s for a 0.5B model),
        not inside the first ``generate()`` that needs it. That graph runs chunks of tokens on a non-empty cache: a
        bf16 or int8 target's verification of draft tokens, and a draft's catch-up on the tokens it did not see
        (a draft with its own cache; a self-draft that reads its target's cache never runs it). In fp32 the graph is
        checked to give each token the bits the 1-token graph gives it (else chunks run one token per call, logged).
        In int8 (and in bf16 without AVX512-BF16) it costs a second packed copy of the weights; fp32 and bf16 graphs
        share the 1-token graph's copy where both multiply with the packed kernel (AVX-512; docs/memory.md).

        Returns:
            True when the graph is ready; False for a model without a compiled step (no ``torch_compile``, the IPEX
            backend, or a compile that fell back to the eager decoder, logged).
        """
        return self.runner.compile_chunk_graph()

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
        return self._call_runner().prepare_inputs_for_generation(input_ids, past_key_values, attention_mask, kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, assistant_model, batch_size, *args):
        # 4.x: (..., assistant_model, batch_size, max_cache_length, device); 5.x: (..., generation_mode, batch_size,
        # max_cache_length). batch_size counts the prompts; generate() expands each to num_return_sequences (or
        # num_beams) rows after this call, as transformers sizes its own static caches.
        rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
        return self._call_runner().prepare_cache_for_generation(generation_config, model_kwargs, rows,
                                                                (assistant_model, batch_size) + args)

    def _supports_default_dynamic_cache(self) -> bool:
        return self._call_runner().uses_transformers_cache

    def _get_stopping_criteria(self, *args, **kwargs):
        """transformers' stopping criteria of this ``generate()`` call (``max_length``, EOS, ``stop_strings``,
        ``max_time``, the user's), kept in the call's request so that :meth:`_get_candidate_generator` can cut every
        proposal at the first stopping point (transformers builds them before the candidate generator, in
        4.4x-5.x)."""
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        request = current_request()
        if request is not None:
            request.stopping_criteria = criteria
        return criteria

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        """The candidate generator of this call's strategy
        (:func:`~optimum_ipex_spec.speculative.strategy.select_strategy`),
        cut at the first point where a stopping criterion of the call stops
        (:func:`~optimum_ipex_spec.speculative.candidates.cut_at_stopping_point`): no proposal reaches past
        ``max_new_tokens``, EOS, ``stop_strings``, ``max_time`` or a user ``StoppingCriteria``, so the output is plain
        decoding's.

        transformers 4.x and 5.x both call this with keyword arguments (their positional orders differ)."""
        request = current_request() or GenerationRequest()
        if assistant_tokenizer is None:  # set aside by generate(): same vocabulary size, different vocabularies
            assistant_tokenizer = request.assistant_tokenizer
        criteria = request.stopping_criteria or []
        keep_stopping_token = bool(generation_config.do_sample)
        strategy = select_strategy(
            custom=request.candidate_generator is not None,
            has_draft=assistant_model is not None,
            draft_can_run_ours=isinstance(assistant_model, IPEXModelForCausalLM) and assistant_model.runner.can_draft,
            do_sample=bool(generation_config.do_sample),
            different_tokenizers=target_tokenizer is not None and assistant_tokenizer is not None,
            prompt_lookup=generation_config.prompt_lookup_num_tokens is not None,
            early_exit=getattr(generation_config, "assistant_early_exit", None) is not None,
        )
        request.strategy = strategy
        self.last_strategy = strategy.value
        if strategy is Strategy.CUSTOM:  # a user-written generator: give it the attributes transformers 5 reads too
            return StoppingCriteriaAwareCandidates(request.candidate_generator, criteria, keep_stopping_token,
                                                   vocab_size=self.runner.vocab_size)

        def transformers_default():
            return super(IPEXModelForCausalLM, self)._get_candidate_generator(
                generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
                logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model,
                target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer)

        generator = build_candidate_generator(
            strategy, self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
            assistant_model, target_tokenizer, assistant_tokenizer, transformers_default)
        lookup = strategy is Strategy.PROMPT_LOOKUP
        if lookup:  # no draft config: the schedule passed, the lookup's own length cap
            self.last_speculation_stats = generator.stats
            configured, cap = None, generation_config.prompt_lookup_num_tokens
        else:
            draft_config = assistant_model.generation_config if assistant_model is not None else None
            configured = getattr(draft_config, "num_assistant_tokens_schedule", None)
            cap = getattr(draft_config, "num_assistant_tokens", None) or DEFAULT_NUM_ASSISTANT_TOKENS
        if uses_cost_model(strategy, assistant_model is not None, configured, request.schedule):
            if lookup:
                generator.adaptive = False  # its length and pauses are the cost model's now
            cap = min(int(cap), MAX_DRAFT_TOKENS)
            # a lookup costs next to nothing: its first rounds propose the most it may (only the verification is
            # at stake, and the long end is measured at once); a draft model starts at k0 = 2, or, where the target
            # verifies in fixed-size calls (a compiled step), at the k that fills one call
            rows = self._call_runner().verify_rows
            first = cap if lookup else (max(2, min(cap, rows - 1)) if rows else 2)
            settings = dict(max_tokens=cap, first_tokens=first, verify_rows=rows,
                            plain_first=getattr(generator, "starts_at_any_length", False))
            if generation_config.do_sample:
                # lengths from times measured once per draft, so that a seed gives one output on every call; the
                # plan measures a plain step and twice the first length before the times are frozen
                settings.update(plain_rounds=1 if settings["plain_first"] else 0,
                                plan_extra=(min(cap, 2 * first),))
                draft = getattr(assistant_model, "per_call_view_of", assistant_model)
                self.last_cost_model = self._sampling_times.cost_model(draft, **settings)
            else:
                self.last_cost_model = CostModel(**settings)
            speculate_by_cost(generator, self.last_cost_model)
        else:
            self.last_cost_model = None
        draft_config = getattr(generator, "generation_config", None)  # transformers' drafts: a copy of the target's
        if draft_config is not None and getattr(draft_config, "stop_strings", None) is not None:
            # the draft's nested generate() gets no tokenizer and would refuse stop_strings; the proposals are cut
            # at the stop strings here instead
            draft_config.stop_strings = None
        return stop_proposals_at_stopping_criteria(generator, criteria, keep_stopping_token) if criteria else generator

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
        (prompt lookup). They apply to this call only: the draft's generation config is left as it was. Set on a
        ``generation_config=`` passed to the call they count as passed, except where they equal transformers'
        defaults, which transformers 4.x cannot tell from unset (``num_assistant_tokens_schedule="constant"``,
        ``num_assistant_tokens=20``: pass those as keywords). ``prompt_lookup_num_tokens`` set on the model's own
        generation config starts prompt lookup as the keyword does, under the same checks.

        Raises:
            ValueError: ``num_beams > 1`` on the IPEX backend (IPEXFusedCache does not reorder beams); contrastive
                search; speculative decoding with more than one prompt; ``candidate_generator`` together with
                ``assistant_model`` or ``prompt_lookup_num_tokens``; an assisted-decoding argument without the
                strategy it configures (e.g. ``num_assistant_tokens`` without ``assistant_model``);
                ``prompt_lookup_num_tokens`` or ``max_matching_ngram_size`` not an integer >= 1;
                ``assistant_early_exit`` (transformers' early-exit self-speculation; use ``self_draft()``); a prompt of
                ``config.max_position_embeddings`` tokens or more (no position left for a new token), before any
                forward. A longer request (prompt + ``max_new_tokens``, or ``max_length``) is not an error: it stops at
                the model's positions, with one warning (logger ``optimum_ipex_spec``), and returns what was generated
                (:func:`~optimum_ipex_spec.limits.fit_to_positions`). ``output_hidden_states`` /
                ``output_attentions`` where this model cannot return them (:meth:`_layer_outputs_runner`), before
                any forward: the IPEX backend, int8 weights, a ``PreallocatedKVCache`` passed to continue, attentions
                with speculative decoding where the attention returns no weights (transformers 5's SDPA).
            TypeError: ``candidate_generator`` lacks the two methods.

        Hidden states and attentions (``output_hidden_states`` / ``output_attentions``, with
        ``return_dict_in_generate=True``): on the pure-PyTorch path the whole call runs transformers' forward with
        transformers' ``DynamicCache`` (our decoder returns logits only), with every candidate source; the output
        has stock transformers' structure and values.
        """
        if current_request() is None:  # a call of the user's (not a draft's inside another model's generate())
            self.last_strategy = self.last_cost_model = self.last_speculation_stats = None
        generation_config = kwargs.get("generation_config") or self.generation_config
        lookup_arguments(kwargs, generation_config)
        num_beams = kwargs.get("num_beams", getattr(generation_config, "num_beams", 1)) or 1
        if not self.runner.supports_beam_search and num_beams > 1:
            raise ValueError(
                "Beam search (num_beams > 1) is not supported on the IPEX backend: IPEXFusedCache does not reorder "
                "beams. Use greedy decoding, sampling, or assisted generation."
            )
        self._check_generation_mode(generation_config, args, kwargs, candidate_generator)
        self._check_call_inputs(args, kwargs)
        if current_request() is None:  # the target's positions (a draft's nested call asks for what fits the target's)
            fit_to_positions(self.config, generation_config, args, kwargs,
                             fixed_rotary_tables=self.backend == "ipex")
        draft_overrides = assisted_arguments(kwargs, candidate_generator)
        assistant = kwargs.get("assistant_model")
        if assistant is not None:
            draft_config = getattr(assistant, "generation_config", None)
            check_draft_arguments({name: draft_overrides.get(name, getattr(draft_config, name, None))
                                   for name in DRAFT_ARGUMENTS})
        request = GenerationRequest(schedule=draft_overrides.get("num_assistant_tokens_schedule"))
        request.runner = self._layer_outputs_runner(
            generation_config, kwargs, speculative=(candidate_generator is not None or assistant is not None
                                                    or kwargs.get("prompt_lookup_num_tokens") is not None))
        if assistant is None and draft_overrides:  # prompt lookup's schedule: checked here, it has no draft config
            check_draft_arguments(draft_overrides)
            draft_overrides = {}
        if candidate_generator is not None:
            for method in ("get_candidates", "update_candidate_strategy"):
                if not callable(getattr(candidate_generator, method, None)):
                    raise TypeError(
                        f"candidate_generator must implement {method}() (transformers' CandidateGenerator "
                        f"interface); got {type(candidate_generator).__name__}"
                    )
            if kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens") is not None:
                raise ValueError("pass either candidate_generator or assistant_model/prompt_lookup_num_tokens, not both")
            # transformers enters assisted decoding only for a draft or prompt lookup; prompt_lookup_num_tokens
            # switches it there, and _get_candidate_generator returns the request's generator instead of a lookup
            kwargs["prompt_lookup_num_tokens"] = 1
            request.candidate_generator = candidate_generator
        if same_size_different_vocabularies(self, assistant, kwargs.get("tokenizer"), kwargs.get("assistant_tokenizer")):
            # transformers tells tokenizers apart by vocabulary size only and would refuse assistant_tokenizer
            # here; set it aside past that check so universal assisted generation re-encodes the text
            request.assistant_tokenizer = kwargs.pop("assistant_tokenizer")
        speculative = assistant is not None or kwargs.get("prompt_lookup_num_tokens") is not None
        if self.backend == "torch" and speculative:
            dynamic_cache_for_assisted(self, generation_config, args, kwargs)
        ipex_involved = self.backend == "ipex" or getattr(assistant, "backend", None) == "ipex"
        # assisted as target, or continuing a cache (how transformers drives an assistant model)
        assisted = speculative or isinstance(kwargs.get("past_key_values"), IPEXFusedCache)
        patches = generation_patches(assisted=assisted) if ipex_involved else contextlib.nullcontext()
        with request_scope(request), draft_generation_config(kwargs, draft_overrides), patches:
            return super().generate(*args, **kwargs)

    def _layer_outputs_runner(self, generation_config, kwargs, speculative: bool):
        """The runner of a ``generate()`` call that asks for hidden states or attentions (``output_hidden_states`` /
        ``output_attentions``, passed or on the call's generation config), when it is not the model's own: on the
        pure-PyTorch decoder, transformers' forward with transformers' own cache for the whole call (the decoder and
        its preallocated cache return logits only); None otherwise. A draft's nested call (transformers hands a draft
        its target's generation config, flags included, marked ``is_assistant``) has the flags turned off in
        ``kwargs`` instead: nothing reads a draft's hidden states or attentions.

        Raises:
            ValueError: before anything runs, where this model cannot return them: the IPEX backend (its fused graph
                returns logits only: ``backend="torch"``), int8 weights (``weights="dense"``), a
                ``PreallocatedKVCache`` passed to continue (transformers' forward cannot read it), or
                ``output_attentions`` in speculative decoding (``speculative``) where the model's attention returns
                no weights (:func:`~optimum_ipex_spec.compat.returns_attention_weights`: transformers 5's assisted
                decoding would fail on them with an IndexError; without speculation it returns empty tuples, as
                stock transformers does).
        """
        names = requested_layer_outputs(kwargs, generation_config)
        if not names:
            return None
        if getattr(generation_config, "is_assistant", False):
            config = copy.deepcopy(generation_config)
            for name in names:
                setattr(config, name, False)
                kwargs.pop(name, None)
            kwargs["generation_config"] = config
            return None
        runner = self.runner.layer_outputs_runner(names)
        attention = getattr(getattr(runner, "model", None), "config", self.config).get_text_config()
        attention = getattr(attention, "_attn_implementation", None) or "eager"
        if speculative and "output_attentions" in names and not returns_attention_weights(attention):
            raise ValueError(
                f"output_attentions=True with speculative decoding (assistant_model, prompt_lookup_num_tokens or "
                f"candidate_generator): this model's {attention!r} attention returns no attention weights with "
                f"transformers {transformers.__version__}, and its assisted decoding needs them from every "
                "verification. Load the checkpoint with eager attention: IPEXModelForCausalLM.from_transformers_model("
                "AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation='eager'), backend='torch'), or "
                "generate without speculative decoding"
            )
        if runner is self.runner:
            return None
        for name in ("past_key_values", "cache"):
            if isinstance(kwargs.get(name), PreallocatedKVCache):
                raise ValueError(preallocated_cache_refused(names))
        return runner

    def _call_runner(self):
        """The runner of the ``generate()`` call running now (see :meth:`_layer_outputs_runner`), else the model's."""
        request = current_request()
        return request.runner if request is not None and request.runner is not None else self.runner

    def _check_call_inputs(self, args, kwargs) -> None:
        """Refuse, before any work, token ids the forward cannot take and a draft that cannot be one.

        Raises:
            TypeError: ids of another dtype than the runner takes (:func:`~optimum_ipex_spec.backends.base.
                check_token_ids`); ``assistant_model`` that is not a model (e.g. a string: load it first).
            ValueError: ids outside the vocabulary; an encoder-decoder ``assistant_model`` (T5, Whisper, BART): its
                proposals would not be next tokens of the target's own sequence.
        """
        inputs = call_input_ids(args, kwargs)
        if isinstance(inputs, torch.Tensor):
            check_token_ids(inputs, self.runner.vocab_size, dtypes=self.runner.token_id_dtypes)
        assistant = kwargs.get("assistant_model")
        if assistant is None:
            return
        config = getattr(assistant, "config", None)
        if not callable(getattr(assistant, "generate", None)) or not isinstance(config, PretrainedConfig):
            hint = (f" (to use the checkpoint {assistant!r}: assistant_model=IPEXModelForCausalLM.from_pretrained("
                    f"{assistant!r}, export=True))" if isinstance(assistant, (str, os.PathLike)) else "")
            raise TypeError(f"assistant_model must be a causal language model (an IPEXModelForCausalLM or a "
                            f"transformers *ForCausalLM), got {type(assistant).__name__}{hint}")
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"assistant_model is an encoder-decoder model ({type(assistant).__name__}, model_type "
                f"{getattr(config, 'model_type', '?')!r}): its proposals would continue its decoder's sequence, not "
                "this decoder-only target's, and speculative decoding would no longer return the target's tokens. "
                "Use a decoder-only draft (a smaller causal LM, or model.self_draft())."
            )

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
        if value("assistant_early_exit") is not None:
            raise ValueError(
                f"assistant_early_exit={value('assistant_early_exit')} (transformers' early-exit self-speculation, "
                "LayerSkip) is not supported by IPEXModelForCausalLM: its draft runs the target's first layers "
                "through transformers' own modules. Pass assistant_model=model.self_draft() (a cheaper copy of "
                "this model) instead."
            )
        speculative = (kwargs.get("assistant_model") is not None or candidate_generator is not None
                       or kwargs.get("prompt_lookup_num_tokens") is not None)
        if not speculative:
            return
        inputs = call_input_ids(args, kwargs)
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

    def self_draft(self, torch_dtype: Union[str, torch.dtype] = torch.bfloat16, backend: str = "auto",
                   weights: str = "dense", torch_compile: bool = False):
        """A cheaper copy of this model to use as its own draft: ``generate(assistant_model=...)``.

        The same checkpoint loaded again in ``torch_dtype`` (default bf16), exported like the target
        (``weights="dense"``), or held as weight-only int8 with bf16 activations on our pure-PyTorch decoder
        (``weights="int8"``: PyTorch's own int8 CPU kernel, :mod:`~optimum_ipex_spec.backends.pytorch.int8_weights`; a
        quarter of the fp32 weight bytes, built in seconds, not saved by ``save_pretrained``), or as int4 blocks with
        fp32 activations (``weights="int4"``, :mod:`~optimum_ipex_spec.backends.pytorch.int4_weights`, the kernels' fast
        mode where the CPU has AVX512-VNNI: 0.14-0.16x the fp32 bytes; ``torch_dtype`` is then fp32). Same tokenizer, so
        plain assisted generation applies; output stays the target's (every draft token is verified). Measured on
        SmolLM2-135M (docs/benchmarks.md): the bf16 copy agrees with the fp32 target's next token ~99% of the time;
        which copy is the cheaper draft on a machine is measured by ``make bench`` (self-draft section).
        ``torch_compile=True`` (pure-PyTorch path) compiles the draft's steps, as :meth:`from_pretrained` does. As a
        draft of this model the copy runs no prefill or catch-up of its own: it copies the KV rows it lacks from this
        model's cache (:mod:`~optimum_ipex_spec.speculative.shared_kv`; ``draft.share_target_kv = False`` turns it off).

        Raises:
            ValueError: the model was not exported from a checkpoint path or id (``source`` unknown); a dense copy
                in this model's own dtype (not cheaper); ``weights="int8"`` with a dtype other than bf16 or
                ``backend="ipex"``; ``weights="int4"`` with ``backend="ipex"``, or of a model that holds 4-bit blocks
                already (not cheaper); an unknown ``weights``.
        """
        if weights == "gguf":
            raise ValueError("a GGUF draft is a file of its own: IPEXModelForCausalLM.from_pretrained(<file or "
                             "provisioned name>, weights='gguf'); self_draft() makes dense, int8 or int4 copies")
        if not self.source:
            raise ValueError(
                "self_draft() needs the checkpoint this model was exported from; export it with "
                "IPEXModelForCausalLM.from_pretrained(model_id, export=True) or load the draft yourself"
            )
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
        check_torch_compile_flag(torch_compile)
        if weights == "int4":
            if backend == "ipex":
                raise ValueError("weights='int4' runs on our pure-PyTorch decoder: pass backend='auto' or 'torch', or "
                                 "weights='dense' for IPEX")
            if self.weights == "int4":
                raise ValueError("this model holds int4 blocks already: an int4 copy reads as many bytes and is not a "
                                 "cheaper draft. Use a smaller model of its family as the draft (e.g. "
                                 "from_pretrained(<0.5B>, weights='int4')), or prompt lookup")
            draft = type(self).from_transformers_model(
                load_causal_lm(self.source, torch.float32, **self.source_options), dtype=torch.float32,
                backend="torch", source=self.source, weights="int4", gguf_mode="fast", torch_compile=torch_compile,
                source_options=self.source_options)
        elif weights == "int8":
            if resolve_dtype(torch_dtype) != torch.bfloat16 or backend == "ipex":
                raise ValueError("weights='int8' runs on our pure-PyTorch decoder with bf16 activations: pass "
                                 "torch_dtype=torch.bfloat16 and backend='auto' or 'torch'")
            draft = type(self).from_transformers_model(
                load_causal_lm(self.source, torch.bfloat16, **self.source_options),
                dtype=torch.bfloat16, backend="torch", source=self.source, weights="int8", torch_compile=torch_compile,
                source_options=self.source_options)
        elif resolve_dtype(torch_dtype) == self._dtype:
            raise ValueError(
                f"this model is already {dtype_name(self._dtype)}: a {dtype_name(self._dtype)} copy is not a cheaper "
                "draft. Use an fp32 target with the default bf16 draft, weights='int8', or another draft model."
            )
        else:
            draft = type(self).from_pretrained(self.source, export=True, torch_dtype=torch_dtype, backend=backend,
                                               torch_compile=torch_compile, **self.source_options)
        draft._origin = self._origin  # the same weights: a draft of a loaded export keeps what the export recorded
        if draft._dtype == torch.bfloat16 and not onednn_bf16_available():
            _warn_emulated_bf16_draft(torch.backends.cpu.get_cpu_capability())
        # A copy of the target agrees with it almost always: stopping a draft block early on low draft
        # confidence (transformers' default threshold 0.4) only costs extra rounds; the cost model picks each
        # round's length up to 8 from measured costs and acceptance.
        draft.generation_config.assistant_confidence_threshold = 0.0
        draft.generation_config.num_assistant_tokens = 8
        draft.generation_config.num_assistant_tokens_schedule = COST_SCHEDULE
        return draft

    # ------------------------------------------------------------------ loading / export
    @classmethod
    def from_pretrained(cls, model_id: Union[str, Path], *args, **kwargs) -> "IPEXModelForCausalLM":
        """Load an exported folder, or export a transformers checkpoint with ``export=True``.

        Args:
            model_id: a local folder (transformers checkpoint or one written by ``save_pretrained``), a hub model
                id, or a provisioned model name (``optimum_ipex_spec.facts.PROVISIONED_MODELS``).
            export: export from a transformers checkpoint (``ipex.llm.optimize`` + trace). A folder
                without an export is exported automatically.
            torch_dtype: ``torch.float32`` (default), ``torch.bfloat16`` or ``"auto"``.
            backend: ``"auto"`` (IPEX when usable, else the pure-PyTorch path, logged once),
                ``"ipex"`` (raise if IPEX is unusable) or ``"torch"``.
            torch_compile: on the pure-PyTorch path (fp32 or bf16), compile the one-token decode step and the
                4-token verification step with ``torch.compile`` (Inductor's C++ GEMM templates; on AVX-512 our
                packed kernel, fp32 and, with AVX512-BF16, bf16, :mod:`~optimum_ipex_spec.kernels.packed_gemm`: one
                packed copy of the weights for both graphs, and in fp32 the only copy, the model's own released;
                :mod:`~optimum_ipex_spec.backends.pytorch.compiled_step`): SmolLM2-135M decodes x1.87 (fp32) / x3.70
                (bf16) faster than stock here. Compiling takes up to a minute per graph (the verification graph at the
                first chunk of draft tokens; autotuning cached on disk by Inductor); if it fails the eager decoder runs,
                logged. Default False.
            trust_torchscript: load an export of format 1 or 2, whose ``ipex_model.pt`` is a TorchScript program
                that runs code from the folder when loaded: only for a folder you made yourself (docs/security.md).
                Default False: such a folder is refused, with the command that exports it again. A folder saved by
                this release holds data only (safetensors, JSON, a manifest) and needs no trust: its files are
                checked against the manifest, and IPEX's graphs are traced again here from its weights.

        Raises:
            FileNotFoundError: ``model_id`` looks like a local path that does not exist.
            ValueError: not a causal LM; unsupported dtype; unknown backend; ``backend="ipex"`` with
                an architecture outside IPEX's fused path; ``torch_compile=True`` with IPEX's graphs or a torch
                older than 2.6.
            IPEXNotAvailableError: ``backend="ipex"`` without a usable IPEX (the message has the pip command).
            TypeError: a keyword this method does not take (a misspelling is named with the closest keyword; see
                :func:`check_from_pretrained_keywords`); ``dtype`` and ``torch_dtype`` both given.
            ValueError: ``device_map`` / ``device`` other than the CPU; a ``subfolder`` that leaves the folder; an
                export folder whose files do not match its manifest (``ManifestError``), whose config.json or
                weights disagree with what it recorded, or of format 1/2 with IPEX without ``trust_torchscript``.
        """
        model_id = str(model_id)
        check_from_pretrained_keywords(kwargs)
        if wants_gguf(model_id, kwargs):
            return cls._from_gguf(model_id, kwargs)
        weights = kwargs.get("weights", "dense")
        check_load_options(weights, kwargs.get("torch_dtype"), kwargs.get("backend", "auto"), kwargs.get("gguf_mode"))
        if weights != "dense" and kwargs.get("torch_dtype") in (None, "auto"):
            kwargs["torch_dtype"] = activation_dtype(weights)  # int8: bf16 activations; int4: fp32
        if is_provisioned_name(model_id) and not os.path.exists(model_id):
            from .provisioning.provision import resolve_model  # imported only for a provisioned name

            model_id = resolve_model(model_id)
        if not os.path.isdir(model_id) and (looks_like_local_path(model_id) or os.path.exists(model_id)):
            if os.path.isfile(model_id):
                raise FileNotFoundError(f"{model_id} is a file; pass the folder that contains config.json")
            raise FileNotFoundError(
                f"model folder {model_id} does not exist; pass a transformers checkpoint folder, a folder written by "
                "IPEXModelForCausalLM.save_pretrained, or a hub model id"
            )
        if os.path.isdir(model_id) and model_id.count("@") == 1:  # optimum would split off a "revision"
            relative = os.path.relpath(model_id)
            if relative.count("@") == 1:
                raise ValueError(f"{model_id}: optimum reads 'name@revision' as a hub id and a revision, so a local "
                                 "folder whose path holds one '@' would be looked up elsewhere; rename the folder, pass "
                                 "a link to it without '@', or (provisioned models) set OPTIMUM_IPEX_SPEC_CACHE")
            model_id = relative
        check_subfolder(kwargs.get("subfolder"), model_id)
        folder = checkpoint_folder(model_id, kwargs.get("subfolder"))
        # an export's files against its manifest, before its config is read; the weights' sha256 runs while they load
        kwargs["weights_check"] = check_export_files(folder, model_id)
        if os.path.isdir(model_id) and not os.path.isfile(os.path.join(folder, "config.json")):
            raise FileNotFoundError(f"{folder} has no config.json: it is not a transformers model folder")
        backend = kwargs.get("backend", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return super().from_pretrained(model_id, *args, **kwargs)

    @classmethod
    def _from_gguf(cls, model_id: str, kwargs: dict) -> "IPEXModelForCausalLM":
        """``from_pretrained`` of a GGUF file's blocks as shipped (:mod:`~optimum_ipex_spec.loading.gguf` finds the
        file and its config; :mod:`~optimum_ipex_spec.backends.pytorch.gguf_weights` maps and multiplies the blocks):
        our decoder, fp32 activations. ``gguf_mode``: "exact" (default: the dequantized weights times fp32 activations,
        the provisioned fp32 folder's function) or "fast" (activations rounded to int8 per block, AVX512-VNNI integer
        products, as llama.cpp computes: its own outputs). The model's ``source`` is the config folder when that holds a
        checkpoint (a provisioned model's fp32 folder): ``self_draft()`` then reads it."""
        weights = kwargs.pop("weights", "gguf")
        if weights != "gguf":
            raise ValueError(f"a GGUF file (gguf_file=, a .gguf path, gguf_mode=) is held as shipped (weights='gguf'); "
                             f"got weights={weights!r}. "
                             "For transformers' dequantized copy use AutoModelForCausalLM.from_pretrained(folder, "
                             "gguf_file=...) and from_transformers_model")
        backend, torch_compile = kwargs.get("backend", "auto"), kwargs.get("torch_compile", False)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_torch_compile_flag(torch_compile)
        check_gguf_options(kwargs.get("torch_dtype"), backend, kwargs)
        if is_provisioned_name(str(model_id)) and not os.path.exists(str(model_id)):
            from .provisioning.provision import gguf_source  # imported only for a provisioned name

            source = gguf_source(str(model_id), kwargs.get("gguf_file"))
        else:
            source = locate_gguf(model_id, kwargs.get("gguf_file"))
        gguf = read_gguf(source.path)  # checked by our reader before transformers reads its metadata
        config, generation_config = read_gguf_config(source, gguf)
        check_causal_lm_config(config, model_id)
        model = load_gguf_model(gguf, config, mode=kwargs.get("gguf_mode") or "exact")
        checkpoint = None
        if source.folder is not None and any(name.endswith(".safetensors") for name in os.listdir(source.folder)):
            checkpoint = os.path.abspath(source.folder)
        loaded = cls.from_transformers_model(model, dtype=torch.float32, backend="torch",
                                             generation_config=generation_config, source=checkpoint, weights="gguf",
                                             torch_compile=torch_compile)
        #: the GGUF file whose blocks the model multiplies (mapped, read-only)
        loaded.gguf_path = os.path.abspath(source.path)
        return loaded

    @classmethod
    def _choose_backend(cls, backend: str, config: PretrainedConfig, dtype: torch.dtype) -> str:
        """``backend`` resolved for this model and dtype on this machine.

        Raises:
            IPEXNotAvailableError: ``backend="ipex"`` without a usable IPEX.
            ValueError: ``backend="ipex"`` for an architecture off IPEX's fused path. (``backend="auto"`` with a
                dtype IPEX cannot run on this CPU returns "torch"; ``backend="ipex"`` with it is refused by
                :func:`~optimum_ipex_spec.backends.ipex.export.export_to_ipex`.)
        """
        if backend == "torch":
            return "torch"
        if backend == "ipex":
            require_ipex()
            if not ipex_supports(config):
                raise ValueError(
                    f"backend='ipex': architecture {first_architecture(config)} is not on IPEX's fused path "
                    f"(supported: {', '.join(IPEX_FUSED_ARCHITECTURES)}); use backend='auto' or 'torch'"
                )
            return "ipex"  # a dtype IPEX cannot run here: export_to_ipex refuses it before IPEX touches the model
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
        unsupported = ipex_dtype_unsupported(dtype_name(dtype))
        if unsupported:
            log_dtype_fallback_once(unsupported)
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
        torch_compile: bool = False,
        weights_check: Optional[HashCheck] = None,
        weights: str = "dense",
        gguf_mode: Optional[str] = None,
        **kwargs,
    ) -> "IPEXModelForCausalLM":
        check_causal_lm_config(config, model_id)
        folder = checkpoint_folder(model_id, subfolder)
        origin = None
        if has_export(folder):
            meta = read_export_meta(folder, model_id)
            if not is_data_only(meta) and meta["backend"] == "ipex":  # a graph archive, no weights
                raise ValueError(
                    f"{model_id} is already an IPEX export (it has {EXPORT_CONFIG_NAME}): load it without export=True, "
                    "or export the original transformers checkpoint"
                )
            # a data-only export (or a pure-PyTorch one) is a checkpoint too (self_draft reads it): no remote code, and
            # what it recorded stays its origin
            trust_remote_code = False
            origin = (meta.get("source"), meta.get("source_options") or {})
            weights_check = weights_check or check_export_files(folder, model_id)
            if is_data_only(meta):
                with checked_while_loading(weights_check, wait=False):  # damage named as such, not as a parser's error
                    check_export_folder(folder, meta, config)
        dtype = resolve_dtype(torch_dtype, config)
        load_kwargs = dict(
            revision=revision,
            cache_dir=cache_dir,
            force_download=force_download,
            token=token,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
        )
        if subfolder:
            load_kwargs["subfolder"] = subfolder
        with checked_while_loading(weights_check):
            eager = load_causal_lm(model_id, dtype, **load_kwargs)  # a local fp32 checkpoint read straight into bf16
        # the checkpoint's name for self_draft() and KV sharing: a local subfolder as its path, hub options beside an id
        if os.path.isdir(model_id):  # an absolute path: the name means the same from another working directory
            source, source_options = os.path.abspath(folder), {}
        else:
            source = model_id
            source_options = {key: value for key, value in (("revision", revision), ("subfolder", subfolder)) if value}
        return cls.from_transformers_model(
            eager, dtype=dtype, backend=backend, generation_config=eager.generation_config, source=source,
            torch_compile=torch_compile, source_options=source_options, origin=origin, weights=weights,
            gguf_mode=gguf_mode,
        )

    @classmethod
    def from_transformers_model(
        cls,
        model: torch.nn.Module,
        dtype: Union[None, str, torch.dtype] = None,
        backend: str = "auto",
        generation_config: Optional[GenerationConfig] = None,
        source: Optional[str] = None,
        weights: str = "dense",
        torch_compile: bool = False,
        source_options: Optional[dict] = None,
        origin: Optional[Tuple[str, dict]] = None,
        gguf_mode: Optional[str] = None,
    ) -> "IPEXModelForCausalLM":
        """Export an in-memory transformers causal LM. IPEX modifies ``model`` in place: pass a copy
        if you still need the eager model, or want to export it again. ``weights="int8"`` (``backend="torch"``,
        bf16): weight-only int8 on our decoder, releasing ``model``'s projection weights; ``weights="int4"``
        (fp32): int4 blocks (:mod:`~optimum_ipex_spec.backends.pytorch.int4_weights`) replace ``model``'s projections,
        head and embedding, multiplied in ``gguf_mode`` ("exact", default, or "fast"). ``torch_compile``: as in
        :meth:`from_pretrained`; in fp32 on the packed kernel ``model``'s projections and head become the packed copies
        its graphs multiply with (``model`` still runs, on them; each weight held once).

        Raises:
            ValueError: not a causal LM, unsupported dtype or backend; ``model`` was already optimized by IPEX
                (an earlier export of the same object): IPEX rewrote its modules in place and it cannot be traced
                again; ``weights="int8"`` / ``"int4"`` with another backend or dtype, or an architecture our decoder
                does not run; ``torch_compile=True`` where it does not apply (see :meth:`from_pretrained`).
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_torch_compile_flag(torch_compile)
        if ipex_converted(model):
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
        # already in dtype (from_pretrained loads it so): no .to(), which would also round float buffers such as the
        # rotary inv_freq that transformers keeps in fp32 (bf16 logits then drifted from stock's by up to 5e-2)
        model = (model if model.dtype == dtype else model.to(dtype)).eval()
        generation_config = generation_config or getattr(model, "generation_config", None)
        if weights != "gguf" and (weights != "dense" or gguf_mode is not None):  # a GGUF file's: checked at its load
            check_load_options(weights, dtype, backend, gguf_mode)
        if weights != "dense":  # our decoder's format (make_runner checks the architecture)
            if weights == "int4":
                if not TorchCausalLMDecoder.supports(model):
                    raise ValueError(f"weights='int4' runs on our pure-PyTorch decoder, which does not run "
                                     f"{type(model).__name__} ({', '.join(SUPPORTED_ARCHITECTURES)}): use "
                                     "weights='dense'")
                model = quantize_model_int4(model, gguf_mode or "exact")
            return cls(model, config, backend="torch", dtype=dtype, generation_config=generation_config,
                       source=source, weights=weights, torch_compile=torch_compile, source_options=source_options,
                       origin=origin)
        if torch_compile:  # the compiled step is our decoder's: "auto" means it, "ipex" cannot have it
            check_torch_compile("torch" if backend == "auto" else backend, model, dtype, weights)
            backend = "torch"
        if cls._choose_backend(backend, config, dtype) == "ipex":
            graphs = export_to_ipex(model, dtype)
            return cls(graphs.decode, config, backend="ipex", dtype=dtype, generation_config=generation_config,
                       verify_model=graphs.verify, source=source, source_options=source_options, origin=origin)
        return cls(model, config, backend="torch", dtype=dtype, generation_config=generation_config, source=source,
                   torch_compile=torch_compile, source_options=source_options, origin=origin)

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
        torch_compile: bool = False,
        weights_check: Optional[HashCheck] = None,
        trust_torchscript: bool = False,
        weights: str = "dense",
        gguf_mode: Optional[str] = None,
        **kwargs,
    ) -> "IPEXModelForCausalLM":
        check_torch_compile_flag(torch_compile)
        folder = checkpoint_folder(model_id, subfolder)
        if not has_export(folder):
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
                torch_compile=torch_compile,
                weights=weights,
                gguf_mode=gguf_mode,
            )
        meta = read_export_meta(folder, model_id)
        dtype = resolve_dtype(meta["torch_dtype"])
        if weights != "dense" and is_data_only(meta):
            dtype = activation_dtype(weights)  # the export's weights read in the format's dtype, then quantized
        elif torch_dtype not in (None, "auto") and resolve_dtype(torch_dtype) != dtype:
            raise ValueError(
                f"{model_id} was exported in {meta['torch_dtype']}; torch_dtype={torch_dtype} would need a new "
                "export from the original checkpoint"
            )
        if not is_data_only(meta):
            if weights != "dense":
                raise ValueError(f"{model_id} is an export of an older format; weights={weights!r} quantizes a "
                                 f"checkpoint at load: {reexport_hint(meta)}")
            return cls._from_legacy_export(model_id, folder, meta, config, dtype, backend, torch_compile,
                                           trust_torchscript, weights_check)
        weights_check = weights_check or check_export_files(folder, model_id)  # from_pretrained started it
        with checked_while_loading(weights_check, wait=False):  # damage named as such, not as a parser's error
            check_export_folder(folder, meta, config)
        generation_config = GenerationConfig.from_pretrained(folder) if os.path.isfile(
            os.path.join(folder, "generation_config.json")) else GenerationConfig.from_model_config(config)
        if backend == "auto" and meta["backend"] == "torch":
            backend = "torch"  # an IPEX export under "auto": IPEX where it is usable here, else our decoder (logged)
        # the folder holds the weights in the export dtype: the export is made again from them, on the backend the
        # export was made for unless asked otherwise (IPEX's graphs are traced here, for this machine); the weights'
        # sha256 is checked while they are read, before the model is returned
        with checked_while_loading(weights_check):
            eager = load_causal_lm(folder, dtype, use_safetensors=True, trust_remote_code=False)
            model = cls.from_transformers_model(eager, dtype=dtype, backend=backend,
                                                generation_config=generation_config, source=os.path.abspath(folder),
                                                torch_compile=torch_compile,
                                                origin=(meta.get("source"), meta.get("source_options")),
                                                weights=weights, gguf_mode=gguf_mode)
        model.model_save_dir = folder
        return model

    @classmethod
    def _from_legacy_export(cls, model_id: str, folder: str, meta: dict, config: PretrainedConfig, dtype: torch.dtype,
                            backend: str, torch_compile: bool, trust_torchscript: bool,
                            weights_check: Optional[HashCheck] = None) -> "IPEXModelForCausalLM":
        """Load an export of format 1 or 2 (before the manifest): a TorchScript archive for IPEX, transformers'
        weights for the pure-PyTorch path."""
        try:
            generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:
            generation_config = GenerationConfig.from_model_config(config)
        if meta["backend"] == "ipex":
            if torch_compile:
                raise ValueError(f"{model_id} holds an IPEX graph; torch_compile=True compiles our pure-PyTorch "
                                 "decoder's step: export the checkpoint with backend='torch', or drop torch_compile")
            if backend == "torch":
                raise ValueError(
                    f"{model_id} holds an IPEX graph; backend='torch' needs the original transformers checkpoint"
                )
            if not trust_torchscript:
                raise ValueError(legacy_archive_refusal(folder, meta))
            check_ipex_for_saved_graph(model_id, meta, ipex_status())
            graphs = load_graphs(folder, meta)
            model = cls(graphs.decode, config, backend="ipex", dtype=dtype, generation_config=generation_config,
                        model_save_dir=folder, verify_model=graphs.verify, source=meta.get("source"), warmup=False,
                        source_options=meta.get("source_options"))
            try:
                model.runner.warmup()
            except RuntimeError as exc:  # e.g. a config.json that does not match the graph
                raise ValueError(
                    f"the graph in {folder} does not run with its config.json ({str(exc).splitlines()[0]}); "
                    f"{reexport_hint(meta)}"
                ) from exc
            return model
        if backend == "ipex":
            raise ValueError(
                f"{model_id} holds a pure-PyTorch export (backend 'torch'); backend='ipex' needs a new export from "
                f"the original checkpoint: {reexport_hint(meta)}"
            )
        if weights_check is None:
            log_unchecked_export_once(folder)
        with checked_while_loading(weights_check):  # a manifest it holds is checked, whatever format it claims
            eager = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, use_safetensors=True,
                                                         trust_remote_code=False)
        # its weights are in the folder: the folder is its source (self_draft() reads it), never a recorded path
        return cls(eager.eval(), config, backend="torch", dtype=dtype, generation_config=generation_config,
                   model_save_dir=folder, source=os.path.abspath(folder), torch_compile=torch_compile,
                   origin=(meta.get("source"), meta.get("source_options")))

    def save_pretrained(self, save_directory: Union[str, Path], push_to_hub: bool = False, **kwargs) -> None:
        """Write this model as an export folder (format 3, data only): config.json, generation_config.json, the
        weights in safetensors in the model's dtype, ``ipex_export.json`` (versions, source, the model facts it was
        built for) and, last, ``manifest.json`` (every file's size and sha256). The folder is written beside
        ``save_directory`` and renamed into place: an existing export is replaced only once the new one is complete
        (swapped in one step where the system can), and a save that is killed leaves the old export or nothing
        (besides a hidden ``.<name>-`` folder, which loading names as an unfinished save).

        An IPEX model holds IPEX's packed weights only: its weights are read again from its ``source`` checkpoint
        (the one it was exported or loaded from) in its dtype. ``push_to_hub``: optimum's upload of the folder.

        Raises:
            ValueError: ``save_directory`` is a file, a symbolic link, or a non-empty folder that holds no export (it
                is replaced whole, and it is not ours to delete); a model with int8 weights; an IPEX model without a
                ``source``.
        """
        target = Path(os.path.abspath(os.path.expanduser(str(save_directory))))
        check_save_target(target)
        kept = []
        with staged_directory(target, honour_umask=True, keep=kept) as staging:
            self._save_pretrained(staging)
            for preprocessor in self.preprocessors:
                preprocessor.save_pretrained(staging)
            kept += carry_over(str(target), str(staging))  # a tokenizer, a README, the CLI's draft-bf16/
            write_manifest(str(staging))
        if push_to_hub:
            return self.push_to_hub(str(target), **kwargs)
        return None

    def _save_pretrained(self, save_directory: Union[str, Path]) -> None:
        if self.weights == "gguf":
            raise ValueError("a model on GGUF weights is its GGUF file: it is not saved again. Keep the .gguf file "
                             "and load it with from_pretrained(..., weights='gguf')")
        if self.weights != "dense":
            raise ValueError(f"a model with {self.weights} weights is built from its checkpoint in seconds and is "
                             "not saved: save the checkpoint, and build it again with from_pretrained(checkpoint, "
                             f"weights={self.weights!r}) or self_draft(weights={self.weights!r})")
        save_directory = str(save_directory)
        config = self.config
        if self.backend == "ipex":
            if not self.source:
                raise ValueError("this IPEX model holds IPEX's packed weights only, and no checkpoint is recorded to "
                                 "read its weights from: save the transformers model (model.save_pretrained) before "
                                 "exporting it, and export that folder with from_pretrained(folder, export=True)")
            # the checkpoint read again in the model's dtype, as the export read it; its config is the one the export
            # started from (IPEX's graphs are traced again from both when the folder is loaded)
            check = check_export_files(self.source, self.source) if os.path.isdir(self.source) else None
            with checked_while_loading(check):  # a source that is a saved export is checked like any load of it
                eager = load_causal_lm(self.source, self._dtype, **self.source_options)
            eager.save_pretrained(save_directory, safe_serialization=True)
            config = eager.config
            del eager
        else:
            # in bf16 the decoder fuses q/k/v and gate/up, and the layers' weights are row slices of the fused
            # matrices; a checkpoint holds each weight on its own: those slices are copied for the save (the fused
            # weights once more in memory while it runs); a model compiled on the packed kernel (fp32; bf16 where AMX
            # runs its prefills) holds its projections packed only: their state dict unpacks them for the save (a
            # copy too; a tied head and its embedding one tensor, which transformers writes once)
            state_dict = {name: tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor
                          for name, tensor in self.model.state_dict().items()}
            self.model.save_pretrained(save_directory, state_dict=state_dict, safe_serialization=True)
        self.generation_config.save_pretrained(save_directory)
        ipex_version = ipex_status().ipex_version if self.backend == "ipex" else None
        origin, origin_options = self.origin
        write_export_meta(save_directory, export_meta(self.backend, dtype_name(self._dtype),
                                                      first_architecture(config), origin, ipex_version,
                                                      origin_options, config))


register_for_pipelines(IPEXModelForCausalLM.__name__)


#: keywords :meth:`IPEXModelForCausalLM.from_pretrained` takes (optimum's hub options, ours, and the transformers
#: spellings it honours: ``dtype`` for ``torch_dtype``, ``device_map``/``device`` for the CPU)
FROM_PRETRAINED_KEYWORDS = (
    "config", "export", "subfolder", "revision", "force_download", "local_files_only", "trust_remote_code",
    "cache_dir", "token", "torch_dtype", "dtype", "backend", "torch_compile", "device_map", "device",
    "trust_torchscript", "weights", "gguf_file", "gguf_mode")


def check_from_pretrained_keywords(kwargs: Dict[str, Any]) -> None:
    """Refuse keywords that ``from_pretrained`` would otherwise drop without a word, and the CPU-only ones' other
    values; ``dtype=`` (transformers 5's name) becomes ``torch_dtype``, and ``device_map`` / ``device`` are removed
    once checked. Changes ``kwargs`` in place.

    Raises:
        TypeError: an unknown keyword (the message suggests the closest of :data:`FROM_PRETRAINED_KEYWORDS`);
            ``dtype`` and ``torch_dtype`` both given.
        ValueError: ``device_map`` other than None, ``"cpu"`` or a map of every module to the CPU; ``device``
            other than the CPU.
    """
    unknown = [name for name in kwargs if name not in FROM_PRETRAINED_KEYWORDS]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, FROM_PRETRAINED_KEYWORDS, n=1, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"IPEXModelForCausalLM.from_pretrained() got unexpected keyword argument(s) "
                        f"{', '.join(hints)}; it takes {', '.join(FROM_PRETRAINED_KEYWORDS)}")
    if "dtype" in kwargs:
        if kwargs.get("torch_dtype") is not None:
            raise TypeError("pass the dtype once: dtype= (transformers 5's name) or torch_dtype=, not both")
        kwargs["torch_dtype"] = kwargs.pop("dtype")
    device_map = kwargs.pop("device_map", None)
    targets = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    for target in targets + [kwargs.pop("device", None)]:
        if target is None or (isinstance(target, (str, torch.device)) and str(target) == "cpu"):
            continue
        raise ValueError(f"IPEXModelForCausalLM runs on the CPU only; got device_map/device={device_map or target!r}. "
                         "Leave it out (or pass device_map='cpu'); for a GPU use transformers' own model class")


#: forward arguments with one entry per token of the call (transformers' names), cut with it when it is split
_PER_TOKEN_ARGUMENTS = ("cache_position", "token_type_ids")


def _prefill_with_candidates(input_ids, cache, logits_to_keep, use_cache: bool, kwargs) -> bool:
    """Whether a forward call is speculative decoding's first verification: one sequence on an empty cache, keeping
    the logits of its last ``logits_to_keep`` (> 1) positions, at most its tokens (transformers' assisted decoding
    asks for ``k + 1``: the prompt's last token's and the ``k`` candidates'; all of them on a 1-token prompt; a plain
    prefill asks for 1), and asking for nothing that covers the whole call (hidden states, attentions, a loss)."""
    return (isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool)
            and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] == 1
            and 1 < logits_to_keep <= input_ids.shape[1] and use_cache
            and not whole_call_arguments(kwargs)
            and _cached_tokens(cache) == 0)


def _cached_tokens(cache) -> int:
    """Tokens held by a cache of any kind: None, a transformers ``Cache`` (ours included), or the legacy tuple of
    per-layer ``(key [batch, heads, tokens, head_dim], value)`` pairs that transformers 4.x's GPT-2 returns."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return cache.get_seq_length()
    return int(cache[0][0].shape[-2]) if len(cache) else 0
