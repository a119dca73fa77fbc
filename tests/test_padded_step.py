"""The IPEX runner's padded decode step (a one-token step run as a chunk of copies of the token on the verify graph,
``IPEXGraphRunner.step_rows``): exact against stock transformers whichever way a step runs, and chosen by timing."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.runners import ipex_graphs

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


def test_a_padded_step_gives_the_decode_graphs_logits_and_keeps_one_row(exported, tokenizer):
    stock, model = exported("llama")
    ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    chosen = model.runner.step_rows
    try:
        with torch.no_grad():
            results = []
            for rows in (1, ipex_graphs.PADDED_STEP_ROWS):
                model.runner.step_rows = rows
                cache = model(ids[:, :-1]).past_key_values
                step = model(ids[:, -1:], past_key_values=cache)
                assert step.past_key_values.get_seq_length() == ids.shape[1]
                after = model(ids[:, :1], past_key_values=step.past_key_values)  # the next step sees one row more
                results.append((step.logits, after.logits))
            reference = stock(ids).logits[:, -1:]
    finally:
        model.runner.step_rows = chosen
    (plain, plain_next), (padded, padded_next) = results
    assert padded.shape == plain.shape == reference.shape
    torch.testing.assert_close(padded, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(padded_next, plain_next, rtol=1e-4, atol=1e-4)


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
