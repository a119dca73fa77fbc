"""Every stopping rule x every candidate source x both backends: greedy fp32 output is the target's alone.

Stopping rules: ``max_new_tokens``, ``max_length``, ``min_new_tokens``, EOS (int and list), ``stop_strings``, a user
``StoppingCriteria``, ``max_time``. Candidate sources: an IPEXModelForCausalLM draft (constant schedule, and the cost
model, whose draft holds a window of the prompt on its first rounds), a transformers draft,
``self_draft()``, prompt lookup (under the cost model and gating itself), universal assisted generation (a draft of
another tokenizer) and a user ``candidate_generator``. The stopping points are chosen from the target's own greedy
tokens so that they fall inside a draft block (the drafts over the target's weights propose exactly the target's
tokens). Expected values come from stock transformers on the same weights, never from the code under test.
"""

import copy
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.speculative.cost_model import PROBE_CONTEXT
from optimum_ipex_spec.utils.import_utils import ipex_status
from test_universal import draft_tokenizer  # noqa: F401  (fixture: a real, different BPE tokenizer)

TEXT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"
SOURCES = ["ipex-draft", "ipex-draft-cost", "hf-draft", "self-draft", "prompt-lookup", "prompt-lookup-gating",
           "universal", "user-generator"]
#: "torch-compiled": the pure-PyTorch path with torch_compile=True (fp32: decode and verification on one graph)
BACKENDS = ["auto", "torch", "torch-compiled"]


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class _TargetOracle:
    """A user candidate generator that proposes the target's own next greedy tokens (computed by stock
    transformers), ``per_round`` at a time, with no regard for budgets or stopping rules."""

    def __init__(self, stock, per_round=3):
        self.stock, self.per_round = stock, per_round

    def get_candidates(self, input_ids):
        with torch.no_grad():
            out = self.stock.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=self.per_round, eos_token_id=None, pad_token_id=0)
        return out, None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


@pytest.fixture(scope="module")
def setup(tiny_dir, tokenizer):
    path = tiny_dir("llama")
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    base = tokenizer(TEXT, return_tensors="pt").input_ids
    # the prompt holds the model's own continuation once, so that prompt lookup proposes (accepted) tokens too
    cont = stock.generate(base, attention_mask=torch.ones_like(base), max_new_tokens=12, do_sample=False)
    ids = torch.cat([cont, base], dim=1)
    assert ids.shape[1] > PROBE_CONTEXT  # so that a draft under the cost model starts on a window of the prompt
    plain = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    return {"path": path, "stock": stock, "ids": ids, "plain": plain, "targets": {}, "drafts": {}}


def _target(setup, backend):
    if backend == "torch" and not ipex_status().available:
        pytest.skip("no IPEX in this lane: backend='auto' already is the pure-PyTorch path")
    if backend not in setup["targets"]:
        compiled = backend == "torch-compiled"
        setup["targets"][backend] = IPEXModelForCausalLM.from_pretrained(
            setup["path"], export=True, backend="torch" if compiled else backend, torch_compile=compiled)
        # it compiles in every lane (before torch 2.13 on ATen's kernels only: torch 2.8's C++ GEMM template emitted
        # code that did not compile for this model)
        assert not compiled or setup["targets"][backend].runner.step is not None
    return setup["targets"][backend]


def _source_kwargs(source, setup, target, backend, tokenizer, draft_tokenizer):  # noqa: F811
    """generate() keywords that select ``source`` (drafts propose 4 tokens a round, whatever their confidence)."""
    drafts = setup["drafts"]
    if source in ("ipex-draft", "ipex-draft-cost"):  # another IPEXModelForCausalLM over the target's graphs
        draft = IPEXModelForCausalLM(target.model, target.config, backend=target.backend, dtype=target.dtype,
                                     generation_config=copy.deepcopy(target.generation_config),
                                     verify_model=target.verify_model, warmup=False)
        if source == "ipex-draft-cost":  # the cost model: the draft's cache holds a window of the (longer) prompt
            # on its first rounds, then restarts on the whole context
            return {"assistant_model": draft, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "cost"}
        return {"assistant_model": draft, "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    if source == "hf-draft":
        return {"assistant_model": AutoModelForCausalLM.from_pretrained(setup["path"]).eval(),
                "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    if source == "self-draft":
        if ("self", backend) not in drafts:
            drafts[("self", backend)] = target.self_draft(backend="torch" if backend == "torch-compiled" else backend)
        return {"assistant_model": drafts[("self", backend)]}
    if source == "prompt-lookup":  # under the cost model
        return {"prompt_lookup_num_tokens": 4}
    if source == "prompt-lookup-gating":  # the lookup's own break-even gating
        return {"prompt_lookup_num_tokens": 4, "num_assistant_tokens_schedule": "constant"}
    if source == "universal":
        if "universal" not in drafts:
            drafts["universal"] = build_tiny("qwen2", vocab_size=len(draft_tokenizer), seed=5)
        return {"assistant_model": drafts["universal"], "tokenizer": tokenizer, "assistant_tokenizer": draft_tokenizer,
                "num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0}
    return {"candidate_generator": _TargetOracle(setup["stock"])}


def _rules(setup, tokenizer):
    """Stopping rule name -> generate() keywords (greedy). Stopping points fall on the target's tokens 1-4."""
    plain, n = setup["plain"], setup["ids"].shape[1]
    return {
        "max_new_tokens=1": dict(max_new_tokens=1),
        "max_new_tokens=5": dict(max_new_tokens=5),
        "max_length": dict(max_length=n + 3),
        "eos=first-token": dict(max_new_tokens=10, eos_token_id=plain[0], pad_token_id=0),
        "eos=third-token": dict(max_new_tokens=10, eos_token_id=plain[2], pad_token_id=0),
        "eos-list": dict(max_new_tokens=10, eos_token_id=[3, plain[3]], pad_token_id=0),
        "min_new_tokens": dict(max_new_tokens=8, min_new_tokens=3, eos_token_id=plain[0], pad_token_id=0),
        "stop_strings": dict(max_new_tokens=10, stop_strings=[tokenizer.decode(plain[1])], tokenizer=tokenizer),
        "user-criteria": dict(max_new_tokens=10, stopping_criteria=StoppingCriteriaList([_StopAfter(n + 2)])),
        "max_time=60": dict(max_new_tokens=6, max_time=60.0),
    }


RULES = ["max_new_tokens=1", "max_new_tokens=5", "max_length", "eos=first-token", "eos=third-token", "eos-list",
         "min_new_tokens", "stop_strings", "user-criteria", "max_time=60"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_stopping_rule_is_lossless(source, backend, setup, tokenizer, draft_tokenizer):  # noqa: F811
    target = _target(setup, backend)
    ids = setup["ids"]
    mask = torch.ones_like(ids)
    failures = []
    for name, rule in _rules(setup, tokenizer).items():
        stock_rule = {k: v for k, v in rule.items() if k != "tokenizer"}
        if "stop_strings" in rule:
            stock_rule["tokenizer"] = tokenizer
        expected = setup["stock"].generate(ids, attention_mask=mask, do_sample=False, **stock_rule)
        kwargs = _source_kwargs(source, setup, target, backend, tokenizer, draft_tokenizer)
        if "tokenizer" in rule and "tokenizer" in kwargs:
            rule = {k: v for k, v in rule.items() if k != "tokenizer"}
        got = target.generate(ids, attention_mask=mask, do_sample=False, **rule, **kwargs)
        if got.shape != expected.shape or not torch.equal(got, expected):
            failures.append((name, got[0, ids.shape[1]:].tolist(), expected[0, ids.shape[1]:].tolist()))
    assert not failures, failures


@pytest.mark.parametrize("source", SOURCES)
def test_max_time_stops_on_a_prefix_of_plain_greedy(source, setup, tokenizer, draft_tokenizer):  # noqa: F811
    """max_time=0: plain decoding adds one token, then the time is up; so must every candidate source (transformers
    4.x's assisted loop added none when the candidate already met the time limit)."""
    target = _target(setup, "auto")
    ids = setup["ids"]
    kwargs = _source_kwargs(source, setup, target, "auto", tokenizer, draft_tokenizer)
    start = time.perf_counter()
    got = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                          max_time=0.0, **kwargs)[0, ids.shape[1]:].tolist()
    assert got == setup["plain"][:1], (got, setup["plain"])
    assert time.perf_counter() - start < 30


# ------------------------------------------------------------------------------ the five reported cases
def test_user_generator_respects_budget_and_eos(setup):
    """Issue 12, case 1: a generator proposing the target's own tokens, 2 (or 8) per round."""
    target, stock, ids = _target(setup, "auto"), setup["stock"], setup["ids"]
    mask = torch.ones_like(ids)
    plain = setup["plain"]
    for per_round in (2, 8):
        got = target.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                              candidate_generator=_TargetOracle(stock, per_round))
        assert got.shape[1] == ids.shape[1] + 1 and int(got[0, -1]) == plain[0]
    for eos_index, max_new in ((0, 20), (2, 40)):
        kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=plain[eos_index], pad_token_id=0)
        expected = stock.generate(ids, attention_mask=mask, **kw)
        got = target.generate(ids, attention_mask=mask, candidate_generator=_TargetOracle(stock, 2), **kw)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("source", ["ipex-draft", "user-generator"])
def test_stop_string_of_the_first_token(source, setup, tokenizer, draft_tokenizer):  # noqa: F811
    """Issue 12, case 2: stop_strings = the text of the first greedy token, draft blocks of 2, threshold 0."""
    target, stock, ids = _target(setup, "auto"), setup["stock"], setup["ids"]
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=8, do_sample=False, stop_strings=[tokenizer.decode(setup["plain"][0])])
    expected = stock.generate(ids, attention_mask=mask, tokenizer=tokenizer, **kw)
    extra = _source_kwargs(source, setup, target, "auto", tokenizer, draft_tokenizer)
    if source == "ipex-draft":
        extra["num_assistant_tokens"] = 2
    got = target.generate(ids, attention_mask=mask, tokenizer=tokenizer, **kw, **extra)
    assert torch.equal(got, expected) and expected.shape[1] == ids.shape[1] + 1
