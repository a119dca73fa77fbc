"""Candidate generation for speculative decoding with an IPEX draft model.

transformers' ``AssistedCandidateGenerator`` drafts by calling ``assistant_model.generate()`` once
per round; on a 135M-parameter draft that decodes in ~14 ms per token, the per-call set-up of
``generate()`` (config copies, logits-processor and stopping-criteria construction, output
dataclasses) costs a large share of each round. :class:`IPEXDraftCandidateGenerator` keeps
transformers' two-method interface (``get_candidates`` / ``update_candidate_strategy``) and its
schedules (``num_assistant_tokens``, ``"constant"`` / ``"heuristic"``,
``assistant_confidence_threshold`` as a stopping rule), but drafts greedily in a tight loop on the
draft's own forward and cache (IPEXFusedCache, or PreallocatedKVCache on the PyTorch path).

Greedy only: for ``do_sample=True`` the draft must sample from the same processed distribution
that speculative sampling (Leviathan et al., 2023, arXiv:2211.17192; transformers PR #28316) uses
as ``q``, so sampling goes through transformers' own generator unchanged.

Losslessness does not depend on the draft: every candidate is verified by the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator, PromptLookupCandidateGenerator

from ..compat import zero_proposals_add_nothing
from .shared_kv import copy_rows, has_buffers


@dataclass
class SpeculationStats:
    """Counters of one assisted ``generate()`` call (greedy, IPEX draft).

    Attributes:
        rounds: draft-then-verify rounds.
        proposed: draft tokens proposed in total.
        accepted: draft tokens the target accepted.
        shared_rows: cache rows the draft copied from the target's cache instead of computing them (its prompt
            prefill and catch-up: :mod:`~optimum_ipex_spec.speculative.shared_kv`); 0 for a draft that computes its own.
        draft_forward_tokens: tokens the draft ran through its own forward (prefill, catch-up and drafting).
    """

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    shared_rows: int = 0
    draft_forward_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (NaN before the first round)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens emitted per target forward: accepted drafts + the target's own token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")


class IPEXDraftCandidateGenerator(AssistedCandidateGenerator):
    """Greedy drafting with an ``IPEXModelForCausalLM`` as the assistant (IPEX backend, or the PyTorch path's
    decoder): a tight loop on the draft's own forward and cache instead of a nested ``generate()`` per round.

    Shapes: ``get_candidates(input_ids [1, L])`` returns ``(candidates [1, L + n], None)`` with
    ``0 <= n <= num_assistant_tokens`` new draft tokens (no logits are needed for greedy verification).
    The first call may come at any length (the draft's cache catches up with whatever it lacks): the cost model
    can then leave the draft's prefill until after the first token (``starts_at_any_length``).

    A draft that computes its own cache can also hold a *window* of the context (``context_window = W``): when it
    lacks more than ``W`` tokens (its first call, or a probe after rounds without drafting), its cache restarts at
    the last ``W`` tokens instead of running everything it lacks (positions count from the window's start; keys carry
    relative rotary positions, so a window is a shorter context, not a shifted one). The cost model
    (:func:`~optimum_ipex_spec.speculative.cost_model.speculate_by_cost`) sets it while it only measures whether the
    draft pays, and clears it (``context_window = None``: the whole context) once it chooses to draft; the next call
    then runs the whole context once (:attr:`restarts_context`). A useless draft so never pays for its prefill of the
    prompt. Proposals change, the output does not.

    Args:
        target_cache: the target's cache of this ``generate()`` call (an ``IPEXFusedCache`` or
            ``PreallocatedKVCache``, updated in place by the target), for a draft that shares it
            (:func:`~optimum_ipex_spec.speculative.shared_kv.shares_target_kv`): what the draft lacks of the tokens the
            target has verified is copied from it (:func:`~optimum_ipex_spec.speculative.shared_kv.copy_rows`), and only
            the last token runs through the draft; a first call before the target's prefill proposes nothing, whatever
            the schedule, so that the target prefills alone. None: the draft computes its own cache.
    Other arguments: transformers' ``AssistedCandidateGenerator``'s.
    """

    starts_at_any_length = True

    def __init__(self, *args, target_cache=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._target_cache = target_cache
        self._cache = None  # the draft's own cache (IPEXFusedCache or PreallocatedKVCache)
        self._start = 0  # index in input_ids of the first token the draft's cache holds (> 0: a window)
        self.context_window: Optional[int] = None  # see the class docstring; None: the whole context
        self._waiting_for_target = False
        # a left-padded prompt's mask [1, prompt]: the draft must not attend to the padding either (None: no padding)
        mask = getattr(self, "assistant_kwargs", {}).get("attention_mask")
        self._prompt_mask = mask if isinstance(mask, torch.Tensor) and not bool(mask.all()) else None
        eos = self.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self._eos = torch.tensor(eos, dtype=torch.long)
        self.stats = SpeculationStats()
        self.assistant_model.last_speculation_stats = self.stats

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        if self._waiting_for_target:  # the round that let the target prefill alone: nothing was proposed
            self._waiting_for_target = False
            return
        self.stats.rounds += 1
        self.stats.proposed += scores.shape[1] - 1
        self.stats.accepted += int(num_matches)
        super().update_candidate_strategy(input_ids, scores, num_matches)

    @torch.no_grad()
    def get_candidates(self, input_ids: torch.LongTensor) -> Tuple[torch.LongTensor, Optional[torch.FloatTensor]]:
        if hasattr(self, "_calculate_new_tokens"):  # transformers >= 4.48: its own budget
            _, max_new_tokens = self._calculate_new_tokens(input_ids)
        else:  # what it computes, from the generation config of that era
            max_new_tokens = min(int(self.num_assistant_tokens),
                                 self.generation_config.max_length - input_ids.shape[-1] - 1)
        if max_new_tokens <= 0:
            return input_ids, None
        if self._target_cache is not None and self._target_cache.get_seq_length() == 0:
            # The target has not run its prefill yet (transformers' schedules call the draft first): propose nothing
            # this round, so the first token comes as early as without a draft and the draft then copies the prompt's
            # rows instead of running them.
            self._waiting_for_target = True
            return input_ids, None
        draft = self.assistant_model
        # Roll the draft's cache back to the tokens the target accepted, then feed what it lacks (or restart it).
        if self._cache is not None:
            self._cache.crop(min(self._cache.get_seq_length(), input_ids.shape[1] - 1 - self._start))
        start = self._window_start(input_ids.shape[1])
        if self._cache is None or start != self._start:  # a window moved on, or the whole context wanted again
            self._cache, self._start = draft.new_cache(input_ids.shape[0]), start
        if self._target_cache is not None:
            self._share_target_rows(input_ids)
        held = self._start + self._cache.get_seq_length()  # input_ids[:, :held] are in the cache (or before it)
        self.stats.draft_forward_tokens += input_ids.shape[1] - held
        # only the last position's logits: a catch-up of the prompt (or of a round's accepted tokens) runs its other
        # rows through the layers, not through the LM head (a large share of a small draft: a 0.5B's 151936 x 896)
        logits = draft(input_ids[:, held:], attention_mask=self._mask(input_ids.shape[1]),
                       past_key_values=self._cache, logits_to_keep=1).logits[:, -1]
        threshold = draft.generation_config.assistant_confidence_threshold or 0.0
        new_tokens = []
        for step in range(max_new_tokens):
            token = logits.argmax(-1, keepdim=True)
            new_tokens.append(token)
            if self._eos.numel() and bool(torch.isin(token, self._eos).any()):
                break
            if threshold > 0 and float(torch.softmax(logits.float(), -1).max()) < threshold:
                break
            if step + 1 < max_new_tokens:
                self.stats.draft_forward_tokens += 1
                logits = draft(token, attention_mask=self._mask(input_ids.shape[1] + step + 1),
                               past_key_values=self._cache).logits[:, -1]
        return torch.cat([input_ids] + new_tokens, dim=-1), None

    @property
    def shares_target_cache(self) -> bool:
        """True when the draft copies the target's rows instead of computing its own cache (it then always holds the
        whole context: the copy costs little)."""
        return self._target_cache is not None

    @property
    def restarts_context(self) -> bool:
        """True when the next call runs the whole context from its first token: the draft holds a window and
        ``context_window`` was cleared."""
        return self._cache is not None and self._start > 0 and self.context_window is None

    def _window_start(self, length: int) -> int:
        """Where the draft's cache should start for a context of ``length`` tokens: 0 for the whole context (no
        window, or a draft that copies the target's rows), else the last ``context_window`` tokens' start when the
        draft lacks more than that many, else where it starts now."""
        if self.context_window is None or self.shares_target_cache:
            return 0
        held = self._start + (self._cache.get_seq_length() if self._cache is not None else 0)
        if self._cache is not None and length - held <= self.context_window:
            return self._start
        return max(0, length - self.context_window)

    def _mask(self, length: int) -> Optional[torch.Tensor]:
        """The attention mask ``[1, length - start]`` of the tokens up to ``length`` that the draft's cache holds (the
        padded prompt's, then ones), or None for an unpadded prompt."""
        if self._prompt_mask is None:
            return None
        prompt = self._prompt_mask.shape[1]
        if length <= prompt:
            mask = self._prompt_mask[:, :length]
        else:
            mask = torch.cat([self._prompt_mask, self._prompt_mask.new_ones(1, length - prompt)], dim=-1)
        return mask[:, self._start:]

    def _share_target_rows(self, input_ids: torch.LongTensor) -> None:
        """Copy into the draft's cache the rows it lacks of ``input_ids [1, L]`` that the target's cache holds (at
        most ``L - 1``: the last token is the target's own, not in its cache yet), so that the draft runs only what
        is left. An empty IPEX draft cache first runs the prompt's first token (IPEX allocates its buffers then)."""
        want = min(input_ids.shape[1] - 1, self._target_cache.get_seq_length())
        if want <= self._cache.get_seq_length():
            return
        if not has_buffers(self._cache):
            self.stats.draft_forward_tokens += 1
            self.assistant_model(input_ids[:, :1], attention_mask=self._mask(1), past_key_values=self._cache)
        self.stats.shared_rows += copy_rows(self._target_cache, self._cache, want)


class AdaptivePromptLookupCandidateGenerator(PromptLookupCandidateGenerator):
    """Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; transformers
    PR #27775) that never overshoots, never proposes forbidden tokens and gets out of the way when it
    does not pay.

    On top of transformers' ``PromptLookupCandidateGenerator`` (n-gram match in the context, copy
    what followed it):

    * **no EOS**: works with ``eos_token_id=None`` (transformers 4.51's lookup raised TypeError);
    * **budget**: at most ``max_length - current_length - 1`` candidates (transformers 4.51 capped the
      copy at an *index* equal to ``max_length`` and returned up to 6 tokens beyond ``max_new_tokens``);
    * **processors**: the proposal is cut before the first token that the logits processors (e.g.
      ``bad_words_ids``, ``no_repeat_ngram_size``) set to ``-inf`` in its context (sampling warpers,
      which depend on the real scores, are not consulted);
    * **matches of >= 2 tokens** (unless ``max_matching_ngram_size=1``): a single-token match occurs
      almost everywhere and mostly proposes noise;
    * **adaptivity**: verifying ``k`` candidates costs about ``VERIFY_BASE + VERIFY_SLOPE * k`` extra
      decode steps (SmolLM2 fp32, IPEX 2.8: 54 ms for 2 tokens, 52 for 4, 66-72 for 9, against 35 ms
      for one), so a round pays only when it is expected to accept more than that. The generator keeps
      an exponential moving average of accepted tokens per round; when it falls below the break-even,
      it stops proposing for 1, 2, 4 ... 16 rounds (plain decoding, no extra cost), then probes again.
      Fully accepted proposals grow by 2 up to ``prompt_lookup_num_tokens``; partly accepted ones
      shrink to twice the accepted count (at least 2).

    Under the cost model (the default for ``generate(prompt_lookup_num_tokens=...)``, see
    :mod:`~optimum_ipex_spec.speculative.cost_model`) ``adaptive`` is False: the cost model sets the length each round
    (``num_output_tokens``) and decides when not to look up, from costs measured on the machine it runs on; a round
    without a match is one of its empty rounds. ``generate(num_assistant_tokens_schedule="constant")`` (or
    ``"heuristic"``) keeps the gating above.

    Losslessness is unaffected: every candidate is verified by the target.
    """

    MAX_PAUSE = 16
    VERIFY_BASE = 0.45
    VERIFY_SLOPE = 0.05
    EMA = 0.5

    def __init__(self, eos_token_id=None, num_output_tokens: int = 10, max_matching_ngram_size=None,
                 max_length: int = 20, logits_processor=None, vocab_size: Optional[int] = None):
        super().__init__(eos_token_id=eos_token_id, num_output_tokens=num_output_tokens,
                         max_matching_ngram_size=max_matching_ngram_size or 2, max_length=max_length)
        if self.eos_token_id is None:  # transformers 4.51 passes None to torch.isin and raises TypeError
            self.eos_token_id = torch.empty(0, dtype=torch.long)
        self.min_ngram = 1 if self.max_matching_ngram_size == 1 else 2
        self.max_output_tokens = num_output_tokens
        self.constraints = [p for p in (logits_processor or []) if not type(p).__name__.endswith("Warper")]
        self.vocab_size = vocab_size
        self.pause = 0
        self.backoff = 1
        self.expected_accepted = self._break_even(num_output_tokens) + 1.0  # optimistic start
        self.stats = SpeculationStats()
        self.adaptive = True  # False: no pauses or length changes of its own (a cost model sets the length)

    def _break_even(self, proposed: int) -> float:
        return self.VERIFY_BASE + self.VERIFY_SLOPE * proposed

    def get_candidates(self, input_ids: torch.LongTensor) -> Tuple[torch.LongTensor, Optional[torch.FloatTensor]]:
        budget = self.max_length - input_ids.shape[1] - 1
        if budget <= 0:
            return input_ids, None
        if self.pause > 0:
            self.pause -= 1
            return input_ids, None
        proposal = self._lookup(input_ids)[:, :budget]
        proposal = self._allowed_prefix(input_ids, proposal)
        return torch.cat([input_ids, proposal], dim=-1), None

    def _lookup(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """Tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
        length = input_ids.shape[1]
        tokens = input_ids[0]
        for n in range(min(self.max_matching_ngram_size, length - 1), self.min_ngram - 1, -1):
            windows = tokens.unfold(0, n, 1)[:-1]  # every n-gram except the suffix itself
            hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
            for start in reversed(hits.tolist()):  # the most recent occurrence first
                follow = tokens[start + n : min(start + n + self.num_output_tokens, length)]
                if follow.numel():
                    eos = torch.isin(follow, self.eos_token_id).nonzero()
                    if eos.numel():  # stop before an EOS so generation cannot run past it
                        follow = follow[: int(eos[0])]
                    return follow.unsqueeze(0)
        return input_ids[:, :0]

    def _allowed_prefix(self, input_ids: torch.LongTensor, proposal: torch.LongTensor) -> torch.LongTensor:
        if not self.constraints or proposal.shape[1] == 0 or self.vocab_size is None:
            return proposal
        context = input_ids
        for i in range(proposal.shape[1]):
            scores = torch.zeros(1, self.vocab_size)
            for processor in self.constraints:
                scores = processor(context, scores)
            if scores[0, proposal[0, i]] == float("-inf"):
                return proposal[:, :i]
            context = torch.cat([context, proposal[:, i : i + 1]], dim=-1)
        return proposal

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        proposed, accepted = scores.shape[1] - 1, int(num_matches)
        if proposed == 0:
            return
        self.stats.rounds += 1
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        if not self.adaptive:
            return
        self.expected_accepted = self.EMA * self.expected_accepted + (1 - self.EMA) * accepted
        if accepted == proposed:
            self.num_output_tokens = min(self.max_output_tokens, self.num_output_tokens + 2)
        else:
            self.num_output_tokens = max(2, min(self.max_output_tokens, 2 * accepted))
        if self.expected_accepted < self._break_even(proposed):
            self.pause = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_PAUSE)
            # the next probe starts from break-even: one good round keeps it going, a bad one pauses longer
            self.expected_accepted = self._break_even(self.num_output_tokens)
        else:
            self.backoff = 1


#: transformers 4.x's assisted decoding adds no token in a round whose candidate (even with zero proposals) already
#: meets a stopping criterion; 5.x adds the target's own token.
_ZERO_PROPOSALS_ADD_NOTHING = zero_proposals_add_nothing()


def _stopping_point(criteria, ids: torch.LongTensor) -> bool:
    """Whether any of ``criteria`` stops ``ids`` (batch 1), each called with ``scores=None``. A criterion that
    needs the scores (it raises TypeError/AttributeError without them) is left to transformers' own end-of-block
    check; the others are still consulted."""
    for criterion in criteria:
        try:
            if bool(torch.as_tensor(criterion(ids, None)).any()):
                return True
        except (TypeError, AttributeError):
            continue
    return False


def cut_at_stopping_point(candidates: torch.LongTensor, logits: Optional[torch.FloatTensor], start: int, criteria,
                          keep_stopping_token: bool):
    """Cut a proposal ``candidates [1, start + n]`` (and its ``logits [1, n, vocab]`` when given) at the first
    prefix that one of the stopping ``criteria`` stops.

    ``keep_stopping_token=False`` (greedy) keeps the proposals strictly before that prefix: at most the target's
    own next token then reaches the stopping point, where transformers' end-of-block check stops, as plain decoding
    would. ``keep_stopping_token=True`` (sampling) keeps the stopping token and drops what follows: whether a token
    is proposed then depends only on the tokens before it (a stopping time), which keeps speculative sampling's law
    exact; dropping a drafted token because of its own value would bias it.
    """
    if _ZERO_PROPOSALS_ADD_NOTHING and _stopping_point(criteria, candidates[:, :start]):
        # the context itself already stops (max_time ran out): propose exactly one token. transformers 4.x treats a
        # candidate that meets a criterion as complete and drops the target's own token (n_matches - 1), so zero
        # proposals would add nothing where plain decoding adds one; with one proposal it adds exactly the target's
        # token, whatever was proposed.
        first = candidates[:, start : start + 1] if candidates.shape[1] > start else candidates[:, start - 1 : start]
        return torch.cat([candidates[:, :start], first], dim=-1), None if logits is None else logits[:, :1]
    for end in range(start + 1, candidates.shape[1] + 1):
        if _stopping_point(criteria, candidates[:, :end]):
            keep = end - start - (0 if keep_stopping_token else 1)
            return candidates[:, : start + keep], (logits[:, :keep] if logits is not None else None)
    return candidates, logits


def check_user_candidates(input_ids: torch.LongTensor, candidates, logits, vocab_size: Optional[int]) -> None:
    """Check what a user-written generator's ``get_candidates(input_ids)`` returned, before the target reads it.

    Args:
        input_ids: the context the generator was given, int64 ``[1, L]``.
        candidates: must be an integer tensor ``[1, L + n]`` (``n >= 0`` proposals) whose first ``L`` ids are
            ``input_ids`` unchanged, every id in ``0 .. vocab_size - 1``.
        logits: None, or a floating tensor ``[1, n, V]`` (the generator's scores of its ``n`` proposals).
        vocab_size: the target's vocabulary size (None: not checked).

    Raises:
        ValueError: any of the above does not hold; the message names what and the contract. (A changed prefix
            would make the target continue a text other than the user's: the output would silently differ from the
            target alone.)
    """
    contract = ("get_candidates(input_ids) must return (candidate_ids, logits or None) with candidate_ids an integer "
                "tensor [1, L + n]: the input_ids it was given, unchanged, followed by its n proposed tokens")
    if not isinstance(candidates, torch.Tensor) or candidates.dtype.is_floating_point or candidates.is_complex() \
            or candidates.dtype == torch.bool:
        what = candidates.dtype if isinstance(candidates, torch.Tensor) else type(candidates).__name__
        raise ValueError(f"candidate_generator returned candidate_ids of type {what}; {contract}")
    length = input_ids.shape[1]
    if candidates.dim() != 2 or candidates.shape[0] != input_ids.shape[0] or candidates.shape[1] < length:
        raise ValueError(f"candidate_generator returned candidate_ids of shape {tuple(candidates.shape)} for input_ids "
                         f"of shape {tuple(input_ids.shape)}; {contract}")
    changed = (candidates[:, :length] != input_ids).nonzero()
    if changed.numel():
        position = int(changed[0, 1])
        raise ValueError(f"candidate_generator changed the context it was given: at position {position} it returned "
                         f"id {int(candidates[0, position])} where input_ids hold {int(input_ids[0, position])}; "
                         f"{contract}")
    proposed = candidates[:, length:]
    if vocab_size is not None and proposed.numel() and (int(proposed.min()) < 0 or int(proposed.max()) >= vocab_size):
        raise ValueError(f"candidate_generator proposed token ids outside the target's vocabulary "
                         f"(0 .. {vocab_size - 1}): {proposed[(proposed < 0) | (proposed >= vocab_size)].tolist()}")
    if logits is not None and (not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point
                               or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, proposed.shape[1])):
        what = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"candidate_generator returned logits {what} for {proposed.shape[1]} proposed tokens; "
                         "return None, or floating-point logits [1, n, vocab] for the n proposals")


def stop_proposals_at_stopping_criteria(generator, stopping_criteria, keep_stopping_token: bool = False):
    """Make ``generator`` (a transformers ``CandidateGenerator`` or one of ours) cut each proposal at the first
    point where ``stopping_criteria`` (all criteria of the ``generate()`` call: ``max_length``, EOS,
    ``stop_strings``, the user's) stop; see :func:`cut_at_stopping_point`.

    transformers checks the criteria other than EOS and ``max_length`` (and in 4.x all of them) only at the end of
    an accepted block, and relies on each candidate generator to stop its proposals there; a proposal that crosses
    the stopping point returns tokens that plain decoding would not. The instance's ``get_candidates`` is wrapped
    in place so that transformers still sees the generator's own class (5.x checks ``isinstance`` to persist the
    heuristic schedule). Returns ``generator``.
    """
    original = generator.get_candidates

    def get_candidates(input_ids, *args, **kwargs):
        candidates, logits = original(input_ids, *args, **kwargs)
        return cut_at_stopping_point(candidates, logits, input_ids.shape[1], stopping_criteria, keep_stopping_token)

    generator.get_candidates = get_candidates
    return generator


class StoppingCriteriaAwareCandidates:
    """Wraps a user-written candidate generator so that no proposal reaches past a stopping criterion of the
    ``generate()`` call (``max_new_tokens`` / ``max_length``, EOS, ``stop_strings``, the user's
    ``StoppingCriteria``, ``max_time``): see :func:`cut_at_stopping_point`. A user's generator need not know the
    budget or the stopping rules; the output is plain decoding's whatever it proposes.

    It also gives user-written generators the attributes transformers 5 reads from every candidate generator
    (``requires_model_outputs``).

    Args:
        generator: any object with transformers' two-method candidate-generator interface.
        stopping_criteria: the ``StoppingCriteriaList`` (or list) of the call (criteria are called with
            ``scores=None``; one that needs the scores is left to transformers' own end-of-block check).
        keep_stopping_token: True when sampling (see :func:`cut_at_stopping_point`).
    """

    def __init__(self, generator, stopping_criteria, keep_stopping_token: bool = False,
                 vocab_size: Optional[int] = None):
        from transformers import StoppingCriteriaList

        self.generator = generator
        self.stopping_criteria = (stopping_criteria if isinstance(stopping_criteria, StoppingCriteriaList)
                                  else StoppingCriteriaList(stopping_criteria))
        self.keep_stopping_token = keep_stopping_token
        self.vocab_size = vocab_size

    def get_candidates(self, input_ids: torch.LongTensor):
        result = self.generator.get_candidates(input_ids)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise ValueError(f"candidate_generator.get_candidates() must return a pair (candidate_ids, logits or "
                             f"None), got {type(result).__name__}")
        candidates, logits = result
        check_user_candidates(input_ids, candidates, logits, self.vocab_size)
        return cut_at_stopping_point(candidates, logits, input_ids.shape[1], self.stopping_criteria,
                                     self.keep_stopping_token)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        return self.generator.update_candidate_strategy(input_ids, scores, num_matches)

    @property
    def requires_model_outputs(self) -> bool:
        """transformers 5 asks whether the target must return extra outputs (hidden states) for the generator;
        a user-written two-method generator does not need them."""
        return getattr(self.generator, "requires_model_outputs", False)

    def __getattr__(self, name):  # anything else transformers reads (e.g. the assistant model) is the wrapped one's
        return getattr(self.generator, name)
