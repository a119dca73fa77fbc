"""GGUF weights as shipped (``weights="gguf"``, optimum_ipex_spec/backends/pytorch/gguf_weights.py and
csrc/gguf_gemm.cpp).

- Each block type: the kernel's values are gguf-py's own dequantization, bit for bit, on random blocks; its products
  give every row the same bits for 1 to 16 rows and for a prefill's many rows; they agree with the dequantized
  matrix's product; the PyTorch reference path (no kernel) too.
- Tiny seeded Llama and Qwen2 models written as GGUF files (llama.cpp's row permutation of attn_q / attn_k included,
  every block type used): the loaded model's weights are the file's dequantization (checked against transformers'
  own un-permutation), its greedy tokens are the dequantized dense model's, and speculative decoding over it returns
  its own tokens with every kind of draft.
- Bad files and options are refused early, with the fix.
"""

import os

import numpy as np
import pytest
import torch

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch import gguf_weights as gw
from optimum_ipex_spec.kernels import gguf as gk
from optimum_ipex_spec.backends.pytorch.gguf_weights import GGUFEmbedding, GGUFError, GGUFLinear
from optimum_ipex_spec.kernels.gguf import BLOCK_TYPES

from conftest import speculation_arguments

gguf = pytest.importorskip("gguf")

TYPES = {t.name: t for t in BLOCK_TYPES.values()}
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
#: per layer, the block type of each projection: every type the kernel runs appears
PLAN = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q8_0", "ffn_gate": "Q4_K",
     "ffn_up": "Q5_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "F16",
     "ffn_up": "Q4_1", "ffn_down": "Q4_0"},
]


def random_blocks(block, rows: int, k: int, rng) -> np.ndarray:
    """uint8 ``[rows, row_bytes]`` of random blocks of ``block``'s type with finite, modest scales."""
    b = rng.integers(0, 256, size=(rows, k // block.values, block.bytes), dtype=np.uint8)

    def put(offset, scale):
        values = (rng.uniform(0.5, 1.0, b.shape[:2]) * scale).astype(np.float16)
        b[..., offset:offset + 2] = values.view(np.uint8).reshape(*b.shape[:2], 2)

    if block.name in ("Q4_0", "Q5_0", "Q8_0"):
        put(0, 0.01)
    elif block.name == "Q4_1":
        put(0, 0.01)
        put(2, -0.05)
    elif block.name in ("Q4_K", "Q5_K"):
        put(0, 0.0004)
        put(2, 0.0004)
    elif block.name == "Q6_K":
        put(208, 0.00003)
    elif block.name == "F16":
        b[...] = (rng.standard_normal(b.shape[:2]) * 0.05).astype(np.float16).view(np.uint8).reshape(b.shape)
    elif block.name == "F32":
        b[...] = (rng.standard_normal(b.shape[:2]) * 0.05).astype(np.float32).view(np.uint8).reshape(b.shape)
    return b.reshape(rows, -1)


def gguf_dequantize(blocks: np.ndarray, block) -> np.ndarray:
    """gguf-py's own dequantization (the reference the kernel must equal)."""
    if block.name == "F32":
        return blocks.view(np.float32)
    if block.name == "F16":
        return blocks.view(np.float16).astype(np.float32)
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(block.qtype))


@pytest.fixture(scope="module")
def kernel():
    if not gk.gguf_kernel_available():
        pytest.skip("the GGUF kernel needs AVX2 (or AVX-512) and a C++ compiler here; the reference path is tested "
                    "below")


def built_here(build):
    """``build`` (a :class:`gk.Build`) loaded: skipped where this CPU lacks its instructions, failed where it does
    not build."""
    if not build.cpu_flags <= gk._cpu_flags():
        pytest.skip(f"this CPU lacks {', '.join(sorted(build.cpu_flags - gk._cpu_flags()))}")
    if not gk._built(build):
        pytest.fail(f"{build.namespace} did not build here (see the log)")
    return build


@pytest.fixture(params=list(gk.EXACT_KERNELS))
def isa(request):
    """Each build of the exact kernel this CPU runs (AVX-512, AVX2), called directly."""
    built_here(gk.EXACT_KERNELS[request.param])
    return request.param


def _k_for(block) -> int:
    return 512 if block.values == 256 else 96


@pytest.mark.parametrize("name", sorted(TYPES))
def test_kernel_values_are_gguf_dequantization(isa, name):
    block, rng = TYPES[name], np.random.default_rng(1)
    k = _k_for(block)
    blocks = random_blocks(block, 37, k, rng)
    got = gk.exact_dequantize(isa, torch.from_numpy(blocks), block.qtype, k)
    assert torch.equal(got, torch.from_numpy(gguf_dequantize(blocks, block)).reshape(37, k))


def lanes_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight [N, K].T`` summed as both exact kernels document it (csrc/gguf_gemm.cpp, gguf_gemm_avx2.cpp):
    16 fp32 lanes, lane l a chain of fused multiply-adds over k = l, l + 16, ... from zero, then lanes 8-15 + 0-7,
    the upper 4 + the lower 4, [0] + [2] and [1] + [3], then the two. A fused multiply-add is emulated in float64
    (the product is exact there; the sum is rounded twice, which differs from one rounding about once in 2^29)."""
    m, k = x.shape
    xs, ws = x.double().view(m, 1, k // 16, 16), weight.double().view(1, -1, k // 16, 16)
    acc = torch.zeros(m, weight.shape[0], 16, dtype=torch.float32)
    for step in range(k // 16):
        acc = (xs[:, :, step] * ws[:, :, step] + acc.double()).float()
    s8 = acc[..., 8:] + acc[..., :8]
    s4 = s8[..., 4:] + s8[..., :4]
    return (s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])


@pytest.fixture
def threads():
    """Restores the thread count a test changes."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_every_row_count_gives_each_row_the_same_bits(isa, threads, name):
    block, rng = TYPES[name], np.random.default_rng(2)
    # several 256-value passes and a partial one (896 = 3 x 256 + 128) where the block type allows it
    for k in sorted({_k_for(block), 896 if block.values == 32 else 768}):
        blocks = torch.from_numpy(random_blocks(block, 37, k, rng))
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(0))
        torch.set_num_threads(1)
        alone = torch.cat([gk.exact_mm(isa, x[m:m + 1], blocks, block.qtype, k) for m in range(16)])
        for count in (1, 2):  # the rows of weights split between threads: no bit may change
            torch.set_num_threads(count)
            for rows in range(1, 17):
                together = gk.exact_mm(isa, x[:rows], blocks, block.qtype, k)
                assert torch.equal(together, alone[:rows]), f"k={k}, {rows} rows, {count} threads"
        weight = torch.from_numpy(gguf_dequantize(blocks.numpy(), block)).reshape(37, k)
        assert torch.equal(alone, lanes_reference(x, weight)), "not the kernels' documented sums"


@pytest.mark.parametrize("name", sorted(TYPES))
def test_a_prefill_gives_each_row_the_bits_it_has_alone(isa, threads, name):
    """Many rows of x (a prefill) take another path through each exact kernel (panel_path: gguf_gemm.cpp from 96 rows,
    from 48 where K > 2048, in tiles of 12 rows against panels of 32 weight rows; gguf_gemm_avx2.cpp from 48 rows where
    K > 2048, tiles of 6, panels of 16): each row still gets the bits it has alone, at the thresholds, for every size
    of the last tile and a last panel that fills one vector and part of the other, on 1 and 2 threads. Python cannot
    see which path ran: the counts reach far past the thresholds (300 and 200 rows), so the path is run as long as its
    thresholds stay below them."""
    block, rng = TYPES[name], np.random.default_rng(3)
    n = 93  # a last panel of 29 rows (AVX-512: 16 + 13) and of 13 (AVX2: 8 + 5)
    wide = 4096 + 2 * max(block.values, 16)  # K > 2048
    for k, counts in ((768, (*range(95, 108), 131, 300)), (wide, (47, 48, 51, 52, 53, 61, 200))):
        blocks = torch.from_numpy(random_blocks(block, n, k, rng))
        x = torch.randn(max(counts), k, generator=torch.Generator().manual_seed(4))
        torch.set_num_threads(1)
        alone = torch.cat([gk.exact_mm(isa, x[m:m + 1], blocks, block.qtype, k) for m in range(len(x))])
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in counts:
                assert torch.equal(gk.exact_mm(isa, x[:rows], blocks, block.qtype, k), alone[:rows]), (k, rows, count)
        weight = torch.from_numpy(gguf_dequantize(blocks.numpy(), block)).reshape(n, k)
        assert torch.equal(alone[:8], lanes_reference(x[:8], weight)), "not the kernels' documented sums"


#: where each block type keeps its fp16 scales (d, and dmin or m), in bytes from the block's start
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,)}


@pytest.mark.parametrize("name", sorted(SCALE_OFFSETS))
def test_every_finite_scale_gives_the_documented_sums(isa, name):
    """The kernels build a block's values with fused multiply-adds and tables where that is exact for every fp16
    scale (gguf_gemm.cpp, k_table): each of the 63,488 finite fp16 bit patterns (both signs, zeros, subnormals, the
    largest) stands in each scale field of some block, and every value, signed zeros included, is gguf-py's, summed in
    the documented chains by every width of weight-row group (4, 3, 2, 1) for 1 and 4 rows of activations."""
    block, rng = TYPES[name], np.random.default_rng(7)
    k = _k_for(block)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = every[(every & 0x7C00) != 0x7C00]
    per_row = k // block.values
    rows = -(-len(finite) // per_row)
    rows += (3 - rows % 4) % 4  # groups of 4 weight rows, then 3 (and 2, 1 with the last rows left out below)
    blocks = random_blocks(block, rows, k, rng)
    view = blocks.reshape(rows, per_row, block.bytes)
    for offset in SCALE_OFFSETS[name]:
        bits = rng.choice(finite, size=rows * per_row)
        bits[:len(finite)] = rng.permutation(finite)
        view[..., offset:offset + 2] = bits.reshape(rows, per_row).view(np.uint8).reshape(rows, per_row, 2)
    blocks = torch.from_numpy(blocks)
    weight = torch.from_numpy(gguf_dequantize(blocks.numpy(), block)).reshape(rows, k)
    assert torch.isfinite(weight).all()
    got = gk.exact_dequantize(isa, blocks, block.qtype, k)
    assert torch.equal(got.view(torch.int32), weight.view(torch.int32))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1))
    expected = lanes_reference(x, weight)
    for count in (1, 4):
        for n in (rows, rows - 1, rows - 2):
            out = gk.exact_mm(isa, x[:count], blocks[:n], block.qtype, k)
            assert torch.equal(out, expected[:count, :n]), f"{count} rows of x, {n} weight rows"


def test_reference_path_without_the_kernel(monkeypatch):
    block, rng = TYPES["Q4_K"], np.random.default_rng(3)
    blocks = torch.from_numpy(random_blocks(block, 9, 256, rng))
    layer = GGUFLinear(blocks, block, 256)
    monkeypatch.setattr(layer, "kernel", None)
    monkeypatch.setattr(gk, "REFERENCE_ROWS", 4)  # several pieces of rows
    x = torch.randn(5, 256)
    weight = torch.from_numpy(gguf_dequantize(blocks.numpy(), block)).reshape(9, 256)
    out = layer(x)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2:3], layer(x[2:3])), "the reference gives a row the same bits alone"
    assert torch.equal(layer.dequantized(), weight)


def test_layer_refuses_other_dtypes_and_widths(kernel):
    block = TYPES["Q8_0"]
    layer = GGUFLinear(torch.from_numpy(random_blocks(block, 4, 64, np.random.default_rng(4))), block, 64)
    with pytest.raises(TypeError, match="fp32 activations"):
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="64 input features"):
        layer(torch.randn(1, 32))
    with pytest.raises(GGUFError, match="blocks of 32"):
        GGUFLinear(torch.zeros(4, 10, dtype=torch.uint8), block, 40)


# ------------------------------------------------------------------------------------------ tiny GGUF models


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for attn_q / attn_k of a ``llama`` model (convert_hf_to_gguf.py)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """transformers' own inverse (LlamaTensorProcessor), the independent reference for the loader's."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(weights, heads, heads)


def write_tiny_gguf(folder, arch: str, seed: int = 0, name: str = "model.gguf", truncate: int = 0,
                    bad_type: bool = False, head_count_kv_array: bool = False) -> str:
    """A tiny ``arch`` ("llama", tied head; "qwen2", untied head and q/k/v biases) model as ``folder/name`` (GGUF
    blocks of every type, PLAN) plus ``config.json`` and the dense fp32 model of the file's dequantized weights
    (``model.safetensors``: the reference, and the checkpoint self_draft() reads)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common))
    model.config.architectures = [type(model).__name__]
    writer = gguf.GGUFWriter(os.path.join(folder, name), arch)
    writer.add_name(f"tiny {arch}")  # transformers 4.51 cannot read a file's config without it
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv([KV_HEADS] if head_count_kv_array else KV_HEADS)
    writer.add_embedding_length(HIDDEN)
    writer.add_layer_norm_rms_eps(model.config.rms_norm_eps)
    state = {}

    def add(gguf_name: str, hf_name: str, type_name: str, rows: int, k: int, heads: int = 0):
        block = TYPES[type_name]
        blocks = random_blocks(block, rows, k, rng)
        if bad_type and gguf_name == "blk.0.attn_q.weight":
            writer.add_tensor(gguf_name, np.zeros((rows, k // 256 * 84), np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            writer.add_tensor(gguf_name, blocks, raw_dtype=gguf.GGMLQuantizationType(block.qtype))
        dense = gguf_dequantize(blocks, block).reshape(rows, k)
        state[hf_name] = torch.from_numpy(_unpermute(dense, heads) if heads else dense.copy())

    def add_f32(gguf_name: str, hf_name: str, values: np.ndarray):
        writer.add_tensor(gguf_name, values.astype(np.float32))
        state[hf_name] = torch.from_numpy(values.astype(np.float32))

    head_dim = HIDDEN // HEADS
    sizes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
             "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
             "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    paths = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    add("token_embd.weight", "model.embed_tokens.weight", "Q8_0", VOCAB, HIDDEN)
    for i in range(LAYERS):
        for short, (rows, k) in sizes.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(short, 0) if arch == "llama" else 0
            add(f"blk.{i}.{short}.weight", f"model.layers.{i}.{paths[short]}.weight", PLAN[i][short], rows, k, heads)
            if arch == "qwen2" and short in ("attn_q", "attn_k", "attn_v"):
                add_f32(f"blk.{i}.{short}.bias", f"model.layers.{i}.{paths[short]}.bias",
                        rng.standard_normal(rows) * 0.1)
        add_f32(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight",
                1 + rng.standard_normal(HIDDEN) * 0.1)
        add_f32(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight",
                1 + rng.standard_normal(HIDDEN) * 0.1)
    add_f32("output_norm.weight", "model.norm.weight", 1 + rng.standard_normal(HIDDEN) * 0.1)
    if arch == "qwen2":
        add("output.weight", "lm_head.weight", "Q6_K", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate:
        path = os.path.join(folder, name)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - truncate)
    if arch == "llama":
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.generation_config.pad_token_id = 2
    model.save_pretrained(folder)
    return os.path.join(folder, name)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """Factory: ``(folder, gguf path)`` of a tiny ``arch`` model, built once per module."""
    cache = {}

    def make(arch: str, seed: int = 0):
        if (arch, seed) not in cache:
            folder = tmp_path_factory.mktemp(f"gguf-{arch}-{seed}")
            cache[arch, seed] = (str(folder), write_tiny_gguf(str(folder), arch, seed))
        return cache[arch, seed]

    return make


PROMPT = torch.tensor([[5, 17, 200, 33, 91, 17, 200, 33, 91, 17, 200, 64]])


def _first_divergence_is_a_near_tie(dense, got, expected):
    """True when ``got`` equals ``expected``, or differs first at a position where the dense model's top two logits
    are within 1e-4 (the issue's rule: a sum in another order may pick the other of two tied tokens)."""
    if torch.equal(got, expected):
        return True
    at = int((got[0] != expected[0]).nonzero()[0])
    with torch.no_grad():
        logits = dense(expected[:, :at]).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]) < 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loaded_weights_are_the_files_dequantization(kernel, tiny_gguf, arch):
    from transformers import AutoModelForCausalLM

    folder, path = tiny_gguf(arch)
    model = IPEXModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf")
    dense = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    layers = 0
    for name, module in model.model.named_modules():
        if isinstance(module, GGUFLinear):
            reference = dense.model.embed_tokens if name == "model.embed_tokens.table" else dense.get_submodule(name)
            assert torch.equal(module.dequantized(), reference.weight), name
            if module.bias is not None:
                assert torch.equal(module.bias, reference.bias), name
            layers += 1
    assert layers == LAYERS * 7 + (2 if arch == "qwen2" else 1)
    assert model.weights == "gguf" and model.gguf_path == os.path.abspath(path)
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, dense(PROMPT).logits, rtol=1e-4, atol=1e-4)
    expected = dense.generate(PROMPT, max_new_tokens=24, do_sample=False)
    got = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert _first_divergence_is_a_near_tie(dense, got, expected)


@pytest.fixture(scope="module")
def qwen_gguf(kernel, tiny_gguf):
    folder, path = tiny_gguf("qwen2")
    target = IPEXModelForCausalLM.from_pretrained(path)
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    return {"folder": folder, "target": target, "alone": alone}


def _drafts(kind, qwen_gguf, tiny_gguf):
    folder = qwen_gguf["folder"]
    shared = speculation_arguments(kind, qwen_gguf["target"])
    if shared is not None:
        return shared
    if kind == "gguf draft of another seed":
        other, _ = tiny_gguf("qwen2", seed=1)
        return {"assistant_model": IPEXModelForCausalLM.from_pretrained(other, weights="gguf")}
    # the exact target's draft as benchmarks/gguf_llamacpp.py runs it: the fast kernels
    if kind == "fast-mode gguf draft of another seed":
        other, _ = tiny_gguf("qwen2", seed=1)
        return {"assistant_model": IPEXModelForCausalLM.from_pretrained(other, weights="gguf", gguf_mode="fast")}
    if kind == "dense draft (the dequantized folder)":
        return {"assistant_model": IPEXModelForCausalLM.from_pretrained(folder, export=True)}
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["int8 self-draft", "bf16 self-draft", "gguf draft of another seed",
                                  "fast-mode gguf draft of another seed", "dense draft (the dequantized folder)",
                                  "prompt lookup", "user candidate generator"])
def test_speculation_over_a_gguf_target_is_lossless(qwen_gguf, tiny_gguf, kind):
    target = qwen_gguf["target"]
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=False, **_drafts(kind, qwen_gguf, tiny_gguf))
    assert torch.equal(got, qwen_gguf["alone"]), kind


def test_a_gguf_draft_of_a_dense_target_is_lossless(qwen_gguf, tiny_gguf):
    folder = qwen_gguf["folder"]
    target = IPEXModelForCausalLM.from_pretrained(folder, export=True)
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    draft = IPEXModelForCausalLM.from_pretrained(os.path.join(folder, "model.gguf"))
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=draft), alone)
    stats = draft.last_speculation_stats
    assert stats is not None and stats.proposed > 0, "the GGUF draft never proposed: speculation did not run"


def test_sampling_over_a_gguf_target(qwen_gguf):
    target = qwen_gguf["target"]
    draft = target.self_draft(weights="int8")
    # top_k=1 goes through the sampling verification and must give the greedy tokens
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=True, top_k=1, assistant_model=draft)
    assert torch.equal(got, qwen_gguf["alone"])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(target.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=1.0, assistant_model=draft))
    assert torch.equal(runs[0], runs[1]), "the same seed gives the same output"


@pytest.fixture
def force_kernel(monkeypatch):
    """Sets OPTIMUM_IPEX_SPEC_GGUF_KERNEL for the layers built next; the choice is made again afterwards."""

    def force(name):
        monkeypatch.setenv(gk.KERNEL_VARIABLE, name)
        gk.exact_kernel.cache_clear()
        gk.fast_kernel.cache_clear()

    yield force
    monkeypatch.delenv(gk.KERNEL_VARIABLE, raising=False)
    gk.exact_kernel.cache_clear()
    gk.fast_kernel.cache_clear()


def test_the_kernel_variable_picks_a_kernel_or_refuses(kernel, force_kernel, monkeypatch):
    block = TYPES["Q4_K"]
    blocks = torch.from_numpy(random_blocks(block, 4, 256, np.random.default_rng(5)))
    force_kernel("reference")
    assert gk.exact_kernel() is None and GGUFLinear(blocks, block, 256).kernel is None
    assert gk.fast_kernel() is None and not GGUFLinear(blocks, block, 256, mode="fast").fast, "no fast mode either"
    force_kernel("AVX2 ")  # case and spaces forgiven
    assert gk.exact_kernel() == "avx2" and GGUFLinear(blocks, block, 256).kernel == "avx2"
    assert GGUFLinear(blocks, block, 256, mode="fast").fast_kernel == "avx2"
    force_kernel("sse4")
    with pytest.raises(ValueError, match="OPTIMUM_IPEX_SPEC_GGUF_KERNEL='sse4' is not one of auto, avx512, avx2"):
        gk.exact_kernel()
    monkeypatch.setattr(gk, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})  # a CPU without AVX-512
    force_kernel("avx512")
    with pytest.raises(RuntimeError, match="this CPU lacks avx512bw, avx512f: unset it"):
        gk.exact_kernel()
    force_kernel("auto")
    assert gk.exact_kernel() == "avx2" and gk.fast_kernel() == "avx2"
    def no_proc(*args, **kwargs):
        raise OSError("no /proc/cpuinfo here")

    monkeypatch.setattr(gk, "open", no_proc, raising=False)  # the module's open: builtins stay untouched
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert gk._cpu_flags() == {"avx2", "fma", "f16c"}, "without /proc/cpuinfo: torch's capability"


@pytest.mark.parametrize("name", [*gk.EXACT_KERNELS, "reference"])
def test_each_kernel_runs_a_model_and_its_speculation_exactly(qwen_gguf, force_kernel, name):
    """Each path forced on this machine: the kernels give the default kernel's bits, so its tokens; the reference
    (other sums) its own tokens, which speculation keeps."""
    if name != "reference" and not gk.EXACT_KERNELS[name].cpu_flags <= gk._cpu_flags():
        pytest.skip(f"this CPU cannot run the {name} kernel")
    force_kernel(name)
    target = IPEXModelForCausalLM.from_pretrained(qwen_gguf["target"].gguf_path)
    assert all(m.kernel == (None if name == "reference" else name)
               for m in target.model.modules() if isinstance(m, GGUFLinear))
    alone = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    if name != "reference":
        assert torch.equal(alone, qwen_gguf["alone"][:, :alone.shape[1]])
    for kind in ("int8 self-draft", "prompt lookup"):
        got = target.generate(PROMPT, max_new_tokens=16, do_sample=False, **speculation_arguments(kind, target))
        assert torch.equal(got, alone), kind


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_compiled_gguf_target_is_lossless(qwen_gguf, mode):
    if mode == "fast" and not gk.gguf_fast_available():
        pytest.skip("the fast GGUF mode needs AVX512-VNNI here")
    target = IPEXModelForCausalLM.from_pretrained(os.path.join(qwen_gguf["folder"], "model.gguf"), torch_compile=True,
                                                  gguf_mode=mode)
    if target.runner.step is None:
        pytest.fail("the compiled step did not compile for a GGUF model (see the log)")
    alone = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    if mode == "exact":  # the eager exact model's tokens (the fast mode's are its own)
        assert _first_divergence_is_a_near_tie(qwen_gguf["target"].model, alone,
                                               qwen_gguf["alone"][:, :alone.shape[1]])
    got = target.generate(PROMPT, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=5)
    assert torch.equal(got, alone)
    assert target.runner.step.chunk_exact, "the verification graph must give each row the 1-token graph's bits"


# ------------------------------------------------------------------------------------------ refusals


def test_bad_files_and_options_are_refused_early(kernel, tiny_gguf, tmp_path):
    folder, path = tiny_gguf("llama")
    with pytest.raises(ValueError, match="fp32 activations"):
        IPEXModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pure-PyTorch decoder"):
        IPEXModelForCausalLM.from_pretrained(path, backend="ipex")
    with pytest.raises(ValueError, match="not a path"):
        IPEXModelForCausalLM.from_pretrained(folder, gguf_file="../model.gguf")
    with pytest.raises(ValueError, match="do not apply"):
        IPEXModelForCausalLM.from_pretrained(path, revision="main")
    with pytest.raises(ValueError, match="weights='dense'"):
        IPEXModelForCausalLM.from_pretrained(folder, weights="int3")
    model = IPEXModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="not saved again"):
        model.save_pretrained(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="GGUF draft is a file of its own"):
        model.self_draft(weights="gguf")

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    write_tiny_gguf(str(damaged), "llama", truncate=4096)
    # a cut in the data section: the header reads, and the byte-range check of read_gguf refuses the tensors
    with pytest.raises(GGUFError, match="does not hold: a truncated or damaged file"):
        IPEXModelForCausalLM.from_pretrained(str(damaged), weights="gguf")
    other = tmp_path / "other-type"
    other.mkdir()
    write_tiny_gguf(str(other), "llama", bad_type=True)
    with pytest.raises(GGUFError, match="Q2_K"):
        IPEXModelForCausalLM.from_pretrained(str(other), weights="gguf")
    write_tiny_gguf(str(other), "llama", name="second.gguf")
    with pytest.raises(FileNotFoundError, match="name it with gguf_file="):
        IPEXModelForCausalLM.from_pretrained(str(other), weights="gguf")
    (tmp_path / "noise.gguf").write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(GGUFError, match="GGUF version|truncated or damaged"):
        IPEXModelForCausalLM.from_pretrained(str(tmp_path / "noise.gguf"))


def test_a_config_that_does_not_describe_the_file_is_refused(kernel, tiny_gguf, tmp_path):
    import json
    import shutil

    folder, path = tiny_gguf("qwen2")
    copy = tmp_path / "mismatch"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 1024
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFError, match="the config does not describe this file"):
        IPEXModelForCausalLM.from_pretrained(str(copy), gguf_file="model.gguf")


# ------------------------------------------------------------------------------------------ the fast mode


@pytest.fixture(scope="module")
def fast_kernel(kernel):
    if not gk.gguf_fast_available():
        pytest.skip("the fast GGUF mode needs AVX2 (or AVX512-VNNI) and a C++ compiler here")


@pytest.fixture(params=list(gk.FAST_KERNELS))
def interleaved_ops(request):
    """Each build of the fast kernel this CPU runs (AVX512-VNNI, AVX2), as its operators: ``interleave``,
    ``deinterleave``, ``mm_interleaved`` (the interleaved layout) and ``mm`` (the file's rows)."""
    return getattr(torch.ops, built_here(gk.FAST_KERNELS[request.param]).namespace)


def _fast_ops():
    """The operators of the fast kernel this process picked."""
    return getattr(torch.ops, gk.FAST_KERNELS[gk.fast_kernel()].namespace)


@pytest.fixture(params=list(gk.FAST_KERNELS))
def fast_mm(request):
    """Each build of the fast kernel this CPU runs (AVX512-VNNI, AVX2), as ``mm(x, blocks, qtype, k)``."""
    return getattr(torch.ops, built_here(gk.FAST_KERNELS[request.param]).namespace).mm


def _fast_reference(x: torch.Tensor, blocks: np.ndarray, block) -> torch.Tensor:
    """The fast mode's definition in NumPy: each row of x rounded to int8 with one scale per 256 values (K-quants)
    or per 32 (the others), scale max|x| / 127, times the exact dequantized weights."""
    k = x.shape[1]
    group = 256 if block.values == 256 else 32
    pieces = x.numpy().reshape(x.shape[0], k // group, group).astype(np.float32)
    top = np.abs(pieces).max(axis=2, keepdims=True)
    scale = top / np.float32(127)
    inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(pieces * inverse)
    rounded = torch.from_numpy((q * scale).reshape(x.shape[0], k).astype(np.float32))
    weight = torch.from_numpy(gguf_dequantize(blocks, block)).reshape(blocks.shape[0], k)
    return rounded.double() @ weight.double().T


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_fast_mode_is_int8_activations_times_the_weights(fast_mm, threads, name):
    block, rng = TYPES[name], np.random.default_rng(5)
    k = 512
    blocks = random_blocks(block, 37, k, rng)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(1))
    got = fast_mm(x, torch.from_numpy(blocks), block.qtype, k)
    torch.testing.assert_close(got.double(), _fast_reference(x, blocks, block), rtol=1e-4, atol=1e-4)
    exact = x.double() @ torch.from_numpy(gguf_dequantize(blocks, block)).reshape(37, k).double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 2e-2, "int8 activations: about 1% of error at most"
    torch.set_num_threads(1)
    alone = torch.cat([fast_mm(x[m:m + 1], torch.from_numpy(blocks), block.qtype, k) for m in range(16)])
    for count in (1, 2):  # the rows of weights split between threads: no bit may change
        torch.set_num_threads(count)
        for rows in range(1, 17):
            assert torch.equal(fast_mm(x[:rows], torch.from_numpy(blocks), block.qtype, k), alone[:rows]), (rows, count)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_interleaved_layout_holds_the_same_blocks_and_multiplies_as_the_fast_mode(interleaved_ops, threads, name):
    block, rng, ops = TYPES[name], np.random.default_rng(7), interleaved_ops
    group_bytes = {"Q4_K": 2368, "Q6_K": 3392}.get(name, 16 * block.bytes)  # per 16 rows and block (super-block)
    for rows, k in ((48, 512), (16, 768 if block.values == 256 else 192)):
        blocks = random_blocks(block, rows, k, rng)
        groups = ops.interleave(torch.from_numpy(blocks), block.qtype, k)
        assert groups.shape == (rows // 16, k // block.values * group_bytes)
        assert torch.equal(ops.deinterleave(groups, block.qtype, k), torch.from_numpy(blocks)), "byte for byte"
        x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
        torch.set_num_threads(1)
        alone = torch.cat([ops.mm_interleaved(x[m:m + 1], groups, block.qtype, k) for m in range(16)])
        torch.testing.assert_close(alone.double(), _fast_reference(x, blocks, block), rtol=1e-4, atol=1e-4)
        # the same integer sums as the row-major fast kernel; only the order of the fp32 sums differs
        row_major = ops.mm(x, torch.from_numpy(blocks), block.qtype, k)
        torch.testing.assert_close(alone, row_major, rtol=1e-5, atol=1e-5)
        for count in (1, 2):  # groups of 16 weight rows split between threads: no bit may change
            torch.set_num_threads(count)
            for m in range(1, 17):
                assert torch.equal(ops.mm_interleaved(x[:m], groups, block.qtype, k), alone[:m]), (rows, k, m, count)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_both_interleaved_kernels_give_the_same_bits(name):
    """On the interleaved layout the AVX2 kernel computes the VNNI kernel's integer sums and then the same fp32
    operations per lane, so a model in the fast mode gives the same tokens on either CPU (checked where both run)."""
    vnni = getattr(torch.ops, built_here(gk.FAST_KERNELS["avx512"]).namespace)
    avx2 = getattr(torch.ops, built_here(gk.FAST_KERNELS["avx2"]).namespace)
    block, rng = TYPES[name], np.random.default_rng(11)
    k = 512
    blocks = torch.from_numpy(random_blocks(block, 32, k, rng))
    groups = avx2.interleave(blocks, block.qtype, k)
    assert torch.equal(groups, vnni.interleave(blocks, block.qtype, k)), "one layout"
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    assert torch.equal(avx2.mm_interleaved(x, groups, block.qtype, k), vnni.mm_interleaved(x, groups, block.qtype, k))


#: per interleaved type, the byte ranges of a block that hold its codes (and Q4_K's 6-bit scales, Q6_K's int8 ones),
#: and the byte that gives each code (or scale) its largest magnitude
EXTREME_CODES = {"Q4_0": [(2, 18, 0xFF)], "Q4_1": [(4, 20, 0xFF)], "Q5_0": [(2, 22, 0xFF)], "Q8_0": [(2, 34, 0x80)],
                 "Q4_K": [(4, 144, 0xFF)], "Q6_K": [(0, 192, 0xFF), (192, 208, 0x80)]}


@pytest.mark.parametrize("name", sorted(EXTREME_CODES))
def test_the_largest_codes_and_activations_do_not_saturate(interleaved_ops, name):
    """Every code at its largest magnitude times activations whose codes are all +-127: the kernels' int16 sums
    (the AVX2 kernels add several vpmaddubsw words before widening) must not saturate."""
    block, ops = TYPES[name], interleaved_ops
    blocks = random_blocks(block, 16, 512, np.random.default_rng(12))
    blocks = blocks.reshape(16, 512 // block.values, block.bytes)
    for start, end, byte in EXTREME_CODES[name]:
        blocks[:, :, start:end] = byte
    blocks = blocks.reshape(16, -1)
    x = torch.ones(3, 512)
    x[1] = -1.0
    x[2, ::2] = -1.0
    expected = _fast_reference(x, blocks, block)
    groups = ops.interleave(torch.from_numpy(blocks), block.qtype, 512)
    for got in (ops.mm_interleaved(x, groups, block.qtype, 512), ops.mm(x, torch.from_numpy(blocks), block.qtype, 512)):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_a_fast_layer_is_held_interleaved_and_looks_up_rows(fast_kernel, name):
    block, rng = TYPES[name], np.random.default_rng(8)
    blocks = torch.from_numpy(random_blocks(block, 64, 256, rng))
    layer = GGUFLinear(blocks, block, 256, mode="fast")
    assert layer.interleaved and layer.row_major is None and "interleaved" in repr(layer)
    assert torch.equal(layer.blocks, blocks), "the GGUF rows come back byte for byte"
    weight = torch.from_numpy(gguf_dequantize(blocks.numpy(), block)).reshape(64, 256)
    assert torch.equal(layer.dequantized(), weight)
    ids = torch.tensor([[0, 17, 63, 17], [15, 16, 17, 0]])  # repeated ids, several in one group of 16
    assert torch.equal(GGUFEmbedding(layer)(ids), weight[ids]), "a tied table's lookups, from the interleaved layout"
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), _fast_ops().mm_interleaved(x, layer.groups, block.qtype, 256))


def test_a_fast_layer_stays_row_major_where_it_cannot_interleave(fast_kernel):
    block, rng = TYPES["Q6_K"], np.random.default_rng(8)
    blocks = torch.from_numpy(random_blocks(block, 64, 256, rng))
    assert not GGUFLinear(blocks[:40], block, 256, mode="fast").interleaved, "40 rows: not a multiple of 16"
    assert not GGUFLinear(blocks, block, 256).interleaved, "the exact mode multiplies the file's rows"
    assert not GGUFLinear(torch.from_numpy(random_blocks(TYPES["Q5_K"], 16, 256, rng)), TYPES["Q5_K"], 256,
                          mode="fast").interleaved, "Q5_K stays row-major"


def test_the_interleaved_operators_refuse_what_they_cannot_hold(interleaved_ops):
    ops, rng = interleaved_ops, np.random.default_rng(9)
    q4k = torch.from_numpy(random_blocks(TYPES["Q4_K"], 40, 256, rng))
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \[16 n, 144\]"):
        ops.interleave(q4k, 12, 256)  # 40 rows: not whole groups of 16
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K, got 13"):
        ops.interleave(torch.zeros(16, 176, dtype=torch.uint8), 13, 256)  # Q5_K
    with pytest.raises(RuntimeError, match="not a positive multiple of 256"):
        ops.interleave(q4k[:16], 12, 128)
    groups = ops.interleave(q4k[:32].contiguous(), 12, 256)
    with pytest.raises(RuntimeError, match="must end in 256 features"):
        ops.mm_interleaved(torch.randn(1, 128), groups, 12, 256)
    with pytest.raises(RuntimeError, match=r"groups must be a contiguous uint8 \[n, 4736\]"):
        ops.mm_interleaved(torch.randn(1, 512), groups, 12, 512)


def test_in_the_fast_mode_an_untied_table_stays_as_the_files_rows(fast_kernel, tiny_gguf):
    folder, _ = tiny_gguf("qwen2")  # untied: a Q8_0 table and a Q6_K head
    target = IPEXModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", gguf_mode="fast")
    table, head = target.model.model.embed_tokens.table, target.model.lm_head
    assert not table.interleaved and not table.fast and head.interleaved


def test_released_pages_keep_the_files_bytes(kernel, tiny_gguf):
    """Releasing a tensor's pages never changes what they hold (their memory effect is measured in
    benchmarks/gguf_llamacpp.py's RSS line)."""
    _, path = tiny_gguf("qwen2")
    gguf_file = gw.read_gguf(path)
    before = gguf_file.blocks("output.weight").clone()
    gguf_file.release("output.weight")
    assert torch.equal(gguf_file.blocks("output.weight"), before)


@pytest.mark.parametrize("kind", ["int8 self-draft", "prompt lookup", "gguf draft of another seed"])
def test_speculation_over_a_fast_mode_target_is_lossless(fast_kernel, qwen_gguf, tiny_gguf, kind):
    folder = qwen_gguf["folder"]
    target = IPEXModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", gguf_mode="fast")
    assert any(m.fast for m in target.model.modules() if isinstance(m, GGUFLinear))
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    extra = _drafts(kind, {**qwen_gguf, "target": target}, tiny_gguf)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, **extra), alone), kind


@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # untied (table row-major) and tied (interleaved)
def test_sampling_and_lookup_over_a_fast_target(fast_kernel, tiny_gguf, arch):
    folder, path = tiny_gguf(arch)
    target = IPEXModelForCausalLM.from_pretrained(path, gguf_mode="fast")
    assert target.model.lm_head.fast and target.model.lm_head.interleaved
    alone = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=5), alone)
    draft = IPEXModelForCausalLM.from_pretrained(folder, export=True, weights="int8")
    # top_k=1 goes through the sampling verification and must give the greedy tokens
    got = target.generate(PROMPT, max_new_tokens=24, do_sample=True, top_k=1, assistant_model=draft)
    assert torch.equal(got, alone)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(target.generate(PROMPT, max_new_tokens=16, do_sample=True, temperature=1.0, assistant_model=draft))
    assert torch.equal(runs[0], runs[1]), "the same seed gives the same output"


def test_gguf_mode_is_checked(kernel, tiny_gguf):
    _, path = tiny_gguf("llama")
    with pytest.raises(ValueError, match="gguf_mode must be one of"):
        IPEXModelForCausalLM.from_pretrained(path, gguf_mode="int8")


@pytest.mark.parametrize("change", [{"num_attention_heads": 8}, {"num_hidden_layers": 1}, {"vocab_size": 500},
                                    {"rms_norm_eps": 0.1}])
def test_a_config_that_splits_the_file_otherwise_is_refused(kernel, tiny_gguf, tmp_path, change):
    """Shapes alone cannot tell 8 heads of 32 from 4 of 64, nor see the file's layers a config leaves out: the
    file's own metadata and tensor names can."""
    import json
    import shutil

    folder, _ = tiny_gguf("qwen2")
    copy = tmp_path / "other-split"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(change)
    if "num_hidden_layers" in change:
        config.pop("layer_types", None)  # transformers 5 checks one per layer
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFError, match="the config does not describe this file"):
        IPEXModelForCausalLM.from_pretrained(str(copy), gguf_file="model.gguf")


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_fast_mode_keeps_a_nan_activation_visible(interleaved_ops, name):
    block, ops = TYPES[name], interleaved_ops
    blocks = torch.from_numpy(random_blocks(block, 16, 256, np.random.default_rng(6)))
    x = torch.randn(5, 256)
    x[1, 17] = float("nan")
    x[2] = 1e-38  # so small that 127 / max|x| overflows: codes 0, outputs 0
    x[3, 3], x[4, 200] = float("inf"), float("-inf")  # as a NaN: no sign to trust after rounding to int8
    for out in (ops.mm(x, blocks, block.qtype, 256),  # the file's rows, and the interleaved layout
                ops.mm_interleaved(x, ops.interleave(blocks, block.qtype, 256), block.qtype, 256)):
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all() and torch.equal(out[2], torch.zeros(16))
        assert torch.isnan(out[3:]).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bare_files_config_is_transformers(kernel, tiny_gguf, tmp_path, arch):
    """A .gguf file with no config.json beside it: the config built from its metadata (our header reader) is the one
    transformers' AutoConfig(gguf_file=) builds, every attribute, a one-element array read as its element too."""
    import transformers

    from optimum_ipex_spec.loading.gguf import config_from_metadata

    folder = tmp_path / arch
    folder.mkdir()
    path = write_tiny_gguf(str(folder), arch, head_count_kv_array=True)
    os.remove(folder / "config.json")
    expected = transformers.AutoConfig.from_pretrained(str(folder), gguf_file="model.gguf")
    ours = config_from_metadata(gw.read_gguf(path))
    assert ours.num_key_value_heads == KV_HEADS and ours.num_hidden_layers == LAYERS
    assert type(ours) is type(expected) and ours.to_dict() == expected.to_dict()
