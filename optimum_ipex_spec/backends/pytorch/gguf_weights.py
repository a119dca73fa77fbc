"""GGUF weights as the file ships them: the block-quantized tensors of a ``.gguf`` file, memory-mapped and multiplied
without ever being dequantized in memory, as a weight format of the pure-PyTorch decoder (``weights="gguf"``).

A CPU decode step reads every weight once, so its speed is the bytes it reads: Qwen2.5-Coder-1.5B's Q4_K_M file
holds 0.98 GB per token where its fp32 dequantization holds 6.2 GB. The kernel (``csrc/gguf_gemm.cpp``, built at the
first use with ``torch.utils.cpp_extension``, cached in ``TORCH_EXTENSIONS_DIR``) dequantizes each weight row once per
call into registers and L1, for all the rows of the call, and multiplies in fp32:

* "exact" mode: it computes the dequantized model's own function (each weight exactly the fp32 value gguf-py's
  ``gguf.quants.dequantize`` gives, so exactly the provisioned fp32 folder's weight; the sums in another order);
* every output row is the same chain of fused multiply-adds whatever the number of rows, so a token gets the same
  logits decoded alone as verified among draft tokens: speculative decoding over a GGUF target returns that target's
  own greedy tokens.

Block types: ggml's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, and F16 / F32 (:data:`BLOCK_TYPES`). Architectures: the
decoder's Llama family (GGUF ``llama``: SmolLM2; ``qwen2``: Qwen2.5). llama.cpp's converter permutes the rows of
``attn_q`` / ``attn_k`` of ``llama`` models for its rotary layout; whole rows move, so :func:`load_gguf_model` undoes it
on the quantized rows (as transformers' ``LlamaTensorProcessor`` does on dequantized ones).

The exact kernel has an AVX-512 build and an AVX2 one (``csrc/gguf_gemm_avx2.cpp``: the same bits, see
:func:`exact_kernel`). Where neither runs (no AVX2, no C++ compiler), :class:`GGUFLinear` multiplies through the PyTorch
reference (:func:`reference_mm`: gguf-py's dequantization, a bounded number of rows at a time, then ``torch.mv`` per
row; slow, logged once). The file is untrusted data: its header is parsed as data
(:mod:`~optimum_ipex_spec.kernels.gguf_header`; no code runs), every tensor's type, shape and byte range is checked
before use (:func:`read_gguf`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from ...kernels.gguf import (
    BLOCK_TYPES,
    FAST_KERNELS,
    FAST_TYPES,
    INTERLEAVED_TYPES,
    MODES,
    BlockType,
    exact_dequantize,
    exact_kernel,
    exact_mm,
    fast_kernel,
    ggml_type_name,
    gguf_fast_available,
    reference_dequantize,
    reference_mm,
    row_bytes,
)
from ...kernels.gguf_header import GGUFError, read_header
from ...utils.memory import page_out

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- modules


class GGUFLinear(torch.nn.Module):
    """``x @ W.T + b`` with ``W`` held as GGUF blocks: ``x [..., in]`` fp32 -> ``[..., out]`` fp32. The exact kernel
    :func:`exact_kernel` picks (AVX-512 or AVX2), else :func:`reference_mm`.

    In the fast mode a layer of :data:`INTERLEAVED_TYPES` with a multiple of 16 rows is held once, in the fast
    kernel's interleaved layout (16 rows per vector, the same bytes rearranged; a few percent more for Q4_K and
    Q6_K): the rows of a verification or a prefill then cost fewer instructions each. Any other layer holds the
    blocks as given (a view of the memory-mapped file, or the caller's tensor).

    Args:
        blocks: uint8 ``[out, row_bytes]``, each row ``in_features`` values in ``block``'s type.
        block: the :class:`BlockType`.
        in_features: values per row.
        bias: fp32 ``[out]`` or None.
        mode: "exact" or "fast" (:data:`MODES`); "fast" multiplies exactly where the fast kernel cannot run this
            layer (:data:`FAST_TYPES`, rows of a multiple of 64 values, :func:`fast_kernel`).

    Raises:
        GGUFError: ``blocks`` is not uint8 ``[out, row_bytes(block, in_features)]``.
        ValueError: an unknown ``mode``.
    """

    def __init__(self, blocks: torch.Tensor, block: BlockType, in_features: int, bias: Optional[torch.Tensor] = None,
                 mode: str = "exact"):
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(block, in_features):
            raise GGUFError(f"{block.name} blocks of rows of {in_features} values must be uint8 "
                            f"[out, {row_bytes(block, in_features)}], got {blocks.dtype} {tuple(blocks.shape)}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.register_buffer("bias", bias, persistent=False)
        self.block = block
        self.qtype = block.qtype
        self.in_features, self.out_features = in_features, blocks.shape[0]
        #: the exact kernel that multiplies ("avx512", "avx2") or None (the reference): decided once, a plain
        #: attribute, which torch.compile reads as a constant
        self.kernel = exact_kernel()
        #: the fast kernel that multiplies ("avx512", "avx2": mode "fast" where one runs this layer) or None
        self.fast_kernel = (fast_kernel() if mode == "fast" and block.qtype in FAST_TYPES and in_features % 64 == 0
                            else None)
        #: whether a fast kernel multiplies
        self.fast = self.fast_kernel is not None
        #: whether the layer is held in the interleaved layout (``groups``) instead of row-major ``blocks``
        self.interleaved = self.fast and block.qtype in INTERLEAVED_TYPES and self.out_features % 16 == 0
        if self.interleaved:
            groups = self._ops.interleave(blocks.contiguous(), self.qtype, in_features)
            self.register_buffer("row_major", None, persistent=False)
            self.register_buffer("groups", groups, persistent=False)
        else:
            self.register_buffer("row_major", blocks, persistent=False)
            self.register_buffer("groups", None, persistent=False)

    @property
    def _ops(self):
        """The fast kernel's operators (``mm``, ``interleave``, ``deinterleave``, ``mm_interleaved``)."""
        return getattr(torch.ops, FAST_KERNELS[self.fast_kernel].namespace)

    @property
    def blocks(self) -> torch.Tensor:
        """uint8 ``[out, row_bytes]``: the GGUF rows (of an interleaved layer: put back, a new tensor, byte for byte
        the rows it was given)."""
        if self.row_major is not None:
            return self.row_major
        return self._ops.deinterleave(self.groups, self.qtype, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """uint8 ``[len(ids), row_bytes]``: the GGUF rows ``ids`` (int64 ``[n]``), e.g. an embedding's lookups (of an
        interleaved layer: the group of 16 rows that holds each id put back, per id; shapes fixed by ``ids``'s, as
        torch.compile needs: no ``torch.unique``).

        Raises:
            IndexError: an id outside ``[0, out_features)``.
        """
        if self.row_major is not None:
            return self.row_major.index_select(0, ids)
        groups = self.groups.index_select(0, torch.div(ids, 16, rounding_mode="floor"))
        rows = self._ops.deinterleave(groups, self.qtype, self.in_features)
        return rows.index_select(0, torch.arange(ids.numel()) * 16 + ids % 16)

    def extra_repr(self) -> str:
        layout = ", interleaved" if self.interleaved else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.block.name}{layout}"

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` fp32 (a new tensor: what the blocks stand for)."""
        return exact_dequantize(self.kernel, self.blocks, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Raises:
            TypeError: ``x`` is not fp32 (GGUF weights run with fp32 activations).
            ValueError: ``x`` does not end in ``in_features``."""
        if x.dtype != torch.float32:
            raise TypeError(f"GGUF weights multiply fp32 activations, got {x.dtype}: load the model with "
                            "torch_dtype=torch.float32")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"this GGUF layer takes {self.in_features} input features, got x of shape "
                             f"{tuple(x.shape)}")
        if self.interleaved:
            out = self._ops.mm_interleaved(x, self.groups, self.qtype, self.in_features)
        elif self.fast:
            out = self._ops.mm(x, self.row_major, self.qtype, self.in_features)
        else:
            out = exact_mm(self.kernel, x, self.row_major, self.qtype, self.in_features)
        return out if self.bias is None else out + self.bias


class GGUFEmbedding(torch.nn.Module):
    """An input embedding held as GGUF blocks: ``ids`` int64 ``[...]`` -> ``[..., hidden]`` fp32, each row dequantized
    as it is looked up (the rows ``nn.Embedding`` of the dequantized table gives, bit for bit).

    Args:
        table: the :class:`GGUFLinear` of the table (``[vocab, hidden]``); a tied LM head is the same module.
    """

    def __init__(self, table: GGUFLinear):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.rows(ids.reshape(-1))
        values = exact_dequantize(self.table.kernel, rows, self.table.qtype, self.embedding_dim)
        return values.view(*ids.shape, self.embedding_dim)


# ----------------------------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``rows`` x ``k`` values (ggml lists the dimensions the other way round) in
    ``block``'s type, ``nbytes`` bytes from ``offset`` in the file."""

    name: str
    block: BlockType
    rows: int
    k: int
    offset: int
    nbytes: int


@dataclass
class GGUFFile:
    """A GGUF file's architecture, metadata fields this package reads, and tensors (:func:`read_gguf`)."""

    path: str
    architecture: str
    fields: dict
    tensors: Dict[str, GGUFTensor]
    size: int
    #: metadata key -> element count of each array, the tokenizer's too (``tokenizer.ggml.tokens``: the vocabulary)
    array_lengths: Dict[str, int] = field(default_factory=dict)
    _mapped: Optional[torch.Tensor] = None

    def mapped(self) -> torch.Tensor:
        """The whole file as a uint8 tensor on a private memory map (pages read from the file as they are touched,
        shared with the page cache; nothing copied; a write would stay private to this process, and nothing here
        writes)."""
        if self._mapped is None:
            self._mapped = torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)
        return self._mapped

    def blocks(self, name: str) -> torch.Tensor:
        """uint8 ``[rows, row_bytes]``, a view of the mapped file."""
        t = self.tensors[name]
        return self.mapped()[t.offset:t.offset + t.nbytes].view(t.rows, t.nbytes // t.rows)

    def release(self, name: str) -> None:
        """Let the pages of tensor ``name`` leave this process's memory (a tensor a layer holds in another form now:
        interleaved, or rows reordered): :func:`~optimum_ipex_spec.utils.memory.page_out` on its whole pages of the
        map; reading them again reads the file, and a written page keeps its content. Where the OS cannot, the
        pages stay until the kernel reclaims them.

        Raises:
            KeyError: no tensor ``name`` in the file.
        """
        t = self.tensors[name]
        if self._mapped is not None:
            page_out(self._mapped.data_ptr() + t.offset, t.nbytes)

    def values(self, name: str) -> torch.Tensor:
        """A small tensor (a norm, a bias) dequantized to fp32 ``[rows * k]`` (a copy of its own)."""
        t = self.tensors[name]
        return reference_dequantize(self.blocks(name), t.block.qtype, t.k).reshape(-1).clone()


def read_gguf(path: os.PathLike) -> GGUFFile:
    """Parse ``path``'s header (:func:`~optimum_ipex_spec.kernels.gguf_header.read_header`: data only, nothing in the
    file is executed) and check every tensor: a supported block type, at most 2 dimensions, a byte range inside the
    file's data section, aligned, of the size its shape needs, shared with no other tensor.

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not a GGUF file, or a tensor that fails a check (named).
    """
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    header = read_header(path)
    fields = dict(header.fields)  # the tokenizer's scalars too (special token ids); its arrays are stepped over
    architecture = str(fields.get("general.architecture", ""))
    start, size, alignment = header.data_offset, header.size, header.alignment
    tensors = {}
    for t in header.tensors:
        block = BLOCK_TYPES.get(t.ggml_type)
        if block is None:
            raise GGUFError(f"{path}: tensor {t.name} is of ggml type {ggml_type_name(t.ggml_type)}, which the GGUF "
                            f"kernel does not run (supported: {', '.join(b.name for b in BLOCK_TYPES.values())})")
        dims = list(t.dims)
        if not 1 <= len(dims) <= 2:
            raise GGUFError(f"{path}: tensor {t.name} has {len(dims)} dimensions; a decoder's weights have 1 or 2")
        k, rows = dims[0], (dims[1] if len(dims) == 2 else 1)
        if k < 1 or rows < 1:
            raise GGUFError(f"{path}: tensor {t.name} has an empty dimension ({dims}): a damaged file")
        if k % block.values:
            raise GGUFError(f"{path}: tensor {t.name} has rows of {k} values, not whole {block.name} blocks")
        nbytes = rows * (k // block.values) * block.bytes
        offset = t.offset
        if offset < start or offset + nbytes > size or (offset - start) % alignment:
            raise GGUFError(f"{path}: tensor {t.name} needs {nbytes} bytes at offset {offset}, which the file's data "
                            f"section ({start} to {size}, aligned to {alignment}) does not hold: a truncated or "
                            "damaged file")
        tensors[t.name] = GGUFTensor(t.name, block, rows, k, offset, nbytes)
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, name), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:  # a header's offsets may not make two tensors share bytes
            raise GGUFError(f"{path}: tensors {name} and {other} overlap in the file: a damaged file")
    return GGUFFile(path, architecture, fields, tensors, size, dict(header.array_lengths))


# ----------------------------------------------------------------------------------------------- the model

#: GGUF architectures whose tensors map onto the decoder's Llama-family modules, and their transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

#: GGUF name in block i -> the decoder layer's module path of that projection (the Llama family's seven)
LAYER_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's rotary permutation of ``attn_q`` / ``attn_k`` (``heads`` of them): row
    ``i`` of the result is row ``order[i]`` of the file (transformers' ``_reverse_permute_weights`` on indices)."""
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows of attn_q/attn_k cannot be {heads} heads of an even size: the config does not "
                        "describe this file")
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def _check_metadata(gguf: GGUFFile, config) -> None:
    """The config's layer and head counts against the file's own metadata (where the file records them), and no
    layer in the file beyond the config's: tensor shapes alone cannot tell 8 heads of 64 from 4 of 128."""
    arch = gguf.architecture
    recorded = {"block_count": config.num_hidden_layers, "attention.head_count": config.num_attention_heads,
                "attention.head_count_kv": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                "embedding_length": config.hidden_size}
    for key, value in recorded.items():
        found = gguf.fields.get(f"{arch}.{key}")
        if found is not None and not isinstance(found, (list, str)) and int(found) != int(value):
            raise GGUFError(f"{gguf.path} records {arch}.{key} = {found}, the config has {value}: the config does not "
                            "describe this file")
    rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    for key, value in (("rope.freq_base", rope), ("attention.layer_norm_rms_epsilon", getattr(config, "rms_norm_eps",
                                                                                                None))):
        found = gguf.fields.get(f"{arch}.{key}")
        if (found is not None and value is not None and not isinstance(found, (list, str))
                and abs(float(found) - float(value)) > 1e-6 * abs(float(value))):  # the file holds fp32
            raise GGUFError(f"{gguf.path} records {arch}.{key} = {found}, the config has {value}: the config does not "
                            "describe this file")
    embedding = gguf.tensors.get("token_embd.weight")
    if embedding is not None and embedding.rows != config.vocab_size:
        raise GGUFError(f"{gguf.path}: token_embd.weight has {embedding.rows} rows, the config's vocab_size is "
                        f"{config.vocab_size}: the config does not describe this file")
    layers = {int(name.split(".")[1]) for name in gguf.tensors
              if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if layers and max(layers) >= config.num_hidden_layers:
        raise GGUFError(f"{gguf.path} has {max(layers) + 1} layers, the config {config.num_hidden_layers}: the config "
                        "does not describe this file")


def _check_shape(gguf: GGUFFile, name: str, rows: int, k: int) -> GGUFTensor:
    t = gguf.tensors.get(name)
    if t is None:
        raise GGUFError(f"{gguf.path} has no tensor {name}: not a complete {gguf.architecture} model")
    if (t.rows, t.k) != (rows, k):
        raise GGUFError(f"{gguf.path}: tensor {name} is [{t.rows}, {t.k}], the config needs [{rows}, {k}]: the "
                        "config does not describe this file")
    return t


@functools.lru_cache(maxsize=None)
def _log_exact_layers_once(path: str, what: str) -> None:
    logger.warning("%s: the fast mode runs block types Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K with rows of a "
                   "multiple of 64 values; its layers of %s multiply in the exact mode.", path, what)


def load_gguf_model(gguf: GGUFFile, config, mode: str = "exact") -> torch.nn.Module:
    """A transformers causal LM of ``config`` (fp32, eval mode) whose projections, LM head and input embedding are
    :class:`GGUFLinear` / :class:`GGUFEmbedding` modules on ``gguf``'s mapped blocks (never dequantized in memory),
    norms and biases fp32 copies of the file's (small). ``mode``: how the layers multiply (:data:`MODES`).

    Raises:
        GGUFError: an architecture other than :data:`ARCHITECTURES`; a tensor missing, or whose shape is not the
            config's.
    """
    from transformers import AutoModelForCausalLM

    expected = ARCHITECTURES.get(gguf.architecture)
    if expected is None:
        raise GGUFError(f"{gguf.path} is a {gguf.architecture!r} model; weights='gguf' runs "
                        f"{', '.join(ARCHITECTURES)} (the decoder's Llama family)")
    architectures = getattr(config, "architectures", None) or [expected]
    if architectures[0] != expected:
        raise GGUFError(f"{gguf.path} holds a {gguf.architecture} model but the config is {architectures[0]}")
    config.architectures = [expected]
    _check_metadata(gguf, config)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # the default dtype, fp32: a meta skeleton, no memory
    inner = model.model

    def linear(name: str, rows: int, k: int, bias_name: Optional[str] = None, heads_permuted: int = 0,
               layer_mode: str = mode):
        t = _check_shape(gguf, name, rows, k)
        blocks = gguf.blocks(name)
        bias = None
        if bias_name is not None and bias_name in gguf.tensors:
            b = _check_shape(gguf, bias_name, 1, rows)
            bias = gguf.values(b.name)
        if heads_permuted:
            order = _unpermute_rows(rows, heads_permuted)
            blocks = blocks.index_select(0, order)  # q and k only: a small copy, rows whole
            bias = bias[order] if bias is not None else None
        module = GGUFLinear(blocks, t.block, k, bias, mode=layer_mode)
        if module.interleaved or heads_permuted:
            gguf.release(name)  # the layer holds its own copy
        return module

    def norm(module, name: str, size: int):
        _check_shape(gguf, name, 1, size)
        module.weight = torch.nn.Parameter(gguf.values(name), requires_grad=False)

    llama = gguf.architecture == "llama"
    sizes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
             "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
             "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for index, layer in enumerate(inner.layers):
        for short, path in LAYER_PROJECTIONS.items():
            rows, k = sizes[short]
            permuted = {"attn_q": heads, "attn_k": kv_heads}.get(short, 0) if llama else 0
            module = linear(f"blk.{index}.{short}.weight", rows, k, f"blk.{index}.{short}.bias", permuted)
            parent, attr = path.split(".")
            setattr(getattr(layer, parent), attr, module)
        norm(layer.input_layernorm, f"blk.{index}.attn_norm.weight", hidden)
        norm(layer.post_attention_layernorm, f"blk.{index}.ffn_norm.weight", hidden)
    norm(inner.norm, "output_norm.weight", hidden)
    tied = "output.weight" not in gguf.tensors
    # an untied table is only looked up, never multiplied: kept as the file's rows
    table = linear("token_embd.weight", config.vocab_size, hidden, layer_mode=mode if tied else "exact")
    inner.embed_tokens = GGUFEmbedding(table)
    if not tied:
        model.lm_head = linear("output.weight", config.vocab_size, hidden)
        config.tie_word_embeddings = False
    else:  # tied: the head multiplies the embedding's blocks
        model.lm_head = table
        config.tie_word_embeddings = True
    with torch.device("cpu"):
        inner.rotary_emb = type(inner.rotary_emb)(config=config)
    if mode == "fast" and gguf_fast_available():
        exact = {f"{m.block.name} x {m.in_features}" for m in model.modules()
                 if isinstance(m, GGUFLinear) and not m.fast and (tied or m is not table)}
        if exact:
            _log_exact_layers_once(gguf.path, ", ".join(sorted(exact)))
    left = [name for name, tensor in list(model.named_parameters()) + list(model.named_buffers()) if tensor.is_meta]
    if left:
        raise GGUFError(f"{gguf.path}: no GGUF tensor for {', '.join(left[:4])}: this model's layout is not the "
                        "Llama family's")
    return model.eval()
