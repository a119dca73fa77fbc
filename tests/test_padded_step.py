"""The IPEX runner's padded decode step and short chunks (a step or chunk of fewer than ``IPEXGraphRunner.step_rows``
tokens run on the verify graph with its last token repeated up to that many rows): exact against stock transformers
whichever way a step runs, and chosen by timing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.ipex import runner as ipex_graphs

ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def exported(tiny_dir):
    from optimum_ipex_spec.utils.import_utils import ipex_status

    if not ipex_status().available:
        pytest.skip(f"IPEX not usable in this lane: {ipex_status().reason} (the padded step is the IPEX runner's)")
    models = {}

    def get(arch):
        if arch not in models:
            path = tiny_dir(arch)
            models[arch] = (AutoModelForCausalLM.from_pretrained(path).eval(),
                            IPEXModelForCausalLM.from_pretrained(path, export=True, torch_dtype=torch.float32))
        return models[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rows", [1, 2, ipex_graphs.PADDED_STEP_ROWS, 5])
def test_greedy_is_the_stock_models_whichever_way_a_step_runs(exported, arch, rows, tokenizer):
    stock, model = exported(arch)
    chosen = model.runner.step_rows
    model.runner.step_rows = rows
    try:
        for text in ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "The quick brown fox"):
            inputs = tokenizer(text, return_tensors="pt")
            expected = stock.generate(**inputs, max_new_tokens=40, do_sample=False)
            assert torch.equal(model.generate(**inputs, max_new_tokens=40, do_sample=False), expected), text
    finally:
        model.runner.step_rows = chosen


@pytest.mark.parametrize("q", [1, 2, 3])
def test_a_padded_step_or_short_chunk_gives_the_stock_logits_and_keeps_its_rows(exported, tokenizer, q):
    """A step (``q = 1``) or a verification of ``q`` < step_rows tokens runs padded: its logits are the stock model's
    at those positions (and the unpadded run's), the cache holds exactly its rows, and the next step sees them."""
    stock, model = exported("llama")
    ids = tokenizer("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    chosen = model.runner.step_rows
    try:
        with torch.no_grad():
            results = []
            for rows in (1, ipex_graphs.PADDED_STEP_ROWS):
                model.runner.step_rows = rows
                cache = model(ids[:, :-q - 1]).past_key_values
                chunk = model(ids[:, -q - 1:-1], past_key_values=cache)
                assert chunk.past_key_values.get_seq_length() == ids.shape[1] - 1
                after = model(ids[:, -1:], past_key_values=chunk.past_key_values)
                results.append((chunk.logits, after.logits))
            reference = stock(ids).logits
    finally:
        model.runner.step_rows = chosen
    (plain, plain_next), (padded, padded_next) = results
    assert padded.shape == plain.shape == (1, q, reference.shape[-1])
    torch.testing.assert_close(padded, reference[:, -q - 1:-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_next, reference[:, -1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_next, plain_next, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_tokens", [1, 2])
def test_assisted_generation_with_short_rounds_is_the_stock_models_greedy(exported, tokenizer, arch, draft_tokens):
    """Rounds of 1-2 draft tokens verify 2-3 tokens: padded to step_rows, the output stays the stock model's."""
    stock, model = exported(arch)
    chosen = model.runner.step_rows
    model.runner.step_rows = ipex_graphs.PADDED_STEP_ROWS
    try:
        inputs = tokenizer("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", return_tensors="pt")
        expected = stock.generate(**inputs, max_new_tokens=40, do_sample=False)
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=model,
                             num_assistant_tokens=draft_tokens, num_assistant_tokens_schedule="constant")
        assert torch.equal(out, expected)
        out = model.generate(**inputs, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=draft_tokens)
        assert torch.equal(out, expected)
    finally:
        model.runner.step_rows = chosen


def test_no_padding_past_the_last_position(exported):
    """Padded rows past max_position_embeddings would read beyond IPEX's rotary tables (NaN carried into the real
    rows): the last positions run unpadded, and their logits are finite."""
    _, model = exported("llama")
    runner = model.runner
    chosen = runner.step_rows
    runner.step_rows = ipex_graphs.PADDED_STEP_ROWS
    last = runner.max_positions
    try:
        assert runner._pads(last - 4, 1, 1, True) and runner._pads(last - 5, 3, 1, True)
        assert not runner._pads(last - 3, 1, 1, True) and not runner._pads(last - 3, 2, 1, True)
        assert not runner._pads(0, 1, 1, True)  # prefill
        assert not runner._pads(10, 1, 2, True) and not runner._pads(10, 1, 1, False)  # batch 2, padded batch
        with torch.no_grad():
            cache = model(torch.full((1, last - 2), 5, dtype=torch.long)).past_key_values
            step = model(torch.full((1, 1), 7, dtype=torch.long), past_key_values=cache)
            chunk = model(torch.full((1, 1), 7, dtype=torch.long), past_key_values=step.past_key_values)
        assert torch.isfinite(step.logits).all() and torch.isfinite(chunk.logits).all()
        assert chunk.past_key_values.get_seq_length() == last
    finally:
        runner.step_rows = chosen


@pytest.mark.parametrize("padded_ms,expected", [(30.0, ipex_graphs.PADDED_STEP_ROWS), (38.0, 1), (60.0, 1)])
def test_the_padded_step_is_kept_only_where_it_is_faster(exported, monkeypatch, padded_ms, expected):
    """A simulated clock: a decode-graph step costs 40 ms; the padded step is kept at <= 93% of that."""
    _, model = exported("llama")
    runner = model.runner
    chosen = runner.step_rows
    clock = [0.0]
    real_forward = runner.forward

    def timed_forward(*args):
        clock[0] += (40.0 if runner.step_rows == 1 else padded_ms) / 1e3
        return real_forward(*args)

    monkeypatch.setattr(ipex_graphs.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(runner, "forward", timed_forward)
    try:
        with torch.no_grad():
            cache = model(torch.ones(1, 6, dtype=torch.long)).past_key_values
            assert runner.choose_step_rows(cache) == expected == runner.step_rows
            assert cache.get_seq_length() == 6  # the timed steps were cropped away
    finally:
        runner.step_rows = chosen
