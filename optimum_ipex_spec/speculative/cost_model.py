"""Cost-aware speculation: measure, per ``generate()`` call, what a round of drafting and verifying costs on this
machine and pick each round's draft length ``k`` (0 = plain decoding) that maximises expected tokens per second.

Model (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", arXiv 2211.17192,
section 3): if each draft token is accepted with probability ``alpha`` independently, a round that proposes ``k``
tokens yields ``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens (the accepted prefix plus the target's own token).
:class:`PositionAcceptance` generalises this to ``E(k) = 1 + sum_{i=1..k} p_1 ... p_i`` with a rate per position
(``p_i``: proposal ``i`` accepted given ``1..i-1`` were; SpecDec++, Huang et al. 2024, arXiv 2405.19715, predicts
it with a trained head); one rate for all positions is the default, because per-position counts, replayed on real
traces, got stuck at short rounds (a round of ``k`` says nothing about position ``k + 1``) and lost to it
(``benchmarks/acceptance_replay.py``, docs/assisted-generation.md). ``k`` is scaled by the measured share of
proposals the target gets to verify (a draft of another tokenizer proposes ``k`` of its own tokens, which become
some other number of target tokens; a draft may stop early).
A round that verifies ``n`` proposals costs ``T(n)``: drafting them, the target's forward over ``n + 1`` tokens and
the loop's own work; ``n = 0`` is one plain decode step, ``E(0) = 1``. A target that verifies in calls of a fixed
number of tokens (a compiled step: ``CostModel.verify_rows``) costs a step function of its calls instead, plus the
drafting time. A drafting round may also yield nothing to
verify (a universal draft whose tokens make no new target token; prompt lookup without a match): it yields the
target's one token and costs ``Z(k)``, its drafting time and a plain step, measured by the ``k`` chosen. A round
choosing ``k`` is such an empty round with probability ``z`` (the empty share) and otherwise verifies ``n = s k``
proposals on average (``s``, the verified share of non-empty rounds, below 1 when a draft stops early or, of another
tokenizer, makes fewer target tokens). Each round proposes the ``k`` in ``0..max_tokens`` that maximises
``(z + (1 - z) E(s k)) / (z Z(k) + (1 - z) T(s k))``; with ``z = 0``, ``E(s k) / T(s k)``.
Choosing the length from a model of acceptance is also what SpecDec++ and Dynamic Speculation Lookahead (Mamou et
al. 2024, arXiv 2405.04304) do; here the costs are measured, so the model can also decide that drafting does not pay
at all.

Measured online (wall clock): ``T(n)``, the time from one round's start to the next round's start for rounds that
verified ``n`` proposals (the fastest of the last few per ``n``: interference only adds time; linear between measured
lengths; filed by ``n``, not by the ``k`` chosen, so that rounds whose draft stopped early do not price the rounds
that drafted all ``k``: universal Gemma 3 + SmolLM2 chose ``k = 16`` on the cost of 1-token rounds and ran x0.74 on a
news prompt; until a plain step is measured, its cost is bounded by the fastest verification, which is a forward over
more tokens, and where the draft's lead is smaller than :data:`MEASURE_PLAIN_BELOW` under that bound one plain step
is measured); acceptance, from decayed counts of the proposals reached and accepted, with a prior of 0.5 worth one
round. For the report, the round is also split into the candidate generator's time (draft) and the rest
(verification).

Start: one round at ``k0 = 2`` (the draft's prefill), not measured, one plain decode step and ``k0`` again,
measured. Generators that can start late (ours) start with the target's prefill alone (so the first token comes as
soon as without a draft), then ``k0`` twice (the first carries the draft's prefill, the second is measured);
``CostModel.plain_rounds`` measured plain steps can be put before them. Our drafts hold only the last
:data:`PROBE_CONTEXT` tokens of the context until the model first chooses to draft (then the whole context, once):
a draft that never pays costs no prompt prefill. From then on every round is chosen; a
length not measured yet is costed on the line through the measured ones (round time grows about linearly with
``n``: draft steps plus a slowly growing verification; beyond the longest measured length optimistically,
:data:`OPTIMISM`), and measured once chosen; every :data:`EXPLORE_EVERY` drafting rounds one round re-measures a
neighbouring length. While the best ``k`` is 0 the draft idles for 8 plain rounds, then 16, 32, ... and is probed
again with ``k = 1`` (the probe's cost includes the draft's catch-up); the doubling stops where a probe costs
:attr:`CostModel.probe_budget` of the plain rounds around it. A probe whose token is accepted is followed by a
measured ``k0`` round.

Losslessness is unaffected: only how many tokens are proposed changes; every proposal is still verified.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional

#: ``num_assistant_tokens_schedule`` value that selects this model (also the default for our targets)
COST_SCHEDULE = "cost"
#: observations kept per round length (the fastest is the estimate; the report gives their median)
WINDOW = 5
#: until a plain step is measured its cost is bounded by the fastest verification; when the best length's
#: expected rate is less than this many times the plain rate under that bound (a lead the bound's error could
#: erase: a forward over 2 tokens costs 1.45 plain steps on the pure-PyTorch path in fp32), one plain step is
#: measured first. Not higher: a plain round costs a good draft a whole round (on the SmolLM2 self-draft traces,
#: whose lead is ~1.45, measuring it lost 4-6% of a 128-token call)
MEASURE_PLAIN_BELOW = 1.25
#: context (tokens) that a draft computing its own cache holds while the model only measures whether drafting pays
#: (its first rounds and probes): its prompt prefill and long catch-ups are paid only once the model chooses to draft
#: (``IPEXDraftCandidateGenerator.context_window``). A bf16 SmolLM2 draft's prefill of a 166-token prompt took 0.4 s
#: of a 6 s call, and its catch-ups at probes 0.18 s (10, 17, 33 tokens), on an AVX-512 BF16 CPU; a window of 32
#: runs in ~0.1 s
PROBE_CONTEXT = 32
#: every this many chosen drafting rounds, one round measures a neighbouring length (:meth:`CostModel.neighbour`:
#: one not measured yet of twice as long, one longer, one shorter; else twice as long again, or half as long at the
#: cap), so that a length costed once on a noisy round, or only on the line through its neighbours, is not avoided
#: for the rest of the call
EXPLORE_EVERY = 6


@dataclass
class PositionAcceptance:
    """Acceptance of draft tokens by position in the round, from decayed counts; the positions from
    ``pooled_from`` on share one estimate.

    ``p(i)`` (``i`` from 1) estimates the probability that proposal ``i`` is accepted given that proposals
    ``1..i-1`` were: ``(accepted + strength * prior_i) / (reached + strength)``, where ``reached`` counts the
    proposals at that position (or, pooled, at any position from ``pooled_from`` on) that were verified with
    everything before them accepted, ``accepted`` those accepted, ``prior_1 = prior`` and ``prior_i = p(i - 1)``.
    Each round decays the counts it adds to by ``decay``, so the estimate follows the text being generated.

    ``pooled_from = 1`` (the default) is the geometric model of Leviathan et al. 2023 (arXiv 2211.17192), one
    rate for all positions. ``pooled_from = 2`` tells a round's first proposal from the ones after it (bursty
    acceptance: ``p(2) > p(1)``); replayed on real traces (``benchmarks/acceptance_replay.py``) it lost to the
    geometric model: rounds of one proposal never reach position 2, so a low early estimate of ``p(2)`` keeps
    the rounds short.
    """

    decay: float = 0.9
    prior: float = 0.5
    strength: float = 1.0
    pooled_from: int = 1
    reached: List[float] = field(init=False)
    accepted: List[float] = field(init=False)

    def __post_init__(self):
        if isinstance(self.pooled_from, bool) or not isinstance(self.pooled_from, int) or self.pooled_from < 1:
            raise ValueError(f"PositionAcceptance.pooled_from must be an integer >= 1, got {self.pooled_from!r}")
        self.reached = [0.0] * self.pooled_from
        self.accepted = [0.0] * self.pooled_from

    def observe(self, verified: int, accepted: int) -> None:
        """A round verified ``verified`` proposals and the target accepted the first ``accepted`` of them."""
        verified = max(0, int(verified))
        accepted = max(0, min(int(accepted), verified))
        reached = [0.0] * self.pooled_from
        hits = [0.0] * self.pooled_from
        for i in range(min(verified, accepted + 1)):  # positions 1..accepted accepted, the next one rejected
            slot = min(i, self.pooled_from - 1)
            reached[slot] += 1.0
            hits[slot] += 1.0 if i < accepted else 0.0
        for slot in range(self.pooled_from):
            if reached[slot]:
                self.reached[slot] = self.decay * self.reached[slot] + reached[slot]
                self.accepted[slot] = self.decay * self.accepted[slot] + hits[slot]

    def probabilities(self, n: int) -> List[float]:
        """``[p(1), ..., p(n)]``."""
        estimates, prior = [], self.prior
        for slot in range(self.pooled_from):
            prior = (self.accepted[slot] + self.strength * prior) / (self.reached[slot] + self.strength)
            estimates.append(prior)
        return [estimates[min(i, self.pooled_from - 1)] for i in range(n)]

    def expected_tokens(self, k: float) -> float:
        """Tokens a round of ``k`` proposals yields, the target's own token included:
        ``1 + sum_{i<=k} p(1)...p(i)``; a fractional ``k`` (a draft of another tokenizer) is interpolated."""
        if k <= 0:
            return 1.0
        whole = int(math.floor(k))
        survive, steps = 1.0, []
        for p in self.probabilities(whole + 1):
            survive *= p
            steps.append(survive)
        return 1.0 + sum(steps[:whole]) + (k - whole) * steps[whole]


#: lengths beyond the longest measured one are costed with this share of the last measured slope: optimistic, so
#: that a longer round is tried (and then measured) when the line through short rounds overstates its cost (a
#: round's fixed costs, e.g. the draft's catch-up, make short rounds look steep)
OPTIMISM = 0.75


def _interpolate(points: Dict[int, float], x: float) -> Optional[float]:
    """Piecewise-linear through ``{x: y}``; below the first point with the first slope, beyond the last with
    :data:`OPTIMISM` times the last slope; flat with one point."""
    if not points:
        return None
    if x in points:
        return points[x]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x < xs[0]:
        a, b = xs[0], xs[1]
    elif x > xs[-1]:
        a, b = xs[-2], xs[-1]
    else:
        b = next(v for v in xs if v > x)
        a = max(v for v in xs if v < x)
    slope = (points[b] - points[a]) / (b - a)
    if x > xs[-1]:
        return max(0.0, points[b] + OPTIMISM * slope * (x - b))
    return max(0.0, points[a] + slope * (x - a))


@dataclass
class CostModel:
    """Online measurements of one ``generate()`` call and the draft length they call for.

    Args:
        max_tokens: the largest ``k`` to consider (the draft's ``num_assistant_tokens``).
        first_tokens: ``k0``, the length of the first rounds.
        probe_budget: share of plain-decoding time that probing an idle draft may cost.
        decay: weight of a position's earlier acceptance counts each time a round reaches it.
        plain_first: start with plain rounds, so that the draft's prefill is not on the way to the first tokens;
            only for generators that can start at any length (transformers' own expect their first call at the
            prompt's length).
        plain_rounds: with ``plain_first``, the plain decode steps measured after the target's prefill and
            before the draft's first round (the answer's first tokens never wait for the draft's prefill). With 0,
            the draft starts on the second round, and until a plain step is measured its cost is bounded by the
            fastest verification measured (a forward over ``k + 1`` tokens costs at least one over 1).
        pooled_from: the draft position from which acceptance is estimated jointly (:class:`PositionAcceptance`;
            1 = one rate for every position, the geometric model).
        verify_rows: the most tokens the target verifies in one forward call when it runs a fixed-size graph (a
            compiled target: :data:`~optimum_ipex_spec.backends.pytorch.compiled_step.CHUNK_ROWS`), or None. With it, a
            round's cost is its drafting time (linear in the proposals) plus a step function of the target's calls
            (:meth:`verify_calls`), and exploring rounds come after 6, 18, 42, ... drafting rounds (:meth:`_explored`).
        plan_extra: lengths of rounds run (and measured) after the planned start, before the first choice.
        times: measured round times to decide on instead of measuring (:meth:`time_tables` of an earlier model of
            the same target and draft): the model then measures nothing (``times_frozen``), so its lengths depend
            only on its plan, these times and the acceptance seen in the call. Sampling uses it: the length of a round
            decides how many random numbers a round draws, so lengths chosen on wall-clock times would give another
            output for the same seed (:class:`SamplingTimes`).
        on_first_choice: called with :meth:`time_tables` when the model makes its first choice from measurements
            (its plan is done), after which it measures nothing more (``times_frozen``); None: measure to the end.

    Attributes: ``alpha`` (the first proposal's acceptance estimate); ``acceptance`` (a
    :class:`PositionAcceptance`); ``empty_share`` (decayed share of drafting rounds that yielded nothing to verify);
    ``verified_share`` (decayed share of ``k`` verified in the other drafting rounds); ``chosen`` (a Counter of the
    ``k`` of every round); ``rounds``; ``rounds_off`` (plain
    rounds chosen); ``probes``; :meth:`report` gives the measurements in milliseconds.
    """

    max_tokens: int = 8
    first_tokens: int = 2
    probe_budget: float = 0.03
    decay: float = 0.9
    plain_first: bool = False
    plain_rounds: int = 0
    pooled_from: int = 1
    verify_rows: Optional[int] = None
    accepted: float = 0.5  # pseudo-counts of the prior: the first position's acceptance starts at 0.5, worth one round
    rejections: float = 0.5
    chosen: Counter = field(default_factory=Counter)
    rounds: int = 0
    rounds_off: int = 0
    probes: int = 0
    probe_overhead_s: Optional[float] = None
    verified_share: float = 1.0
    empty_share: float = 0.0
    round_times: Dict[int, Deque[float]] = field(default_factory=dict)
    empty_round_times: Dict[int, Deque[float]] = field(default_factory=dict)
    draft_times: Dict[int, Deque[float]] = field(default_factory=dict)
    verify_times: Dict[int, Deque[float]] = field(default_factory=dict)
    _plan: List[int] = field(default_factory=list)
    _off_left: int = 0
    _probe_next: bool = False
    _off_streak: int = 0
    _speculating: int = 0
    _next_exploration: int = EXPLORE_EVERY  # the drafting round (count) of the next exploring round
    _exploration_gap: int = EXPLORE_EVERY  # drafting rounds from the last exploring round to the next (_explored)
    full_context_round: Optional[int] = None  # the round from which a windowed draft holds the whole context
    acceptance: Optional[PositionAcceptance] = None  # built from the settings above unless given
    plan_extra: tuple = ()
    times: Optional[dict] = None
    on_first_choice: Optional[Callable[[dict], None]] = None
    times_frozen: bool = False

    def __post_init__(self):
        for name, least, optional in (("max_tokens", 1, False), ("first_tokens", 1, False), ("plain_rounds", 0, False),
                                      ("pooled_from", 1, False), ("verify_rows", 1, True)):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"CostModel.{name} must be {'None or ' if optional else ''}an integer >= {least}, "
                                 f"got {value!r}")
        if any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_tokens for k in self.plan_extra):
            raise ValueError(f"CostModel.plan_extra must hold lengths in 0..max_tokens, got {self.plan_extra!r}")
        if not 0.0 < self.probe_budget <= 1.0:
            raise ValueError(f"CostModel.probe_budget must be a share in (0, 1], got {self.probe_budget!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"CostModel.decay must be in [0, 1), got {self.decay!r}")
        if not (self.accepted > 0 and self.rejections > 0):
            raise ValueError("CostModel.accepted and .rejections are pseudo-counts of the prior and must be > 0, got "
                             f"{self.accepted!r} and {self.rejections!r}")
        self.first_tokens = min(self.first_tokens, self.max_tokens)
        if self.acceptance is None:  # the pseudo-counts are the prior of the first position
            self.acceptance = PositionAcceptance(decay=self.decay, prior=self.accepted / (self.accepted + self.rejections),
                                                 strength=self.accepted + self.rejections, pooled_from=self.pooled_from)
        # the draft's first round (its prefill), then one plain round and one of k0 that are measured; with
        # plain_first, the target's prefill first (the first token as early as without a draft) and plain_rounds
        # measured plain steps, then the draft's first round and one of k0 that is measured (if that one was slowed
        # down by other work and turns the draft off, the first accepted probe re-measures k0)
        first = self.first_tokens
        self._plan = [0] * (1 + self.plain_rounds) + [first, first] if self.plain_first else [first, 0, first]
        self._plan += list(self.plan_extra)
        if self.times is not None:
            self.load_time_tables(self.times)

    # ------------------------------------------------------------------ frozen times (sampling)
    _TABLES = ("round_times", "empty_round_times", "draft_times", "verify_times")

    def time_tables(self) -> dict:
        """A copy of the measured times (seconds, by proposals verified; empty rounds by ``k``) and the probe
        overhead: what :attr:`times` takes."""
        tables = {name: {n: list(values) for n, values in getattr(self, name).items()} for name in self._TABLES}
        tables["probe_overhead_s"] = self.probe_overhead_s
        return tables

    def load_time_tables(self, tables: dict) -> None:
        """Decide on ``tables`` (:meth:`time_tables`) from now on and measure nothing more."""
        for name in self._TABLES:
            setattr(self, name, {n: deque(values, maxlen=WINDOW) for n, values in tables[name].items()})
        self.probe_overhead_s = tables["probe_overhead_s"]
        self.times_frozen = True

    # ------------------------------------------------------------------ estimates
    @property
    def alpha(self) -> float:
        """Estimated acceptance of a round's first proposal."""
        return self.acceptance.probabilities(1)[0]

    def round_s(self, n: float) -> Optional[float]:
        """Estimated seconds of a round in which the target verifies ``n`` proposals (``n = 0``: a plain decode
        step; fractional between lengths): the fastest of the last :data:`WINDOW` rounds per number verified
        (interference from other work on the machine only adds time, so one slow round must not price a length
        out), interpolated between them. Rounds are filed by what they verified, not by the ``k`` chosen: a draft
        that stops early (EOS, ``assistant_confidence_threshold``, a universal draft whose tokens make fewer target
        tokens) does less work than ``k`` asked for, and the fastest of such rounds must not price rounds that do
        all of it. With :attr:`verify_rows` the two parts are priced apart: the drafting time linear in ``n``, the
        verification by the target's calls (:meth:`_verify_s`)."""
        if self.verify_rows and self.round_times:
            return self._draft_s(n) + self._verify_s(n)
        points = _fastest(self.round_times)
        if 0 not in points and self.verify_times:  # no plain round yet: a verification costs at least one
            points[0] = min(_fastest(self.verify_times).values())
        return _interpolate(points, n)

    def verify_calls(self, n: float) -> int:
        """Forward calls of the target that verify ``n`` proposals (``n + 1`` tokens) when it verifies at most
        :attr:`verify_rows` tokens per call (1 call for any ``n`` when ``verify_rows`` is None)."""
        if not self.verify_rows:
            return 1
        return max(1, math.ceil((n + 1) / self.verify_rows - 1e-9))

    def _draft_s(self, n: float) -> float:
        """The drafting part of a round verifying ``n`` proposals: linear between the fastest measured per ``n``
        (nothing for a plain round)."""
        points = _fastest(self.draft_times)
        points.setdefault(0, 0.0)
        return _interpolate(points, n)

    def _verify_s(self, n: float) -> float:
        """The verification part (the target's forward calls and the loop's own work) of a round verifying ``n``
        proposals, for a target that verifies :attr:`verify_rows` tokens per call: a step function of the calls
        (:meth:`verify_calls`), the fastest measured per number of calls, linear between them; beyond the most
        calls measured, each further call at the mean cost of those; below the fewest, as the fewest."""
        by_calls: Dict[int, float] = {}
        for measured, seconds in _fastest(self.verify_times).items():
            calls = self.verify_calls(measured)
            by_calls[calls] = min(seconds, by_calls.get(calls, seconds))
        calls = self.verify_calls(n)
        if calls in by_calls:
            return by_calls[calls]
        most, fewest = max(by_calls), min(by_calls)
        if calls > most:
            return by_calls[most] * calls / most
        if calls < fewest:
            return by_calls[fewest]
        return _interpolate(by_calls, calls)

    def empty_round_s(self, k: int) -> Optional[float]:
        """Estimated seconds of a round choosing ``k`` whose draft yields nothing to verify (its drafting time and a
        plain step): the fastest of the last :data:`WINDOW` such rounds per ``k``, interpolated between the ``k``
        measured; with none measured, a plain step (the least such a round can cost)."""
        measured = _interpolate(_fastest(self.empty_round_times), k)
        return self.round_s(0) if measured is None else measured

    def verified(self, k: int) -> float:
        """Expected proposals the target verifies in a non-empty round choosing ``k``: ``k`` times the verified
        share."""
        return k * self.verified_share if k else 0.0

    def tokens(self, k: int) -> float:
        """Expected tokens a round choosing ``k`` yields: one in an empty round (share ``empty_share``), otherwise
        ``E`` of the proposals the target gets to verify, ``k`` times the verified share measured so far (a draft of
        another tokenizer turns ``k`` of its tokens into another number of target tokens; a draft may also stop
        early)."""
        if not k:
            return 1.0
        z = self.empty_share
        return z + (1 - z) * self.acceptance.expected_tokens(self.verified(k))

    def seconds(self, k: int) -> Optional[float]:
        """Expected seconds of a round choosing ``k``: :meth:`empty_round_s` with the empty share's weight,
        :meth:`round_s` at the expected number verified otherwise."""
        full = self.round_s(self.verified(k))
        z = self.empty_share if k else 0.0
        if full is None or not z:
            return full
        empty = self.empty_round_s(k)
        return full if empty is None else z * empty + (1 - z) * full

    def rate(self, k: int) -> Optional[float]:
        """Expected tokens per second of rounds choosing ``k``: :meth:`tokens` over :meth:`seconds`."""
        seconds = self.seconds(k)
        if seconds is None:
            return None
        return self.tokens(k) / max(seconds, 1e-9)  # a clock too coarse to see a round: count it as 1 ns

    def best_k(self) -> int:
        """The ``k`` in ``0..max_tokens`` (and at most twice the longest measured length) of the highest expected
        tokens/s (the smallest on ties); 0 until a plain round was measured."""
        if self.round_s(0) is None:
            return 0
        best, best_rate = 0, self.rate(0)
        longest = max(self.round_times)  # extrapolate at most to twice the longest measured round
        for k in range(1, self.max_tokens + 1):
            if k > 2 and self.verified(k) > 2 * longest:
                break
            rate = self.rate(k)
            if rate is not None and rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    # ------------------------------------------------------------------ decisions
    def next_k(self) -> int:
        """The draft length of the next round (a probe's is 1, see :meth:`probe_due`)."""
        if self._plan:
            k = self._plan.pop(0)
        elif self._off_left > 0:
            self._off_left -= 1
            k = 0
        elif self._probe_next:
            self._probe_next = False
            self.probes += 1
            k = 1
        else:
            if self.on_first_choice is not None and not self.times_frozen:
                self.times_frozen = True  # the plan's rounds are measured: from here on, decide on them alone
                self.on_first_choice(self.time_tables())
            k = self.best_k()
            if (k > 0 and 0 not in self.round_times and not self.times_frozen
                    and self.rate(k) < MEASURE_PLAIN_BELOW * self.rate(0)):
                k = 0  # the draft's lead rests on the bound for a plain step: measure one (once), then decide
            elif k == 0:  # the draft does not pay: plain rounds, then a probe
                self._off_streak += 1
                self._off_left = self._off_rounds() - 1
                self._probe_next = True
            else:
                self._off_streak = 0
                self._speculating += 1
                if self._speculating == self._next_exploration:  # measure a neighbour: one noisy round can hide it
                    k = self.neighbour(k)
                    self._explored()
        if k == 0:
            self.rounds_off += 1
        self.chosen[k] += 1
        return k

    def neighbour(self, k: int) -> int:
        """The length an exploring round drafts instead of the best ``k``: the first of ``2 k``, ``k + 1``, ``k - 1``
        (those in ``1..max_tokens``) whose round was not measured yet; when all were, ``2 k`` again (``k // 2`` at
        the cap), the fastest of its last rounds standing for its cost.

        ``2 k`` first and again: with a cheap draft that is nearly always right the best length is the longest, and
        doubling reaches it soonest (SmolLM2 fp32 + bf16 self-draft, IPEX lane: k = 8). It is re-measured every
        time: a rotation through every neighbour measured k = 8 once per call there, on a slow round, and settled
        on k = 4-5 (x1.80 on a code prompt, x1.94 before; one run each). ``k + 1`` and ``k - 1`` once each,
        because a round's cost need not be linear in its length: a compiled target verifies up to 4 tokens in one
        call (:data:`~optimum_ipex_spec.backends.pytorch.compiled_step.CHUNK_ROWS`), so ``k = 3`` costs a verification
        no more than ``k = 2``, while the line through ``k = 2`` and ``k = 4`` (5 tokens: two calls) prices it between
        them and exploring ``2 k`` alone never measured it. Measured (``make bench-compile``: SmolLM2-135M fp32 compiled
        target, 1 thread, 3 prompts x 128 tokens): its compiled int8 self-draft x1.80 over the target alone, x1.56
        before; the bf16 one x1.30, x1.29 before (constant ``k = 3``: x1.36-1.50 in a scratch run)."""
        for n in (2 * k, k + 1, k - 1):
            if 1 <= n <= self.max_tokens and round(self.verified(n)) not in self.round_times:
                return n
        return min(self.max_tokens, 2 * k) if k < self.max_tokens else max(1, k // 2)

    def _explored(self) -> None:
        """Schedule the next exploring round: :data:`EXPLORE_EVERY` drafting rounds on; for a target that verifies
        in fixed-size calls (:attr:`verify_rows`), twice as many as last time (after 6, 18, 42, ...): there a longer
        neighbour usually needs one more call of the target (k = 3 -> 6 on 4-token calls: 4 + 3 tokens), so an
        exploring round costs much more than a round of the best length, while the step model (:meth:`round_s`)
        prices every length of a call count once one of them is measured."""
        if self.verify_rows:
            self._exploration_gap *= 2
        self._next_exploration += self._exploration_gap

    @property
    def drafting_chosen(self) -> bool:
        """True once the model chose a drafting round on its measurements (not a planned round or a probe)."""
        return self._speculating > 0

    def probe_due(self) -> bool:
        """True when the next round is a probe of an idle draft."""
        return self._probe_next and self._off_left == 0 and not self._plan

    def _off_rounds(self) -> int:
        """Plain rounds before the next probe: 8, doubling while probes keep finding that the draft does not pay,
        up to where a probe costs ``probe_budget`` of the plain rounds' time (a wrong early call recovers fast; a
        draft that never pays costs about the budget)."""
        decode = self.round_s(0)
        overhead = self.probe_overhead_s
        if overhead is None and decode is not None:
            overhead = (self.round_s(1) or decode) - decode
        limit = 512
        if decode and overhead and overhead > 0:
            limit = int(min(512, max(8, math.ceil(overhead / (self.probe_budget * decode)))))
        return min(limit, 8 * 2 ** (self._off_streak - 1))

    # ------------------------------------------------------------------ observations
    def observe(self, verified: int, accepted: int, k: Optional[int] = None) -> None:
        """A round that chose ``k`` verified ``verified`` proposals and the target accepted ``accepted`` of them."""
        self.rounds += 1
        if k:
            self.empty_share = self.decay * self.empty_share + (1 - self.decay) * (verified == 0)
        if k and verified > 0:
            self.verified_share = self.decay * self.verified_share + (1 - self.decay) * min(1.0, verified / k)
        if verified > 0:
            self.acceptance.observe(verified, accepted)

    def probe_accepted(self) -> None:
        """The probe's token was accepted: the next round drafts ``k0`` and is measured, so that the lengths'
        costs are re-measured, not only the acceptance (the draft may have been turned off by slow rounds)."""
        if not self._plan and self._off_left == 0:
            self._plan.append(self.first_tokens)

    def observe_time(self, k: int, round_s: float, draft_s: float, probe: bool = False, accepted: int = 0,
                     verified: Optional[int] = None) -> None:
        """A measured round that chose ``k`` and in which the target verified ``verified`` proposals (None: ``k``):
        ``round_s`` seconds from its start to the next round's, ``draft_s`` of them in the candidate generator. It
        is filed under ``verified`` (:meth:`round_s`); a drafting round that verified nothing, under the ``k`` chosen
        among the empty rounds (:meth:`empty_round_s`: its drafting time depends on what was asked, not on what
        came of it). A probe's time goes to the probe overhead only (it includes the draft's catch-up). Nothing is
        filed once the times are frozen (:attr:`times`, :attr:`on_first_choice`)."""
        if self.times_frozen:
            return
        if probe:
            decode = self.round_s(0)
            if decode is not None:
                self.probe_overhead_s = max(0.0, round_s - decode * (accepted + 1))
            return
        n = k if verified is None else verified
        if k > 0 and n == 0:
            self.empty_round_times.setdefault(k, deque(maxlen=WINDOW)).append(round_s)
            return
        for table, value in ((self.round_times, round_s), (self.draft_times, draft_s),
                             (self.verify_times, round_s - draft_s)):
            table.setdefault(n, deque(maxlen=WINDOW)).append(value)

    def report(self) -> dict:
        """The model's view (milliseconds): round, draft and verification time by proposals verified (``n``), the
        time of rounds that yielded nothing to verify by the ``k`` chosen, the draft's time per verified proposal,
        the acceptance estimate, the verified and empty shares, the chosen lengths (``chosen_k``) and the rounds
        spent without drafting."""
        draft = _medians(self.draft_times)
        per_token = [draft[n] / n for n in draft if n > 0]
        return {
            "alpha": round(self.alpha, 3),
            "acceptance_by_position": [round(p, 3) for p in self.acceptance.probabilities(self.max_tokens)],
            "verified_share": round(self.verified_share, 3),
            "empty_share": round(self.empty_share, 3),
            "decode_ms": None if 0 not in self.round_times else round(1e3 * self.round_s(0), 2),
            "draft_ms_per_token": round(1e3 * statistics.median(per_token), 2) if per_token else None,
            "round_ms_by_n": {n: round(1e3 * s, 2) for n, s in sorted(_medians(self.round_times).items())},
            "verify_ms_by_n": {n: round(1e3 * s, 2) for n, s in sorted(_medians(self.verify_times).items())},
            "empty_round_ms_by_k": {k: round(1e3 * s, 2) for k, s in sorted(_medians(self.empty_round_times).items())},
            "chosen_k": dict(sorted(self.chosen.items())),
            "rounds": self.rounds,
            "rounds_off": self.rounds_off,
            "probes": self.probes,
            "full_context_round": self.full_context_round,
        }


def _fastest(table: Dict[int, Deque[float]]) -> Dict[int, float]:
    return {k: min(values) for k, values in table.items() if values}


def _medians(table: Dict[int, Deque[float]]) -> Dict[int, float]:
    return {k: statistics.median(values) for k, values in table.items() if values}


def draft_length_attribute(generator) -> Optional[str]:
    """The attribute through which ``generator`` reads its per-round draft length: ``num_assistant_tokens``
    (transformers' draft generators and ours), ``num_output_tokens`` (prompt lookup), or None."""
    for name in ("num_assistant_tokens", "num_output_tokens"):
        if isinstance(getattr(generator, name, None), (int, float)):
            return name
    return None


def speculate_by_cost(generator, model: CostModel, clock: Callable[[], float] = time.perf_counter):
    """Make ``generator`` (a transformers ``CandidateGenerator`` or one of ours) propose, each round, the number
    of tokens ``model`` chooses, and feed ``model`` what each round cost. ``k = 0``: the generator is not called
    and the round is a plain decode step. Patched on the instance (transformers 5 checks the class). Returns
    ``generator``.

    The length is set through the generator's own attribute (:func:`draft_length_attribute`) or, without one,
    proposals are cut to it. A generator with a ``context_window`` (ours: a draft's cache can hold a window of the
    context) holds :data:`PROBE_CONTEXT` tokens until ``model`` first chooses to draft, then the whole context; the
    round that runs the whole context is not measured (it carries the draft's prefill).
    """
    if getattr(generator, "cost_model", None) is not None:
        raise ValueError("this candidate generator already has a cost model (speculate_by_cost was applied twice); "
                         "build a new generator per generate() call")
    length_attribute = draft_length_attribute(generator)
    inner_get, inner_update = generator.get_candidates, generator.update_candidate_strategy
    previous = {}  # the last round: start, chosen k, draft seconds, accepted, probe, warm-up, verified
    drafted = []  # whether the generator was called yet (its first call carries the draft's prefill)
    windowed = hasattr(generator, "context_window") and not getattr(generator, "shares_target_cache", False)
    if windowed:
        generator.context_window = PROBE_CONTEXT

    def get_candidates(input_ids, *args, **kwargs):
        start = clock()
        if previous and not previous["warmup"] and previous.get("verified"):
            model.observe_time(previous["k"], start - previous["start"], previous["draft_s"],
                               probe=previous["probe"], accepted=previous["accepted"], verified=previous["n"])
        probe = model.probe_due()
        k = model.next_k()
        if windowed and k > 0 and model.drafting_chosen and generator.context_window is not None:
            generator.context_window = None  # drafting pays: from now on the draft sees the whole context
            model.full_context_round = model.rounds
        # not measured: the first round (the target's prefill), the first drafting round (the draft's prefill) and
        # one that runs the whole context after a window
        warmup = not previous or (k > 0 and (not drafted or getattr(generator, "restarts_context", False)))
        if k > 0:
            drafted.append(True)
        previous.update(start=start, k=k, warmup=warmup, probe=probe, called=k > 0, draft_s=0.0, verified=False)
        if k == 0:
            return input_ids, None
        if length_attribute is not None:
            setattr(generator, length_attribute, k)
        candidates, logits = inner_get(input_ids, *args, **kwargs)
        if length_attribute is None and candidates.shape[1] - input_ids.shape[1] > k:
            candidates = candidates[:, : input_ids.shape[1] + k]
            logits = logits[:, :k] if logits is not None else None
        previous["draft_s"] = clock() - start
        return candidates, logits

    def update_candidate_strategy(input_ids, scores, num_matches, *args, **kwargs):
        if "k" not in previous:
            raise RuntimeError("update_candidate_strategy() was called before get_candidates(): a round is proposed, "
                               "then verified")
        verified = scores.shape[1] - 1 if scores is not None else 0
        previous.update(verified=True, accepted=int(num_matches), n=verified)
        model.observe(verified, int(num_matches), k=previous["k"])
        if previous["probe"] and num_matches > 0:
            model.probe_accepted()
        if previous.get("called"):
            return inner_update(input_ids, scores, num_matches, *args, **kwargs)
        return None

    generator.get_candidates = get_candidates
    generator.update_candidate_strategy = update_candidate_strategy
    generator.cost_model = model
    return generator


class SamplingTimes:
    """Round times measured once per draft (and settings) and reused by every later sampling call of one target, so
    that the same seed gives the same output on every call.

    With ``do_sample=True`` a round's length decides how many random numbers it draws (the draft's samples, the
    acceptance tests, the resampled token), so lengths chosen on each call's own wall-clock times would give another
    output for the same seed. Here a call's lengths depend only on its fixed plan, these times and the acceptance
    seen in the call: the first sampling call with a draft measures its planned rounds (its caller may plan more:
    ``plain_rounds``, ``plan_extra``) and hands the times over at its first choice
    (:attr:`CostModel.on_first_choice`); every later call with the same draft and settings decides on those times from
    the start (:attr:`CostModel.times`). The times are held as long as the draft object lives (prompt lookup: as long
    as the target). Thread-safe.
    """

    def __init__(self):
        self._by_draft: "weakref.WeakKeyDictionary[object, Dict[tuple, dict]]" = weakref.WeakKeyDictionary()
        self._lookup: Dict[tuple, dict] = {}
        self._lock = threading.Lock()

    def cost_model(self, draft, **settings) -> CostModel:
        """A :class:`CostModel` with ``settings`` (its constructor's arguments) for a sampling call with ``draft`` (a
        draft model, or None for prompt lookup): deciding on the times kept for them, or measuring and keeping
        them."""
        key = tuple(sorted(settings.items()))
        with self._lock:
            table = self._lookup if draft is None else self._by_draft.setdefault(draft, {})
            times = table.get(key)
        if times is not None:
            return CostModel(**settings, times=times)

        def keep(measured: dict) -> None:
            with self._lock:
                table.setdefault(key, measured)  # two first calls at once: the first to choose wins

        return CostModel(**settings, on_first_choice=keep)

    def clear(self) -> None:
        """Forget every kept time: the next sampling call with each draft measures again."""
        with self._lock:
            self._by_draft.clear()
            self._lookup.clear()

