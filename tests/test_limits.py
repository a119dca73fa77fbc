"""Limits checked before any work (issue 46, item 6): the model's positions, and a KV cache sized by what is
generated rather than by ``max_new_tokens``.

* A prompt that leaves no position for a new token is refused before any forward, on every backend and strategy.
* A request past the positions (prompt + ``max_new_tokens``, or ``max_length``) stops at them with one warning and
  returns the target's own tokens up to there, as stock transformers does with ``max_length`` there.
* The pure-PyTorch path's ``PreallocatedKVCache`` starts at the prompt and grows with the tokens: a 5-token answer
  holds the same bytes whether ``max_new_tokens`` was 16 or 4,000,000; growing inside a generation changes no bit
  of the output, with or without speculative decoding.
"""

import copy
import inspect
import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, StoppingCriteria, StoppingCriteriaList

from conftest import FixedProposals, build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch.cache import GROWTH_ROWS, PreallocatedKVCache
from optimum_ipex_spec.utils.import_utils import ipex_status

POSITIONS = 64
VOCAB = 512
BACKENDS = ["torch", "eager"] + (["ipex"] if ipex_status().available else [])
STRATEGIES = ["plain", "draft", "prompt lookup", "candidate generator"]


def _tiny(kind: str, positions: int = POSITIONS, seed: int = 0):
    """A tiny seeded transformers model with ``positions`` positions: a Llama ("torch", "ipex": our decoder / IPEX's
    graphs) or a GPT-2 ("eager": transformers' own forward; its learned position table has ``positions`` rows)."""
    if kind == "eager":
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=positions,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=2))
        model.config.architectures = [type(model).__name__]
        model.generation_config.pad_token_id = 2
        return model.eval()
    model = build_tiny("llama", seed=seed, vocab_size=VOCAB)
    model.config.max_position_embeddings = positions  # default rope: its tables do not depend on it (IPEX's do)
    return model


_MODELS = {}


def _ours(kind: str, seed: int = 0) -> IPEXModelForCausalLM:
    """One export per (kind, seed) for the module."""
    if (kind, seed) not in _MODELS:
        backend = "ipex" if kind == "ipex" else "torch"
        _MODELS[kind, seed] = IPEXModelForCausalLM.from_transformers_model(_tiny(kind, seed=seed), backend=backend)
    return _MODELS[kind, seed]


def _strategy(name: str, kind: str) -> dict:
    if name == "draft":
        draft = _ours(kind, seed=1)
        draft.generation_config.num_assistant_tokens = 5
        draft.generation_config.assistant_confidence_threshold = 0.0  # a random model is never confident
        return dict(assistant_model=draft)
    if name == "prompt lookup":
        return dict(prompt_lookup_num_tokens=3)
    if name == "candidate generator":
        return dict(candidate_generator=FixedProposals([7, 8, 9, 10]))
    return {}


def _prompt(tokens: int, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(3, VOCAB, (1, tokens))


def _our_warnings(caplog):
    return [r for r in caplog.records if r.name == "optimum_ipex_spec" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("prompt_tokens", [POSITIONS, POSITIONS + 6])
def test_a_prompt_past_the_positions_is_refused_before_any_forward(kind, strategy, prompt_tokens, monkeypatch):
    model = _ours(kind)
    calls = []
    forward = model.runner.forward
    monkeypatch.setattr(model.runner, "forward", lambda *args: calls.append(1) or forward(*args))
    ids = _prompt(prompt_tokens)
    with pytest.raises(ValueError) as error:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                       **_strategy(strategy, kind))
    message = str(error.value)
    assert f"the prompt has {prompt_tokens} tokens" in message and f"max_position_embeddings={POSITIONS}" in message
    assert f"at most {POSITIONS - 1} tokens" in message  # the fix, with the number
    assert calls == [], "the prompt reached the forward before it was refused"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("request_", ["max_new_tokens", "max_length"])
def test_a_request_past_the_positions_stops_there_with_one_warning(kind, strategy, request_, caplog):
    """40 prompt tokens and 100 new ones asked of a 64-position model: 24 new tokens, the target's own (and stock
    transformers' with max_new_tokens=24), one warning naming the numbers. Before, the IPEX graph raised at the 64th
    position (every token discarded), and the pure-PyTorch path went on past its positions."""
    model = _ours(kind)
    ids = _prompt(40)
    common = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    room = POSITIONS - ids.shape[1]
    want = _tiny(kind).generate(ids, max_new_tokens=room, min_new_tokens=room, **common)
    assert want.shape[1] == POSITIONS
    assert torch.equal(model.generate(ids, max_new_tokens=room, min_new_tokens=room, **common), want)
    asked = dict(max_new_tokens=100, min_new_tokens=100) if request_ == "max_new_tokens" else dict(max_length=140,
                                                                                                   min_length=140)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        got = model.generate(ids, **asked, **_strategy(strategy, kind), **common)
    assert torch.equal(got, want)
    warnings = _our_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert f"{request_}={asked[request_]}" in text and f"{POSITIONS} positions" in text
    assert f"at most {room} new" in text


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_request_within_the_positions_is_left_alone(kind, caplog):
    model = _ours(kind)
    ids = _prompt(40)
    with caplog.at_level(logging.WARNING):
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=POSITIONS - 40,
                             min_new_tokens=POSITIONS - 40, do_sample=False)
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False)  # transformers' default length
    assert got.shape[1] == POSITIONS and not _our_warnings(caplog)


class _StopAfter(StoppingCriteria):
    """Stops every sequence once it holds ``length`` tokens: a short answer whatever max_new_tokens allows."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.fixture
def cache_bytes(monkeypatch):
    """Records every PreallocatedKVCache made while a test runs (refusing, before it allocates, one of a million rows
    or more); ``bytes()`` sums their buffers' storage (the last state: a cache only grows)."""
    made = []
    init = PreallocatedKVCache.__init__
    signature = inspect.signature(init)

    def recording_init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        capacity = bound.arguments["capacity"]
        assert capacity < 1_000_000, f"a KV cache of {capacity} rows was allocated up front"
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(PreallocatedKVCache, "__init__", recording_init)

    class Recorder:
        @staticmethod
        def bytes() -> int:
            return sum(t.untyped_storage().nbytes() for cache in made for t in cache.keys + cache.values)

        @staticmethod
        def capacities() -> list:
            return [cache.capacity for cache in made]

        @staticmethod
        def clear() -> None:
            made.clear()

    return Recorder


@pytest.mark.parametrize("strategy", ["plain", "draft", "prompt lookup"])
def test_a_short_answer_holds_the_same_cache_memory_whatever_max_new_tokens(strategy, cache_bytes):
    """A 5-token answer (a stopping criterion ends it) on the pure-PyTorch path: the caches' bytes are the same for
    max_new_tokens=16 and 4,000,000 (before, the cache was allocated for prompt + max_new_tokens up front)."""
    model = IPEXModelForCausalLM.from_transformers_model(_tiny("torch", positions=1 << 23), backend="torch")
    kwargs = _strategy(strategy, "torch") if strategy != "draft" else {}
    if strategy == "draft":
        kwargs["assistant_model"] = IPEXModelForCausalLM.from_transformers_model(
            _tiny("torch", positions=1 << 23, seed=1), backend="torch")
        kwargs["assistant_model"].generation_config.assistant_confidence_threshold = 0.0
    ids = _prompt(20)
    held = {}
    outputs = {}
    for max_new_tokens in (16, 4_000_000):
        cache_bytes.clear()
        outputs[max_new_tokens] = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            stopping_criteria=StoppingCriteriaList([_StopAfter(ids.shape[1] + 5)]), **kwargs)
        held[max_new_tokens] = cache_bytes.bytes()
    assert outputs[16].shape[1] == ids.shape[1] + 5 and torch.equal(outputs[16], outputs[4_000_000])
    assert held[16] == held[4_000_000], held
    if strategy != "draft":  # the target's cache alone: the prompt and GROWTH_ROWS rows
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        row = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # keys and values, fp32
        assert held[16] == (ids.shape[1] + GROWTH_ROWS) * row


@pytest.mark.parametrize("prompt_tokens", [20, 300])
def test_a_cache_that_grows_inside_a_generation_changes_no_bit(prompt_tokens, monkeypatch):
    """The cache grows at other calls in plain decoding than in speculative decoding (a verification chunk reserves
    several rows at once). Under every strategy the logits of every generated token are the bits of the same
    strategy on a cache allocated whole up front (the decoder reads the filled rows, whatever the capacity), and the
    tokens stock transformers'."""
    from optimum_ipex_spec.backends.pytorch import runner as torch_decoder

    stock = _tiny("torch", positions=4096)
    model = IPEXModelForCausalLM.from_transformers_model(_tiny("torch", positions=4096), backend="torch")
    draft = IPEXModelForCausalLM.from_transformers_model(_tiny("torch", positions=4096, seed=1), backend="torch")
    draft.generation_config.num_assistant_tokens = 5
    draft.generation_config.assistant_confidence_threshold = 0.0
    grown = []
    reserve = PreallocatedKVCache.reserve

    def recording_reserve(cache, total):
        before = cache.capacity
        reserve(cache, total)
        if cache.capacity != before:
            grown.append((before, cache.capacity))

    monkeypatch.setattr(PreallocatedKVCache, "reserve", recording_reserve)
    ids = _prompt(prompt_tokens)
    new = 3 * GROWTH_ROWS + 5  # past two growths: + GROWTH_ROWS, then + 2 * GROWTH_ROWS rows
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  return_dict_in_generate=True, output_logits=True)
    want = stock.generate(ids, max_new_tokens=new, min_new_tokens=new, attention_mask=torch.ones_like(ids),
                          do_sample=False)
    # constant schedules: the same calls in both runs (the cost model's lengths follow measured times)
    strategies = {"plain": {}, "candidate generator": dict(candidate_generator=FixedProposals([7, 8, 9])),
                  "draft": dict(assistant_model=draft, num_assistant_tokens_schedule="constant"),
                  "prompt lookup": dict(prompt_lookup_num_tokens=3, num_assistant_tokens_schedule="constant")}
    growing = {}
    for name, strategy in strategies.items():
        grown.clear()
        growing[name] = model.generate(ids, **strategy, **kwargs)
        assert torch.equal(growing[name].sequences, want), name
        if name == "plain":
            # + GROWTH_ROWS, then + 2 * GROWTH_ROWS but no further than the most rows the generation can hold
            assert grown[:2] == [(prompt_tokens + GROWTH_ROWS, prompt_tokens + 2 * GROWTH_ROWS),
                                 (prompt_tokens + 2 * GROWTH_ROWS, prompt_tokens + new - 1)], grown
    monkeypatch.setattr(torch_decoder, "first_capacity", lambda prompt: 4096)  # the whole generation at once
    for name, strategy in strategies.items():
        grown.clear()
        whole = model.generate(ids, **strategy, **kwargs)
        assert not [g for g in grown if g[0] == 4096], "the target's cache grew"
        differ = [i for i, (a, b) in enumerate(zip(growing[name].logits, whole.logits)) if not torch.equal(a, b)]
        assert not differ, f"{name}: the logits of generated tokens {differ} changed with the cache's growth"


def test_the_cache_grows_by_growing_steps_up_to_its_limit():
    cache = PreallocatedKVCache(num_layers=1, batch_size=1, kv_heads=1, head_dim=2, capacity=10, growth_rows=4,
                                growth_limit=30)
    key = torch.arange(20.0).view(1, 1, 10, 2)
    cache.write(0, key, -key)
    cache.advance(10)
    capacities = []
    for total in (11, 15, 23, 31, 32):
        cache.reserve(total)
        capacities.append(cache.capacity)
    # + 4, + 8, then the limit (30); past it (a cache continued by a later call) + 32 again, not a row at a time
    assert capacities == [14, 22, 30, 62, 62]
    cache.reserve(200)  # a reserve of more than a growth (+ 64 now) gets what it asks
    assert cache.capacity == 200
    assert torch.equal(cache.keys[0][:, :, :10], key) and torch.equal(cache.values[0][:, :, :10], -key)
    doubling = PreallocatedKVCache(num_layers=1, batch_size=1, kv_heads=1, head_dim=2, capacity=8)
    for total, capacity in ((9, 16), (17, 32), (100, 100)):
        doubling.reserve(total)
        assert doubling.capacity == capacity


def test_a_compiled_fp32_target_starts_a_long_generation_small_and_stays_exact(cache_bytes):
    """The exact fp32 compiled step (attention reads whole blocks of 512 rows past a capacity of 513): a request of
    4,000,000 new tokens starts its cache just past that capacity (not 4,000,000 rows) and grows it as the tokens
    come; plain decoding, a draft, prompt lookup and a candidate generator give every generated token the same logits
    bit for bit, and stock transformers' tokens."""
    from optimum_ipex_spec.backends.pytorch import compiled_step

    stock = _tiny("torch", positions=1 << 23)
    target = IPEXModelForCausalLM.from_transformers_model(_tiny("torch", positions=1 << 23), backend="torch",
                                                          torch_compile=True)
    if target.runner.step is None or not target.runner.step.exact:
        pytest.skip("the compiled step did not compile here (logged)")
    draft = IPEXModelForCausalLM.from_transformers_model(_tiny("torch", positions=1 << 23, seed=1), backend="torch")
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0
    block = compiled_step.ATTENTION_BLOCK
    for prompt_tokens, new in ((12, 5), (block - 12, 24)):  # the second one grows past the first block
        ids = _prompt(prompt_tokens)
        stop = StoppingCriteriaList([_StopAfter(prompt_tokens + new)])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4_000_000, do_sample=False,
                      stopping_criteria=stop, return_dict_in_generate=True, output_logits=True)
        want = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        cache_bytes.clear()
        plain = target.generate(ids, **kwargs)
        assert torch.equal(plain.sequences, want)
        # past a capacity of block + 1 rows from the start (whole blocks from the first call), then whole blocks
        first = max(prompt_tokens + GROWTH_ROWS, block + 2)
        assert cache_bytes.capacities() == [first if prompt_tokens + new < block else 2 * block + 1]
        for name, strategy in {"draft": dict(assistant_model=draft, num_assistant_tokens_schedule="constant"),
                               "prompt lookup": dict(prompt_lookup_num_tokens=3,
                                                     num_assistant_tokens_schedule="constant"),
                               "candidate generator": dict(candidate_generator=FixedProposals([7, 8, 9]))}.items():
            got = target.generate(ids, **strategy, **kwargs)
            assert torch.equal(got.sequences, want), name
            differ = [i for i, (a, b) in enumerate(zip(got.logits, plain.logits)) if not torch.equal(a, b)]
            assert not differ, f"{name}: the logits of generated tokens {differ} differ from plain decoding's"


def test_a_scaled_rotary_embedding_lifts_the_limit_except_where_the_tables_end():
    """With rope_scaling (dynamic NTK, YaRN, ...) transformers' rotary embedding computes positions past
    max_position_embeddings: the pure-PyTorch path generates past it as stock does; IPEX's rotary tables end there."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from optimum_ipex_spec.limits import max_positions

    scaled = LlamaConfig(max_position_embeddings=POSITIONS, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert max_positions(LlamaConfig(max_position_embeddings=POSITIONS)) == POSITIONS
    assert max_positions(scaled) is None and max_positions(scaled, fixed_rotary_tables=True) == POSITIONS
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        architectures=["LlamaForCausalLM"])).eval()
    ours = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(stock), backend="torch")
    ids = torch.arange(70).remainder(VOCAB - 3).add(3).unsqueeze(0)  # a prompt longer than the positions
    want = stock.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    assert want.shape[1] == 76
    assert torch.equal(ours.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids)),
                       want)
