"""The cost model that picks each round's draft length (optimum_ipex_spec.speculative.cost_model): its arithmetic, its
decisions on simulated costs (a fake clock, no timing of real code), when it is on, and that output stays the target's;
one real run with a draft of random weights, whose proposals are almost never accepted whatever the clock says."""

import pytest
import torch

from optimum_ipex_spec.speculative.cost_model import PROBE_CONTEXT, CostModel, PositionAcceptance, speculate_by_cost
from optimum_ipex_spec.speculative.strategy import Strategy, uses_cost_model


def expected_tokens(alpha, k):
    """The geometric model's tokens per round, at a rate ``alpha`` for every position (no observations yet: the
    estimate is the prior)."""
    return PositionAcceptance(prior=alpha).expected_tokens(k)


def test_expected_tokens_matches_the_geometric_sum():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for k in range(0, 9):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha ** i for i in range(k + 1)))
    assert expected_tokens(1.0, 5) == 6
    assert expected_tokens(0.5, 2.5) == pytest.approx(1.75 + 0.5 * 0.125)  # a fractional k is interpolated


def test_position_acceptance_counts_what_each_round_reached():
    pooled = PositionAcceptance(decay=0.5, prior=0.5, strength=1.0)
    pooled.observe(verified=4, accepted=2)  # positions 1, 2 accepted, 3 rejected, 4 never reached
    assert pooled.reached == [3.0] and pooled.accepted == [2.0]
    assert pooled.probabilities(3) == [pytest.approx(2.5 / 4)] * 3
    pooled.observe(verified=2, accepted=2)  # earlier counts decay by half before adding
    assert pooled.reached == [3.5] and pooled.accepted == [3.0]
    per_position = PositionAcceptance(decay=0.5, prior=0.5, strength=1.0, pooled_from=2)
    per_position.observe(verified=4, accepted=2)
    assert per_position.reached == [1.0, 2.0] and per_position.accepted == [1.0, 1.0]
    first = 1.5 / 2  # position 1 shrunk towards the prior, positions 2+ towards position 1's estimate
    assert per_position.probabilities(3) == pytest.approx([first, (1.0 + first) / 3, (1.0 + first) / 3])
    assert per_position.expected_tokens(2) == pytest.approx(1 + first + first * (1.0 + first) / 3)
    with pytest.raises(ValueError, match="pooled_from"):
        PositionAcceptance(pooled_from=0)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Simulated:
    """A candidate generator whose rounds cost simulated time: ``decode`` seconds per target token verified plus
    ``verify_slope`` per extra token, ``draft`` seconds per proposal; the target accepts a proposal while
    ``accept(i)`` says so (deterministic)."""

    def __init__(self, clock, draft, decode, verify_slope, accept, verify_base=0.0, verify=None):
        self.clock, self.draft, self.decode, self.verify_slope, self.accept = clock, draft, decode, verify_slope, accept
        self.verify_base = verify_base  # extra seconds of any forward over several tokens
        # seconds of the target's forward over k + 1 tokens, when not decode + base + slope * k
        self.verify = verify or (lambda k: decode + (verify_base + verify_slope * k if k else 0.0))
        self.num_assistant_tokens = 20
        self.calls = 0

    def get_candidates(self, input_ids):
        self.calls += 1
        k = int(self.num_assistant_tokens)
        self.clock.now += self.draft * k
        return torch.cat([input_ids, torch.zeros(1, k, dtype=torch.long)], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def _run(generator, model, clock, rounds, length=10):
    """Drive ``generator`` like transformers' assisted loop: proposals, a verification forward, the update."""
    tokens = 0
    ids = torch.zeros(1, length, dtype=torch.long)
    for _ in range(rounds):
        candidates, _ = generator.get_candidates(ids)
        k = candidates.shape[1] - ids.shape[1]
        # the target verifies k + 1 tokens
        clock.now += generator.verify(k)
        accepted = 0
        while accepted < k and generator.accept(tokens + accepted):
            accepted += 1
        generator.update_candidate_strategy(candidates, torch.zeros(1, k + 1, 4), accepted)
        tokens += accepted + 1
        ids = torch.zeros(1, length + tokens, dtype=torch.long)
    return tokens


def test_a_cheap_agreeing_draft_gets_long_rounds():
    clock = _Clock()
    generator = _Simulated(clock, draft=0.01, decode=0.05, verify_slope=0.004, accept=lambda i: True)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=30)
    assert model.chosen[8] >= 20 and model.rounds_off <= 1
    # best possible: 9 tokens per 0.08 + 0.05 + 0.032 s = 55.6 tokens/s (2.78x plain decoding); exploration included
    assert tokens / clock.now > 2.5 / 0.05


def test_a_length_verified_in_the_same_call_as_a_shorter_one_is_found():
    """A compiled target verifies up to 4 tokens in one call (compiled_step.CHUNK_ROWS): a round of k = 3 costs the
    verification of k = 2, k = 4 costs two calls. The line through k = 2 and k = 4 prices k = 3 between them (rounds
    of 57, 85 and 114 ms: 2.71, 3.44 and 4.10 tokens at 90% acceptance, so k = 2 looks best); measured, k = 3
    runs 3.44 tokens in 69 ms and is the best length."""
    clock = _Clock()
    generator = _Simulated(clock, draft=0.012, decode=0.033, verify_slope=0.0, accept=lambda i: i % 10 != 9,
                           verify=lambda k: 0.033 * -(-(k + 1) // 4))
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=60)
    assert model.chosen[3] > 30 and model.chosen[3] > 3 * model.chosen[2], model.chosen
    assert tokens / clock.now > 1.3 / 0.033  # k = 3 throughout: 49.8 tokens/s, x1.64 plain decoding


def test_a_target_that_verifies_in_fixed_size_calls_is_priced_by_its_calls():
    """A compiled 1.5B target verifies 4 tokens per call (225 ms a call), a 0.5B draft token costs 30 ms, 90% are
    accepted. Told ``verify_rows=4``, the model starts at k = 3 (one full call), prices a longer round by its calls
    and explores after 6, 18, 42 ... drafting rounds: a short call (40 rounds, ~128 tokens) runs 8% faster than
    with the linear model, which starts at k = 2 and explores k = 6 (two calls) every 6th round (Qwen2.5-Coder 1.5B
    + 0.5B int8, both compiled: the cost model decoded x1.91 over the target alone, a constant k = 3 x2.54)."""
    rates, chosen = {}, {}
    for rows in (None, 4):
        clock = _Clock()
        generator = _Simulated(clock, draft=0.03, decode=0.225, verify_slope=0.0, accept=lambda i: i % 10 != 9,
                               verify=lambda k: 0.225 * -(-(k + 1) // 4))
        model = CostModel(max_tokens=8, first_tokens=3 if rows else 2, verify_rows=rows, plain_first=True)
        speculate_by_cost(generator, model, clock=clock)
        rates[rows] = _run(generator, model, clock, rounds=40) / clock.now
        chosen[rows] = model.chosen
    second_call = sum(n for k, n in chosen[4].items() if k >= 4)
    assert chosen[4][3] >= 34 and second_call <= 3, chosen[4]
    assert rates[4] > 1.05 * rates[None], (rates, chosen)  # 10.2 against 9.5 tokens/s; a constant k = 3: 10.8
    assert model.verify_calls(3) == 1 and model.verify_calls(4) == 2 and model.verify_calls(7) == 2


def test_verify_rows_must_be_a_positive_integer():
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="verify_rows"):
            CostModel(verify_rows=bad)


def test_a_draft_that_does_not_pay_is_turned_off_and_probed_rarely():
    clock = _Clock()
    # as costly per token as the target and never right: every proposal is wasted time
    generator = _Simulated(clock, draft=0.05, decode=0.05, verify_slope=0.005, accept=lambda i: False)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=300)
    plain = tokens * 0.05
    assert model.rounds_off >= 280 and 1 <= model.probes <= 12  # 8, 16, 32, then every ~37 (3% budget)
    assert plain / clock.now >= 0.95  # within 5% of decoding alone, exploration and probes included
    assert generator.calls == model.rounds - model.rounds_off


def test_a_plain_step_is_measured_when_the_draft_only_beats_its_bound():
    """Our drafts start after the target's prefill, so no plain step is measured at first and a verification's
    time bounds its cost. Measured on the pure-PyTorch path (SmolLM2 fp32 target, eager bf16 self-draft): a plain
    step 48 ms, a 2-token verification 69 ms, a draft token 56 ms, 95% accepted. Under the bound one proposal per
    round looks better than plain decoding (1.95 tokens per 129 ms against 1 per 69); it is not (1 per 48)."""
    clock = _Clock()
    generator = _Simulated(clock, draft=0.056, decode=0.048, verify_slope=0.004, verify_base=0.021,
                           accept=lambda i: i % 20 != 0)
    model = CostModel(max_tokens=8, plain_first=True)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=120)
    assert model.report()["decode_ms"] == pytest.approx(48.0)
    assert model.rounds_off >= 100
    # near decoding alone, its first rounds and probes included (without the measured plain step: x0.75)
    assert tokens * 0.048 / clock.now >= 0.9


def test_the_draft_comes_back_when_it_starts_to_agree():
    clock = _Clock()
    # wrong for the first 60 tokens (e.g. prose), then always right (e.g. copying code)
    generator = _Simulated(clock, draft=0.01, decode=0.05, verify_slope=0.004, accept=lambda i: i >= 60)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    _run(generator, model, clock, rounds=120)
    assert model.rounds_off >= 20 and model.probes >= 1 and model.chosen[8] >= 10
    report = model.report()
    assert report["rounds"] == 120 and report["decode_ms"] == pytest.approx(50.0)
    assert report["draft_ms_per_token"] == pytest.approx(10.0)


def test_one_slow_round_does_not_turn_a_good_draft_off_for_long():
    """Interference from other work only adds time: one slow measured round may turn a good draft off, but the
    lengths are costed by their fastest round and the first accepted probe re-measures, so drafting resumes."""
    clock = _Clock()
    generator = _Simulated(clock, draft=0.01, decode=0.05, verify_slope=0.004, accept=lambda i: True)
    inner = generator.get_candidates

    def slow_second_call(ids):
        if generator.calls == 1:  # the first measured drafting round (the call before carries the prefill)
            clock.now += 0.5
        return inner(ids)

    generator.get_candidates = slow_second_call
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    _run(generator, model, clock, rounds=40)
    assert model.probes >= 1 and model.rounds_off <= 10 and model.chosen[8] >= 20


def test_a_generator_without_a_length_attribute_is_cut():
    clock = _Clock()
    generator = _Simulated(clock, draft=0.0, decode=0.05, verify_slope=0.0, accept=lambda i: True)
    del generator.num_assistant_tokens
    generator.get_candidates = lambda ids: (torch.cat([ids, torch.zeros(1, 20, dtype=torch.long)], dim=1), None)
    model = CostModel(max_tokens=4, plain_first=True)
    speculate_by_cost(generator, model, clock=clock)
    candidates, _ = generator.get_candidates(torch.zeros(1, 3, dtype=torch.long))  # plain_first: the prefill alone
    assert candidates.shape[1] == 3
    generator.update_candidate_strategy(candidates, torch.zeros(1, 1, 4), 0)
    candidates, _ = generator.get_candidates(torch.zeros(1, 4, dtype=torch.long))
    assert candidates.shape[1] == 4 + 2  # the draft's first round proposes k0 = 2, cut from 20


class _StopsEarly(_Simulated):
    """Every other round the draft stops after one proposal (as at ``assistant_confidence_threshold``): cheap rounds
    that did a fraction of the work the chosen ``k`` asks for."""

    def get_candidates(self, ids):
        if self.calls % 2 == 0:
            self.calls += 1
            self.clock.now += self.draft
            return torch.cat([ids, torch.zeros(1, 1, dtype=torch.long)], dim=1), None
        return super().get_candidates(ids)


def test_rounds_are_costed_by_what_they_verified_not_by_the_k_chosen():
    """Only each round's first proposal is accepted, and every other round the draft stops after it. The best is
    k = 1 (2 tokens per 0.072 s, 27.8 tokens/s against 20 plain); a long k adds rejected draft tokens (k = 8: 2
    tokens per 0.226 s). Filed by the k chosen, the cheap stopped rounds priced long rounds at 0.072 s and the model
    chose them: 19.1 tokens/s, slower than plain decoding. Filed by what they verified: 22.7 (one rate for every
    position overrates the second proposal, so k = 2 wins over k = 1)."""
    clock = _Clock()
    generator = _StopsEarly(clock, draft=0.02, decode=0.05, verify_slope=0.002, accept=lambda i: False)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = 0
    ids = torch.zeros(1, 10, dtype=torch.long)
    for _ in range(200):  # _run's loop, with the first proposal of every round accepted
        candidates, _ = generator.get_candidates(ids)
        k = candidates.shape[1] - ids.shape[1]
        clock.now += generator.decode + (generator.verify_slope * k if k else 0.0)
        accepted = 1 if k else 0
        generator.update_candidate_strategy(candidates, torch.zeros(1, k + 1, 4), accepted)
        tokens += accepted + 1
        ids = torch.zeros(1, 10 + tokens, dtype=torch.long)
    assert tokens / clock.now >= 1.08 / 0.05
    assert sum(n for k, n in model.chosen.items() if k <= 4) >= 180


class _OftenEmpty(_Simulated):
    """A draft that spends its drafting time every round but, on all rounds but every ``every``-th, yields nothing to
    verify (a universal draft whose tokens make no new target token): the input comes back unchanged."""

    def __init__(self, clock, every, **kwargs):
        super().__init__(clock, **kwargs)
        self.every = every

    def get_candidates(self, ids):
        if self.calls % self.every:
            self.calls += 1
            self.clock.now += self.draft * int(self.num_assistant_tokens)
            return ids, None
        return super().get_candidates(ids)


def test_a_draft_that_often_yields_nothing_is_charged_for_it():
    """4 rounds in 5 draft for nothing; the fifth has all its proposals accepted. Every k loses to plain decoding
    (k = 8: 2.6 tokens per 0.293 s, 8.9 tokens/s against 20). Until 2026-12-03 an empty round was filed nowhere and
    only lowered the verified share: the model rated k = 8 at 2.6 tokens per 0.10 s and drafted on (x0.5 of plain
    decoding in this simulation). Charged at its own cost, the empty rounds turn the draft off."""
    clock = _Clock()
    generator = _OftenEmpty(clock, every=5, draft=0.03, decode=0.05, verify_slope=0.002, accept=lambda i: True)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=300)
    assert tokens * 0.05 / clock.now >= 0.9
    report = model.report()
    assert report["empty_share"] > 0.3 and report["empty_round_ms_by_k"]
    assert min(report["empty_round_ms_by_k"].values()) >= 50.0 + 30.0  # a plain step and at least one draft token


def test_cheap_empty_rounds_do_not_turn_a_good_draft_off():
    """Prompt lookup without a match costs next to nothing: every other round is empty, the others have all 8
    proposals accepted (k = 8: 5 tokens per 0.066 s, 76 tokens/s against 20). The draft stays on at long rounds."""
    clock = _Clock()
    generator = _OftenEmpty(clock, every=2, draft=0.0005, decode=0.05, verify_slope=0.002, accept=lambda i: True)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    tokens = _run(generator, model, clock, rounds=100)
    assert model.chosen[8] >= 60 and model.rounds_off <= 2
    assert tokens * 0.05 / clock.now >= 3.0


class _Windowed(_Simulated):
    """A simulated generator with a ``context_window`` (as ours): running the whole context once costs ``prefill``
    seconds, on the call after the window was cleared."""

    def __init__(self, clock, prefill, **kwargs):
        super().__init__(clock, **kwargs)
        self.prefill, self.context_window, self.restarts_context, self.windows = prefill, None, False, []

    def __setattr__(self, name, value):
        if name == "context_window" and value is None and getattr(self, "context_window", None) is not None:
            self.restarts_context = True  # it held a window: the next call runs the whole context
        super().__setattr__(name, value)

    def get_candidates(self, ids):
        self.windows.append(self.context_window)
        if self.restarts_context:
            self.clock.now += self.prefill
            self.restarts_context = False
        return super().get_candidates(ids)


def _windowed_run(rounds, **costs):
    """A :class:`_Windowed` generator (a 1 s prefill) under the cost model for ``rounds`` rounds."""
    clock = _Clock()
    generator = _Windowed(clock, prefill=1.0, decode=0.05, **costs)
    model = CostModel(max_tokens=8, plain_first=True)
    speculate_by_cost(generator, model, clock=clock)
    _run(generator, model, clock, rounds=rounds)
    return generator, model


def test_a_draft_holds_a_window_until_drafting_pays_and_the_prefill_round_is_not_measured():
    generator, model = _windowed_run(30, draft=0.01, verify_slope=0.004, accept=lambda i: True)
    first_chosen = generator.windows.index(None)
    # planned rounds (k0 twice) on the window; the first round the model chooses gets the whole context
    assert generator.windows[:first_chosen] == [PROBE_CONTEXT] * 2 and set(generator.windows[first_chosen:]) == {None}
    assert model.full_context_round == 3 and model.report()["full_context_round"] == 3
    # the second-long prefill is in no measurement: every length is costed from ordinary rounds
    assert max(max(times) for times in model.round_times.values()) < 0.2 and model.chosen[8] >= 20


def test_a_draft_that_never_pays_keeps_its_window():
    generator, model = _windowed_run(200, draft=0.05, verify_slope=0.005, accept=lambda i: False)
    assert model.probes >= 2 and set(generator.windows) == {PROBE_CONTEXT} and model.full_context_round is None


@pytest.mark.parametrize("strategy,has_draft,configured,passed,on", [
    (Strategy.DRAFT, True, None, None, True),  # transformers 5: unset
    (Strategy.DRAFT, True, "constant", None, True),  # transformers 4: the default value
    (Strategy.TRANSFORMERS, True, "cost", "cost", True),
    (Strategy.TRANSFORMERS, True, "cost", None, True),  # on the draft's generation config
    (Strategy.UNIVERSAL_SAMPLING, True, "constant", None, True),
    (Strategy.DRAFT, True, "constant", "constant", False),  # passed to generate(): the user's choice
    (Strategy.DRAFT, True, "heuristic", None, False),
    (Strategy.TRANSFORMERS, False, None, None, False),  # early exit: no draft model
    (Strategy.PROMPT_LOOKUP, False, None, None, True),  # prompt lookup: on by default
    (Strategy.PROMPT_LOOKUP, False, None, "cost", True),
    (Strategy.PROMPT_LOOKUP, False, None, "constant", False),  # passed: the lookup's own gating
    (Strategy.PROMPT_LOOKUP, False, None, "heuristic", False),
    (Strategy.CUSTOM, False, None, None, False),
])
def test_when_the_cost_model_is_on(strategy, has_draft, configured, passed, on):
    assert uses_cost_model(strategy, has_draft, configured, passed) is on


def test_default_on_switch_off_and_lossless(tiny_stock_target_draft):
    stock, target, draft = tiny_stock_target_draft
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])
    expected = stock.generate(ids, max_new_tokens=40, do_sample=False)
    for assistant in (draft, stock):
        got = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant)
        assert torch.equal(got, expected)
        report = target.last_cost_model.report()
        assert report["rounds"] >= 3 and sum(report["chosen_k"].values()) == report["rounds"]
        got = target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=assistant,
                              num_assistant_tokens_schedule="constant")
        assert torch.equal(got, expected) and target.last_cost_model is None
    looked_up = target.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(looked_up, expected[:, :ids.shape[1] + 8]) and target.last_cost_model.max_tokens == 3
    target.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3,
                    num_assistant_tokens_schedule="constant")
    assert target.last_cost_model is None  # the lookup's own gating
    target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert target.last_cost_model is not None
    target.generate(ids, max_new_tokens=4, do_sample=False)  # a plain call clears the last call's model
    assert target.last_cost_model is None and target.last_strategy is None


def test_a_draft_of_random_weights_is_turned_off(tiny_stock_target_draft):
    """Issue 15's useless draft, in a unit test: the target's architecture with other random weights (seed 99).
    With next to no accepted tokens no draft length can beat a plain step, so the cost model decodes without the
    draft in most rounds (its timing only decides how often it probes); output stays the target's."""
    from conftest import build_tiny
    from optimum_ipex_spec import IPEXModelForCausalLM

    stock, target, _ = tiny_stock_target_draft
    useless = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=99))
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])
    expected = stock.generate(ids, max_new_tokens=80, do_sample=False)
    got = target.generate(ids, max_new_tokens=80, do_sample=False, assistant_model=useless)
    assert torch.equal(got, expected)
    report = target.last_cost_model.report()
    assert report["alpha"] < 0.2, report  # the proposals were tried, and rejected
    assert report["rounds_off"] >= 0.7 * report["rounds"] and report["chosen_k"].get(0, 0) == report["rounds_off"], \
        report


@pytest.mark.parametrize("argument,value,message", [
    ("num_assistant_tokens", 0, "number >= 1"),
    ("num_assistant_tokens", -1, "number >= 1"),
    ("num_assistant_tokens", float("nan"), "number >= 1"),
    ("num_assistant_tokens", "3", "number >= 1"),
    ("num_assistant_tokens_schedule", "bogus", "must be one of"),
    ("num_assistant_tokens_schedule", "Cost", "must be one of"),
    ("assistant_confidence_threshold", 2.0, r"\[0, 1\]"),
    ("assistant_confidence_threshold", -1, r"\[0, 1\]"),
])
def test_bad_draft_arguments_are_refused_before_generating(tiny_stock_target_draft, argument, value, message):
    stock, target, draft = tiny_stock_target_draft
    ids = torch.tensor([[5, 17, 99, 3]])
    for assistant in (draft, stock):  # our draft and a transformers draft alike
        with pytest.raises(ValueError, match=message):
            target.generate(ids, max_new_tokens=4, assistant_model=assistant, **{argument: value})
    original = draft.generation_config.num_assistant_tokens_schedule
    draft.generation_config.num_assistant_tokens_schedule = "bogus"  # on the draft's own config, too
    try:
        with pytest.raises(ValueError, match="must be one of"):
            target.generate(ids, max_new_tokens=4, assistant_model=draft)
    finally:
        draft.generation_config.num_assistant_tokens_schedule = original


@pytest.mark.parametrize("arguments,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=None), "max_tokens"),
    (dict(max_tokens=float("inf")), "max_tokens"),
    (dict(first_tokens=0), "first_tokens"),
    (dict(probe_budget=0.0), "probe_budget"),
    (dict(decay=1.0), "decay"),
    (dict(accepted=0.0, rejections=0.0), "pseudo-counts"),
    (dict(plain_rounds=-1), "plain_rounds"),
    (dict(plain_rounds=True), "plain_rounds"),
    (dict(pooled_from=0), "pooled_from"),
])
def test_cost_model_refuses_bad_settings(arguments, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**arguments)


def test_a_clock_too_coarse_to_see_a_round_still_decides():
    clock = _Clock()  # never advances: every round measures 0 s
    generator = _Simulated(clock, draft=0.0, decode=0.0, verify_slope=0.0, accept=lambda i: True)
    model = CostModel(max_tokens=8)
    speculate_by_cost(generator, model, clock=clock)
    _run(generator, model, clock, rounds=20)
    assert model.rounds == 20 and model.best_k() >= 0


def test_speculate_by_cost_refuses_a_second_wrap_and_an_update_first():
    clock = _Clock()
    generator = _Simulated(clock, draft=0.01, decode=0.05, verify_slope=0.0, accept=lambda i: True)
    speculate_by_cost(generator, CostModel(), clock=clock)
    with pytest.raises(ValueError, match="applied twice"):
        speculate_by_cost(generator, CostModel(), clock=clock)
    with pytest.raises(RuntimeError, match="before get_candidates"):
        generator.update_candidate_strategy(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 1, 4), 0)


def test_the_first_token_comes_before_the_draft_runs(tiny_stock_target_draft, monkeypatch):
    """Time to first token with a draft: the first round is the target's alone (the draft's prefill follows), so
    the streamer gets the first token before any draft forward, as without a draft."""
    from transformers.generation.streamers import BaseStreamer

    stock, target, draft = tiny_stock_target_draft

    class Chunks(BaseStreamer):
        def __init__(self):
            self.sizes = []

        def put(self, value):
            self.sizes.append(value.numel())

        def end(self):
            pass

    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])
    expected = stock.generate(ids, max_new_tokens=24, do_sample=False)
    for assistant in (draft,):  # ours (transformers' drafts expect their first call at the prompt's length)
        calls, chunks, forward = [], Chunks(), assistant.forward

        def counted(*args, **kwargs):
            calls.append(len(chunks.sizes))  # how many chunks the streamer had when the draft ran
            return forward(*args, **kwargs)

        monkeypatch.setattr(assistant, "forward", counted)
        got = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant, streamer=chunks)
        monkeypatch.undo()
        assert torch.equal(got, expected)
        assert chunks.sizes[:2] == [ids.shape[1], 1]  # the prompt, then the first token alone
        assert calls and min(calls) >= 2  # the draft first ran after the first token was out
