"""The eager runner: transformers' own forward and cache (architectures outside our decoder, or what the decoder
does not serve: embeddings as input, attentions / hidden states requested, a transformers cache)."""

from __future__ import annotations

import functools
import logging

import transformers
from transformers.cache_utils import DynamicCache

from ..compat import cache_kwarg, logits_to_keep_kwarg, static_caches_refuse_assisted
from .dense_weights import use_dense_kernels
from .base import Runner, check_token_ids

logger = logging.getLogger("optimum_ipex_spec")


@functools.lru_cache(maxsize=None)
def log_eager_once(architecture: str, covered: str) -> None:
    logger.warning("%s runs transformers' own forward on the pure-PyTorch path (our preallocated-cache decoder "
                   "covers %s)", architecture, covered)


class EagerRunner(Runner):
    """transformers' forward of ``model`` (a ``PreTrainedModel``), its caches and generation hooks."""

    backend = "torch"
    uses_transformers_cache = True

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.get_input_embeddings().num_embeddings
        use_dense_kernels(model)  # its output head: verification chunks on the fast kernels (dense_weights.py)

    def forward(self, input_ids, attention_mask, cache, position_ids, use_cache, kwargs):
        """transformers' forward. Raises TypeError / ValueError for ids of another dtype or outside the vocabulary
        (:func:`~optimum_ipex_spec.backends.base.check_token_ids`), not an ``IndexError`` from the embedding."""
        if input_ids is not None or kwargs.get("inputs_embeds") is None:
            check_token_ids(input_ids, self.vocab_size)
        if "logits_to_keep" in kwargs and logits_to_keep_kwarg() != "logits_to_keep":  # transformers < 4.50
            kwargs = dict(kwargs)
            kwargs[logits_to_keep_kwarg()] = kwargs.pop("logits_to_keep")
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, return_dict=True, **{cache_kwarg(): cache}, **kwargs)

    def new_cache(self, batch_size: int, capacity: int):
        raise NotImplementedError(f"{type(self.model).__name__} runs transformers' forward: use DynamicCache()")

    def prepare_inputs_for_generation(self, input_ids, cache, attention_mask, kwargs):
        return self.model.prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                        **{cache_kwarg(): cache}, **kwargs)

    def prepare_cache_for_generation(self, generation_config, model_kwargs, rows, transformers_args):
        return self.model._prepare_cache_for_generation(generation_config, model_kwargs, *transformers_args)


def dynamic_cache_for_assisted(model, generation_config, args, kwargs) -> None:
    """transformers 4.x refuses assisted generation for models whose default cache is static, hybrid or
    sliding-window (Gemma 2/3): those caches cannot be cropped. A ``DynamicCache`` can, and is exact as long as
    the sequence stays within the sliding window, so put one into ``kwargs`` in that case.

    Raises:
        ValueError: prompt + new tokens exceed the sliding window (4.x's DynamicCache path masks the window
            wrongly past it; transformers >= 5 handles it: use the ``torch-current`` lane).
    """
    text_config = model.config.get_text_config()
    implementation = getattr(model.generation_config, "cache_implementation", None) or getattr(
        text_config, "cache_implementation", None)
    if (not static_caches_refuse_assisted() or kwargs.get("past_key_values") is not None
            or implementation not in ("static", "hybrid", "sliding_window", "hybrid_chunked")):
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    max_new = kwargs.get("max_new_tokens", generation_config.max_new_tokens)
    total = (ids.shape[-1] + max_new) if (ids is not None and max_new is not None) else kwargs.get(
        "max_length", generation_config.max_length)
    window = getattr(text_config, "sliding_window", None)
    if window is not None and total > window:
        raise ValueError(
            f"{type(model.model).__name__} uses a {implementation!r} cache with a {window}-token sliding window; "
            f"with transformers {transformers.__version__} assisted generation / prompt lookup is exact only up "
            f"to {window} tokens (prompt + max_new_tokens), got {total}. Shorten the request or use "
            "transformers >= 5 (the torch-current lane), whose caches crop sliding windows."
        )
    kwargs["past_key_values"] = DynamicCache()
