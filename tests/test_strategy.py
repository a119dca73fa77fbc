"""Which candidate source a generate() call uses: the pure selection (a table), and end to end which one ran."""

import threading

import pytest
import torch
from transformers import LlamaConfig

from conftest import FixedProposals
from optimum_ipex_spec.backends.ipex.runner import IPEXGraphRunner
from optimum_ipex_spec.speculative.strategy import (
    GenerationRequest,
    Strategy,
    current_request,
    request_scope,
    select_strategy,
)

_FACTS = ("custom", "has_draft", "draft_can_run_ours", "do_sample", "different_tokenizers", "prompt_lookup",
          "early_exit")

#: (facts that are True, expected strategy); every other fact is False
SELECTION_TABLE = [
    ((), Strategy.TRANSFORMERS),  # transformers only asks when assisted; nothing special: its own
    (("custom",), Strategy.CUSTOM),
    (("custom", "prompt_lookup"), Strategy.CUSTOM),  # generate() sets the lookup switch for a custom generator
    (("has_draft", "draft_can_run_ours"), Strategy.DRAFT),
    (("has_draft", "draft_can_run_ours", "do_sample"), Strategy.TRANSFORMERS),
    (("has_draft", "draft_can_run_ours", "different_tokenizers"), Strategy.TRANSFORMERS),  # universal greedy
    (("has_draft", "draft_can_run_ours", "early_exit"), Strategy.TRANSFORMERS),
    (("has_draft", "draft_can_run_ours", "different_tokenizers", "do_sample"), Strategy.UNIVERSAL_SAMPLING),
    (("has_draft", "different_tokenizers", "do_sample"), Strategy.UNIVERSAL_SAMPLING),
    (("has_draft",), Strategy.TRANSFORMERS),  # a transformers draft
    (("has_draft", "do_sample"), Strategy.TRANSFORMERS),
    (("prompt_lookup",), Strategy.PROMPT_LOOKUP),
    (("prompt_lookup", "do_sample"), Strategy.PROMPT_LOOKUP),
    (("prompt_lookup", "early_exit"), Strategy.TRANSFORMERS),
]


@pytest.mark.parametrize("true_facts,expected", SELECTION_TABLE,
                         ids=["+".join(facts) or "none" for facts, _ in SELECTION_TABLE])
def test_select_strategy_table(true_facts, expected):
    facts = {name: name in true_facts for name in _FACTS}
    assert select_strategy(**facts) is expected


def test_request_scope_nests_and_restores():
    assert current_request() is None
    outer, inner = GenerationRequest(), GenerationRequest()
    with request_scope(outer):
        assert current_request() is outer
        with request_scope(inner):  # a draft's own generate() inside the target's
            assert current_request() is inner
        assert current_request() is outer
        seen = []
        thread = threading.Thread(target=lambda: seen.append(current_request()))
        thread.start()
        thread.join()
        assert seen == [None]  # another thread's generate() does not see this call's request
    assert current_request() is None
    with pytest.raises(RuntimeError):
        with request_scope(outer):
            raise RuntimeError("generate failed")
    assert current_request() is None


def test_ipex_runner_routes_a_chunk_on_a_cache_to_the_verify_graph():
    """The routing rule behind the silent wrong-answer bug (field notes): q > 1 on past > 0 never reaches
    IPEX's fused attention; without a verify graph (or for a padded batch) it runs token by token."""
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    decode, verify = object(), object()
    runner = IPEXGraphRunner(decode, verify, config, torch.float32)
    assert runner.graph_for(past=0, q=8, batch=1, unpadded=True) is decode  # prefill
    assert runner.graph_for(past=0, q=8, batch=2, unpadded=False) is decode  # padded batch prefill
    assert runner.graph_for(past=9, q=1, batch=2, unpadded=False) is decode  # one-token decode
    assert runner.graph_for(past=9, q=5, batch=1, unpadded=True) is verify  # verification chunk
    assert runner.graph_for(past=9, q=5, batch=2, unpadded=True) is None
    assert runner.graph_for(past=9, q=5, batch=1, unpadded=False) is None
    legacy = IPEXGraphRunner(decode, None, config, torch.float32)
    assert legacy.graph_for(past=9, q=5, batch=1, unpadded=True) is None
    assert legacy.graph_for(past=9, q=1, batch=1, unpadded=True) is decode


def test_the_strategy_that_ran_and_its_output(tiny_stock_target_draft):
    """Each way of asking for speculation runs the strategy the table says, with plain greedy's tokens."""
    stock, target, draft = tiny_stock_target_draft
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 5, 17]])
    expected = stock.generate(ids, max_new_tokens=12, do_sample=False)
    calls = [
        (dict(assistant_model=draft), "draft"),
        (dict(assistant_model=stock), "transformers"),
        (dict(prompt_lookup_num_tokens=3), "prompt-lookup"),
        (dict(candidate_generator=FixedProposals([11, 12, 13])), "custom"),
        (dict(), None),
    ]
    for arguments, strategy in calls:
        got = target.generate(ids, max_new_tokens=12, do_sample=False, **arguments)
        assert torch.equal(got, expected), arguments
        assert target.last_strategy == strategy, arguments
        assert current_request() is None
    # sampling through our draft goes to transformers' generator (it needs the draft's probabilities)
    target.generate(ids, max_new_tokens=4, do_sample=True, top_k=1, assistant_model=draft)
    assert target.last_strategy == "transformers"
