"""generate(return_dict_in_generate=True) with output_hidden_states / output_attentions / output_scores / output_logits,
for every candidate source (none, a draft of ours, a transformers draft, prompt lookup, a user candidate_generator)
and backend: the tokens of stock transformers' plain greedy decoding, the structure (steps, tuple lengths, shapes) of
stock's same call, and its values within fp32 tolerance; or, where a backend cannot return a field (IPEX's fused
graph, a model with int8 weights), a ValueError from our generate() before anything runs.

Stock's same call: the stock target with a stock draft of the same weights as ours, stock's own prompt lookup, and the
same user generator handed to stock's assisted decoding. transformers splits a round's hidden states and attentions
into one entry per token (the first round's entries after its first token come from the chunk's first positions, in
4.51 and 5.x alike): the drafts here propose what stock's do (constant schedule, no confidence stop), so the rounds,
and with them those entries, are stock's.

Runs in every lane on the pure-PyTorch path (backend="torch"); the IPEX cases skip where IPEX is not usable.
"""

import copy

import pytest
import torch
from transformers.generation.candidate_generator import CandidateGenerator

from conftest import TINY_VOCAB, build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.compat import cache_kwarg
from optimum_ipex_spec.utils.import_utils import ipex_status

#: ends with the 2-gram it starts with: prompt lookup proposes in its first round (stock's and ours alike)
PROMPT = torch.tensor([[5, 17, 99, 3, 250, 7, 1234, 40000, 5, 17]])
MAX_NEW = 12
ATOL = 1e-4
SOURCES = ["plain", "draft-ours", "draft-stock", "prompt-lookup", "custom"]
FIELDS = {"output_hidden_states": "hidden_states", "output_attentions": "attentions", "output_scores": "scores",
          "output_logits": "logits"}
LAYER_FLAGS = ("output_hidden_states", "output_attentions")
DRAFT = dict(num_assistant_tokens=3, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)


class _Oracle(CandidateGenerator):
    """A stateless user generator: the next 3 tokens of ``expected`` (plain greedy decoding's sequence), the second
    one wrong at every odd length (a rejection), never past ``max_length - 1``."""

    def __init__(self, expected: torch.Tensor):
        self.expected = expected

    def get_candidates(self, input_ids, *args, **kwargs):
        start = input_ids.shape[1]
        proposal = self.expected[:, start: min(start + 3, self.expected.shape[1] - 1)].clone()
        if start % 2 and proposal.shape[1] > 1:
            proposal[0, 1] = (proposal[0, 1] + 1) % TINY_VOCAB
        return torch.cat([input_ids, proposal], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def _ipex_or_skip():
    status = ipex_status()
    if not status.available:
        pytest.skip(f"IPEX not usable in this lane: {status.reason}")


def _build(attention: str):
    """Stock transformers' tiny Llama with ``attention`` (its ``_attn_implementation``) and its plain greedy output,
    and ours on each backend (built on first use)."""
    stock = build_tiny("llama")
    stock.config._attn_implementation = attention
    plain = stock.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False)
    built = {}

    def ours(backend: str):
        if backend not in built:
            kind = "ipex" if backend == "ipex" else "torch"
            built[backend] = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(stock), backend=kind)
            assert built[backend].backend == kind
        return built[backend]

    return stock, plain, ours


@pytest.fixture(scope="module")
def models():
    """The tiny Llama with transformers' default attention (SDPA)."""
    return _build("sdpa")


@pytest.fixture(scope="module")
def eager_models():
    """The tiny Llama with eager attention (what returns attention weights in every transformers)."""
    return _build("eager")


def _stock_returns_attention_weights(stock) -> bool:
    """Whether ``stock``'s forward returns attention weights (SDPA: transformers 4.x falls back to eager attention for
    output_attentions=True, 5.x's returns none)."""
    with torch.no_grad():
        return bool(stock(PROMPT, output_attentions=True).attentions)


def _twin(model):
    """Another IPEXModelForCausalLM over the same graphs/weights (a draft that always agrees with its target)."""
    return IPEXModelForCausalLM(model.model, model.config, backend=model.backend, dtype=model.dtype,
                                generation_config=copy.deepcopy(model.generation_config),
                                verify_model=model.verify_model, warmup=False)


def _stock_draft(stock):
    draft = copy.deepcopy(stock)
    for name, value in DRAFT.items():
        setattr(draft.generation_config, name, value)
    return draft


def _generate(model, source, plain, flags, draft=None):
    """``model.generate`` of PROMPT with candidate ``source`` and ``flags``; a stock model gets the user generator
    through its ``_get_candidate_generator`` (stock's generate() has no ``candidate_generator``)."""
    kwargs = dict(max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True, **flags)
    ours = isinstance(model, IPEXModelForCausalLM)
    if source.startswith("draft"):
        kwargs["assistant_model"] = draft
        if ours:  # stock reads these from the draft's generation config; ours are passed (the cost model off)
            kwargs.update(DRAFT)
    elif source == "prompt-lookup":
        kwargs.update(prompt_lookup_num_tokens=3, max_matching_ngram_size=2)
        if ours:
            kwargs["num_assistant_tokens_schedule"] = "constant"
    elif source == "custom":
        oracle = _Oracle(plain)
        if ours:
            kwargs["candidate_generator"] = oracle
        else:
            kwargs["prompt_lookup_num_tokens"] = 1  # enters assisted decoding; the generator is the oracle
            model._get_candidate_generator = lambda **_: oracle
    try:
        with torch.no_grad():
            return model.generate(PROMPT, **kwargs)
    finally:
        if source == "custom" and not ours:
            del model._get_candidate_generator


def _structure(value):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return tuple(_structure(item) for item in value)


def _leaves(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif value is not None:
        for item in value:
            yield from _leaves(item)


def _assert_like_stock(got, want, plain, flags):
    assert torch.equal(want.sequences, plain), "stock's own call changed its tokens"
    assert torch.equal(got.sequences, plain)
    for field in FIELDS.values():
        assert _structure(getattr(got, field, None)) == _structure(getattr(want, field, None)), field
    for flag in flags:
        field = FIELDS[flag]
        leaves = list(zip(_leaves(getattr(got, field)), _leaves(getattr(want, field))))
        assert leaves or not list(_leaves(getattr(want, field))), field
        for index, (mine, theirs) in enumerate(leaves):
            torch.testing.assert_close(mine.float(), theirs.float(), atol=ATOL, rtol=ATOL,
                                       msg=lambda m: f"{field}, leaf {index}: {m}")


def _draft_for(source, target, stock):
    if source == "draft-ours":
        return _twin(target)
    if source == "draft-stock":
        return _stock_draft(stock)
    return None


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("flag", list(FIELDS))
def test_torch_backend_returns_stocks_outputs(models, source, flag):
    """With SDPA, transformers 5 returns no attention weights: plain decoding then returns stock's empty tuples,
    and speculative decoding (where stock fails with an IndexError) is refused before anything runs."""
    stock, plain, ours = models
    target = ours("torch")
    flags = {flag: True}
    if flag == "output_attentions" and source != "plain" and not _stock_returns_attention_weights(stock):
        with pytest.raises(ValueError, match=r"output_attentions=True with speculative decoding.*'sdpa' attention "
                                             r"returns no attention weights.*attn_implementation='eager'"):
            _generate(target, source, plain, flags, draft=_draft_for(source, target, stock))
        return
    got = _generate(target, source, plain, flags, draft=_draft_for(source, target, stock))
    want = _generate(stock, source, plain, flags, draft=_stock_draft(stock) if source.startswith("draft") else None)
    _assert_like_stock(got, want, plain, flags)


def test_the_compat_answer_on_attention_weights_is_this_lanes_behaviour(models, eager_models):
    from optimum_ipex_spec.compat import returns_attention_weights

    assert returns_attention_weights("sdpa") == _stock_returns_attention_weights(models[0])
    assert returns_attention_weights("eager") and _stock_returns_attention_weights(eager_models[0])


@pytest.mark.parametrize("source", SOURCES)
def test_eager_attention_returns_stocks_attentions(eager_models, source):
    """A model with eager attention returns attention weights in every lane, with every candidate source."""
    stock, plain, ours = eager_models
    target = ours("torch")
    flags = {"output_attentions": True}
    got = _generate(target, source, plain, flags, draft=_draft_for(source, target, stock))
    want = _generate(stock, source, plain, flags, draft=_stock_draft(stock) if source.startswith("draft") else None)
    _assert_like_stock(got, want, plain, flags)
    assert len(got.attentions) == MAX_NEW and all(len(step) == stock.config.num_hidden_layers
                                                  for step in got.attentions)


@pytest.mark.parametrize("source", ["plain", "draft-ours", "prompt-lookup"])
def test_every_field_at_once_and_the_next_call_plain(eager_models, source):
    """All four fields in one call, then a call without them on the same model: its preallocated cache again, the
    tokens unchanged."""
    stock, plain, ours = eager_models
    target = ours("torch")
    flags = dict.fromkeys(FIELDS, True)
    got = _generate(target, source, plain, flags, draft=_draft_for(source, target, stock))
    want = _generate(stock, source, plain, flags, draft=_stock_draft(stock) if source.startswith("draft") else None)
    _assert_like_stock(got, want, plain, flags)
    again = _generate(target, source, plain, {}, draft=_draft_for(source, target, stock))
    assert torch.equal(again.sequences, plain)
    assert again.hidden_states is None and again.attentions is None


@pytest.mark.parametrize("backend", ["torch", "ipex"])
def test_our_draft_inside_a_stock_target_with_layer_outputs(eager_models, backend):
    """A stock target asks for hidden states and attentions; transformers hands its generation config, flags included,
    to the draft's own generate(): ours drafts without them (nobody reads a draft's), on IPEX too."""
    stock, plain, ours = eager_models
    if backend == "ipex":
        _ipex_or_skip()
    flags = dict.fromkeys(LAYER_FLAGS, True)
    draft = _twin(ours(backend))
    for name, value in DRAFT.items():
        setattr(draft.generation_config, name, value)
    got = _generate(stock, "draft-ours", plain, flags, draft=draft)
    want = _generate(stock, "draft-stock", plain, flags, draft=_stock_draft(stock))
    _assert_like_stock(got, want, plain, flags)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("flag", ["output_scores", "output_logits"])
def test_ipex_backend_returns_scores_and_logits(models, source, flag):
    _ipex_or_skip()
    stock, plain, ours = models
    target = ours("ipex")
    flags = {flag: True}
    got = _generate(target, source, plain, flags, draft=_draft_for(source, target, stock))
    want = _generate(stock, source, plain, flags, draft=_stock_draft(stock) if source.startswith("draft") else None)
    _assert_like_stock(got, want, plain, flags)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("flag", LAYER_FLAGS)
def test_ipex_backend_refuses_layer_outputs_before_generating(models, source, flag, monkeypatch):
    _ipex_or_skip()
    stock, plain, ours = models
    target = ours("ipex")
    draft = _draft_for(source, target, stock)
    runner = target.runner
    monkeypatch.setattr(runner, "forward", _fail_forward)
    with pytest.raises(ValueError, match=rf"{flag}=True is not available on the IPEX backend.*backend='torch'"):
        _generate(target, source, plain, {flag: True}, draft=draft)
    # set on the generation config instead of passed: refused the same way
    monkeypatch.setattr(target, "generation_config", copy.deepcopy(target.generation_config))
    setattr(target.generation_config, flag, True)
    with pytest.raises(ValueError, match=rf"{flag}=True is not available on the IPEX backend"):
        _generate(target, source, plain, {}, draft=draft)


def _fail_forward(*args, **kwargs):
    raise AssertionError("generate() ran the model before refusing")


def test_int8_weights_refuse_layer_outputs_before_generating():
    """A model with int8 weights has no transformers forward to return them: refused up front, naming the fix; as a
    draft (our generator drives its forward, which needs none of them) it serves a target that asks for them."""
    stock = build_tiny("llama")
    plain = stock.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False)
    int8 = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(stock).to(torch.bfloat16), dtype=torch.bfloat16,
                                                        backend="torch", weights="int8")
    for flag in LAYER_FLAGS:
        with pytest.raises(ValueError, match=rf"{flag}=True needs transformers' own forward.*weights='dense'"):
            int8.generate(PROMPT, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True,
                          **{flag: True})
    stock.config._attn_implementation = "eager"  # attention weights in every lane
    target = IPEXModelForCausalLM.from_transformers_model(copy.deepcopy(stock), backend="torch")
    flags = dict.fromkeys(LAYER_FLAGS, True)
    got = _generate(target, "draft-ours", plain, flags, draft=int8)
    want = _generate(stock, "plain", plain, flags)
    assert torch.equal(got.sequences, plain)
    for field in ("hidden_states", "attentions"):
        assert [len(step) for step in getattr(got, field)] == [len(step) for step in getattr(want, field)]
        assert _structure(getattr(got, field)) == _structure(getattr(want, field))


def test_our_preallocated_cache_never_meets_transformers_forward(models):
    """Hidden states / attentions / a loss run transformers' own forward: with no cache it returns stock's values and
    its own DynamicCache; with our PreallocatedKVCache (empty or filled), passed to forward() or generate(), it is a
    ValueError naming the argument and the fix, not a silently wrong result."""
    stock, plain, ours = models
    model = ours("torch")
    ids = PROMPT
    with torch.no_grad():
        got = model(ids, output_hidden_states=True, output_attentions=True)
        want = stock(ids, output_hidden_states=True, output_attentions=True)
        for field in ("hidden_states", "attentions"):
            assert _structure(getattr(got, field)) == _structure(getattr(want, field))
            for mine, theirs in zip(_leaves(getattr(got, field)), _leaves(getattr(want, field))):
                torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=ATOL)
        nxt = torch.tensor([[42]])
        cache = cache_kwarg()  # past_key_values; cache in transformers 5
        step = model(nxt, output_hidden_states=True, **{cache: getattr(got, cache)})
        reference = stock(nxt, output_hidden_states=True, **{cache: getattr(want, cache)})
        torch.testing.assert_close(step.hidden_states[-1], reference.hidden_states[-1], atol=ATOL, rtol=ATOL)
        for ours_cache in (model.new_cache(1, 64), getattr(model(ids), cache)):
            for arguments in ({"output_hidden_states": True}, {"output_attentions": True}, {"labels": nxt}):
                name = next(iter(arguments))
                with pytest.raises(ValueError, match=rf"{name}.*PreallocatedKVCache.*DynamicCache"):
                    model(nxt, **{cache: ours_cache}, **arguments)
    with pytest.raises(ValueError, match=r"output_hidden_states.*PreallocatedKVCache.*DynamicCache"):
        model.generate(PROMPT, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                       output_hidden_states=True, **{cache_kwarg(): model.new_cache(1, 64)})
