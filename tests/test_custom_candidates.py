"""A user-written candidate generator (transformers' two-method interface) driving an IPEX target."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM


class _Fixed:
    """Proposes a fixed continuation (right or wrong) and records what happened."""

    def __init__(self, tokens):
        self.tokens = torch.tensor([tokens])
        self.calls = 0
        self.matches = []

    def get_candidates(self, input_ids):
        self.calls += 1
        return torch.cat([input_ids, self.tokens], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.matches.append(int(num_matches))


@pytest.fixture(scope="module")
def pair(tiny_dir):
    path = tiny_dir("llama")
    return AutoModelForCausalLM.from_pretrained(path).eval(), IPEXModelForCausalLM.from_pretrained(path, export=True)


def test_custom_generator_is_lossless_and_used(pair):
    stock, model = pair
    ids = torch.tensor([[5, 17, 99, 3, 250, 7]])
    expected = stock.generate(ids, max_new_tokens=20, do_sample=False)
    right = _Fixed(expected[0, 6:10].tolist())  # the true first 4 tokens: accepted in round 1
    got = model.generate(ids, max_new_tokens=20, do_sample=False, candidate_generator=right)
    assert torch.equal(got, expected)
    assert right.calls > 0 and right.matches[0] == 4
    wrong = _Fixed([11, 12, 13])
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, candidate_generator=wrong), expected)


def test_custom_generator_errors(pair):
    _, model = pair
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="get_candidates"):
        model.generate(ids, max_new_tokens=4, candidate_generator=object())
    with pytest.raises(ValueError, match="not both"):
        model.generate(ids, max_new_tokens=4, candidate_generator=_Fixed([1]), prompt_lookup_num_tokens=3)
    # the generator does not leak into the next call
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                       pair[0].generate(ids, max_new_tokens=6, do_sample=False))
