"""What every runner does: one runtime (IPEX graphs, our pure-PyTorch decoder, transformers' eager forward)
behind the forward and the generation hooks of :class:`~optimum_ipex_spec.modeling.IPEXModelForCausalLM`.

The model chooses its runner once, when it is built; nothing else asks which runtime it has.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

#: forward arguments that ask for more than logits and a cache (transformers' names); what they return covers every
#: position of the call. Our decoder leaves them to transformers' forward, and a call with one is never split
#: (``IPEXModelForCausalLM.forward``).
WHOLE_CALL_ARGUMENTS = ("inputs_embeds", "labels", "output_attentions", "output_hidden_states", "head_mask")


def whole_call_arguments(kwargs) -> list:
    """The names among :data:`WHOLE_CALL_ARGUMENTS` that forward ``kwargs`` set (to neither None nor False)."""
    return [name for name in WHOLE_CALL_ARGUMENTS if kwargs.get(name) is not None and kwargs.get(name) is not False]


#: ``generate()`` arguments that ask the forward for every layer's outputs at every position (transformers' names)
LAYER_OUTPUT_ARGUMENTS = ("output_hidden_states", "output_attentions")


def requested_layer_outputs(kwargs, generation_config) -> list:
    """The names among :data:`LAYER_OUTPUT_ARGUMENTS` that a ``generate()`` call asks for: a true value passed in
    ``kwargs``, else set on ``generation_config`` (the one passed to the call, else the model's)."""
    return [name for name in LAYER_OUTPUT_ARGUMENTS
            if (kwargs[name] if name in kwargs else getattr(generation_config, name, None))]


#: integer dtypes of token ids that the embedding lookups take (int64 is what tokenizers return)
TOKEN_ID_DTYPES = (torch.int64, torch.int32)


class Runner:
    """One runtime for a causal LM's forward.

    Attributes:
        backend: ``"ipex"`` or ``"torch"`` (what ``IPEXModelForCausalLM.backend`` reports).
        supports_beam_search: whether its cache reorders beams.
        can_draft: whether :class:`~optimum_ipex_spec.speculative.candidates.IPEXDraftCandidateGenerator` can drive it
            as a draft (it keeps its own cache between rounds).
        uses_transformers_cache: whether transformers' own ``DynamicCache`` is its cache (eager forward).
        vocab_size: token ids must be in ``0 .. vocab_size - 1``.
        token_id_dtypes: the integer dtypes of token ids its forward takes.
        verify_rows: the most tokens one forward call verifies when they come in a fixed-size graph (a compiled step:
            ``k`` draft tokens cost ``ceil((k + 1) / verify_rows)`` calls), or None (any number in one call, at a
            cost that grows with it).
    """

    backend = "torch"
    #: the vocabulary size (token ids must be below it) and the dtypes of ids its forward takes
    vocab_size: int
    token_id_dtypes: tuple = TOKEN_ID_DTYPES
    supports_beam_search = True
    can_draft = False
    uses_transformers_cache = False
    verify_rows: Optional[int] = None

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], cache: Any,
                position_ids: Optional[torch.Tensor], use_cache: bool, kwargs: Dict[str, Any]) -> CausalLMOutputWithPast:
        """Logits ``[batch, q, vocab]`` for ``input_ids`` int64 ``[batch, q]`` on top of ``cache``."""
        raise NotImplementedError

    def new_cache(self, batch_size: int, capacity: int):
        """An empty cache of this runtime for ``batch_size`` rows (``capacity`` tokens where it preallocates)."""
        raise NotImplementedError

    def prepare_inputs_for_generation(self, input_ids, cache, attention_mask, kwargs) -> Dict[str, Any]:
        raise NotImplementedError

    def prepare_cache_for_generation(self, generation_config, model_kwargs, rows: int, transformers_args: tuple) -> None:
        """Put this runtime's cache for ``rows`` sequences into ``model_kwargs`` (unless the user passed one or
        ``use_cache=False``). ``transformers_args`` are transformers' own arguments, for the eager runner."""
        raise NotImplementedError

    def layer_outputs_runner(self, names) -> "Runner":
        """The runner that serves a ``generate()`` call asking for ``names`` (among :data:`LAYER_OUTPUT_ARGUMENTS`),
        with its own cache from start to end: this one where its forward returns them (transformers' forward, by
        default), else transformers' forward over the same weights.

        Raises:
            ValueError: no runtime of this model returns them (IPEX's fused graph, int8 weights); the message names
                the argument and the fix.
        """
        return self

    def warmup(self) -> None:
        """Prepare the runtime for the first user call (compile, specialize); no-op by default."""

    def compile_chunk_graph(self) -> bool:
        """Compile the graph that runs chunks of tokens on a non-empty cache now rather than at the first chunk;
        True when this runtime has such a graph and it is ready. False by default (nothing compiled lazily)."""
        return False


def check_token_ids(input_ids, vocab_size: int, dtypes=TOKEN_ID_DTYPES, what: str = "input_ids") -> None:
    """Refuse token ids that a forward would fail on deep inside a kernel (or read as something else).

    Args:
        input_ids: token ids, ``[batch, q]`` of one of ``dtypes``.
        vocab_size: ids must be in ``0 .. vocab_size - 1``.
        dtypes: the integer dtypes accepted (the IPEX graphs were traced with int64 only).
        what: the argument's name in the messages.

    Raises:
        TypeError: not a tensor, or a dtype outside ``dtypes`` (e.g. uint8, a float or a bool tensor).
        ValueError: not 2-D, empty, or ids outside the vocabulary.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor of token ids [batch, sequence], got {type(input_ids).__name__}")
    if input_ids.dtype not in dtypes:
        names = " or ".join(str(dtype).replace("torch.", "") for dtype in dtypes)
        got = str(input_ids.dtype).replace("torch.", "")
        raise TypeError(f"{what} must hold integer token ids ({names}), got {got}: convert them with {what}.long()")
    if input_ids.dim() != 2:
        raise ValueError(f"{what} must be a 2-D tensor [batch, sequence], got shape {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"{what} is empty (shape {tuple(input_ids.shape)}); pass at least one token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}) for this model (its vocabulary size); {what} holds "
                         f"values in [{low}, {high}]: encode the text with this model's tokenizer")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: logits at position t predict labels at t+1; -100 is ignored."""
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, -logits.shape[1]:][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


def mask_and_positions(attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], batch: int,
                       past: int, q: int):
    """Default or check ``attention_mask`` int64 ``[batch, past + q]``; derive ``position_ids`` ``[batch, q]``
    from it when not given; return both and whether nothing is padded (one reduction per step).

    Raises:
        ValueError: ``attention_mask`` of another shape.
    """
    if attention_mask is None:
        attention_mask = torch.ones(batch, past + q, dtype=torch.long)
    elif tuple(attention_mask.shape) != (batch, past + q):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({batch}, {past + q}) = "
            "(batch, cached tokens + new tokens)"
        )
    unpadded = bool(attention_mask.all())
    if position_ids is None:
        position_ids = _position_ids(attention_mask, past, q, unpadded)
    return attention_mask, position_ids, unpadded


def _position_ids(attention_mask: torch.Tensor, past: int, q: int, unpadded: bool) -> torch.Tensor:
    if unpadded:
        return torch.arange(past, past + q, dtype=torch.long).unsqueeze(0).expand(attention_mask.shape[0], -1)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return position_ids[:, -q:]


def passed_to_forward(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments ``generate()`` sets that a runner's ``prepare_inputs_for_generation`` hands on to its forward
    unchanged: ``logits_to_keep`` (1 on the prompt, ``k + 1`` in a verification), where given."""
    return {"logits_to_keep": kwargs["logits_to_keep"]} if "logits_to_keep" in kwargs else {}


def output(logits: torch.Tensor, cache: Any, use_cache: bool, loss: Optional[torch.Tensor] = None,
           cache_field: str = "past_key_values") -> CausalLMOutputWithPast:
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{cache_field: cache if use_cache else None})


def kept_positions(x: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``x [batch, q, ...]`` at the positions transformers' ``logits_to_keep`` names: 0 (all), ``n > 0`` (the last
    ``n``) or a 1-D tensor of position indices. ``generate()`` passes 1 for the prompt (only the last position's
    logits are used) and ``k + 1`` for a verification of k draft tokens.

    Raises:
        ValueError: a negative count, or something that is neither an int nor a 1-D integer tensor.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.is_floating_point():
            raise ValueError(f"logits_to_keep as a tensor is a 1-D tensor of position indices, got "
                             f"{logits_to_keep.dtype} of shape {tuple(logits_to_keep.shape)}")
        return x[:, logits_to_keep]
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep is 0 (all positions), a positive count of last positions or a 1-D index "
                         f"tensor, got {logits_to_keep!r}")
    return x if logits_to_keep == 0 else x[:, -logits_to_keep:]
