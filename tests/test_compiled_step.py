"""``torch_compile=True`` (optimum_ipex_spec.backends.pytorch.compiled_step): the compiled bf16 one-token step against
our eager decoder, crop and capacity changes without recompiling, a compiled bf16 draft that keeps an fp32 target exact,
the fallback when compiling fails, int8 weights compiled, and clear errors where it does not apply. Each compile of a
tiny model takes seconds.
"""

import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from optimum_ipex_spec import IPEXModelForCausalLM
from optimum_ipex_spec.backends.pytorch import compiled_step
from optimum_ipex_spec.kernels import packed_gemm
from optimum_ipex_spec.kernels.packed_gemm import PackedEmbedding, packed_gemm_available

from conftest import build_tiny



@pytest.fixture
def dense_bf16_compile():
    """The compiled dense bf16 step runs only where oneDNN has bf16; elsewhere torch_compile=True refuses it
    (test_dense_bf16_compile_is_refused_on_a_cpu_without_onednn_bf16 checks that on every CPU)."""
    reason = compiled_step.dense_bf16_compile_unsupported()
    if reason:
        pytest.skip(reason)


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def _windowed_mistral():
    torch.manual_seed(3)
    model = MistralForCausalLM(MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=6, max_position_embeddings=256, pad_token_id=2))
    model.config.architectures = ["MistralForCausalLM"]
    return model.eval()


def _pair(build):
    """(our eager bf16 model, our compiled bf16 model) of one seeded model."""
    eager = IPEXModelForCausalLM.from_transformers_model(build().to(torch.bfloat16), backend="torch")
    compiled = IPEXModelForCausalLM.from_transformers_model(build().to(torch.bfloat16), backend="torch",
                                                            torch_compile=True)
    assert compiled.runner.step is not None and compiled.runner.step.compile_seconds > 0
    return eager, compiled


@pytest.mark.parametrize("build", [lambda: build_tiny("qwen2", vocab_size=512),  # q/k/v biases, grouped queries
                                   _windowed_mistral],  # a sliding window shorter than the sequence
                         ids=["qwen2", "mistral-window"])
def test_compiled_step_tracks_the_eager_decoder_and_crops_exactly(build, dense_bf16_compile):
    eager, compiled = _pair(build)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the counter counts compiles
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (1, 9))
    caches = [m.runner.new_cache(1, 10) for m in (eager, compiled)]  # capacity 10: decoding grows it
    for model, cache in zip((eager, compiled), caches):
        model(prompt, past_key_values=cache)
    token = prompt[:, -1:]
    steps = []
    for _ in range(8):
        want = eager(token, past_key_values=caches[0]).logits.float()
        got = compiled(token, past_key_values=caches[1]).logits.float()
        assert got.shape == want.shape == (1, 1, 512)
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
        steps.append(got)
        token = want.argmax(-1)
    assert caches[1].capacity > 10 and caches[1].get_seq_length() == 17
    for layer in range(2):  # the compiled step wrote the same keys/values at the same rows
        assert torch.allclose(caches[1].keys[layer][:, :, :17].float(), caches[0].keys[layer][:, :, :17].float(),
                              atol=0.05)
    # crop back 3 tokens and decode them again: the same logits, bit for bit (stale rows are masked out)
    caches[1].crop(14)
    tokens = [s.argmax(-1) for s in steps]
    replay = [compiled(tokens[i - 1] if i else prompt[:, -1:], past_key_values=caches[1]).logits.float()
              for i in range(5, 8)]
    for again, first in zip(replay, steps[5:]):
        assert torch.equal(again, first)
    # a cache of another capacity runs the graph compiled at load: no recompile
    other = compiled.runner.new_cache(1, 40)
    compiled(prompt, past_key_values=other)
    compiled(prompt[:, -1:], past_key_values=other)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_compiled_bf16_graphs_share_one_packed_copy_and_verify_as_they_decode(dense_bf16_compile):
    """bf16 compiled: both graphs multiply with the packed bf16 kernel where the CPU has AVX512-BF16 (one packed copy
    of the weights for both, where Inductor's GEMM templates held one per graph), and a chunk of 4 verified on the
    4-token graph gives the logits its tokens decode to one at a time (to bf16 rounding: attention reads other
    lengths)."""
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512).to(torch.bfloat16),
                                                         backend="torch", torch_compile=True)
    step = model.runner.step
    packed_here = _avx512() and torch.cpu._is_avx512_bf16_supported()
    assert step.kernel == ("packed" if packed_here else "inductor")
    assert (step.module.packed is not None) == packed_here
    packed = step.module.packed
    assert model.compile_chunk_step() and step.module.packed is packed and not step.failed
    if packed_here:
        assert packed[0][0].packed.dtype == torch.bfloat16
        # where its prefills run on AMX tiles the packed copy is the model's only one
        held_once = packed_gemm.packed_amx_available()
        assert model.runner.decoder.packed == held_once
        assert any(isinstance(m, torch.nn.Linear) for m in model.model.modules()) != held_once
    torch.manual_seed(0)
    prompt, more = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 4))
    caches = [model.runner.new_cache(1, 20) for _ in range(2)]
    for cache in caches:
        model(prompt, past_key_values=cache)
    steps = torch.cat([model(more[:, i:i + 1], past_key_values=caches[0]).logits for i in range(4)], 1).float()
    chunk = model(more, past_key_values=caches[1]).logits.float()
    assert chunk.shape == steps.shape == (1, 4, 512)
    assert (chunk - steps).abs().max() <= 0.02 * steps.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_fp32_target_verifies_chunks_as_its_steps_decode(arch):
    """fp32 compiled (the target of speculative decoding): tokens decoded one at a time (the 1-token graph) and a
    chunk of 6 (the 4-token graph, 4 + 2 padded rows) give the same logits bit for bit, and the eager decoder's logits
    and keys/values to fp32 rounding; the padding rows are not counted by the cache."""
    def build():
        return build_tiny(arch, vocab_size=512)

    eager = IPEXModelForCausalLM.from_transformers_model(build(), backend="torch")
    compiled = IPEXModelForCausalLM.from_transformers_model(build(), backend="torch", torch_compile=True)
    step = compiled.runner.step
    # single tokens run on a 1-token graph where the autotuner offers Inductor's C++ GEMM templates alone (torch >=
    # 2.13), else padded on the 4-token graph (ATen's kernels offered: MKL rounds one row and four differently)
    padded = step._settings["max_autotune_gemm_backends"] != "CPP"
    assert step is not None and step.compile_seconds > 0
    assert step.step_rows == (compiled_step.CHUNK_ROWS if padded else 1)
    # the 1-token graph already multiplies with the packed weights, which the chunk graph then shares
    assert (step.module.packed is not None) == (step.kernel == "packed")
    packed = step.module.packed
    torch.manual_seed(0)
    prompt, more = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 6))
    caches = {name: m.runner.new_cache(1, 10) for name, m in (("eager", eager), ("steps", compiled),
                                                              ("chunk", compiled))}
    for name, cache in caches.items():
        (eager if name == "eager" else compiled)(prompt, past_key_values=cache)
    want = eager(more, past_key_values=caches["eager"]).logits
    steps = torch.cat([compiled(more[:, i:i + 1], past_key_values=caches["steps"]).logits for i in range(6)], 1)
    chunk = compiled(more, past_key_values=caches["chunk"]).logits
    # the chunk compiled the 4-token graph, which checked that it gives each row the 1-token graph's bits (or it is
    # the one graph)
    assert step.chunk_exact is True and not step.failed and (step.chunk_compile_seconds == 0) == padded
    # both graphs multiply with the packed fp32 kernel on AVX-512 CPUs where single tokens have a graph of their own
    assert step.kernel == ("packed" if not padded and _avx512() else "inductor") and step.module.packed is packed
    assert want.shape == steps.shape == chunk.shape == (1, 6, 512) and chunk.dtype == torch.float32
    scale = want.abs().max()
    assert (steps - want).abs().max() <= 1e-5 * scale and (chunk - want).abs().max() <= 1e-5 * scale
    assert torch.equal(chunk, steps)
    assert caches["chunk"].get_seq_length() == caches["steps"].get_seq_length() == 15
    for layer in range(len(caches["eager"].keys)):
        for buffers in ("keys", "values"):
            ref = getattr(caches["eager"], buffers)[layer][:, :, :15]
            for name in ("steps", "chunk"):
                assert torch.allclose(getattr(caches[name], buffers)[layer][:, :, :15], ref, atol=1e-5)


def test_a_chunk_graph_that_rounds_otherwise_verifies_token_by_token(tiny_dir, caplog):
    """Where the fp32 4-token graph does not give a row the 1-token graph's bits (simulated: its logits nudged by one
    ulp-sized step), the check at its compile says so in a warning, chunks then run one token at a time on the 1-token
    graph (the target reports 1-token verification calls to the cost model), and assisted generation still returns
    plain decoding's logits bit for bit."""
    target = IPEXModelForCausalLM.from_pretrained(tiny_dir("llama"), export=True, backend="torch", torch_compile=True)
    step = target.runner.step
    step.step_rows, step.chunk_exact = 1, None  # a 1-token graph, also where single tokens would run padded
    compiled, rows = step._compiled, []

    def nudged(*args):
        rows.append(args[0].shape[1])
        logits = compiled(*args)
        return logits * (1 + 1e-6) if args[0].shape[1] == compiled_step.CHUNK_ROWS else logits

    step._compiled = nudged
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec.backends.pytorch.compiled_step"):
        assert target.compile_chunk_step()
    assert step.chunk_exact is False and target.runner.verify_rows == 1 and not step.failed
    assert "rounds differently from the 1-token graph" in caplog.text
    draft = target.self_draft(backend="torch")
    draft.generation_config.assistant_confidence_threshold = 0.0  # a random model is never confident
    torch.manual_seed(1)
    ids = torch.randint(3, 1000, (1, 12))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                  return_dict_in_generate=True, output_logits=True)
    plain = target.generate(ids, **kwargs)
    rows.clear()
    assisted = target.generate(ids, assistant_model=draft, num_assistant_tokens=3,
                               num_assistant_tokens_schedule="constant", **kwargs)
    assert draft.last_speculation_stats.proposed > 0 and rows and set(rows) == {1}
    assert torch.equal(assisted.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(assisted.logits, plain.logits))


def test_two_compiled_models_of_one_shape_each_run_their_own_weights():
    """The step compiles without Dynamo's guards on its modules (their weights): two models of the same architecture
    and shapes but other weights, compiled in one process, must each run their own graph, not the other's."""
    models = [IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=seed, vocab_size=512),
                                                           backend="torch", torch_compile=True) for seed in (0, 1)]
    eager = [IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=seed, vocab_size=512),
                                                          backend="torch") for seed in (0, 1)]
    prompt = torch.randint(3, 500, (1, 6))
    got, want = [], []
    for compiled, reference in zip(models, eager):
        caches = [compiled.runner.new_cache(1, 16), reference.runner.new_cache(1, 16)]
        compiled(prompt, past_key_values=caches[0])
        reference(prompt, past_key_values=caches[1])
        got.append(compiled(prompt[:, -1:], past_key_values=caches[0]).logits)
        want.append(reference(prompt[:, -1:], past_key_values=caches[1]).logits)
    assert not torch.allclose(want[0], want[1], atol=1e-3)  # the two models differ
    for mine, reference in zip(got, want):
        assert (mine - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_compiled_fp32_target_is_exact_with_a_draft_and_prompt_lookup(tiny_dir):
    """The target compiled in fp32 decodes as stock transformers does (greedy), and assisted generation (a bf16
    self-draft) and prompt lookup return those tokens, with their verification chunks on the compiled graphs."""
    path = tiny_dir("llama")
    stock = AutoModelForCausalLM.from_pretrained(path).eval()
    target = IPEXModelForCausalLM.from_pretrained(path, export=True, backend="torch", torch_compile=True)
    draft = target.self_draft(backend="torch")
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # a random model is never confident
    assert target.runner.step.compile_chunk()  # ahead: its scratch run is not a verification
    chunks = []
    run = target.runner.step._run
    target.runner.step._run = lambda tokens, *args: chunks.append(len(tokens)) or run(tokens, *args)
    torch.manual_seed(1)
    ids = torch.randint(3, 1000, (1, 12))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = stock.generate(ids, **kwargs)
    assert torch.equal(target.generate(ids, **kwargs), want)
    assisted = target.generate(ids, assistant_model=draft, num_assistant_tokens_schedule="constant", **kwargs)
    assert torch.equal(assisted, want)
    assert draft.last_speculation_stats.proposed > 0 and any(n > 1 for n in chunks)  # compiled verification ran
    # the default schedule: the cost model, told that the target verifies in 4-token calls, starts at k = 3
    assert torch.equal(target.generate(ids, assistant_model=draft, **kwargs), want)
    model = target.last_cost_model
    rows = compiled_step.CHUNK_ROWS
    assert (model.verify_rows, model.first_tokens) == (rows, rows - 1), model.report()
    # prompt lookup on the prompt and its continuation, then the prompt again: its n-grams recur, lookup proposes
    ids = torch.cat([want, ids], 1)
    kwargs["attention_mask"] = torch.ones_like(ids)
    want = stock.generate(ids, **kwargs)
    chunks.clear()
    got = target.generate(ids, prompt_lookup_num_tokens=3, num_assistant_tokens_schedule="constant", **kwargs)
    assert torch.equal(got, want) and any(n > 1 for n in chunks)
    # and under the cost model (the default schedule), which prices the lookup's rounds by the target's 4-token calls
    assert torch.equal(target.generate(ids, prompt_lookup_num_tokens=3, **kwargs), want)
    assert target.last_cost_model.verify_rows == compiled_step.CHUNK_ROWS


@pytest.mark.parametrize("prompt_tokens", [12, 500], ids=["short-capacity", "past-one-attention-block"])
def test_compiled_fp32_target_gives_the_same_logits_bit_for_bit_under_every_strategy(tmp_path, prompt_tokens):
    """Not only the same tokens: plain greedy decoding, assisted generation (constant and default schedules) and
    prompt lookup on a compiled fp32 target give the same logits for every generated token, the last ones included.
    Plain decoding runs the 1-token graph, verification the 4-token one (checked to round each row alike when it
    compiled). The kernel's rounding depends on the rows attention reads (masked ones too). A short generation reads
    the whole capacity (bar one row), which generate() sizes for the compiled graphs' padding rows: with a capacity
    that grew at the last tokens, the last 1-3 tokens' logits of this model differed between plain decoding and the
    other strategies. A long one (500 + 24 tokens) reads the filled rows rounded up to a multiple of the kernel's block
    of 512 keys, 512 and then 1,024 rows here, and no bit changes with the length; nothing recompiles for it."""
    build_tiny("llama", vocab_size=512).save_pretrained(tmp_path)
    target = IPEXModelForCausalLM.from_pretrained(str(tmp_path), export=True, backend="torch", torch_compile=True)
    assert target.runner.step is not None
    assert target.compile_chunk_step() and target.runner.step.chunk_exact is True  # ahead: no graph compiles below
    padded = target.runner.step.step_rows == compiled_step.CHUNK_ROWS
    assert target.runner.step.kernel == ("packed" if not padded and _avx512() else "inductor")
    draft = target.self_draft(backend="torch")
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # a random model is never confident
    lengths = []
    compiled = target.runner.step._compiled
    target.runner.step._compiled = lambda *args: lengths.append(args[3].shape[0]) or compiled(*args)
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(1)
    ids = torch.randint(3, 500, (1, prompt_tokens))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                  return_dict_in_generate=True, output_logits=True)
    plain = target.generate(ids, **kwargs)
    assert len(plain.logits) == 24
    block = compiled_step.ATTENTION_BLOCK
    assert set(lengths) == ({block, 2 * block} if prompt_tokens + 24 > block else {prompt_tokens + 24 + 2}), lengths
    strategies = {"draft, constant k": dict(assistant_model=draft, num_assistant_tokens_schedule="constant"),
                  "draft, cost model": dict(assistant_model=draft), "prompt lookup": dict(prompt_lookup_num_tokens=3)}
    for name, strategy in strategies.items():
        got = target.generate(ids, **strategy, **kwargs)
        assert torch.equal(got.sequences, plain.sequences) and len(got.logits) == 24
        differ = [i for i, (a, b) in enumerate(zip(got.logits, plain.logits)) if not torch.equal(a, b)]
        assert not differ, f"{name}: the logits of generated tokens {differ} differ from plain decoding's"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("needed, capacity, length", [
    (4, 16, 15),  # a short capacity: all of it but the row kept free, whatever the call needs
    (300, 310, 309), (512, 513, 512),  # up to a capacity of 513 (a length of 512)
    (513, 514, 1024),  # one row more: whole blocks (the caller grows the cache to hold them)
    (2, 1025, 512), (512, 1025, 512), (513, 1025, 1024), (1024, 1025, 1024),  # long: the needed rows, to 512s
    (700, 4097, 1024),
])
def test_the_exact_fp32_graph_reads_the_capacity_or_whole_blocks(needed, capacity, length):
    assert compiled_step.exact_attention_length(needed, capacity) == length


def test_the_exact_attention_length_refuses_a_cache_without_its_free_row():
    with pytest.raises(ValueError, match="reserve 17 first"):
        compiled_step.exact_attention_length(16, 16)


@pytest.mark.parametrize("rows, padded", [(1, 4), (2, 4), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8), (12, 12),
                                          (33, 36), (36, 36)])
def test_the_exact_graphs_hand_sdpa_query_rows_in_fours(rows, padded):
    assert compiled_step.attention_query_rows(rows) == padded


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sdpa_gives_a_token_the_same_bits_in_the_1_token_and_the_4_token_graphs_query_rows(kv_heads, threads):
    """What the exact fp32 graphs rely on, checked on this machine's kernel (the one the graphs call): a token's query
    rows (one per head of a key/value group) get the same bits from SDPA's CPU kernel in the 1-token graph's call
    (``group`` rows, padded by :func:`attention_query_rows`) as among the 4-token graph's ``4 * group`` rows, for 1-8
    query heads per key/value head. Found on an AMD EPYC Zen 4 (torch 2.13, MKL 2024.2; issue 46): unpadded, 1-3 rows
    rounded otherwise than 4 or more, and with one key/value head on 2 threads 5-7 rows too."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for group in range(1, 9):
            _check_query_rows(group, kv_heads)
    finally:
        torch.set_num_threads(previous)


def test_the_load_time_probe_tells_a_kernel_that_rounds_few_query_rows_otherwise(monkeypatch):
    """:func:`attention_rows_round_alike` (whether the exact graphs pad their query rows) is False where SDPA gives a
    token's rows other bits alone than among 4 tokens' (simulated: fewer than 4 rows nudged by one part in a
    million), True where it gives them the same (simulated: each row computed alone, then in any call alike)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def few_rows_otherwise(query, *args, **kwargs):
        out = sdpa(query, *args, **kwargs)
        return out * (1 + 1e-6) if query.shape[2] < 4 else out

    def row_by_row(query, key, value, attn_mask, scale):
        mask = attn_mask.expand(1, 1, query.shape[2], -1)
        return torch.cat([sdpa(query[:, :, r:r + 1], key, value, attn_mask=mask[:, :, r:r + 1], scale=scale)
                          for r in range(query.shape[2])], dim=2)

    monkeypatch.setattr(compiled_step.F, "scaled_dot_product_attention", few_rows_otherwise)
    assert not compiled_step.attention_rows_round_alike(3, 3, 64)
    assert compiled_step.attention_rows_round_alike(2, 4, 16)
    monkeypatch.setattr(compiled_step.F, "scaled_dot_product_attention", row_by_row)
    assert all(compiled_step.attention_rows_round_alike(kv, group, 16) for kv, group in ((1, 1), (2, 2), (3, 3)))


def _check_query_rows(group: int, kv_heads: int) -> None:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    chunk_rows, dim, keys = compiled_step.CHUNK_ROWS, 64, 15
    gen = torch.Generator().manual_seed(group)
    query = torch.randn(1, kv_heads, group, chunk_rows, dim, generator=gen)  # [.., head of the group, token, ..]
    key, value = torch.randn(2, 1, kv_heads, keys, dim, generator=gen)
    allowed = torch.arange(keys)[None, :] <= torch.arange(chunk_rows)[:, None] + 6  # token t sees keys 0 .. t + 6
    bias = torch.zeros(chunk_rows, keys).masked_fill(~allowed, float("-inf"))
    chunk = op(query.reshape(1, kv_heads, group * chunk_rows, dim), key, value, 0.0, False,
               attn_mask=bias[None].expand(group, -1, -1).reshape(1, 1, group * chunk_rows, keys),
               scale=dim ** -0.5)[0].reshape(1, kv_heads, group, chunk_rows, dim)
    rows = compiled_step.attention_query_rows(group)
    for token in range(chunk_rows):
        alone = query[:, :, :, token].contiguous()  # as the graph hands it (the kernel's bits depend on strides too)
        if rows > group:  # as the graph pads
            alone = torch.cat([alone, alone[:, :, -1:].expand(1, kv_heads, rows - group, dim)], dim=2)
        out = op(alone, key, value, 0.0, False, attn_mask=bias[token].expand(1, 1, rows, keys).contiguous(),
                 scale=dim ** -0.5)[0][:, :, :group]
        assert torch.equal(out, chunk[:, :, :, token]), f"{group} query heads per key/value head, token {token}"


def test_a_compiled_fp32_target_with_one_query_head_per_kv_head_verifies_4_tokens_per_call():
    """Multi-head attention (1 query head per key/value head; SmolLM2 has 3, the other test models 2): unpadded, the
    1-token graph handed SDPA 1 query row per key/value head, which rounded otherwise than the 4-token graph's 4 on an
    AMD EPYC Zen 4, so the check at its compile set ``chunk_exact`` False and chunks ran one token per call (issue 46).
    Padded to 4 (:func:`attention_query_rows`), the 4-token graph verifies, and prompt lookup returns plain greedy
    decoding's tokens and logits bit for bit."""
    target = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama-mha", vocab_size=512), backend="torch",
                                                          torch_compile=True)
    step = target.runner.step
    # padded where this machine's kernel needs it (on the AMD EPYC it does), decided at load
    assert step is not None and step.module.pad_query_rows == (not compiled_step.attention_rows_round_alike(4, 1, 16))
    assert target.compile_chunk_step() and step.chunk_exact is True
    assert target.runner.verify_rows == compiled_step.CHUNK_ROWS
    rows = []
    run = step._run
    step._run = lambda tokens, position, cache, graph_rows, *args: rows.append(graph_rows) or run(
        tokens, position, cache, graph_rows, *args)
    torch.manual_seed(2)
    ids = torch.randint(3, 512, (1, 10))
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    first = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs).sequences
    prompt = torch.cat([first, ids], dim=1)  # lookup finds the prompt's end earlier in it: it proposes at once
    plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    rows.clear()
    got = target.generate(prompt, attention_mask=torch.ones_like(prompt), prompt_lookup_num_tokens=3,
                          num_assistant_tokens_schedule="constant", **kwargs)
    assert compiled_step.CHUNK_ROWS in rows  # verification ran on the 4-token graph
    assert torch.equal(got.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, plain.logits))


@pytest.mark.parametrize("tokens, exact, capacity", [
    (21, True, 25), (509, True, 513),  # the last call's 3 padding rows and the free row
    (510, True, 1025), (1200, True, 1537),  # past one block: whole blocks of 512 and the free row
    (1200, False, 1204),  # bf16 / int8 read the filled rows: no rounding
])
def test_a_generation_gets_the_capacity_its_last_call_needs(tokens, exact, capacity):
    step = compiled_step.CompiledDecodeStep.__new__(compiled_step.CompiledDecodeStep)
    step.exact = exact
    assert step.generation_capacity(tokens) == capacity
    if exact:  # the last call starts at the last token at most, and reads no more than the capacity allows
        last = compiled_step.exact_attention_length(tokens - 1 + compiled_step.CHUNK_ROWS, capacity)
        assert last < capacity


def test_compiled_bf16_draft_keeps_an_fp32_target_exact(tiny_dir, dense_bf16_compile):
    path = tiny_dir("llama")
    target = IPEXModelForCausalLM.from_pretrained(path, export=True, backend="torch")
    draft = IPEXModelForCausalLM.from_pretrained(path, export=True, backend="torch", torch_dtype=torch.bfloat16,
                                                 torch_compile=True)
    assert draft.runner.step is not None
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.assistant_confidence_threshold = 0.0  # a random model is never confident
    calls = []
    compiled = draft.runner.step._compiled
    draft.runner.step._compiled = lambda *args: calls.append(1) or compiled(*args)
    torch.manual_seed(1)
    ids = torch.randint(3, 1000, (1, 12))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    plain = target.generate(ids, **kwargs)
    # a constant schedule passed to generate(): always propose, so the compiled step must run
    assisted = target.generate(ids, assistant_model=draft, num_assistant_tokens_schedule="constant", **kwargs)
    assert torch.equal(assisted, plain)
    assert draft.last_speculation_stats.proposed > 0 and len(calls) > 0  # the compiled step drafted


def test_a_failed_compile_falls_back_to_the_eager_decoder(monkeypatch, caplog, dense_bf16_compile):
    def failing_compile(module, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(compiled_step.torch, "compile", failing_compile)
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec.backends.pytorch.compiled_step"):
        model = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512).to(torch.bfloat16),
                                                             backend="torch", torch_compile=True)
    assert model.runner.step is None
    assert "could not compile" in caplog.text and "no C++ compiler" in caplog.text
    eager = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512).to(torch.bfloat16),
                                                         backend="torch")
    ids = torch.randint(3, 500, (1, 6))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    got = model.generate(ids, **kwargs)
    assert got.shape[1] == 14 and torch.equal(got, eager.generate(ids, **kwargs))


@pytest.mark.parametrize("arch, dtype, kwargs, message", [
    ("llama", torch.bfloat16, {"backend": "ipex"}, "IPEX's fused graphs"),
    ("gpt2", torch.bfloat16, {}, "architecture our decoder runs"),
])
def test_torch_compile_refuses_what_it_cannot_run(arch, dtype, kwargs, message):
    model = build_tiny(arch, vocab_size=512).to(dtype)
    with pytest.raises(ValueError, match=message):
        IPEXModelForCausalLM.from_transformers_model(model, torch_compile=True, **kwargs)


def test_torch_compile_on_a_saved_ipex_export_runs_our_decoder(tmp_path, ipex_available):
    """A saved IPEX export (format 3) holds its weights: torch_compile=True loads it on our compiled decoder, with
    stock's greedy tokens; a format-2 folder holds a graph only, and is refused."""
    from conftest import write_legacy_export

    checkpoint = _save(build_tiny("llama", vocab_size=512), tmp_path / "ckpt")
    model = IPEXModelForCausalLM.from_pretrained(checkpoint, export=True, backend="ipex")
    model.save_pretrained(tmp_path / "export")
    compiled = IPEXModelForCausalLM.from_pretrained(tmp_path / "export", torch_compile=True)
    assert compiled.backend == "torch"
    ids = torch.tensor([[1, 5, 9, 200, 17, 4, 77, 31]])
    stock = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    expected = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(compiled.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                         do_sample=False), expected)
    write_legacy_export(model, tmp_path / "legacy")
    with pytest.raises(ValueError, match="holds an IPEX graph"):
        IPEXModelForCausalLM.from_pretrained(tmp_path / "legacy", torch_compile=True, trust_torchscript=True)


def _checkpoint_names(folder) -> set:
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as checkpoint:
        return set(checkpoint.keys())


def _save(model, folder):
    model.save_pretrained(folder)
    return str(folder)


def test_torch_compile_round_trips_a_saved_torch_export(tmp_path, dense_bf16_compile):
    source = _save(build_tiny("llama", vocab_size=512).to(torch.bfloat16), tmp_path / "ckpt")
    IPEXModelForCausalLM.from_pretrained(source, export=True, backend="torch",
                                         torch_dtype=torch.bfloat16).save_pretrained(tmp_path / "export")
    loaded = IPEXModelForCausalLM.from_pretrained(tmp_path / "export", torch_compile=True)
    assert loaded.runner.step is not None
    reference = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 500, (1, 6))
    with torch.no_grad():
        want = reference(ids).logits[:, -1].float()
    cache = loaded.runner.new_cache(1, 8)
    got = loaded(ids[:, :-1], past_key_values=cache)
    got = loaded(ids[:, -1:], past_key_values=cache).logits[:, -1].float()  # the compiled step
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("tied", [False, True], ids=["untied-head", "tied-head"])
def test_a_compiled_fp32_model_holds_its_weights_once_and_still_runs_and_saves(tmp_path, tied):
    """fp32 on the packed kernel: the model's projections and head are the graphs' packed copies (a tied embedding
    reads the head's), no ``nn.Linear`` weight is left; the prefill, transformers' own forward (hidden states) and
    save_pretrained work on them: stock's greedy tokens, its hidden states to fp32 rounding, its checkpoint bit for
    bit."""
    if not (_avx512() and packed_gemm_available()):
        pytest.skip("the packed fp32 kernel is built for AVX-512 CPUs only")
    reference = build_tiny("llama", vocab_size=512)
    if tied:
        reference.config.tie_word_embeddings = True
        reference.lm_head.weight = reference.model.embed_tokens.weight
    source = _save(reference, tmp_path / "ckpt")
    model = IPEXModelForCausalLM.from_pretrained(source, export=True, backend="torch", torch_dtype=torch.float32,
                                                 torch_compile=True)
    step = model.runner.step
    if step.step_rows != 1:
        pytest.skip("before torch 2.13 single fp32 tokens run padded on the chunk graph, on Inductor's GEMMs")
    assert model.runner.decoder.packed and step.kernel == "packed"
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.modules())
    assert isinstance(model.model.model.embed_tokens, PackedEmbedding) == tied
    torch.manual_seed(0)
    ids = torch.randint(3, 500, (1, 7))
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        want_hidden = reference(ids, output_hidden_states=True).hidden_states
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False),
                       want)
    hidden = model(ids, output_hidden_states=True).hidden_states  # transformers' forward, on the packed modules
    assert len(hidden) == len(want_hidden) and torch.equal(hidden[0], want_hidden[0])
    for got, expected in zip(hidden, want_hidden):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "export")
    # the transformers model it wrapped saves a plain checkpoint too (its state dict unpacks the packed modules)
    model.model.save_pretrained(tmp_path / "hf")
    for folder in ("export", "hf"):
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / folder, torch_dtype=torch.float32).state_dict()
        for name, tensor in reference.state_dict().items():
            assert torch.equal(saved[name], tensor), (folder, name)
        # the names stock writes: a tied head is written once, as the embedding (found by a review: the head was
        # unpacked into a tensor of its own and written twice, 113 MB more for SmolLM2)
        assert _checkpoint_names(tmp_path / folder) == _checkpoint_names(source), folder


def test_two_compiled_models_of_one_shape_keep_their_own_weights(dense_bf16_compile):
    """Inductor freezes each model's weights into its graph: a second model of the same architecture and shapes
    must get its own graph, never run the first one's weights."""
    models = {}
    for seed in (0, 1):
        models[seed] = (
            IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=seed, vocab_size=512).to(
                torch.bfloat16), backend="torch", torch_compile=True),
            IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=seed, vocab_size=512).to(
                torch.bfloat16), backend="torch"))
    ids = torch.randint(3, 500, (1, 6))
    steps = {}
    for seed, (compiled, eager) in models.items():
        caches = [compiled.runner.new_cache(1, 16), eager.runner.new_cache(1, 16)]
        compiled(ids[:, :-1], past_key_values=caches[0])
        eager(ids[:, :-1], past_key_values=caches[1])
        got = compiled(ids[:, -1:], past_key_values=caches[0]).logits.float()
        want = eager(ids[:, -1:], past_key_values=caches[1]).logits.float()
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
        steps[seed] = got
    assert (steps[0] - steps[1]).abs().max() > 0.1 * steps[0].abs().max()  # two different models, really


def test_compiled_int8_step_tracks_the_int8_decoder():
    """weights="int8" (a draft): the compiled step multiplies the decoder's own int8 matrices."""
    def build(**kwargs):
        return IPEXModelForCausalLM.from_transformers_model(build_tiny("qwen2", vocab_size=512).to(torch.bfloat16),
                                                            backend="torch", weights="int8", **kwargs)

    eager, compiled = build(), build(torch_compile=True)
    assert compiled.runner.step is not None and compiled.runner.step.module.int8
    ids = torch.randint(3, 500, (1, 8))
    caches = [eager.runner.new_cache(1, 16), compiled.runner.new_cache(1, 16)]
    eager(ids, past_key_values=caches[0])
    compiled(ids, past_key_values=caches[1])
    token = ids[:, -1:]
    for _ in range(4):
        want = eager(token, past_key_values=caches[0]).logits.float()
        got = compiled(token, past_key_values=caches[1]).logits.float()
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
        token = want.argmax(-1)
    # the 4-token chunk graph (a draft's catch-up) compiled ahead through the public method, not at the first chunk
    step = compiled.runner.step
    assert step.step_rows == 1 and step.chunk_compile_seconds is None
    assert compiled.compile_chunk_step() and step.chunk_compile_seconds > 0
    torch._dynamo.utils.counters.clear()
    chunk = compiled(ids[:, :3], past_key_values=caches[1]).logits.float()
    want = eager(ids[:, :3], past_key_values=caches[0]).logits.float()
    assert (chunk - want).abs().max() <= 0.05 * want.abs().max()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # nothing compiled inside the call
    assert not eager.compile_chunk_step()  # no compiled step: nothing to compile


def test_a_chunk_graph_that_fails_to_compile_falls_back_to_the_eager_decoder(monkeypatch, caplog):
    """compile_chunk_step() where Inductor fails: False and a warning, not the compiler's exception; the model then
    decodes and verifies on its eager decoder."""
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("qwen2", vocab_size=512).to(torch.bfloat16),
                                                         backend="torch", weights="int8", torch_compile=True)
    step = model.runner.step
    assert step is not None and step.step_rows == 1

    def fail(rows):
        raise RuntimeError("C++ compile error")

    monkeypatch.setattr(step, "_scratch_run", fail)
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec.backends.pytorch.compiled_step"):
        assert not model.compile_chunk_step()
    assert "could not compile the 4-token chunk step" in caplog.text and "C++ compile error" in caplog.text
    assert model.runner.step is None
    ids = torch.randint(3, 500, (1, 8))
    cache = model.runner.new_cache(1, 16)
    assert model(ids, past_key_values=cache).logits.shape == (1, 8, 512)
    assert model(ids[:, :3], past_key_values=cache).logits.shape == (1, 3, 512)  # a chunk, on the eager decoder


def test_each_compiled_model_has_its_own_code_and_recompile_budget():
    """Dynamo's recompile limit (8) counts per code object: each step's forward is its own copy, so a process can
    hold more compiled models than that (the ninth failed before)."""
    from optimum_ipex_spec.backends.pytorch.decoder import TorchCausalLMDecoder

    first, second = (compiled_step.CompiledDecodeStep(TorchCausalLMDecoder(
        build_tiny("llama", vocab_size=512).to(torch.bfloat16))) for _ in range(2))
    assert type(first.module).forward.__code__ is not type(second.module).forward.__code__
    assert isinstance(first.module, compiled_step._DecodeStep)


def test_a_compiled_call_that_fails_hands_over_to_the_eager_decoder(caplog, dense_bf16_compile):
    eager, compiled = _pair(lambda: build_tiny("llama", vocab_size=512))

    def failing(*args):
        raise RuntimeError("recompile limit reached")

    compiled.runner.step._compiled = failing
    ids = torch.randint(3, 500, (1, 6))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="optimum_ipex_spec.backends.pytorch.compiled_step"):
        got = compiled.generate(ids, **kwargs)
    assert got.shape[1] == 12 and torch.equal(got, eager.generate(ids, **kwargs))
    assert compiled.runner.step is None and "recompile limit reached" in caplog.text


def test_bad_input_to_the_compiled_step_is_refused_early(dense_bf16_compile):
    model = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512).to(torch.bfloat16),
                                                         backend="torch", torch_compile=True)
    torch._dynamo.utils.counters.clear()
    assert model(torch.tensor([[5]])).logits.shape == (1, 1, 512)  # a cache of capacity 1: no graph of its own
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    # the runner refuses them before the step (backends.base.check_token_ids), as every backend does
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        model(torch.tensor([[512]]), past_key_values=model.new_cache(1, 8))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.tensor([[5.7]]), past_key_values=model.new_cache(1, 8))
    from optimum_ipex_spec.backends.pytorch.cache import PreallocatedKVCache

    with pytest.raises(ValueError, match="this cache holds 3 layers"):
        model(torch.tensor([[5]]), past_key_values=PreallocatedKVCache(3, 1, 2, 16, torch.bfloat16, 8))
    with pytest.raises(ValueError, match="torch_compile must be True or False"):
        IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", vocab_size=512).to(torch.bfloat16),
                                                     backend="torch", torch_compile="false")


def test_dense_bf16_compile_is_refused_on_a_cpu_without_onednn_bf16(cpu_without_onednn_bf16):
    """On an AVX2-only CPU (simulated here on any machine) a compiled dense bf16 step computed wrong logits: it is
    refused before anything compiles, with the fixes; the int8 step is still allowed."""
    model = build_tiny("llama", vocab_size=512).to(torch.bfloat16)
    with pytest.raises(ValueError, match="no oneDNN bf16.*Drop torch_compile.*weights='int8'"):
        IPEXModelForCausalLM.from_transformers_model(model, backend="torch", torch_compile=True)
    assert compiled_step.dense_bf16_compile_unsupported() is not None
    compiled_step.check_torch_compile("torch", model, torch.bfloat16, "int8")  # no error
    # fp32 is not bf16: compiling it stays allowed there (it was refused too, found on an AVX2-only EPYC)
    compiled_step.check_torch_compile("torch", model, torch.float32, "dense")


def test_the_prompt_is_prefilled_alone_so_the_first_logits_are_plain_decodings(tmp_path):
    """On the compiled fp32 target (whose verification gives the bits of its decode steps), every logit of prompt
    lookup and of a draft with its own cache is plain decoding's, the first token's included: their first round
    proposes with the prompt, and the target prefills the prompt alone before it verifies the candidates (in one call
    of the prompt and them its last logits differed from plain decoding's in their last bits: found on a prompt that
    repeats itself, where lookup proposes from the first round; a near-tie could have given another first token)."""
    build_tiny("llama", vocab_size=512).save_pretrained(tmp_path)
    target = IPEXModelForCausalLM.from_pretrained(str(tmp_path), export=True, backend="torch", torch_compile=True)
    assert target.compile_chunk_step() and target.runner.step.chunk_exact is True
    draft = IPEXModelForCausalLM.from_transformers_model(build_tiny("llama", seed=1, vocab_size=512), backend="torch")
    draft.generation_config.num_assistant_tokens = 3
    draft.generation_config.assistant_confidence_threshold = 0.0
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    for seed in range(3):
        torch.manual_seed(seed)
        ids = torch.randint(3, 512, (1, 10 + seed))
        first = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs).sequences
        prompt = torch.cat([first, ids], dim=1)  # lookup finds the prompt's end earlier in it: it proposes at once
        plain = target.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        for name, strategy in {"prompt lookup": dict(prompt_lookup_num_tokens=3),
                               "draft with its own cache": dict(assistant_model=draft)}.items():
            got = target.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  num_assistant_tokens_schedule="constant", **strategy, **kwargs)
            assert torch.equal(got.sequences, plain.sequences), name
            differ = [i for i, (a, b) in enumerate(zip(got.logits, plain.logits)) if not torch.equal(a, b)]
            assert not differ, f"{name}, seed {seed}: the logits of tokens {differ} differ from plain decoding's"


def test_on_2_threads_a_wide_model_verifies_chunks_as_its_steps_decode():
    """With 2 threads, Inductor split a 1-token graph's reduction over a hidden size of 1536 (its RMSNorm: fewer
    rows than threads) between the threads, and the 4-token graph's rows instead: the sums ran in other orders and
    the chunk check turned verification off (Qwen2.5-1.5B's width; found 2026-12-07 on an AVX2 EPYC). The exact
    graphs' own kernels now stay on one thread (compiled_step.SERIAL_KERNELS_MIN_CHUNK): the chunk graph gives every
    row the 1-token graph's bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=1536, intermediate_size=256,
                                             num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=2,
                                             max_position_embeddings=512)).eval()
        compiled = IPEXModelForCausalLM.from_transformers_model(model, backend="torch", torch_compile=True)
        step = compiled.runner.step
        assert step is not None and step.exact
        assert step._settings["cpp.min_chunk_size"] == compiled_step.SERIAL_KERNELS_MIN_CHUNK
        torch.manual_seed(1)
        prompt, more = torch.randint(0, 512, (1, 9)), torch.randint(0, 512, (1, 4))
        caches = [compiled.runner.new_cache(1, 10) for _ in range(2)]
        for cache in caches:
            compiled(prompt, past_key_values=cache)
        steps = torch.cat([compiled(more[:, i:i + 1], past_key_values=caches[0]).logits for i in range(4)], 1)
        chunk = compiled(more, past_key_values=caches[1]).logits
        assert step.chunk_exact is True and not step.failed
        assert torch.equal(chunk, steps)
    finally:
        torch.set_num_threads(previous)
