"""The pure-PyTorch runner: :class:`~optimum_ipex_spec.backends.pytorch.decoder.TorchCausalLMDecoder` over a
:class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache`, for Llama-family architectures without IPEX.

What the decoder does not serve (a transformers cache, embeddings as input, attentions / hidden states / loss
requested) goes to transformers' forward (:class:`~optimum_ipex_spec.backends.eager.EagerRunner`).
"""

from __future__ import annotations

import torch

from ...compat import cache_kwarg, prepare_cache_capacity
from .compiled_step import CHUNK_ROWS, CompiledDecodeStep
from ...kernels.packed_gemm import packed_amx_available
from .cache import GROWTH_ROWS, PreallocatedKVCache, first_capacity
from .decoder import TorchCausalLMDecoder
from ..base import Runner, check_token_ids, mask_and_positions, output, passed_to_forward, whole_call_arguments
from ..eager import EagerRunner


class TorchDecoderRunner(Runner):
    """Our decoder for plain forwards on its own cache; transformers' forward for the rest. With
    ``torch_compile=True`` (fp32 or bf16; dense or int8 weights), one-token steps and chunks on a non-empty cache,
    batch 1 unpadded, run a :class:`~optimum_ipex_spec.backends.pytorch.compiled_step.CompiledDecodeStep` (the graph
    single tokens run on compiled in :meth:`warmup`; the eager decoder if compiling fails, logged); the eager decoder
    serves the prefill and padded batches on the model's own weights."""

    backend = "torch"
    can_draft = True

    def __init__(self, model, dtype, weights: str = "dense", torch_compile: bool = False):
        #: rows of the embedding table: token ids must be below it
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.decoder = TorchCausalLMDecoder(model, weights=weights)
        # int8: the model's own projection weights are gone, so transformers' forward cannot run it (GGUF modules can)
        self.eager = EagerRunner(model) if weights != "int8" else None
        self.dtype = dtype
        self.step = CompiledDecodeStep(self.decoder) if torch_compile else None

    def warmup(self) -> None:
        if self.step is None:
            return
        if self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and self.decoder.weights == "dense"
                                           and packed_amx_available()):
            # fp32: the prefill and transformers' forward multiply with the graphs' packed copies too (as fast as
            # F.linear from 32 rows on), and the model's own weights go, layer by layer as they are packed: each
            # weight held once, and at the peak one layer twice. Before the graphs are traced, as they read the
            # embedding the decoder may replace. bf16 does where the packed kernel's prefills run on AMX tiles (as
            # fast as oneDNN's); elsewhere it keeps its own weights for them (vdpbf16ps: 4-7x slower at 128-512 rows)
            self.step.pack(adopt=self.decoder)
        if not self.step.compile():
            self.step = None

    def compile_chunk_graph(self) -> bool:
        if self.step is None:
            return False
        ready = self.step.compile_chunk()  # False on a failure, logged by the step, which then is off
        if self.step.failed:
            self.step = None
        return ready and self.step is not None

    @property
    def verify_rows(self):
        """:data:`~optimum_ipex_spec.backends.pytorch.compiled_step.CHUNK_ROWS` while the compiled step runs chunks (a
        longer chunk runs in pieces of that many tokens), 1 where its chunk graph failed the exact fp32 check (chunks
        then run one token per call), else None."""
        if self.step is None:
            return None
        return 1 if self.step.chunk_exact is False else CHUNK_ROWS

    def _eager(self, what: str) -> EagerRunner:
        if self.eager is None:
            raise ValueError(f"{what} needs transformers' own forward, which a model with int8 weights (held once, "
                             "by our decoder) cannot run; use a dense model (weights='dense') for it")
        return self.eager

    def layer_outputs_runner(self, names) -> EagerRunner:
        """transformers' forward over the model's weights, with transformers' cache (the decoder returns logits only).

        Raises:
            ValueError: a model with int8 weights (no transformers forward to run)."""
        return self._eager(", ".join(f"{name}=True" for name in names))

    def serves(self, cache, kwargs=None) -> bool:
        """True when the decoder (not transformers' forward) runs a call with this cache and these arguments."""
        if cache is not None and not isinstance(cache, PreallocatedKVCache):
            return False
        return not whole_call_arguments(kwargs or {})

    def forward(self, input_ids, attention_mask, cache, position_ids, use_cache, kwargs):
        """Raises:
            TypeError: ``input_ids`` not int64/int32 (:func:`~optimum_ipex_spec.backends.base.check_token_ids`).
            ValueError: empty or non-2-D ``input_ids``, ids outside the vocabulary; a non-empty cache of another
                batch size; arguments that need transformers' forward (``output_hidden_states``,
                ``output_attentions``, ``labels``, ...) with a ``PreallocatedKVCache``
                (:func:`preallocated_cache_refused`) or on a model with int8 weights."""
        if input_ids is not None or kwargs.get("inputs_embeds") is None:
            check_token_ids(input_ids, self.vocab_size)
        if not self.serves(cache, kwargs):
            what = "a transformers cache" if cache is not None and not isinstance(cache, PreallocatedKVCache) else (
                ", ".join(whole_call_arguments(kwargs or {})))
            eager = self._eager(what)
            if isinstance(cache, PreallocatedKVCache):  # transformers' forward would see none of its tokens
                raise ValueError(preallocated_cache_refused(whole_call_arguments(kwargs)))
            return eager.forward(input_ids, attention_mask, cache, position_ids, use_cache, kwargs)
        batch, q = input_ids.shape
        if cache is None:
            cache = self.new_cache(batch, q)
        elif cache.batch_size != batch and cache.get_seq_length() == 0:
            cache.resize_batch(batch)
        elif cache.batch_size != batch:
            raise ValueError(f"the cache holds batch {cache.batch_size}; this call has batch {batch}")
        past = cache.get_seq_length()
        attention_mask, position_ids, unpadded = mask_and_positions(attention_mask, position_ids, batch, past, q)
        logits = None
        if self.step is not None and self.step.applies(batch, q, past, unpadded):
            logits = self.step(input_ids, position_ids, cache)  # None: it failed (logged) and is off from now on
            if self.step.failed:
                self.step = None
        if logits is None:
            logits = self.decoder(input_ids, position_ids, attention_mask, cache, unpadded,
                                  logits_to_keep=kwargs.get("logits_to_keep", 0))
        return output(logits, cache, use_cache, cache_field=cache_kwarg())

    def new_cache(self, batch_size: int, capacity: int) -> PreallocatedKVCache:
        return self.decoder.new_cache(batch_size, capacity, self.dtype)

    def prepare_inputs_for_generation(self, input_ids, cache, attention_mask, kwargs):
        if not self.serves(cache):
            return self._eager("a transformers cache").prepare_inputs_for_generation(input_ids, cache,
                                                                                      attention_mask, kwargs)
        past = cache.get_seq_length() if cache is not None else 0
        return {
            "input_ids": input_ids[:, past:],
            "attention_mask": attention_mask,
            cache_kwarg(): cache,
            "use_cache": kwargs.get("use_cache", True),
            **passed_to_forward(kwargs),
        }

    def prepare_cache_for_generation(self, generation_config, model_kwargs, rows, transformers_args):
        if model_kwargs.get(cache_kwarg()) is not None or generation_config.use_cache is False:
            return
        # transformers_args: (assistant_model | generation_mode, batch_size, max_cache_length, ...); max_cache_length
        # is prompt + max_new_tokens - 1, the most rows the generation can hold: the growth limit, not the allocation
        # (the cache starts at the prompt and a few rows and grows with the tokens generated)
        tokens = prepare_cache_capacity(transformers_args[2:])
        capacity, limit = first_capacity(_prompt_rows(generation_config, model_kwargs)), tokens
        if self.step is not None:
            # room for the compiled graphs' last call (its padding rows, the row they keep free, and in fp32 its
            # rounded-up attention length). In the exact fp32 graph a short generation's capacity must not grow
            # inside a generate(): attention reads the whole capacity while that is short, and the kernel's rounding
            # depends on the rows it reads (masked ones included), so a token decoded after a growth and the same
            # token verified in a chunk before it would differ in their last bits; a long one reads whole blocks of
            # the filled rows, whatever the capacity (CompiledDecodeStep.generation_capacities)
            capacity, limit = self.step.generation_capacities(capacity, tokens)
        model_kwargs[cache_kwarg()] = self.decoder.new_cache(rows, capacity, self.dtype, growth_rows=GROWTH_ROWS,
                                                            growth_limit=limit)


def _prompt_rows(generation_config, model_kwargs):
    """The prompt's length (padding included) at ``_prepare_cache_for_generation``: the attention mask's (transformers
    4.x; 5.x drops a mask of ones), the position ids' (5.x), else ``max_length - max_new_tokens``; None if unknown."""
    for name in ("attention_mask", "position_ids"):
        value = model_kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return value.shape[-1]
    max_new, max_length = generation_config.max_new_tokens, generation_config.max_length
    return max_length - max_new if max_new is not None and max_length is not None else None


def preallocated_cache_refused(names) -> str:
    """The message for forward arguments ``names`` that need transformers' forward (hidden states, attentions, a
    loss, ...) given together with our :class:`~optimum_ipex_spec.backends.pytorch.cache.PreallocatedKVCache`:
    transformers' forward would read none of its tokens and write its own past them."""
    return (f"{', '.join(names)} run(s) transformers' own forward, which cannot read or extend a PreallocatedKVCache "
            "(the pure-PyTorch decoder's cache): pass no cache (forward() and generate() then use transformers' "
            "DynamicCache and return it) or a transformers DynamicCache")
