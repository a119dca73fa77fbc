"""Field reports, third round (issue 46): what a call may pass, refused by name before any work; seeded sampling
reproducible with the cost model on; per-call draft arguments that never reach a shared draft's state.

Expected tokens come from stock transformers on the same weights, never from the code under test.
"""

import copy
import random
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

from conftest import build_tiny
from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.speculative import cost_model as cost_model_module
from test_universal import draft_tokenizer  # noqa: F401  (fixture: a real, different BPE tokenizer)

IDS = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])


@pytest.fixture(scope="module")
def models(tiny_dir):
    """(stock, {backend: our export}) of the tiny Llama; "torch" only where IPEX makes "auto" another path."""
    from optimum_ipex_spec.utils.import_utils import ipex_status

    path = tiny_dir("llama")
    backends = ["auto", "torch"] if ipex_status().available else ["auto"]
    return (AutoModelForCausalLM.from_pretrained(path).eval(),
            {backend: IPEXModelForCausalLM.from_pretrained(path, export=True, backend=backend) for backend in backends})


def _each_backend(models):
    return list(models[1].items())


def _twin(target):
    """Another model of ours over the target's weights (graphs): a draft of the same tokenizer."""
    return IPEXModelForCausalLM(target.model, target.config, backend=target.backend, dtype=target.dtype,
                                generation_config=copy.deepcopy(target.generation_config),
                                verify_model=target.verify_model, warmup=False)


# ------------------------------------------------------------------------------ drafts that cannot be drafts
def test_encoder_decoder_draft_is_refused(models):
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=49152, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                             decoder_start_token_id=0)).eval()
    for _, target in _each_backend(models):
        with pytest.raises(ValueError, match="encoder-decoder"):
            target.generate(IDS, max_new_tokens=6, do_sample=False, assistant_model=t5)


@pytest.mark.parametrize("assistant", ["some string", 3, object()])
def test_non_model_assistant_is_refused(models, assistant):
    for _, target in _each_backend(models):
        with pytest.raises(TypeError, match="assistant_model must be a causal language model"):
            target.generate(IDS, max_new_tokens=6, do_sample=False, assistant_model=assistant)


# ------------------------------------------------------------------------------ a user's candidate generator
class _Returns:
    """A user generator returning ``make(input_ids)``."""

    def __init__(self, make):
        self.make = make

    def get_candidates(self, input_ids):
        return self.make(input_ids)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def _rewrite_last_prompt_token(ids):
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 100
    return torch.cat([changed, torch.tensor([[11, 12]])], dim=1), None


@pytest.mark.parametrize("make, error, match", [
    (_rewrite_last_prompt_token, ValueError, "changed the context it was given: at position 7"),
    (lambda ids: (ids[:, :-2], None), ValueError, "shape"),
    (lambda ids: (torch.cat([ids, torch.tensor([[3]])], 1)[0], None), ValueError, "shape"),
    (lambda ids: (torch.cat([ids, torch.tensor([[3]])], 1).float(), None), ValueError, "float32"),
    (lambda ids: (torch.cat([ids, torch.tensor([[10 ** 6]])], 1), None), ValueError, "outside the target's vocab"),
    (lambda ids: (torch.cat([ids, torch.tensor([[3, 4]])], 1), torch.zeros(1, 3, 8)), ValueError, "logits"),
    (lambda ids: torch.cat([ids, torch.tensor([[3]])], 1), ValueError, "must return a pair"),
])
def test_malformed_candidates_are_refused(models, make, error, match):
    for _, target in _each_backend(models):
        with pytest.raises(error, match=match):
            target.generate(IDS, max_new_tokens=8, do_sample=False, candidate_generator=_Returns(make))


def test_well_formed_candidates_stay_lossless(models):
    stock = models[0]
    expected = stock.generate(IDS, max_new_tokens=10, do_sample=False)
    for _, target in _each_backend(models):
        good = _Returns(lambda ids: (torch.cat([ids, torch.tensor([[3, 4, 5]])], 1), None))
        assert torch.equal(target.generate(IDS, max_new_tokens=10, do_sample=False, candidate_generator=good),
                           expected)


# ------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize("ids, error, match", [
    (torch.tensor([[1, 2, 49152]]), ValueError, r"token ids must be in \[0, 49152\)"),
    (torch.tensor([[1, -1, 3]]), ValueError, "token ids must be in"),
    (torch.tensor([[1, 2, 3]], dtype=torch.uint8), TypeError, "uint8: convert them with input_ids.long()"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer token ids"),
    (torch.tensor([[True, False]]), TypeError, "integer token ids"),
])
def test_bad_ids_are_refused_by_name_on_every_backend(models, ids, error, match):
    for backend, target in _each_backend(models):
        with pytest.raises(error, match=match):
            target.generate(ids, max_new_tokens=3, do_sample=False)
        with pytest.raises(error, match=match):
            target(ids)


def test_bad_ids_are_refused_on_the_compiled_and_eager_paths(tiny_dir):
    """Our decoder and transformers' forward (an architecture outside our decoder: GPT-2) name the problem."""
    models = [IPEXModelForCausalLM.from_transformers_model(build_tiny("gpt2"), backend="torch")]
    try:
        models.append(IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch",
                                                           torch_compile=True))
    except ValueError as exc:  # a torch too old for the compiled step says so; the eager paths are still checked
        assert "torch" in str(exc)
    for model in models:
        with pytest.raises(ValueError, match="token ids must be in"):
            model.generate(torch.tensor([[1, 2, 10 ** 6]]), max_new_tokens=2, do_sample=False)
        with pytest.raises(ValueError, match="token ids must be in"):
            model(torch.tensor([[1, 2, 10 ** 6]]))


# ------------------------------------------------------------------------------ from_pretrained's keywords
def test_misspelled_from_pretrained_keyword_is_named(tiny_dir):
    with pytest.raises(TypeError, match=r"'torch_dtyp' \(did you mean 'torch_dtype'\?\)"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, torch_dtyp=torch.bfloat16)
    with pytest.raises(TypeError, match="'not_a_keyword'"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, not_a_keyword=1)
    with pytest.raises(TypeError, match="not both"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, dtype="float32", torch_dtype="float32")


@pytest.mark.parametrize("device_map", ["cuda", "auto", {"": "cuda:0"}, 0])
def test_device_map_off_the_cpu_is_refused(tiny_dir, device_map):
    with pytest.raises(ValueError, match="CPU only"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, device_map=device_map)


def test_cpu_device_map_and_dtype_keyword_are_honoured(tiny_dir):
    model = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, device_map="cpu",
                                                 dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ seeded sampling
@pytest.fixture
def jittery_clock(monkeypatch):
    """The cost model's clock with noise (another job on the machine), drawn from a generator of its own: round
    times then differ from call to call as they do on a loaded machine, and the torch RNG is not touched."""
    noise = random.Random()
    real = cost_model_module.time.perf_counter

    def clock():
        return real() + noise.uniform(0.0, 0.05)

    monkeypatch.setattr(cost_model_module.time, "perf_counter", clock)
    # speculate_by_cost took the clock as a default argument when it was defined: give it the jittery one
    monkeypatch.setattr(cost_model_module.speculate_by_cost, "__defaults__", (clock,))


def _sampling_sources(target, stock, tokenizer, draft_tokenizer):  # noqa: F811
    draft_of_other_vocab = build_tiny("qwen2", vocab_size=len(draft_tokenizer), seed=5)
    return {
        "our draft": dict(assistant_model=_twin(target)),
        "transformers draft": dict(assistant_model=build_tiny("llama", seed=1)),
        "prompt lookup": dict(prompt_lookup_num_tokens=4),
        "universal": dict(assistant_model=draft_of_other_vocab, tokenizer=tokenizer,
                          assistant_tokenizer=draft_tokenizer),
    }


@pytest.mark.parametrize("source", ["our draft", "transformers draft", "prompt lookup", "universal"])
def test_the_same_seed_gives_the_same_output_with_the_cost_model(models, source, jittery_clock, tokenizer,
                                                                 draft_tokenizer):  # noqa: F811
    """Issue 46 case 2: manual_seed then generate(do_sample=True, ...) 20 times, on a machine whose round times
    vary: one output. The draft length (chosen by the cost model, the default schedule) decides how many random
    numbers a round draws."""
    ids = torch.tensor([tokenizer("def fib(n):\n    if n < 2:\n        return n\n    return fib(n")["input_ids"]])
    for backend, target in _each_backend(models):
        kwargs = _sampling_sources(target, models[0], tokenizer, draft_tokenizer)[source]
        if source == "prompt lookup":  # a vocabulary of 64: sampled tokens recur in the context, so lookups match
            target = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=64), backend=backend)
            ids = torch.arange(40).remainder(7).unsqueeze(0)
        outputs = []
        for _ in range(20):
            torch.manual_seed(0)
            outputs.append(target.generate(ids, max_new_tokens=24, do_sample=True, top_k=50, **kwargs))
            assert target.last_cost_model is not None, "the cost model chose the lengths"
        assert all(torch.equal(out, outputs[0]) for out in outputs), (backend, [o[0, ids.shape[1]:] for o in outputs])


# ------------------------------------------------------------------------------ per-call arguments, shared draft
@pytest.mark.parametrize("kind", ["ours", "transformers"])
def test_per_call_draft_arguments_stay_in_their_call_across_threads(models, kind):
    """Issue 46 case 5: two threads share one draft, each passing its own num_assistant_tokens; the draft's config
    is never written, each call sees its own value, and both outputs are the target's."""
    stock, by_backend = models
    expected = stock.generate(IDS, max_new_tokens=16, do_sample=False)
    for _, target in by_backend.items():
        draft = _twin(target) if kind == "ours" else build_tiny("llama", seed=0)
        draft.generation_config.num_assistant_tokens = 5
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        seen, errors, results = {}, [], {}
        barrier = threading.Barrier(2)

        def run(tokens):
            try:
                barrier.wait()
                for _ in range(5):
                    results.setdefault(tokens, []).append(target.generate(
                        IDS, max_new_tokens=16, do_sample=False, assistant_model=draft, num_assistant_tokens=tokens,
                        num_assistant_tokens_schedule="constant"))
                    seen.setdefault(tokens, set()).add(draft.generation_config.num_assistant_tokens)
            except Exception as exc:  # reported below, with the thread's value
                errors.append((tokens, exc))

        threads = [threading.Thread(target=run, args=(n,)) for n in (1, 3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert draft.generation_config.num_assistant_tokens == 5  # the shared draft's own value, untouched
        assert seen == {1: {5}, 3: {5}}  # outside a call the draft shows its own config
        for outputs in results.values():
            assert len(outputs) == 5 and all(torch.equal(out, expected) for out in outputs)


def test_per_call_draft_arguments_reach_the_call(models):
    """Each call's own value is what its rounds propose (ours: counted by the draft's stats)."""
    stock, by_backend = models
    expected = stock.generate(IDS, max_new_tokens=16, do_sample=False)
    for _, target in by_backend.items():
        draft = _twin(target)
        draft.generation_config.num_assistant_tokens = 5
        for tokens in (1, 2):
            got = target.generate(IDS, max_new_tokens=16, do_sample=False, assistant_model=draft,
                                  num_assistant_tokens=tokens, num_assistant_tokens_schedule="constant",
                                  assistant_confidence_threshold=0.0)
            assert torch.equal(got, expected)
            stats = draft.last_speculation_stats
            assert stats.rounds > 0 and stats.proposed <= tokens * stats.rounds
            assert stats.proposed > (tokens - 1) * stats.rounds


def test_reset_sampling_times_measures_again(models):
    """The times a sampling call decides on are measured by the first sampling call with a draft, kept, and measured
    again after reset_sampling_times()."""
    for _, target in _each_backend(models):
        target.reset_sampling_times()
        draft = _twin(target)
        kwargs = dict(max_new_tokens=16, do_sample=True, top_k=50, assistant_model=draft)
        target.generate(IDS, **kwargs)
        assert target.last_cost_model.times is None and target.last_cost_model.times_frozen  # measured, then frozen
        target.generate(IDS, **kwargs)
        assert target.last_cost_model.times is not None  # decided on the kept times from its first round
        target.reset_sampling_times()
        target.generate(IDS, **kwargs)
        assert target.last_cost_model.times is None
