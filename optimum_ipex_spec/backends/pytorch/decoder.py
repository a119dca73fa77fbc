"""The pure-PyTorch decoder used where IPEX is not available (no IPEX installed, a torch IPEX does not
support, or transformers 5.x).

It runs a transformers Llama-family model (Llama, Mistral, Qwen2: pre-norm decoder layers with rotary
position embeddings and grouped-query attention) with the model's own modules for the norms, activations and
rotary tables, but replaces what makes stock decoding slow on a CPU: per-step cache objects and mask
construction, and the matrix kernels. Dense weights are the model's own, held once: each projection is
multiplied with the kernel that is fastest here for its row count (:mod:`~optimum_ipex_spec.backends.dense_weights` has
the measurements: MKL's matrix-vector product for a decode step, 1.4x faster than ``nn.Linear`` in bf16; oneDNN's
matmul for fp32 chunks such as speculative decoding's verification, 1.3-1.9x faster). In bf16, parameters that
are views of the memory-mapped checkpoint get memory of their own first (a decode step on mapped weights was 17%
slower here).

Only the positions ``logits_to_keep`` names go through the LM head (``generate()`` asks for one on the prompt).
Keys/values go into a :class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache`;
attention is one fused ``torch.nn.functional.scaled_dot_product_attention`` call per layer over the cached
rows, with an explicit mask only when it is needed (left padding, a chunk on a cache, a sliding window).
A chunk of ``q`` tokens on a non-empty cache (speculative decoding's verification) is exact: position
``i`` of the chunk attends to the cache and chunk positions ``<= i``. With block weights (GGUF, int4), whose kernels
give each row the same bits for any row count, a chunk's rows attend one at a time as decode steps do, so each token
gets the bits its decode step gets.

The design follows pytorch-labs/gpt-fast (a preallocated cache written in place, SDPA over it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...facts import BLOCK_WEIGHT_FORMATS, LLAMA_FAMILY_ARCHITECTURES, WEIGHT_FORMATS
from .gguf_weights import GGUFLinear
from .int8_weights import Int8Weight
from ..dense_weights import DenseProjection
from ..base import kept_positions
from ...kernels.packed_gemm import PackedEmbedding, PackedLinear
from .cache import PreallocatedKVCache, kv_geometry
from ...utils.memory import page_out, return_freed_memory

#: transformers model classes whose decoder layers this module can run.
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY_ARCHITECTURES


def layer_windows(model: torch.nn.Module) -> list:
    """Per decoder layer, its attention window in tokens, or None (full attention), as transformers applies them:
    ``config.layer_types`` where the config has it; for Qwen2, sliding only with ``use_sliding_window`` and only
    in layers ``>= max_window_layers``; else ``config.sliding_window`` everywhere."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and len(kinds) == layers:
        return [window if kind == "sliding_attention" else None for kind in kinds]
    if type(model).__name__ == "Qwen2ForCausalLM":
        if not getattr(config, "use_sliding_window", False):
            return [None] * layers
        first = getattr(config, "max_window_layers", 0) or 0
        return [window if index >= first else None for index in range(layers)]
    return [window] * layers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchCausalLMDecoder(torch.nn.Module):
    """Forward of a Llama-family transformers model over a :class:`PreallocatedKVCache`.

    Args:
        model: a ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` (eval mode); its
            modules are used, not copied.
        weights: ``"dense"`` (the model's own weights, no copy; see the module docstring) or ``"int8"``
            (weight-only int8 with per-channel scales,
            :class:`~optimum_ipex_spec.backends.pytorch.int8_weights.Int8Weight`; bf16
            models only). With ``"int8"`` the model's own projection weights (and an untied LM head) are released
            after packing: the weights are held once, and only this decoder can run the model. ``"gguf"`` and
            ``"int4"``: a model whose projections and head are
            :class:`~optimum_ipex_spec.backends.pytorch.gguf_weights.GGUFLinear`
            already (:func:`~optimum_ipex_spec.backends.pytorch.gguf_weights.load_gguf_model`,
            :func:`~optimum_ipex_spec.backends.pytorch.int4_weights.quantize_model_int4`), fp32; the decoder multiplies
            with them.

    Raises:
        ValueError: the architecture is not one of :data:`SUPPORTED_ARCHITECTURES`; an unknown ``weights``;
            ``"int8"`` for a model that is not bf16; ``"gguf"`` / ``"int4"`` for a model that is not fp32 or whose
            projections are not GGUF modules.
    """

    def __init__(self, model: torch.nn.Module, weights: str = "dense"):
        super().__init__()
        if not self.supports(model):
            raise ValueError(
                f"{type(model).__name__} is not supported by the pure-PyTorch decoder ({', '.join(SUPPORTED_ARCHITECTURES)}"
                ", with the model-level rotary embedding of transformers >= 4.48)"
            )
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
        if weights == "int8" and model.dtype != torch.bfloat16:
            raise ValueError(f"int8 weights run with bf16 activations; this model is {model.dtype}: load it with "
                             "torch_dtype=torch.bfloat16")
        if weights in BLOCK_WEIGHT_FORMATS and (model.dtype != torch.float32 or not all(
                isinstance(m, GGUFLinear) for layer in model.model.layers for m in layer_projections(layer))):
            raise ValueError(f"weights={weights!r} runs a model whose projections are GGUF blocks, in fp32 "
                             f"(IPEXModelForCausalLM.from_pretrained(..., weights={weights!r}))")
        self.weights = weights
        #: True once the compiled graphs' packed copies replaced the dense weights (:meth:`adopt_packed_layer`,
        #: :meth:`adopt_packed_head`)
        self.packed = False
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_layers, self.kv_heads, self.head_dim = kv_geometry(config)
        self.scaling = self.head_dim ** -0.5
        self.sliding_window: Optional[int] = layer_windows(model)[0]
        if weights == "dense" and model.dtype == torch.bfloat16:
            own_mapped_parameters(model)
        self._layers = []
        for layer in model.model.layers:
            self._layers.append(self._pack(layer))
            if weights == "int8":  # hold the weights once: ours, int8
                _release(*layer_projections(layer))
        self._lm_head = self._matrix(model.lm_head)
        if weights == "int8":
            if not _head_is_embedding(model):
                _release(model.lm_head)  # an untied head; a tied one is still the embedding
            own_mapped_parameters(model)  # the embedding and norms: else the whole mapped file stays resident
        if model.dtype == torch.bfloat16:
            return_freed_memory()  # the weights that fused (bf16) or int8 projections replaced

    def _matrix(self, *linears: torch.nn.Linear):
        """One projection (the ``nn.Linear`` layers' outputs concatenated) as this decoder multiplies it, ``m(x)``:

        * int8 weights: an :class:`Int8Weight` of the fused weights;
        * bf16, several layers: one :class:`DenseProjection` of the fused weight (and bias), whose row slices
          become the layers' own parameters (views: the weights are still held once, and the model still runs);
        * otherwise a :class:`DenseProjection` of each layer's own weight (a tuple for several). fp32 is not fused:
          it gains nothing measurable, and a fused copy of a memory-mapped checkpoint's weights would be a second
          one.
        """
        # held packed already (adopt_packed_layer), or GGUF blocks
        if all(isinstance(linear, (PackedLinear, GGUFLinear)) for linear in linears):
            return linears[0] if len(linears) == 1 else tuple(linears)
        weights = [linear.weight.detach() for linear in linears]
        if self.weights == "int8":
            return Int8Weight(weights[0] if len(weights) == 1 else torch.cat(weights, 0), torch.bfloat16)
        if len(linears) == 1 or weights[0].dtype != torch.bfloat16:
            projections = tuple(DenseProjection.of(linear) for linear in linears)
            return projections[0] if len(projections) == 1 else projections
        fused, bias = torch.cat(weights, 0), _fused_bias(linears)
        offset = 0
        for linear in linears:
            rows = slice(offset, offset + linear.out_features)
            linear.weight = torch.nn.Parameter(fused[rows], requires_grad=linear.weight.requires_grad)
            if linear.bias is not None:
                linear.bias = torch.nn.Parameter(bias[rows], requires_grad=linear.bias.requires_grad)
            offset += linear.out_features
        return DenseProjection(fused, bias)

    def _pack(self, layer) -> tuple:
        """(qkv [hidden -> q+k+v], qkv_bias or None, o [heads*head_dim -> hidden], gate_up [hidden -> 2*inter],
        down [inter -> hidden]) for one decoder layer, each as :meth:`_matrix` makes it; dense projections add
        their own biases (qkv_bias None)."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = _fused_bias(projections) if self.weights == "int8" else None
        return (self._matrix(*projections), bias, self._matrix(attn.o_proj), self._matrix(mlp.gate_proj, mlp.up_proj),
                self._matrix(mlp.down_proj))

    def adopt_packed_layer(self, index: int, modules) -> None:
        """Hold a layer's weights once: decoder layer ``index``'s seven projections become ``modules`` (q, k, v, o,
        gate, up, down :class:`~optimum_ipex_spec.kernels.packed_gemm.PackedLinear`: the packed copies the compiled
        graphs multiply with), and their own weights are released at once (pages of a memory-mapped checkpoint they
        viewed leave the RSS too). This decoder (the prefill), the compiled graphs and transformers' forward (which
        calls the modules) then all multiply with the packed copies; ``save_pretrained`` unpacks them. Measured (1
        thread, SmolLM2's shapes), the packed kernel multiplies 32-512 rows within 5% of ``F.linear``'s time in fp32, so
        a prefill costs what it did. The compiled step calls it a layer at a time as it packs the weights
        (:meth:`~optimum_ipex_spec.backends.pytorch.compiled_step.CompiledDecodeStep.pack`), so that the peak holds one
        layer twice, not the model; :meth:`adopt_packed_head` ends it.

        Raises:
            ValueError: int8 weights, or not seven modules.
        """
        if self.weights != "dense" or len(modules) != 7:
            raise ValueError("adopt_packed_layer takes a dense model's packed projections: seven per decoder layer")
        layer = self.model.model.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        old = [getattr(linear, "weight", None) for linear in layer_projections(layer)]
        released = [(w.data_ptr(), w.numel() * w.element_size()) for w in old
                    if isinstance(w, torch.Tensor) and w.is_contiguous()]
        del old
        q, k, v, o, gate, up, down = modules
        attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj = q, k, v, o
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate, up, down
        self._layers[index] = ((q, k, v), None, o, (gate, up), down)
        mapped = _mapped_file_ranges()
        for start, nbytes in released:  # the checkpoint's pages: clean, read back from the file if ever needed
            if any(low <= start < high for low, high in mapped):
                page_out(start, nbytes)

    def adopt_packed_head(self, head: torch.nn.Module) -> None:
        """The LM head becomes ``head`` (a :class:`~optimum_ipex_spec.kernels.packed_gemm.PackedLinear`), and a tied
        input embedding reads its rows from it (:class:`~optimum_ipex_spec.kernels.packed_gemm.PackedEmbedding`); the
        parameters left (embedding, norms) get memory of their own, so no mapped checkpoint stays resident."""
        if _head_is_embedding(self.model):  # the embedding reads the head's packed copy: one copy of the table
            self.model.model.embed_tokens = PackedEmbedding(head)
        self.model.lm_head = head
        self._lm_head = head
        self.packed = True
        own_mapped_parameters(self.model)  # the embedding and norms: else the mapped checkpoint stays resident
        return_freed_memory()

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """A supported architecture whose rotary tables live on the model (``model.model.rotary_emb``: transformers
        >= 4.48 for all three; older releases keep them per attention layer), with one attention window for every
        layer (a Qwen2 config that slides only some layers runs on transformers' forward)."""
        return (type(model).__name__ in SUPPORTED_ARCHITECTURES and hasattr(getattr(model, "model", None), "rotary_emb")
                and len(set(layer_windows(model))) == 1)

    def new_cache(self, batch_size: int, capacity: int, dtype: torch.dtype, **growth) -> PreallocatedKVCache:
        """An empty cache of this model's geometry; ``growth``: ``growth_rows`` / ``growth_limit`` of
        :class:`PreallocatedKVCache`."""
        return PreallocatedKVCache(self.num_layers, batch_size, self.kv_heads, self.head_dim, dtype, capacity,
                                   **growth)

    def _mask(self, attention_mask: torch.Tensor, past: int, q: int, unpadded: bool) -> Optional[torch.Tensor]:
        """Boolean ``[batch, 1, q, past + q]`` (True = attend), or None when SDPA needs none: one unpadded token
        on the cache, or an unpadded prefill (``is_causal``), within the sliding window."""
        total = past + q
        needs_window = self.sliding_window is not None and total > self.sliding_window
        if unpadded and not needs_window and (q == 1 or past == 0):
            return None
        query_pos = torch.arange(past, total).unsqueeze(1)
        key_pos = torch.arange(total).unsqueeze(0)
        allowed = key_pos <= query_pos
        if needs_window:
            allowed &= key_pos > query_pos - self.sliding_window
        mask = allowed[None, None] & attention_mask.bool()[:, None, None, :]
        if not unpadded:
            # a padding query row would attend to nothing (NaN): let it see itself; its output is never used
            mask |= (key_pos == query_pos)[None, None]
        return mask

    @torch.no_grad()
    def forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor, attention_mask: torch.Tensor,
                cache: PreallocatedKVCache, unpadded: bool, logits_to_keep=0) -> torch.Tensor:
        """Logits ``[batch, q, vocab]`` (model dtype) for ``input_ids`` int64 ``[batch, q]`` at ``position_ids``
        int64 ``[batch, q]``, given ``attention_mask`` int64 ``[batch, cache.length + q]``; appends the chunk's
        keys/values to ``cache``. ``logits_to_keep`` (transformers' argument: 0 = all, n = the last n positions,
        or a 1-D index tensor) limits the positions that go through the final norm and the LM head (a prompt's
        logits: one position, not the whole prompt)."""
        inner = self.model.model
        batch, q = input_ids.shape
        past = cache.length
        cache.reserve(past + q)
        hidden = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = self._mask(attention_mask, past, q, unpadded)
        causal = mask is None and q > 1  # an unpadded prefill
        # block weights give each row the same bits for any row count; so that a verification chunk gives each token
        # the logits its decode step gives (the fast mode's int8 rounding turns a last-bit difference into a visible
        # one), its rows attend one at a time, as decode steps do, and take the MLP's activation one at a time (how
        # ATen splits an elementwise op among threads, and so which values its scalar tail computes, follows the
        # tensor's size)
        rowwise = (q > 1 and past > 0 and batch == 1 and unpadded and self.weights in BLOCK_WEIGHT_FORMATS
                   and (self.sliding_window is None or past + q <= self.sliding_window))
        q_size, kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.model.config.intermediate_size
        for index, (layer, (qkv_m, qkv_bias, o_m, gate_up_m, down_m)) in enumerate(zip(inner.layers, self._layers)):
            query, key, value = _project_parts(layer.input_layernorm(hidden), qkv_m, (q_size, kv_size, kv_size),
                                               qkv_bias)
            query = query.view(batch, q, self.num_heads, self.head_dim).transpose(1, 2)
            key = key.view(batch, q, self.kv_heads, self.head_dim).transpose(1, 2)
            value = value.view(batch, q, self.kv_heads, self.head_dim).transpose(1, 2)
            query = query * cos + _rotate_half(query) * sin
            key = key * cos + _rotate_half(key) * sin
            keys, values = cache.write(index, key, value)
            if mask is None and q == 1:
                out = self._attend_token(query, keys, values)
            elif rowwise:
                out = torch.cat([self._attend_token(query[:, :, i:i + 1].contiguous(), keys[:, :, :past + i + 1],
                                                    values[:, :, :past + i + 1]) for i in range(q)], dim=2)
            else:
                out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=causal,
                                                     scale=self.scaling,
                                                     enable_gqa=self.kv_heads != self.num_heads)
            hidden = hidden + o_m(out.transpose(1, 2).reshape(batch, q, q_size))
            gate, up = _project_parts(layer.post_attention_layernorm(hidden), gate_up_m, (inter, inter))
            if rowwise:
                gate = torch.cat([layer.mlp.act_fn(gate[:, i:i + 1]) for i in range(q)], dim=1)
            else:
                gate = layer.mlp.act_fn(gate)
            hidden = hidden + down_m(gate * up)
        cache.advance(q)
        return self._lm_head(inner.norm(kept_positions(hidden, logits_to_keep)))

    def _attend_token(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A decode step's attention: one token's ``query`` ``[batch, heads, 1, head_dim]`` over all of ``keys`` /
        ``values`` ``[batch, kv_heads, n, head_dim]`` (no mask) -> ``[batch, heads, 1, head_dim]``. With grouped-query
        attention the heads that share a key/value head are rows of one query: SDPA's GQA path falls back to its
        slow math kernel on CPU (250 us per layer over 300 cached tokens here), this takes 25 us."""
        if self.kv_heads == self.num_heads:
            return F.scaled_dot_product_attention(query, keys, values, scale=self.scaling)
        batch = query.shape[0]
        return F.scaled_dot_product_attention(
            query.reshape(batch, self.kv_heads, self.num_heads // self.kv_heads, self.head_dim), keys, values,
            scale=self.scaling).reshape(batch, self.num_heads, 1, self.head_dim)


def _project_parts(x: torch.Tensor, matrix, sizes: tuple, bias: Optional[torch.Tensor] = None) -> list:
    """The outputs ``[..., size]`` of a fused projection (one matrix, its output split at ``sizes``, plus ``bias``
    ``[sum(sizes)]`` when given) or of several (a tuple, one output each, as fp32's are: never concatenated, which
    in an fp32 SmolLM2 prefill of 166 tokens cost 9 ms of copies and made the activation after it read a strided
    view)."""
    if isinstance(matrix, tuple):
        return [m(x) for m in matrix]
    out = matrix(x)
    if bias is not None:
        out = out + bias
    return list(out.split(sizes, dim=-1))


def _fused_bias(linears) -> Optional[torch.Tensor]:
    """The biases of ``linears`` concatenated as their fused output is (zeros for a layer without one), or None
    when none has a bias."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias.detach() if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                      for linear in linears])


def layer_projections(layer) -> tuple:
    """A decoder layer's seven ``nn.Linear`` projections (int8 weights replace and release them)."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _head_is_embedding(model: torch.nn.Module) -> bool:
    """True when the LM head's weight is the input embedding's (tied): it is then not the decoder's to replace."""
    head, embedding = model.lm_head, model.model.embed_tokens
    if isinstance(embedding, PackedEmbedding):  # a model that holds its weights packed (adopt_packed_head)
        return getattr(head, "packed", None) is embedding.packed
    return getattr(head, "weight", None) is embedding.weight


def _mapped_file_ranges() -> list:
    """``[(start, end)]`` address ranges of this process privately mapped from files (``/proc/self/maps``; empty where
    it cannot be read)."""
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                # a private mapping of a file (safetensors maps its file so; shared memory is "s")
                if len(fields) == 6 and fields[1].endswith("p") and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        pass
    return ranges


def own_mapped_parameters(model: torch.nn.Module) -> int:
    """Give every parameter of ``model`` that is a view of a memory-mapped file (transformers loads a safetensors
    checkpoint in its own dtype that way) memory of its own; returns how many were copied. While any parameter
    points into the mapping, the whole mapped file stays resident (measured, SmolLM2 fp32: 0.53 GB beside the
    weights in use), and a bf16 decode step on mapped weights was 17% slower here than on its own memory (0.5B
    shapes, 70 vs 60 ms). After each copy the pages it was copied from leave the process's RSS
    (:func:`~optimum_ipex_spec.utils.memory.page_out`, which never discards a written page; pages another
    tensor of the model also views stay), so the peak is the copies plus one parameter, not the copies plus the
    file. Only private file mappings count (``MAP_SHARED`` memory, e.g. after ``share_memory()``, is left alone)."""
    ranges = _mapped_file_ranges()
    parameters = list(model.parameters())  # each shared parameter once (a tied head too)
    extents = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parameters + list(model.buffers())]
    copied = 0
    for index, parameter in enumerate(parameters):
        start, end = extents[index]
        if parameter.numel() and any(low <= start < high for low, high in ranges):
            contiguous = parameter.data.is_contiguous()
            parameter.data = parameter.data.clone()
            copied += 1
            # pages another tensor also views stay; a contiguous parameter's bytes are exactly [start, end)
            aliased = any(other != index and low < end and start < high for other, (low, high) in enumerate(extents))
            if contiguous and not aliased:
                page_out(start, end - start)
    return copied


def _release(*linears: torch.nn.Linear) -> None:
    """Drop the weights of ``nn.Linear`` modules whose packed copy replaced them (shape kept in ``out_features`` /
    ``in_features``); the module then fails loudly if anything still calls it."""
    for linear in linears:
        linear.weight = torch.nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
