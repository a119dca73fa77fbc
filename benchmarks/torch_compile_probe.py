"""Probe for issue 16 (torch.compile on the pure-PyTorch path): one SmolLM2 decode step written gpt-fast style over a
static KV cache (fixed capacity, index_copy_ at the position, a mask over the capacity), run eagerly and through
torch.compile (Inductor CPU, freezing + weight prepacking), against our eager decoder and stock transformers'
forward on a cache of 100 tokens; 1 thread, median ms per step. Not part of the package; torch-current lane:

    python benchmarks/torch_compile_probe.py [float32|bfloat16]

Measured 2026-12-01 (torch 2.13, transformers 5.24): fp32 stock 55 ms, our eager decoder 45, the static step eager
47, compiled 80 (78 without freezing; 26 s to compile; logits within 1.2e-4 of eager, not bit-identical); bf16 stock
50, ours 55, static eager 58, compiled 53 (40 s to compile). A plain compile does not pay on this CPU yet.

What this probe got wrong, found while building optimum_ipex_spec/backends/pytorch/compiled_step.py
(``torch_compile=True``): the cache here is one stacked ``[layers, ...]`` tensor, and ``kc[i].index_copy_`` on it made
Inductor copy the whole cache once per layer (about 20 of the 53-80 ms); per-layer buffers remove that. With them and
``max_autotune`` (Inductor's AMX bf16 GEMM template wins every projection) a bf16 step takes 25-26 ms against 52 for
stock. Inductor settings must be set on ``torch._inductor.config`` around the compiling call: passed as
``torch.compile(options=...)`` freezing did not take effect here.
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from optimum_ipex_spec.provisioning.provision import resolve_model
from optimum_ipex_spec.backends.pytorch.decoder import TorchCausalLMDecoder

dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
path = resolve_model("smollm2-135m-instruct")
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).eval()
dec = TorchCausalLMDecoder(model)
cfg = model.config
H, KV, D = dec.num_heads, dec.kv_heads, dec.head_dim
CAP = 512
L = dec.num_layers
inner = model.model
norms = [(l.input_layernorm.weight, l.post_attention_layernorm.weight) for l in inner.layers]
eps = cfg.rms_norm_eps
kc = torch.zeros(L, 1, KV, CAP, D, dtype=dtype)
vc = torch.zeros(L, 1, KV, CAP, D, dtype=dtype)
inv_freq = inner.rotary_emb.inv_freq


def rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def step(tok, pos, kc, vc):
    # tok int64 [1, 1]; pos int64 [1] (the position of this token); kc/vc [L, 1, KV, CAP, D]
    h = inner.embed_tokens.weight[tok]  # [1, 1, hidden]
    freqs = pos.float()[:, None] * inv_freq[None, :]  # [1, D/2]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]
    mask = (torch.arange(CAP) <= pos)[None, None, None, :]  # [1,1,1,CAP]
    qs, ks = H * D, KV * D
    for i, (qkv_m, bias, o_m, gu_m, down_m) in enumerate(dec._layers):
        n1, n2 = norms[i]
        qkv = rms(h, n1) @ qkv_m
        if bias is not None:
            qkv = qkv + bias
        q, k, v = qkv.split((qs, ks, ks), -1)
        q = q.view(1, 1, H, D).transpose(1, 2)
        k = k.view(1, 1, KV, D).transpose(1, 2)
        v = v.view(1, 1, KV, D).transpose(1, 2)
        def rot(x):
            half = D // 2
            return torch.cat((-x[..., half:], x[..., :half]), -1)
        q = q * cos + rot(q) * sin
        k = k * cos + rot(k) * sin
        kc[i].index_copy_(2, pos, k)
        vc[i].index_copy_(2, pos, v)
        out = F.scaled_dot_product_attention(q.reshape(1, KV, H // KV, D), kc[i], vc[i], attn_mask=mask,
                                             scale=D ** -0.5).reshape(1, H, 1, D)
        h = h + out.transpose(1, 2).reshape(1, 1, qs) @ o_m
        g, u = (rms(h, n2) @ gu_m).chunk(2, -1)
        h = h + (F.silu(g) * u) @ down_m
    return rms(h, inner.norm.weight) @ dec._lm_head


def timeit(fn, n=48):
    ts = []
    for i in range(n):
        t = time.perf_counter(); fn(i); ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts[8:])

with torch.no_grad():
    tok = torch.tensor([[42]])
    ref = [step(tok, torch.tensor([i]), kc, vc) for i in range(4)]
    import torch._inductor.config as ic
    ic.freezing = True
    ic.cpp.weight_prepack = True
    t0 = time.perf_counter()
    cstep = torch.compile(step, fullgraph=True, dynamic=False)
    kc.zero_(); vc.zero_()
    got = [cstep(tok, torch.tensor([i]), kc, vc) for i in range(4)]
    print("compile s", round(time.perf_counter() - t0, 1), "max diff", max((a - b).abs().max().item() for a, b in zip(ref, got)))
    eager_ms = timeit(lambda i: step(tok, torch.tensor([i % 200]), kc, vc))
    print("compiled ready", flush=True)
    comp_ms = timeit(lambda i: cstep(tok, torch.tensor([i % 200]), kc, vc))
    cache = dec.new_cache(1, 512, dtype)
    def ours(i):
        cache.crop(100)
        dec(tok, torch.tensor([[100]]), torch.ones(1, 101, dtype=torch.long), cache, True)
    dec(torch.randint(0, 1000, (1, 100)), torch.arange(100)[None], torch.ones(1, 100, dtype=torch.long), cache, True)
    ours_ms = timeit(ours)
    out = model(torch.randint(0, 1000, (1, 100)), use_cache=True)
    pkv = out.past_key_values
    def stock(i):
        n = pkv.get_seq_length() - 100
        if n: pkv.crop(-n)
        model(tok, past_key_values=pkv, use_cache=True)
    stock_ms = timeit(stock)
    print(f"{dtype}: stock {stock_ms:.1f} ms, our eager decoder {ours_ms:.1f}, static-step eager {eager_ms:.1f}, compiled {comp_ms:.1f}")
