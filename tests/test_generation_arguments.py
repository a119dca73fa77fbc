"""Assisted-decoding arguments honoured or refused, sequence counts, unsupported modes named, pipelines, re-export.

Expected tokens and distributions come from stock transformers on the same weights (or from the model's exact
distribution), never from the code under test.
"""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline
from transformers.generation import candidate_generator as hf_candidates

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.utils.import_utils import ipex_status
from test_universal import draft_tokenizer  # noqa: F401  (fixture: a real, different BPE tokenizer)

BACKENDS = ["auto", "torch"]


def _skip_duplicate(backend):
    if backend == "torch" and not ipex_status().available:
        pytest.skip("no IPEX in this lane: backend='auto' already is the pure-PyTorch path")


@pytest.fixture(scope="module")
def models(tiny_dir):
    path = tiny_dir("llama")
    exported = {}

    def get(backend="auto"):
        _skip_duplicate(backend)
        if backend not in exported:
            exported[backend] = IPEXModelForCausalLM.from_pretrained(path, export=True, backend=backend)
        return exported[backend]

    return AutoModelForCausalLM.from_pretrained(path).eval(), get


def _draft(target, **config):
    """Another IPEXModelForCausalLM over the target's graphs (proposes the target's tokens) with its own config."""
    draft = IPEXModelForCausalLM(target.model, target.config, backend=target.backend, dtype=target.dtype,
                                 generation_config=copy.deepcopy(target.generation_config),
                                 verify_model=target.verify_model, warmup=False)
    for name, value in config.items():
        setattr(draft.generation_config, name, value)
    return draft


IDS = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])


# ------------------------------------------------------------------------------ assisted-decoding arguments
def test_num_assistant_tokens_and_schedule_are_honoured(models):
    """Issue 12, case 4: the draft's config says 8 heuristic; the call says 1 constant: 1 proposal a round."""
    stock, get = models
    target = get()
    draft = _draft(target, num_assistant_tokens=8, num_assistant_tokens_schedule="heuristic",
                   assistant_confidence_threshold=0.0)
    expected = stock.generate(IDS, max_new_tokens=12, do_sample=False)
    got = target.generate(IDS, max_new_tokens=12, do_sample=False, assistant_model=draft, num_assistant_tokens=1,
                          num_assistant_tokens_schedule="constant")
    assert torch.equal(got, expected)
    stats = draft.last_speculation_stats
    assert stats.rounds > 0 and stats.proposed == stats.rounds  # one proposal per round
    assert draft.generation_config.num_assistant_tokens == 8  # for this call only
    assert draft.generation_config.num_assistant_tokens_schedule == "heuristic"
    # the same through a generation_config passed to the call
    config = GenerationConfig(max_new_tokens=12, do_sample=False, num_assistant_tokens=3)
    assert torch.equal(target.generate(IDS, generation_config=config, assistant_model=draft), expected)
    assert draft.last_speculation_stats.proposed <= 3 * draft.last_speculation_stats.rounds


def test_num_assistant_tokens_reaches_a_transformers_draft(models, monkeypatch):
    stock, get = models
    seen = []
    original = hf_candidates.AssistedCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.num_assistant_tokens, self.assistant_model.generation_config.num_assistant_tokens_schedule))

    monkeypatch.setattr(hf_candidates.AssistedCandidateGenerator, "__init__", spy)
    draft = copy.deepcopy(stock)
    draft.generation_config.num_assistant_tokens = 8
    expected = stock.generate(IDS, max_new_tokens=6, do_sample=False)
    got = get().generate(IDS, max_new_tokens=6, do_sample=False, assistant_model=draft, num_assistant_tokens=2,
                         num_assistant_tokens_schedule="constant")
    assert torch.equal(got, expected) and seen == [(2, "constant")]


def test_assistant_confidence_threshold_is_honoured(models):
    """A threshold of 1.0 stops every draft block after its first token (no draft is that sure); 0 never does."""
    stock, get = models
    target = get()
    draft = _draft(target, num_assistant_tokens=6, num_assistant_tokens_schedule="constant",
                   assistant_confidence_threshold=0.0)
    expected = stock.generate(IDS, max_new_tokens=12, do_sample=False)
    got = target.generate(IDS, max_new_tokens=12, do_sample=False, assistant_model=draft,
                          assistant_confidence_threshold=1.0, num_assistant_tokens_schedule="constant")
    assert torch.equal(got, expected)
    assert draft.last_speculation_stats.proposed == draft.last_speculation_stats.rounds
    got = target.generate(IDS, max_new_tokens=12, do_sample=False, assistant_model=draft,
                          num_assistant_tokens_schedule="constant")
    assert torch.equal(got, expected) and draft.last_speculation_stats.proposed > draft.last_speculation_stats.rounds


@pytest.mark.parametrize("ngram", [1, 3])
def test_prompt_lookup_arguments_are_honoured(models, ngram):
    stock, get = models
    target = get()
    ids = torch.cat([IDS, IDS, IDS[:, :2]], dim=1)  # "5 17" recurs: lookup proposes what followed it
    expected = stock.generate(ids, max_new_tokens=8, do_sample=False)
    got = target.generate(ids, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=2,
                          max_matching_ngram_size=ngram)
    assert torch.equal(got, expected)
    stats = target.last_speculation_stats
    assert stats.rounds > 0 and stats.proposed <= 2 * stats.rounds


@pytest.mark.parametrize("name", ["assistant_lookbehind", "target_lookbehind"])
def test_lookbehinds_reach_universal_generation(name, models, tokenizer, draft_tokenizer, monkeypatch):  # noqa: F811
    stock, get = models
    seen = []
    cls = hf_candidates.AssistedCandidateGeneratorDifferentTokenizers
    original = cls.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(getattr(self, name))

    monkeypatch.setattr(cls, "__init__", spy)
    draft = build_tiny("qwen2", vocab_size=len(draft_tokenizer), seed=5)
    inputs = tokenizer("def add(a, b):\n    return", return_tensors="pt")
    expected = stock.generate(**inputs, max_new_tokens=6, do_sample=False)
    got = get().generate(**inputs, max_new_tokens=6, do_sample=False, assistant_model=draft, tokenizer=tokenizer,
                         assistant_tokenizer=draft_tokenizer, **{name: 7})
    assert torch.equal(got, expected) and seen == [7]
    assert getattr(draft.generation_config, name) != 7  # for this call only


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_assistant_tokens=2), "assistant_model"),
    (dict(num_assistant_tokens=2, prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(num_assistant_tokens_schedule="fast", prompt_lookup_num_tokens=3), "num_assistant_tokens_schedule"),
    (dict(assistant_confidence_threshold=0.2), "assistant_model"),
    (dict(max_matching_ngram_size=2), "prompt_lookup_num_tokens"),
    (dict(assistant_lookbehind=3, assistant_model="draft"), "assistant_tokenizer"),
    (dict(target_lookbehind=3, assistant_model="draft"), "assistant_tokenizer"),
    (dict(prompt_lookup_num_tokens=3, assistant_model="draft"), "not both"),
    (dict(num_assistant_tokens=2, candidate_generator="user"), "candidate_generator"),
])
def test_arguments_without_their_strategy_are_refused(kwargs, message, models):
    _, get = models
    target = get()
    kwargs = dict(kwargs)
    if kwargs.get("assistant_model") == "draft":
        kwargs["assistant_model"] = _draft(target)
    if kwargs.get("candidate_generator") == "user":
        from test_custom_candidates import _Fixed

        kwargs["candidate_generator"] = _Fixed([1])
    with pytest.raises(ValueError, match=message):
        target.generate(IDS, max_new_tokens=3, **kwargs)


@pytest.mark.parametrize("name,value", [
    ("prompt_lookup_num_tokens", 0), ("prompt_lookup_num_tokens", -1), ("prompt_lookup_num_tokens", float("nan")),
    ("prompt_lookup_num_tokens", "3"), ("prompt_lookup_num_tokens", 2.5), ("prompt_lookup_num_tokens", True),
    ("max_matching_ngram_size", 0), ("max_matching_ngram_size", -1), ("max_matching_ngram_size", 2.5),
])
@pytest.mark.parametrize("where", ["keyword", "generation_config"])
def test_bad_prompt_lookup_values_are_refused_early(models, name, value, where):
    """transformers fails nine frames deep on these (or takes 0 for its default n-gram size)."""
    _, get = models
    target = get()
    settings = {"prompt_lookup_num_tokens": 3, name: value}
    kwargs = settings if where == "keyword" else {"generation_config": GenerationConfig(max_new_tokens=3, **settings)}
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        target.generate(IDS, max_new_tokens=3, **kwargs)


def test_prompt_lookup_set_on_a_generation_config_is_checked_like_the_keyword(models):
    """The model's own config or the one passed: the same strategy, the same checks, the same schedule switch."""
    stock, get = models
    target = get()
    ids = torch.cat([IDS, IDS, IDS[:, :2]], dim=1)
    expected = stock.generate(ids, max_new_tokens=8, do_sample=False)
    passed = GenerationConfig(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=2,
                              num_assistant_tokens_schedule="heuristic", pad_token_id=2)
    assert torch.equal(target.generate(ids, generation_config=passed), expected)
    assert target.last_strategy == "prompt-lookup" and target.last_cost_model is None  # the lookup's own back-off
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        target.generate(ids, generation_config=GenerationConfig(max_new_tokens=8, prompt_lookup_num_tokens=2,
                                                                num_assistant_tokens=3, pad_token_id=2))
    target.generation_config.prompt_lookup_num_tokens = 2
    try:
        got = target.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, expected) and target.last_cost_model is not None
        target.generate(ids, max_new_tokens=8, do_sample=False, num_assistant_tokens_schedule="constant")
        assert target.last_strategy == "prompt-lookup" and target.last_cost_model is None
        with pytest.raises(ValueError, match="not both"):  # transformers would silently drop the draft
            target.generate(ids, max_new_tokens=8, assistant_model=_draft(target))
        with pytest.raises(ValueError, match="batch of 2"):
            target.generate(torch.cat([ids, ids]), max_new_tokens=8)
    finally:
        target.generation_config.prompt_lookup_num_tokens = None


def test_early_exit_self_speculation_is_named(models):
    _, get = models
    with pytest.raises(ValueError, match="assistant_early_exit.*self_draft"):
        get().generate(IDS, max_new_tokens=3, assistant_early_exit=1)


def test_last_call_attributes_describe_the_last_call(models):
    """last_strategy, last_cost_model and last_speculation_stats are reset by every call of the user's, also one that
    fails or runs without speculation."""
    _, get = models
    target = get()
    ids = torch.cat([IDS, IDS, IDS[:, :2]], dim=1)
    target.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)
    assert target.last_speculation_stats is not None and target.last_cost_model is not None
    target.generate(ids, max_new_tokens=3, do_sample=False)
    assert (target.last_strategy, target.last_cost_model, target.last_speculation_stats) == (None, None, None)
    target.generate(ids, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)
    with pytest.raises(ValueError):
        target.generate(ids, max_new_tokens=3, prompt_lookup_num_tokens=0)
    assert (target.last_strategy, target.last_cost_model, target.last_speculation_stats) == (None, None, None)


# ------------------------------------------------------------------------------ sequence counts
@pytest.mark.parametrize("backend", BACKENDS)
def test_num_return_sequences_sampling(backend):
    """Issue 12, case 3: two sampled sequences from one prompt, each from the target's exact distribution."""
    _skip_duplicate(backend)
    vocab = 12
    ref = build_tiny("llama", vocab_size=vocab, seed=3)
    model = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(ref), backend=backend)
    ids = torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        exact = torch.softmax(ref(ids).logits[0, -1].float(), -1)
    counts = torch.zeros(vocab)
    runs = 300
    for seed in range(runs):
        torch.manual_seed(seed)
        out = model.generate(ids, do_sample=True, num_return_sequences=2, max_new_tokens=1, top_k=0,
                             pad_token_id=0, eos_token_id=None)
        assert out.shape == (2, 4) and torch.equal(out[:, :3], ids.repeat(2, 1))
        counts += torch.bincount(out[:, 3], minlength=vocab)
    tv = 0.5 * ((counts / counts.sum()) - exact).abs().sum().item()
    assert tv < 0.1, (tv, counts, exact)  # 600 samples over 12 outcomes: ~0.04 on average
    torch.manual_seed(0)
    longer = model.generate(ids, do_sample=True, num_return_sequences=3, max_new_tokens=5, pad_token_id=0,
                            eos_token_id=None)
    assert longer.shape == (3, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_num_return_sequences_as_transformers(backend, models):
    stock, get = models
    target = get(backend)
    try:
        expected = stock.generate(IDS, max_new_tokens=5, do_sample=False, num_return_sequences=2)
    except ValueError as exc:  # transformers refuses it: so do we, with its message
        with pytest.raises(ValueError, match="num_return_sequences"):
            target.generate(IDS, max_new_tokens=5, do_sample=False, num_return_sequences=2)
        assert "num_return_sequences" in str(exc)
        return
    assert torch.equal(target.generate(IDS, max_new_tokens=5, do_sample=False, num_return_sequences=2), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_greedy_as_transformers(backend, models, tokenizer):
    stock, get = models
    target = get(backend)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(["def add(a, b):", "Hello there, how are you today?", "x"], return_tensors="pt",
                      padding=True)
    expected = stock.generate(**batch, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(**batch, max_new_tokens=8, do_sample=False), expected)


# ------------------------------------------------------------------------------ unsupported modes, named
def test_contrastive_search_is_named(models):
    _, get = models
    with pytest.raises(ValueError, match="contrastive search"):
        get().generate(IDS, max_new_tokens=3, penalty_alpha=0.6, top_k=4)


@pytest.mark.parametrize("source", ["assistant_model", "prompt_lookup_num_tokens", "candidate_generator"])
def test_speculative_decoding_with_a_batch_is_named(source, models):
    from test_custom_candidates import _Fixed

    _, get = models
    target = get()
    value = {"assistant_model": _draft(target), "prompt_lookup_num_tokens": 3, "candidate_generator": _Fixed([1])}
    with pytest.raises(ValueError, match="speculative decoding.*batch of 2"):
        target.generate(IDS.repeat(2, 1), max_new_tokens=3, **{source: value[source]})


# ------------------------------------------------------------------------------ pipeline, re-export
def test_pipeline_accepts_the_model_silently(models, tokenizer, caplog):
    stock, get = models
    with caplog.at_level(logging.WARNING):
        generator = pipeline("text-generation", model=get(), tokenizer=tokenizer)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    text = "def add(a, b):"
    got = generator(text, max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    inputs = tokenizer(text, return_tensors="pt")
    expected = stock.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs.input_ids.shape[1]:]
    assert got == tokenizer.decode(expected, skip_special_tokens=True)


def test_exporting_the_same_object_twice_is_a_clear_error(ipex_available):
    """Issue 12, case 5: IPEX rewrites the model in place; the second export names the cause and the fix."""
    model = build_tiny("llama", vocab_size=1000)
    IPEXModelForCausalLM.from_transformers_model(model)
    with pytest.raises(ValueError, match=r"already optimized by IPEX.*copy\.deepcopy"):
        IPEXModelForCausalLM.from_transformers_model(model)
    fresh = build_tiny("llama", vocab_size=1000)
    ids = torch.tensor([[1, 2, 3]])
    expected = copy.deepcopy(fresh).generate(ids, max_new_tokens=4, do_sample=False)
    first = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(fresh))
    second = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(fresh))  # copies export as often as needed
    assert torch.equal(first.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert torch.equal(second.generate(ids, max_new_tokens=4, do_sample=False), expected)
