"""Prompt lookup decoding with an IPEX target: token-exact against plain greedy, including length; the target's
distribution with sampling."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, NoBadWordsLogitsProcessor

from conftest import build_tiny, exact_two_token_distributions
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.speculative.candidates import AdaptivePromptLookupCandidateGenerator

REPETITIVE = "def add(a, b):\n    return a + b\n\n" * 4 + "def sub(a, b):\n    return a - b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def pair(tiny_dir):
    path = tiny_dir("llama")
    return AutoModelForCausalLM.from_pretrained(path).eval(), IPEXModelForCausalLM.from_pretrained(path, export=True)


@pytest.mark.parametrize("max_new_tokens", [1, 5, 17, 40])
@pytest.mark.parametrize("ngram", [1, 3])
def test_token_exact_including_length(pair, tokenizer, max_new_tokens, ngram):
    stock, model = pair
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    expected = stock.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    got = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, prompt_lookup_num_tokens=10,
                         max_matching_ngram_size=ngram)
    assert got.shape == expected.shape and torch.equal(got, expected)


def test_lookup_actually_proposes_and_accepts(tiny_dir, tokenizer):
    """A prompt whose continuation is a copy: the self-repeating tiny model accepts lookups."""
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True)
    stock = AutoModelForCausalLM.from_pretrained(tiny_dir("llama")).eval()
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    plain = stock.generate(**inputs, max_new_tokens=30, do_sample=False)
    # make the prompt contain the model's own continuation so lookups match it
    prompt = torch.cat([plain, inputs.input_ids, plain[:, inputs.input_ids.shape[1]:][:, :3]], 1)
    expected = stock.generate(prompt, max_new_tokens=20, do_sample=False)
    got = model.generate(prompt, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=8)
    assert torch.equal(got, expected)
    stats = model.last_speculation_stats
    assert stats.rounds > 0 and stats.accepted > 0


def test_eos_none(pair, tokenizer):
    stock, model = pair
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(**inputs, prompt_lookup_num_tokens=6, **kwargs), stock.generate(**inputs, **kwargs))


def test_no_ngram_match(pair):
    stock, model = pair
    ids = torch.arange(100, 140).unsqueeze(0)  # all distinct: nothing to look up
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=5),
                       stock.generate(ids, max_new_tokens=12, do_sample=False))


def test_bad_words_never_proposed_and_output_exact(pair, tokenizer):
    stock, model = pair
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    banned = tokenizer(" return", add_special_tokens=False).input_ids
    kwargs = dict(max_new_tokens=24, do_sample=False, bad_words_ids=[banned])
    assert torch.equal(model.generate(**inputs, prompt_lookup_num_tokens=8, **kwargs),
                       stock.generate(**inputs, **kwargs))
    processor = NoBadWordsLogitsProcessor([banned], eos_token_id=2)
    gen = AdaptivePromptLookupCandidateGenerator(num_output_tokens=8, max_length=10_000,
                                                 logits_processor=[processor], vocab_size=stock.config.vocab_size)
    ids = inputs.input_ids
    cut = ids[:, : int((ids[0] == banned[0]).nonzero()[-1]) - 1]  # context just before a banned token follows
    candidates, _ = gen.get_candidates(cut)
    assert banned[0] not in candidates[0, cut.shape[1]:].tolist()


def test_adaptive_pause_and_backoff():
    gen = AdaptivePromptLookupCandidateGenerator(num_output_tokens=10, max_length=1000)
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    assert gen.get_candidates(ids)[0].shape[1] > ids.shape[1]  # "1 2" matches: proposes
    for _ in range(3):  # rejected rounds drag the expected acceptance below break-even
        gen.update_candidate_strategy(ids, torch.zeros(1, 11, 5), 0)
        if gen.pause:
            break
    assert gen.pause == 1 and gen.num_output_tokens == 2
    assert gen.get_candidates(ids)[0].shape == ids.shape  # paused: no proposal
    assert gen.get_candidates(ids)[0].shape[1] > ids.shape[1]  # probes again
    gen.update_candidate_strategy(ids, torch.zeros(1, 3, 5), 0)
    assert gen.pause == 2  # exponential backoff
    gen.pause = 0
    gen.update_candidate_strategy(ids, torch.zeros(1, 3, 5), 2)  # fully accepted: grows, backoff resets
    assert gen.num_output_tokens == 4 and gen.backoff == 1
    assert gen.stats.accepted == 2 and gen.stats.rounds >= 3


@pytest.mark.parametrize("schedule, cost_model", [(None, True), ("cost", True), ("constant", False),
                                                  ("heuristic", False)])
def test_the_cost_model_chooses_the_lookup_length_unless_switched_off(pair, tokenizer, schedule, cost_model):
    """The cost model is prompt lookup's default; a schedule passed to generate() other than "cost" keeps the
    lookup's own break-even gating. Either way the output is plain greedy's."""
    stock, model = pair
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    expected = stock.generate(**inputs, max_new_tokens=24, do_sample=False)
    extra = {} if schedule is None else {"num_assistant_tokens_schedule": schedule}
    got = model.generate(**inputs, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=6, **extra)
    assert torch.equal(got, expected)
    assert (model.last_cost_model is not None) == cost_model
    if cost_model:
        report = model.last_cost_model.report()
        assert max(report["chosen_k"]) <= 6 and report["rounds"] > 0
        assert model.last_speculation_stats.rounds > 0  # it looked up, and the target verified the proposals


def test_under_the_cost_model_the_lookup_neither_pauses_nor_resizes():
    gen = AdaptivePromptLookupCandidateGenerator(num_output_tokens=10, max_length=1000)
    gen.adaptive = False
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    for _ in range(5):  # rejected rounds: the gating would pause and shrink the length
        gen.get_candidates(ids)
        gen.update_candidate_strategy(ids, torch.zeros(1, 11, 5), 0)
    assert gen.pause == 0 and gen.num_output_tokens == 10 and gen.stats.rounds == 5
    assert gen.get_candidates(ids)[0].shape[1] > ids.shape[1]


def test_single_token_matches_are_not_proposed():
    gen = AdaptivePromptLookupCandidateGenerator(num_output_tokens=5, max_length=1000)
    ids = torch.tensor([[7, 1, 9, 4, 1]])  # only the 1-gram "1" recurs
    assert gen.get_candidates(ids)[0].shape == ids.shape
    gen1 = AdaptivePromptLookupCandidateGenerator(num_output_tokens=5, max_length=1000, max_matching_ngram_size=1)
    assert gen1.get_candidates(ids)[0][0, 5:].tolist() == [9, 4, 1]


def test_budget_caps_candidates():
    gen = AdaptivePromptLookupCandidateGenerator(num_output_tokens=10, max_length=12)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2]])  # "1 2" recurs; room for 12 - 8 - 1 = 3 candidates
    candidates, _ = gen.get_candidates(ids)
    assert candidates.shape[1] - ids.shape[1] == 3


@pytest.mark.slow
def test_real_smollm2_code_edit(smollm2_dir, tokenizer):
    from optimum_ipex_spec.provisioning.prompts import humaneval_prompts

    code = humaneval_prompts((0,))[0]
    message = f"Rename the function to `check` and return the whole code.\n\n```python\n{code}```"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                           add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    stock = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    model = IPEXModelForCausalLM.from_pretrained(smollm2_dir, export=True)
    expected = stock.generate(**inputs, max_new_tokens=64, do_sample=False)
    got = model.generate(**inputs, max_new_tokens=64, do_sample=False, prompt_lookup_num_tokens=10)
    assert got.shape == expected.shape and torch.equal(got, expected)
    assert model.last_speculation_stats.accepted > 0


@pytest.mark.parametrize("schedule", [None, "constant"])  # the cost model (default), the lookup's own back-off
def test_sampling_with_prompt_lookup_keeps_the_target_distribution(schedule):
    """With ``do_sample=True`` a lookup proposal is kept only where it equals the token the target sampled there, so
    the first two new tokens follow the target's exact law (total variation against it, as in test_assisted)."""
    vocab = 12
    ref = build_tiny("llama", vocab_size=vocab, seed=3)
    target = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(ref))
    ids = torch.tensor([[1, 5, 7, 1, 5]])  # the bigram (1, 5) recurs: the lookup proposes (7, 1) at once
    p1, p2 = exact_two_token_distributions(ref, ids)
    runs = 1500
    counts1, counts2 = torch.zeros(vocab), torch.zeros(vocab)
    rounds = accepted = 0
    extra = {} if schedule is None else {"num_assistant_tokens_schedule": schedule}
    for seed in range(runs):
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=2, do_sample=True, top_k=0, temperature=1.0,
                              prompt_lookup_num_tokens=2, max_matching_ngram_size=2, pad_token_id=0,
                              eos_token_id=None, **extra)
        counts1[out[0, 5]] += 1
        counts2[out[0, 6]] += 1
        rounds += target.last_speculation_stats.rounds
        accepted += target.last_speculation_stats.accepted
    assert rounds >= runs and accepted > 0  # every call proposed, and some proposals were kept
    for counts, exact in ((counts1, p1), (counts2, p2)):
        tv = 0.5 * (counts / runs - exact).abs().sum().item()
        assert tv < 0.07, (schedule, tv, counts / runs, exact)


def test_the_first_round_prefills_the_prompt_alone(pair, tokenizer):
    """Speculative decoding's first call of the target carries the prompt and the first candidates. The prompt is
    prefilled alone, as plain decoding does, so the first token's logits are plain decoding's bit for bit (in one
    call of more rows they could round otherwise, and a near-tie give another first token); on this backend's
    graphs the later tokens' logits too where its verification keeps a decode step's bits."""
    _, model = pair
    inputs = tokenizer(REPETITIVE, return_tensors="pt")
    ids = inputs.input_ids
    prompt_only = model(ids, logits_to_keep=1).logits
    candidates = ids[:, -6:-2]  # proposals that the repetitive prompt makes likely
    together = model(torch.cat([ids, candidates], dim=1), logits_to_keep=candidates.shape[1] + 1)
    assert together.logits.shape[1] == candidates.shape[1] + 1
    assert torch.equal(together.logits[:, :1], prompt_only)
    assert together.past_key_values.get_seq_length() == ids.shape[1] + candidates.shape[1]
    # a 1-token prompt: the call keeps the logits of all its positions, and is split all the same
    one = model(ids[:, -5:], logits_to_keep=5).logits
    assert one.shape[1] == 5 and torch.equal(one[:, :1], model(ids[:, -5:-4], logits_to_keep=1).logits)
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    plain = model.generate(**inputs, **kwargs)
    looked_up = model.generate(**inputs, prompt_lookup_num_tokens=6, num_assistant_tokens_schedule="constant",
                               **kwargs)
    assert model.last_speculation_stats.rounds > 0
    assert torch.equal(looked_up.sequences, plain.sequences)
    assert torch.equal(looked_up.logits[0], plain.logits[0])
