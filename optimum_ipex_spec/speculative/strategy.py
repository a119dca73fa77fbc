"""Which source of draft tokens a ``generate()`` call uses, and the request that carries the call's choices.

transformers' ``GenerationMixin.generate`` drives assisted decoding and asks the model for a candidate generator
(``_get_candidate_generator``) once per call. What that generator should be depends on the call's arguments:

========================  ====================================================================================
strategy                  when
========================  ====================================================================================
``custom``                ``generate(candidate_generator=...)``: the user's generator
``draft``                 greedy, a draft that is one of our models with a runner that can draft, same
                          tokenizer: :class:`~optimum_ipex_spec.speculative.candidates.IPEXDraftCandidateGenerator`
``universal-sampling``    sampling with a draft of another tokenizer: transformers' universal speculative
                          decoding with the draft's LM head left whole (Timor et al. 2025, transformers PR #35029)
``prompt-lookup``         ``prompt_lookup_num_tokens=``:
                          :class:`~optimum_ipex_spec.speculative.candidates.AdaptivePromptLookupCandidateGenerator`
``transformers``          anything else with a draft (a transformers draft, universal greedy, early exit):
                          transformers' own generator
========================  ====================================================================================

:func:`select_strategy` decides from plain facts (a pure function, tested by a table);
:func:`build_candidate_generator` builds the generator. The per-call state our ``generate()`` hands to the
hooks transformers calls back (the user's generator, a tokenizer set aside, the stopping criteria, the strategy
chosen) lives in a :class:`GenerationRequest` held in a context variable for the duration of the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Iterator, Optional

from transformers import GenerationConfig

from .candidates import AdaptivePromptLookupCandidateGenerator, IPEXDraftCandidateGenerator
from ..compat import cache_kwarg, eos_token_tensor, vocabulary_translator
from .cost_model import COST_SCHEDULE
from .shared_kv import SHARABLE_CACHES, shares_target_kv


class Strategy(str, Enum):
    CUSTOM = "custom"
    DRAFT = "draft"
    UNIVERSAL_SAMPLING = "universal-sampling"
    PROMPT_LOOKUP = "prompt-lookup"
    TRANSFORMERS = "transformers"


@dataclass
class GenerationRequest:
    """The state of one ``generate()`` call that transformers' callbacks (``_get_stopping_criteria``,
    ``_get_candidate_generator``) need.

    Attributes:
        candidate_generator: the user's generator (``generate(candidate_generator=...)``), or None.
        assistant_tokenizer: the draft's tokenizer, set aside when its vocabulary has the target's size but
            other ids (transformers would refuse it; universal assisted generation re-encodes the text).
        stopping_criteria: all stopping criteria of the call, once transformers built them.
        strategy: the strategy chosen, once transformers asked for the candidate generator.
        schedule: the ``num_assistant_tokens_schedule`` passed to this call (not only configured), or None. Prompt
            lookup reads it here: it has no draft whose generation config would carry it.
        runner: the runner that serves the whole call when it is not the model's own (transformers' forward and
            cache where the call asks for hidden states or attentions on the pure-PyTorch decoder), else None.
    """

    candidate_generator: Any = None
    assistant_tokenizer: Any = None
    stopping_criteria: Any = None
    strategy: Optional[Strategy] = None
    schedule: Optional[str] = None
    runner: Any = None


_REQUEST: contextvars.ContextVar[Optional[GenerationRequest]] = contextvars.ContextVar(
    "optimum_ipex_spec_generation_request", default=None)


def current_request() -> Optional[GenerationRequest]:
    """The request of the innermost ``generate()`` call of ours running in this context, or None."""
    return _REQUEST.get()


@contextlib.contextmanager
def request_scope(request: GenerationRequest) -> Iterator[GenerationRequest]:
    """Make ``request`` current for one ``generate()`` call (nested calls, e.g. a draft's, get their own)."""
    token = _REQUEST.set(request)
    try:
        yield request
    finally:
        _REQUEST.reset(token)


def select_strategy(*, custom: bool, has_draft: bool, draft_can_run_ours: bool, do_sample: bool,
                    different_tokenizers: bool, prompt_lookup: bool, early_exit: bool) -> Strategy:
    """The strategy for a call, from facts about it (see the module table). Pure.

    Args:
        custom: a user candidate generator was passed.
        has_draft: ``assistant_model`` was passed.
        draft_can_run_ours: the draft is one of our models whose runner can be driven as a draft.
        do_sample: sampling (else greedy).
        different_tokenizers: ``tokenizer=`` and ``assistant_tokenizer=`` were given (universal assisted generation).
        prompt_lookup: ``prompt_lookup_num_tokens`` is set.
        early_exit: ``assistant_early_exit`` is set (transformers' self-speculation through early exit).
    """
    if custom:
        return Strategy.CUSTOM
    if has_draft and draft_can_run_ours and not (do_sample or different_tokenizers or prompt_lookup or early_exit):
        return Strategy.DRAFT
    if has_draft and different_tokenizers and do_sample:
        return Strategy.UNIVERSAL_SAMPLING
    if prompt_lookup and not early_exit:
        return Strategy.PROMPT_LOOKUP
    return Strategy.TRANSFORMERS


#: strategies whose proposals come from a draft model (the cost model sets their length)
DRAFT_STRATEGIES = (Strategy.DRAFT, Strategy.UNIVERSAL_SAMPLING, Strategy.TRANSFORMERS)


def uses_cost_model(strategy: Strategy, has_draft: bool, configured: Optional[str], passed: Optional[str]) -> bool:
    """Whether :mod:`~optimum_ipex_spec.speculative.cost_model` chooses the draft length of a call (pure).

    Args:
        strategy: the call's strategy.
        has_draft: the call has a draft model (``assistant_model=...``).
        configured: the draft's ``num_assistant_tokens_schedule`` for this call (what was passed, else its
            generation config's), or None when unset or when there is no draft.
        passed: the ``num_assistant_tokens_schedule`` passed to ``generate()``, or None.

    A draft model's strategies: on when ``configured`` is ``"cost"``, or is transformers' default (unset, or
    ``"constant"``, which transformers 4.x cannot tell from unset) and nothing was passed: the default for our
    targets. Prompt lookup: on unless a schedule other than ``"cost"`` was passed (then the lookup gates itself,
    :class:`~optimum_ipex_spec.speculative.candidates.AdaptivePromptLookupCandidateGenerator`). Off for everything else.
    """
    if strategy is Strategy.PROMPT_LOOKUP:
        return passed in (None, COST_SCHEDULE)
    if not has_draft or strategy not in DRAFT_STRATEGIES:
        return False
    return configured == COST_SCHEDULE or (configured in (None, "constant") and passed is None)


def build_candidate_generator(strategy: Strategy, target, generation_config, input_ids, inputs_tensor,
                              logits_processor, model_kwargs, assistant_model, target_tokenizer, assistant_tokenizer,
                              transformers_default):
    """The candidate generator of ``strategy`` (not :data:`Strategy.CUSTOM`: the request holds that one).

    Args:
        transformers_default: a callable returning transformers' own generator for the call.

    Raises:
        ValueError: universal speculative sampling on a transformers without it (< 4.50).
    """
    if strategy is Strategy.DRAFT:
        return IPEXDraftCandidateGenerator(
            input_ids=input_ids, assistant_model=assistant_model, generation_config=generation_config,
            model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
            target_cache=shared_target_cache(target, assistant_model, model_kwargs))
    if strategy is Strategy.UNIVERSAL_SAMPLING:
        return _universal_sampling_generator(target, generation_config, input_ids, inputs_tensor, logits_processor,
                                             model_kwargs, assistant_model, target_tokenizer, assistant_tokenizer)
    if strategy is Strategy.PROMPT_LOOKUP:
        return AdaptivePromptLookupCandidateGenerator(
            eos_token_id=eos_token_tensor(generation_config),
            num_output_tokens=generation_config.prompt_lookup_num_tokens,
            max_matching_ngram_size=generation_config.max_matching_ngram_size,
            max_length=generation_config.max_length,
            logits_processor=logits_processor,
            vocab_size=target.config.get_text_config().vocab_size,
        )
    if strategy is Strategy.TRANSFORMERS:
        return transformers_default()
    raise ValueError(f"no generator to build for strategy {strategy!r}")


def shared_target_cache(target, assistant_model, model_kwargs):
    """The target's cache of the call when the draft can fill its own from it
    (:func:`~optimum_ipex_spec.speculative.shared_kv.shares_target_kv` and a cache of ours in ``model_kwargs``), else
    None."""
    cache = model_kwargs.get(cache_kwarg(), model_kwargs.get("past_key_values"))
    if isinstance(cache, SHARABLE_CACHES) and shares_target_kv(target, assistant_model):
        return cache
    return None


def _universal_sampling_generator(target, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                  assistant_model, target_tokenizer, assistant_tokenizer):
    """transformers' universal speculative decoding (sampling with different tokenizers), the draft's LM head
    left whole (:func:`~optimum_ipex_spec.compat.vocabulary_translator`): the same proposals and probabilities."""
    try:
        from transformers.generation.candidate_generator import UniversalSpeculativeDecodingGenerator

        translator = vocabulary_translator(target_tokenizer, assistant_tokenizer,
                                           target.config.get_text_config().vocab_size, assistant_model)
    except ImportError:
        import transformers

        raise ValueError(
            "sampling (do_sample=True) with a draft of another tokenizer needs transformers >= 4.50 (universal "
            f"speculative decoding); transformers {transformers.__version__} is installed. Use greedy decoding "
            "(do_sample=False), a draft with the target's tokenizer, or a newer transformers."
        ) from None
    return UniversalSpeculativeDecodingGenerator(
        input_ids=input_ids, assistant_model=assistant_model, generation_config=generation_config,
        model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
        target_tokenizer=target_tokenizer, assistant_tokenizer=assistant_tokenizer, atm_translator=translator)


#: generate() arguments that transformers' assisted generation reads from the draft's own generation config
DRAFT_ARGUMENTS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
#: ... and those that only universal assisted generation (draft of another tokenizer) reads, also from the draft
UNIVERSAL_ARGUMENTS = ("assistant_lookbehind", "target_lookbehind")


def lookup_arguments(kwargs: Dict[str, Any], generation_config) -> None:
    """Make prompt lookup's settings keywords of the call and check them, before any other check reads ``kwargs``.

    ``prompt_lookup_num_tokens`` and ``max_matching_ngram_size`` set on the effective generation config (the one
    passed to the call, else the model's) start prompt lookup as the keywords do; they are copied into ``kwargs`` so
    that every later check (batch size, a draft model or ``candidate_generator`` besides, the torch path's cache)
    sees the strategy the call will run. ``max_matching_ngram_size`` on a config is copied only with prompt lookup.

    Raises:
        ValueError: ``prompt_lookup_num_tokens`` or ``max_matching_ngram_size`` not an integer >= 1 (transformers
            would fail deep inside its candidate generator, or take 0 for its default).
    """
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
        value = kwargs.get(name)
        if value is None:
            value = getattr(generation_config, name, None)
            if value is None or (name == "max_matching_ngram_size" and kwargs.get("prompt_lookup_num_tokens") is None):
                continue  # an n-gram size configured without prompt lookup is a default: transformers ignores it
            kwargs[name] = value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (tokens), got {value!r}")


def assisted_arguments(kwargs: Dict[str, Any], candidate_generator) -> Dict[str, Any]:
    """Check the assisted-decoding arguments of a ``generate()`` call and return those the draft's generation config
    must carry for this call (``DRAFT_ARGUMENTS`` and ``UNIVERSAL_ARGUMENTS`` passed as keywords, which are removed
    from ``kwargs``, or set to a non-default value in a ``generation_config=`` passed to the call). With prompt
    lookup the only draft argument accepted is ``num_assistant_tokens_schedule`` (``"cost"``, the default, or one
    of transformers' values for the lookup's own back-off); it is returned and removed from ``kwargs`` too.

    Raises:
        ValueError: an argument without the strategy it configures: a draft argument without ``assistant_model``
            (except the schedule with prompt lookup) or with ``candidate_generator`` (which chooses its own
            proposals), a lookbehind without ``tokenizer=`` and ``assistant_tokenizer=``,
            ``max_matching_ngram_size`` without ``prompt_lookup_num_tokens``, or ``prompt_lookup_num_tokens``
            together with ``assistant_model`` (transformers would silently drop the draft).
    """
    assistant = kwargs.get("assistant_model")
    lookup = kwargs.get("prompt_lookup_num_tokens")  # set from a generation config too: lookup_arguments()
    if assistant is not None and lookup is not None:
        raise ValueError(
            "pass either assistant_model (a draft model) or prompt_lookup_num_tokens (prompt lookup), not both: "
            "they are two different sources of draft tokens (prompt_lookup_num_tokens counts when set on the "
            "generation config too: set it to None there to use a draft)"
        )
    if kwargs.get("max_matching_ngram_size") is not None and lookup is None and candidate_generator is None:
        raise ValueError("max_matching_ngram_size configures prompt lookup: pass prompt_lookup_num_tokens=... too")
    if candidate_generator is not None and kwargs.get("max_matching_ngram_size") is not None:
        raise ValueError("max_matching_ngram_size configures prompt lookup; a candidate_generator makes its own "
                         "proposals: drop the argument")
    passed = {name: kwargs[name] for name in DRAFT_ARGUMENTS + UNIVERSAL_ARGUMENTS if kwargs.get(name) is not None}
    user_config = kwargs.get("generation_config")
    if user_config is not None and (assistant is not None or lookup is not None or candidate_generator is not None):
        # a setting of the passed config counts as passed unless it is transformers' default (which 4.x cannot tell
        # from unset: num_assistant_tokens_schedule="constant", num_assistant_tokens=20) or the draft's own value
        defaults = GenerationConfig()
        own = getattr(assistant, "generation_config", None)
        for name in DRAFT_ARGUMENTS + UNIVERSAL_ARGUMENTS:
            configured = getattr(user_config, name, None)
            if (name not in passed and configured is not None and configured != getattr(defaults, name, None)
                    and configured != getattr(own, name, None)):
                passed[name] = configured
    if not passed:
        return {}
    names = ", ".join(sorted(passed))
    if candidate_generator is not None:
        raise ValueError(f"{names} configure(s) a draft model (assistant_model=...); a candidate_generator makes its "
                         "own proposals: drop the argument(s) or configure your generator")
    if assistant is None and lookup is not None and set(passed) == {"num_assistant_tokens_schedule"}:
        kwargs.pop("num_assistant_tokens_schedule", None)  # prompt lookup's switch for the cost model
        return passed
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


#: ``num_assistant_tokens_schedule`` values: transformers' three and ours
SCHEDULES = ("constant", "heuristic", "heuristic_transient", COST_SCHEDULE)


def check_draft_arguments(values: Dict[str, Any]) -> None:
    """Refuse draft arguments transformers would take silently or fail on deep in its loop. ``values``: the
    effective ``num_assistant_tokens``, ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold``
    of a call (passed to ``generate()`` or on the draft's generation config; None = unset).

    Raises:
        ValueError: ``num_assistant_tokens`` not a finite number >= 1, a schedule not in :data:`SCHEDULES`, or a
            confidence threshold not a number in [0, 1].
    """
    tokens = values.get("num_assistant_tokens")  # a float is transformers' own: the heuristic schedule writes one
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, (int, float))
                               or not 1 <= tokens < math.inf):
        raise ValueError(f"num_assistant_tokens must be a number >= 1 (draft tokens proposed per round), got "
                         f"{tokens!r}; to decode without a draft, leave out assistant_model")
    schedule = values.get("num_assistant_tokens_schedule")
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"num_assistant_tokens_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got "
                         f"{schedule!r}")
    threshold = values.get("assistant_confidence_threshold")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0.0 <= threshold <= 1.0):
        raise ValueError(f"assistant_confidence_threshold must be a probability in [0, 1] (the draft stops a round "
                         f"when its top token is less likely than this), got {threshold!r}")


#: per-call generation configs of drafts that read theirs through :func:`call_generation_config` (ours), by
#: ``id(draft)``: a context variable, so each thread (and each nested call) sees only its own call's
_CALL_CONFIGS: contextvars.ContextVar[Dict[int, Any]] = contextvars.ContextVar(
    "optimum_ipex_spec_call_generation_configs", default={})


def call_generation_config(model) -> Optional[Any]:
    """The generation config that ``model`` has for the ``generate()`` call running in this context (set by
    :func:`draft_generation_config`), or None outside such a call."""
    return _CALL_CONFIGS.get().get(id(model))


@contextlib.contextmanager
def draft_generation_config(kwargs: Dict[str, Any], overrides: Dict[str, Any]) -> Iterator[None]:
    """transformers reads the draft arguments from the draft's generation config: give the draft of this call
    (``kwargs["assistant_model"]``) a copy carrying ``overrides``, seen by this call only (the heuristic schedule's
    write-back then lands in the copy too). The shared draft object is never written, so two threads that share a
    draft, each with its own arguments, do not see each other's.

    A draft of ours (a class with ``per_call_generation_config = True``, whose ``generation_config`` property asks
    :func:`call_generation_config`) gets the copy through a context variable; another model (a transformers draft)
    is replaced in ``kwargs`` for this call by a shallow copy holding the copied config (its modules and weights
    shared with the original)."""
    assistant = kwargs.get("assistant_model")
    if not overrides or assistant is None:
        yield
        return
    config = copy.deepcopy(assistant.generation_config)
    for name, value in overrides.items():
        setattr(config, name, value)
    if not getattr(type(assistant), "per_call_generation_config", False):
        view = copy.copy(assistant)  # nn.Module: the copy shares _modules/_parameters, its __dict__ is its own
        view.__dict__["generation_config"] = config
        view.__dict__["per_call_view_of"] = assistant  # state kept per draft is keyed on it (cost_model.SamplingTimes)
        kwargs["assistant_model"] = view
        yield
        return
    token = _CALL_CONFIGS.set({**_CALL_CONFIGS.get(), id(assistant): config})
    try:
        yield
    finally:
        _CALL_CONFIGS.reset(token)


def same_size_different_vocabularies(target, assistant, tokenizer, assistant_tokenizer) -> bool:
    """True when target and draft have the same vocabulary size but their tokenizers map tokens to different
    ids: plain assisted generation would feed the draft ids it reads as other tokens (correct output, but
    almost nothing accepted); universal assisted generation is the right strategy."""
    if assistant is None or tokenizer is None or assistant_tokenizer is None or tokenizer is assistant_tokenizer:
        return False
    sizes = (target.config.get_text_config().vocab_size, assistant.config.get_text_config().vocab_size)
    return sizes[0] == sizes[1] and tokenizer.get_vocab() != assistant_tokenizer.get_vocab()
