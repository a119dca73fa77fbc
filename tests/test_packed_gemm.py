"""optimum_ipex_spec.kernels.packed_gemm: the packed kernel of the compiled fp32 and bf16 graphs. Its products against
F.linear (bf16: against the fp32 product of the bf16 operands), every row of a chunk the same bits as that row alone
(and, in fp32, as Inductor's compiled one-row GEMM), the packed layouts, bad input, and the fallback where it cannot
run."""

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from optimum_ipex_spec.backends.pytorch import compiled_step

from optimum_ipex_spec.kernels import packed_gemm
from optimum_ipex_spec.compat import torch_at_least
from optimum_ipex_spec.backends.pytorch.compiled_step import CPP_ONLY_FROM_TORCH
from optimum_ipex_spec.kernels.packed_gemm import (
    BLOCK_N,
    PackedEmbedding,
    PackedLinear,
    pack_weight,
    packed_gemm_available,
)

from conftest import build_tiny


@pytest.fixture
def kernel():
    """The kernel runs on AVX-512 CPUs (every machine this project's CI and benchmarks use); there it must build."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the packed fp32 kernel is built for AVX-512 CPUs only")
    assert packed_gemm_available()


@pytest.fixture
def bf16_kernel(kernel):
    """The bf16 kernel needs AVX512-BF16 too (this project's Xeon has it; an AVX-512 CPU without it skips)."""
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("the packed bf16 kernel needs AVX512-BF16")
    assert packed_gemm_available(torch.bfloat16)


# 1, 3, 7 (one row: four blocks at once, then two, then one) and 32 blocks of 48 columns
@pytest.mark.parametrize("out_features, in_features", [(32, 16), (48, 64), (100, 33), (300, 62), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_products_are_the_rounded_fp32_sums_each_row_as_alone(bf16_kernel, out_features, in_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(1, rows, in_features, dtype=torch.bfloat16)
        got = packed(x)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
        # the fp32 sum of the bf16 products, rounded to bf16 (then the bias added in bf16): within a bf16 ulp or two
        want = x.float() @ linear.weight.float().t()
        want = want.to(torch.bfloat16) + linear.bias if bias else want
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
        alone = torch.cat([packed(x[:, i:i + 1]) for i in range(rows)], dim=1)
        assert torch.equal(got, alone), f"{rows} rows"


@pytest.mark.parametrize("in_features", [64, 48])  # 48: not a multiple of 32, so vdpbf16ps at any row count
def test_bf16_prefills_run_on_amx_tiles_to_bf16_rounding(bf16_kernel, in_features):
    if not packed_gemm.packed_amx_available():
        pytest.skip("no AMX-BF16 here (or Linux did not grant AMX tile data)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, 100, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear.weight, linear.bias)
    for rows in (16, 17, 40):
        x = torch.randn(2, rows, in_features, dtype=torch.bfloat16)
        got = packed(x)
        want = (x.float() @ linear.weight.float().t()).to(torch.bfloat16) + linear.bias
        assert got.shape == (2, rows, 100)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_that_start_mid_group_give_the_same_bits(kernel, dtype):
    """Threads split the blocks of 48 columns at any block (3 threads over 7: 0-2, 3-5, 6), and one row reads blocks in
    groups of two or four from each thread's first: every split gives the one-thread bits."""
    if dtype == torch.bfloat16 and not packed_gemm_available(torch.bfloat16):
        pytest.skip("the packed bf16 kernel needs AVX512-BF16")
    torch.manual_seed(0)
    weight = torch.randn(300, 62).to(dtype)
    packed = PackedLinear(weight)
    previous = torch.get_num_threads()
    try:
        for rows in (1, 3, 4):
            x = torch.randn(1, rows, 62).to(dtype)
            torch.set_num_threads(1)
            want = packed(x)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(packed(x), want), (rows, threads)
    finally:
        torch.set_num_threads(previous)


def test_the_bf16_layout_is_pairs_of_k_side_by_side_per_column():
    weight = torch.arange(50 * 5, dtype=torch.float32).view(50, 5).to(torch.bfloat16)
    packed = pack_weight(weight)
    assert packed.shape == (2, 3, 2 * BLOCK_N) and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    pairs = packed.view(2, 3, BLOCK_N, 2)
    assert torch.equal(pairs[0, 1, 7], weight[7, 2:4])  # block 0, pair 1 (k = 2, 3), column 7
    assert torch.equal(pairs[1, 2, 1], torch.stack([weight[49, 4], weight.new_zeros(())]))  # the odd k: a zero pair
    assert not pairs[1, :, 2:].any()  # columns 50-95: padding


@pytest.mark.parametrize("out_features, in_features", [(32, 16), (48, 64), (100, 64), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_row_of_a_chunk_is_that_row_alone_bit_for_bit(kernel, out_features, in_features, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = PackedLinear(linear.weight, linear.bias)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(1, rows, in_features)
        got = packed(x)
        assert got.shape == (1, rows, out_features) and got.dtype == torch.float32
        want = F.linear(x, linear.weight, linear.bias)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        alone = torch.cat([packed(x[:, i:i + 1]) for i in range(rows)], dim=1)
        assert torch.equal(got, alone), f"{rows} rows"


def test_a_chunk_gives_the_bits_of_inductors_one_row_gemm(kernel):
    """The claim the compiled step relies on (and checks on each model): the same register blocking, one fused
    multiply-add per k in order, so a row multiplied in a chunk of 4 here has the bits Inductor's frozen 1-row GEMM
    gives it (SmolLM2's gate/up shape)."""
    if not torch_at_least(CPP_ONLY_FROM_TORCH):
        pytest.skip(f"before torch {CPP_ONLY_FROM_TORCH} the autotuner also offers ATen's GEMMs, which round otherwise "
                    "(the compiled step then pads single tokens and does not use this kernel)")
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=False).eval()
    packed = PackedLinear(linear.weight)
    x = torch.randn(1, 4, 576)
    settings = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    with torch.no_grad(), torch._inductor.config.patch(settings), \
            torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        compiled = torch.compile(linear, dynamic=False)
        one_row = torch.cat([compiled(x[:, i:i + 1]) for i in range(4)], dim=1)
    assert torch.equal(packed(x), one_row)


def test_the_packed_layout_is_blocks_of_48_columns_padded_with_zeros():
    weight = torch.arange(100 * 3, dtype=torch.float32).view(100, 3)
    packed = pack_weight(weight)
    assert packed.shape == (3, 3, BLOCK_N) and packed.is_contiguous()
    assert torch.equal(packed[1, :, 5], weight[48 + 5])  # block 1, column 5: output row 53, read along k
    assert torch.equal(packed[2, :, :4].t(), weight[96:])
    assert not packed[2, :, 4:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, in_features", [(100, 33), (96, 64), (5, 2)])
def test_unpacking_gives_the_weight_back_and_the_embedding_reads_the_heads_rows(dtype, out_features, in_features):
    """A model that holds its weights once saves them unpacked, and a tied embedding reads its rows from the head's
    packed copy: both the original values bit for bit."""
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(dtype)
    head = PackedLinear(weight)
    assert torch.equal(head.unpacked_weight(), weight)
    embedding = PackedEmbedding(head)
    assert embedding.packed is head.packed  # no copy of its own
    ids = torch.tensor([[0, out_features - 1, 47 % out_features], [1, 3 % out_features, 0]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, in_features) and rows.dtype == dtype
    assert torch.equal(rows, F.embedding(ids, weight))
    state = torch.nn.ModuleDict({"head": head, "embed": embedding}).state_dict()
    assert set(state) == {"head.weight", "embed.weight"} and state["head.weight"] is state["embed.weight"]
    assert torch.equal(state["head.weight"], weight)


def test_state_dicts_of_modules_packed_in_inference_mode_and_of_a_model_that_replaced_another():
    """Found by a review: the memo that makes a tied head and its embedding one tensor read the packed copy's version
    counter, which tensors made under ``torch.inference_mode()`` lack, and outlived the state dict it served, so a new
    packed copy at a freed one's address could get the old weights. It now lives as long as one state dict."""
    torch.manual_seed(0)
    with torch.inference_mode():
        weight = torch.randn(100, 33)
        head = PackedLinear(weight)
        modules = torch.nn.ModuleDict({"head": head, "embed": PackedEmbedding(head)})
    state = modules.state_dict()
    assert torch.equal(state["head.weight"], weight) and state["head.weight"] is state["embed.weight"]
    kept = state["head.weight"]
    del modules, head, state
    for _ in range(5):  # new copies, of the same shape, often at the freed addresses
        other = torch.randn(100, 33)
        got = PackedLinear(other).state_dict()["weight"]
        assert torch.equal(got, other) and got is not kept
    plain = {}  # a destination that takes no weak reference: each module unpacks its own
    head = PackedLinear(weight.clone())
    torch.nn.ModuleDict({"head": head, "embed": PackedEmbedding(head)}).state_dict(destination=plain)
    assert torch.equal(plain["head.weight"], weight) and torch.equal(plain["embed.weight"], weight)


def test_the_packed_modules_refuse_what_an_nn_module_would_and_a_cast_layout():
    """Found by a break-it review: ids past the vocabulary read the packed head's zero padding (or wrapped) instead
    of raising as nn.Embedding does; a bf16 x one feature short was padded; a module cast after packing failed deep
    in the kernel."""
    torch.manual_seed(0)
    head = PackedLinear(torch.randn(50, 8))
    embedding = PackedEmbedding(head)
    for bad in (50, 95, -1, -100):
        with pytest.raises(IndexError, match=f"token id {bad} is out of range for an embedding of 50 rows"):
            embedding(torch.tensor([[3, bad]]))
    assert torch.equal(embedding(torch.tensor(7)), head.unpacked_weight()[7])  # a 0-D id, as nn.Embedding takes
    assert embedding(torch.zeros(0, dtype=torch.long)).shape == (0, 8)
    bf16 = PackedLinear(torch.randn(50, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="takes 8 input features, got x of shape \\(2, 7\\)"):
        bf16(torch.ones(2, 7, dtype=torch.bfloat16))
    cast = PackedLinear(torch.randn(50, 8)).to(torch.bfloat16)
    with pytest.raises(TypeError, match="packed for torch.float32 and then cast to torch.bfloat16"):
        cast(torch.ones(2, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="packed for torch.float32"):
        PackedEmbedding(head).to(torch.bfloat16)(torch.tensor([1]))


def test_bad_input_is_refused_with_what_to_fix(kernel):
    with pytest.raises(ValueError, match="2-D float32 or bfloat16 weight"):
        pack_weight(torch.ones(96, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D float32 or bfloat16 weight"):
        pack_weight(torch.ones(96))
    packed = pack_weight(torch.ones(96, 8))
    with pytest.raises(RuntimeError, match="x has 7 features, the weight 8"):
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(2, 7), packed, 96)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 tensors of one dtype"):
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(2, 8, dtype=torch.bfloat16), packed, 96)
    with pytest.raises(RuntimeError, match="output features do not match"):
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(2, 8), packed, 40)
    with pytest.raises(RuntimeError, match="0-D tensor"):
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(()), packed, 96)
    bf16 = pack_weight(torch.ones(96, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="pack_weight"):  # an fp32 layout read as bf16's
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(2, 8, dtype=torch.bfloat16), packed.to(torch.bfloat16), 96)
    with pytest.raises(RuntimeError, match="x has 10 features, the weight 7 or 8"):
        torch.ops.optimum_ipex_spec.packed_mm(torch.ones(2, 10, dtype=torch.bfloat16), bf16, 96)


def test_without_avx512_it_says_so_and_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with caplog.at_level(logging.INFO, logger="optimum_ipex_spec"):
        assert packed_gemm.packed_gemm_available.__wrapped__() is False
    assert "needs AVX-512 (this CPU: AVX2)" in caplog.text


def test_without_avx512_bf16_the_bf16_kernel_says_so_and_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with caplog.at_level(logging.INFO, logger="optimum_ipex_spec"):
        assert packed_gemm.packed_gemm_available.__wrapped__(torch.bfloat16) is False
    assert "needs AVX512-BF16" in caplog.text
    assert packed_gemm.packed_gemm_available.__wrapped__(torch.float16) is False  # no kernel for other dtypes


def test_a_failed_build_is_logged_and_the_chunk_graph_keeps_inductors_gemms(monkeypatch, caplog):
    """Where the kernel cannot be built (no compiler or ninja) the chunk graph compiles with Inductor's GEMMs, still
    checked bit for bit against the 1-token graph."""
    if not torch_at_least(CPP_ONLY_FROM_TORCH):
        pytest.skip("before torch 2.13 single fp32 tokens run padded on the chunk graph: no second graph to build")

    def no_build(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec"):
        assert packed_gemm._kernel_built.__wrapped__() is False
    assert "Could not build the packed kernel (RuntimeError: Ninja is required" in caplog.text
    monkeypatch.setattr(compiled_step, "packed_gemm_available", lambda dtype: False)
    from optimum_ipex_spec import IPEXModelForCausalLM

    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512), backend="torch",
                                                         torch_compile=True)
    assert model.compile_chunk_step()
    step = model.runner.step
    assert step.kernel == "inductor" and step.module.packed is None and step.chunk_exact is True
