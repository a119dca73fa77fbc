"""Weights quantized at load from a dense checkpoint (optimum_ipex_spec/backends/pytorch/int4_weights.py):
``weights="int4"`` (ggml Q4_K / Q4_1 blocks on the GGUF kernels, fp32 activations) and ``weights="int8"`` as a target.

- The quantizers, read back by gguf-py's own dequantization: Q4_1 (gguf-py's) every value within half a step;
  Q4_K (ours) every value within half the super-block's largest step plus its minimum's rounding, and about as close
  to the weights as Q4_1 overall; bad matrices refused.
- An int4 model computes the dequantized model's function: its logits are a dense transformers model's whose
  weights are gguf-py's dequantization of the blocks, its greedy tokens that model's (or differ first at a near tie).
- Speculative decoding over an int4 target (exact and fast mode, eager and compiled) and over an int8 target returns
  that target's own greedy tokens with every kind of draft; sampling keeps its seed.
- Options that cannot apply are refused before a checkpoint is read, with the fix.
"""

import numpy as np
import pytest
import torch

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.kernels import gguf as gk
from optimum_ipex_spec.backends.pytorch.gguf_weights import GGUFLinear
from optimum_ipex_spec.backends.pytorch.int4_weights import Q4_1, Q4_K, int4_block, quantize_int4

from conftest import FixedProposals, speculation_arguments

gguf = pytest.importorskip("gguf")

PROMPT = torch.tensor([[5, 17, 200, 33, 91, 17, 200, 33, 91, 17, 200, 64]])


def _dequantize(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """gguf-py's dequantization of int4 blocks ``[rows, row_bytes]`` -> fp32 ``[rows, k]`` (the reference)."""
    values = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(int4_block(k).qtype))
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(blocks.shape[0], k)


def test_quantized_values_are_within_half_a_step():
    weight = torch.randn(70, 96, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[5, :32] += 3.0  # a group with an offset: the minimum follows it
    blocks = quantize_int4(weight)
    assert int4_block(96) is Q4_1
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (70, 3 * Q4_1.bytes)
    values = _dequantize(blocks, 96)
    groups = weight.reshape(70, 3, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (values.reshape(70, 3, 32) - groups).abs().amax(-1)
    # half a step, plus the fp16 rounding of the step (codes up to 15) and of the minimum
    bound = step / 2 + 15 * step * 2 ** -11 + groups.amin(-1).abs() * 2 ** -11 + 1e-6
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0, "the values are quantized, not copied"


def test_q4_k_values_are_within_the_super_blocks_step():
    weight = torch.randn(40, 512, generator=torch.Generator().manual_seed(8)) * 0.05
    weight[2, :32] += 2.0  # offsets and a negative group: minimums and scales differ across groups
    weight[7, 256:288] -= 1.0
    weight[9, :256] *= 0.01
    blocks = quantize_int4(weight)
    assert int4_block(512) is Q4_K and tuple(blocks.shape) == (40, 2 * Q4_K.bytes)
    values = _dequantize(blocks, 512)
    groups = weight.reshape(40, 2, 8, 32)
    lo = groups.amin(-1).clamp(max=0)
    largest_step = ((groups.amax(-1) - lo) / 15).amax(-1)
    # half a step after the 6-bit scale's rounding, the 6-bit minimum's rounding, fp16 d and dmin
    bound = largest_step * 32 / 63 + (-lo).amax(-1) / 63 + largest_step * 2 ** -9 + 1e-7
    error = (values.reshape(40, 2, 256) - weight.reshape(40, 2, 256)).abs().amax(-1)
    assert bool((error <= bound).all()), float((error / bound).max())
    q4_1 = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1),
                                  gguf.GGMLQuantizationType.Q4_1)
    relative = float((values - weight).norm() / weight.norm())
    assert relative < 1.3 * float(np.linalg.norm(q4_1.reshape(40, 512) - weight.numpy()) / weight.norm()), relative
    assert float((values[9, :256] - weight[9, :256]).abs().max()) < 2e-4, "a small super-block keeps its own scale"


def test_quantizing_in_chunks_writes_every_row_in_place():
    weight = torch.randn(1030, 96, generator=torch.Generator().manual_seed(9))  # more rows than QUANTIZE_ROWS
    whole = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(quantize_int4(weight).numpy(), whole), "gguf-py's bytes for the whole matrix at once"
    zero = quantize_int4(torch.zeros(3, 512))
    assert torch.equal(_dequantize(zero, 512), torch.zeros(3, 512)), "an all-zero super-block stays zero"


@pytest.mark.parametrize("weight, match", [
    (torch.zeros(4, 48), "multiple"),
    (torch.zeros(64), "2-D"),
    (torch.full((4, 64), float("nan")), "NaN"),
    (torch.full((4, 256), float("inf")), "NaN or infinite"),
    (torch.full((4, 256), 1e9), "fp16"),
    (torch.full((4, 96), -7e4), "fp16"),
])
def test_quantizer_refuses_bad_matrices(weight, match):
    with pytest.raises(ValueError, match=match):
        quantize_int4(weight)


@pytest.fixture(scope="module")
def int4(tiny_dir):
    folder = tiny_dir("qwen2")
    target = IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4")
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    return {"folder": folder, "target": target, "alone": alone}


def _dense_twin(folder, model):
    """The folder's transformers model with each weight replaced by gguf-py's dequantization of ``model``'s blocks."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    replaced = 0
    for name, module in model.model.named_modules():
        if isinstance(module, GGUFLinear):
            reference = dense.model.embed_tokens if name == "model.embed_tokens.table" else dense.get_submodule(name)
            with torch.no_grad():
                reference.weight.copy_(_dequantize(module.blocks, module.in_features))
            replaced += 1
    return dense, replaced


def test_int4_model_is_its_dequantized_model(int4):
    target = int4["target"]
    assert target.weights == "int4" and target.backend == "torch"
    dense, replaced = _dense_twin(int4["folder"], target)
    tied = target.model.lm_head is target.model.model.embed_tokens.table
    assert tied == bool(target.config.tie_word_embeddings)
    assert replaced == 2 * 7 + (1 if tied else 2), "seven projections per layer, the embedding and the head"
    with torch.no_grad():
        torch.testing.assert_close(target(PROMPT).logits, dense(PROMPT).logits, rtol=1e-4, atol=1e-4)
    expected = dense.generate(PROMPT, max_new_tokens=24, do_sample=False)
    got = int4["alone"]
    if not torch.equal(got, expected):  # the sums in another order may pick the other of two tied tokens
        at = int((got[0] != expected[0]).nonzero()[0])
        with torch.no_grad():
            top = torch.topk(dense(expected[:, :at]).logits[0, -1], 2).values
        assert float(top[0] - top[1]) < 1e-4, f"int4 tokens differ at {at} where the dequantized model is not tied"


def _tied_llama(seed: int = 4, intermediate: int = 512, kv_heads: int = 2):
    """A tiny tied Llama whose rows are multiples of 256 values (every int4 matrix Q4_K), and its twin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dense = LlamaForCausalLM(config).eval()
    dense.load_state_dict(model.state_dict())
    return model, dense


def test_a_tied_q4_k_model_is_its_dequantized_model():
    model, dense = _tied_llama()
    ours = IPEXModelForCausalLM.from_transformers_model(model, weights="int4")
    assert ours.model.lm_head is ours.model.model.embed_tokens.table, "the head and the embedding share one table"
    layers = [m for m in ours.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 2 * 7 + 1 and all(m.block is Q4_K for m in layers)
    with torch.no_grad():
        dense.model.embed_tokens.weight.copy_(_dequantize(ours.model.lm_head.blocks, 256))  # tied: the head too
        for name, module in ours.model.named_modules():
            if isinstance(module, GGUFLinear) and name.startswith("model.layers"):
                dense.get_submodule(name).weight.copy_(_dequantize(module.blocks, module.in_features))
        ids = torch.tensor([[3, 9, 27, 81, 243]])
        torch.testing.assert_close(ours(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode, compiled", [("exact", False), ("fast", False), ("fast", True)])
def test_speculation_over_a_q4_k_target_is_lossless(mode, compiled):
    if mode == "fast" and not gk.gguf_fast_available():
        pytest.skip("the fast mode needs AVX2 (or AVX512-VNNI) here")
    model, _ = _tied_llama()
    target = IPEXModelForCausalLM.from_transformers_model(model, weights="int4", gguf_mode=mode,
                                                          torch_compile=compiled)
    if compiled and target.runner.step is None:
        pytest.fail("the compiled step did not compile for an int4 model (see the log)")
    prompt = PROMPT % 512
    alone = target.generate(prompt, max_new_tokens=20, do_sample=False)
    draft = IPEXModelForCausalLM.from_transformers_model(_tied_llama(seed=5)[0], weights="int4", gguf_mode=mode)
    for extra in ({"prompt_lookup_num_tokens": 5}, {"candidate_generator": FixedProposals([17, 200, 33])},
                  {"assistant_model": draft}):
        assert torch.equal(target.generate(prompt, max_new_tokens=20, do_sample=False, **extra), alone), extra


@pytest.mark.parametrize("mode, kv_heads, intermediate, threads", [
    ("exact", 2, 512, None), ("fast", 2, 512, None), ("fast", 4, 512, None),
    # an activation over 8 rows of 8960 values is split among 3 threads at a point that is not a row's start (exact:
    # the mode that passes a last-bit difference on)
    ("exact", 2, 8960, 3),
])
def test_a_verification_chunk_gives_each_token_its_decode_steps_bits(mode, kv_heads, intermediate, threads):
    """The eager decoder on block weights: tokens verified in one chunk on a cache get, bit for bit, the logits
    decode steps give them (the fast mode's int8 rounding would turn a last-bit difference in attention into a
    visible one: a real prompt's greedy tokens changed under speculation before the chunk's rows attended one at a
    time). Grouped-query and multi-head attention; an MLP activation that ATen splits among threads."""
    if mode == "fast" and not gk.gguf_fast_available():
        pytest.skip("the fast mode needs AVX2 (or AVX512-VNNI) here")
    model, _ = _tied_llama(intermediate=intermediate, kv_heads=kv_heads)
    decoder = IPEXModelForCausalLM.from_transformers_model(model, weights="int4", gguf_mode=mode).runner.decoder
    ids = (PROMPT % 512)[:, :12]
    chunk = torch.tensor([[7, 300, 41, 99, 5, 77, 123, 400]])
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _check_chunk_bits(decoder, ids, chunk)
    finally:
        torch.set_num_threads(before)


def _check_chunk_bits(decoder, ids, chunk):

    def logits(steps):
        cache = decoder.new_cache(1, 40, torch.float32)
        decoder.forward(ids, torch.arange(12)[None], torch.ones(1, 12, dtype=torch.long), cache, True)
        out, start = [], 12
        for part in steps:
            n = part.shape[1]
            positions = torch.arange(start, start + n)[None]
            out.append(decoder.forward(part, positions, torch.ones(1, start + n, dtype=torch.long), cache, True))
            start += n
        return torch.cat(out, dim=1)

    n = chunk.shape[1]
    one_by_one = logits([chunk[:, i:i + 1] for i in range(n)])
    assert torch.equal(logits([chunk]), one_by_one)
    assert torch.equal(logits([chunk[:, :3], chunk[:, 3:]]), one_by_one)


def _draft(kind, folder, target):
    if kind == "int4 self-draft of the dense model":
        return {"assistant_model": IPEXModelForCausalLM.from_pretrained(folder, export=True).self_draft(
            weights="int4")}
    if kind == "dense fp32 draft":
        return {"assistant_model": IPEXModelForCausalLM.from_pretrained(folder, export=True)}
    return speculation_arguments(kind, target)


KINDS = ["int4 self-draft of the dense model", "int8 self-draft", "bf16 self-draft", "dense fp32 draft",
         "prompt lookup", "user candidate generator"]


@pytest.mark.parametrize("kind", KINDS)
def test_speculation_over_an_int4_target_is_lossless(int4, kind):
    target = int4["target"]
    extra = _draft(kind, int4["folder"], target)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, **extra), int4["alone"]), kind
    draft = extra.get("assistant_model")
    if draft is not None:
        assert draft.last_speculation_stats is not None and draft.last_speculation_stats.proposed > 0


def test_an_int4_draft_of_a_dense_target_is_lossless(int4):
    target = IPEXModelForCausalLM.from_pretrained(int4["folder"], export=True)
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    draft = target.self_draft(weights="int4")
    assert draft.weights == "int4"
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=draft), alone)


def test_sampling_over_an_int4_target(int4):
    target = int4["target"]
    draft = target.self_draft(weights="int8")
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=True, top_k=1, assistant_model=draft)
    assert torch.equal(got, int4["alone"]), "top_k=1 through the sampling verification gives the greedy tokens"
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(target.generate(PROMPT, max_new_tokens=16, do_sample=True, assistant_model=draft))
    assert torch.equal(runs[0], runs[1]), "the same seed gives the same output"


@pytest.mark.parametrize("mode, compiled", [("fast", False), ("exact", True), ("fast", True)])
def test_int4_modes_and_compiled_targets_are_lossless(int4, mode, compiled):
    if mode == "fast" and not gk.gguf_fast_available():
        pytest.skip("the fast mode needs AVX2 (or AVX512-VNNI) here")
    target = IPEXModelForCausalLM.from_pretrained(int4["folder"], export=True, weights="int4", gguf_mode=mode,
                                                  torch_compile=compiled)
    table = target.model.model.embed_tokens.table  # an untied table is only looked up: held as given
    multiplying = [m for m in target.model.modules()
                   if isinstance(m, GGUFLinear) and (m is not table or target.model.lm_head is table)]
    assert all(m.fast == (mode == "fast") for m in multiplying)
    if compiled and target.runner.step is None:
        pytest.fail("the compiled step did not compile for an int4 model (see the log)")
    alone = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    for extra in ({"prompt_lookup_num_tokens": 5}, {"candidate_generator": FixedProposals([17, 200, 33])}):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=20, do_sample=False, **extra), alone), extra


def test_an_int8_target_is_lossless(tiny_dir):
    folder = tiny_dir("qwen2")
    target = IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int8")
    assert target.weights == "int8" and target.dtype == torch.bfloat16, "int8 weights take bf16 activations"
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    for extra in ({"prompt_lookup_num_tokens": 5}, {"candidate_generator": FixedProposals([17, 200, 33])},
                  {"assistant_model": IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int4")}):
        assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, **extra), alone), extra


@pytest.mark.parametrize("kwargs, match", [
    ({"weights": "int3"}, "weights='dense'"),
    ({"weights": "int4", "torch_dtype": torch.bfloat16}, "fp32 activations"),
    ({"weights": "int8", "torch_dtype": torch.float32}, "bf16 activations"),
    ({"weights": "int4", "backend": "ipex"}, "pure-PyTorch"),
    ({"weights": "int8", "gguf_mode": "fast"}, "gguf_mode"),
    ({"gguf_mode": "fast", "weights": "dense"}, "gguf_mode"),
    ({"weights": "int4", "gguf_mode": "quick"}, "gguf_mode must be"),
])
def test_options_are_refused_before_loading(tiny_dir, monkeypatch, kwargs, match):
    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the options were checked")

    monkeypatch.setattr("optimum_ipex_spec.modeling.load_causal_lm", no_loading)
    with pytest.raises(ValueError, match=match):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("qwen2"), export=True, **kwargs)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_saved_export_loads_quantized(int4, tmp_path, weights):
    dense = IPEXModelForCausalLM.from_pretrained(int4["folder"], export=True, backend="torch")
    dense.save_pretrained(tmp_path / "export")
    direct = IPEXModelForCausalLM.from_pretrained(int4["folder"], export=True, weights=weights)
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path / "export", weights=weights)
    assert loaded.weights == weights and loaded.dtype == direct.dtype
    expected = direct.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(loaded.generate(PROMPT, max_new_tokens=12, do_sample=False), expected)


def test_what_an_int4_model_cannot_do_is_refused(int4, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="not a cheaper draft"):
        int4["target"].self_draft(weights="int4")
    with pytest.raises(ValueError, match="weights='int4'"):
        int4["target"].save_pretrained(tmp_path / "out")
    with pytest.raises(ValueError, match="pure-PyTorch decoder"):
        IPEXModelForCausalLM.from_pretrained(tiny_dir("gpt2"), export=True, weights="int4")
