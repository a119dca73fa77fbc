"""The model's positions (``config.max_position_embeddings``), checked by ``generate()`` before any work.

A prompt that leaves no position for a new token is refused at once; a request for more tokens than the positions
hold (prompt + ``max_new_tokens``, or ``max_length``) is cut to them, with one warning per call, and returns what
was generated up to there, as transformers' ``max_length`` does (and as transformers itself does with its default
length). Without this, a generation ran until it reached the last position and then failed (IPEX's rotary tables end
there) or went on past it (the pure-PyTorch path), after the work of every token before.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch
from transformers import GenerationConfig

logger = logging.getLogger("optimum_ipex_spec")


def max_positions(config, fixed_rotary_tables: bool = False) -> Optional[int]:
    """``max_position_embeddings`` of ``config`` (its text config for a multimodal one), or None when it has none or
    when it is no limit: a scaled rotary embedding (``rope_scaling`` / ``rope_parameters`` of a type other than
    ``"default"``: YaRN, dynamic NTK, longrope, ...) computes positions past it, unless the runtime's rotary tables
    end there (``fixed_rotary_tables``: IPEX's graphs)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text_config, "max_position_embeddings", None)
    if not fixed_rotary_tables:
        scaling = getattr(text_config, "rope_scaling", None) or getattr(text_config, "rope_parameters", None)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def call_input_ids(args: tuple, kwargs: Dict[str, Any]):
    """The prompt a ``generate()`` call was given: its first positional argument, else ``input_ids=`` or
    ``inputs=`` (None without one)."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def prompt_tokens(args: tuple, kwargs: Dict[str, Any]) -> Optional[int]:
    """The length of ``generate()``'s prompt (padding included, as ``max_length`` counts it): ``input_ids`` /
    ``inputs`` ``[batch, tokens]`` (the first positional argument or a keyword), else ``inputs_embeds``
    ``[batch, tokens, hidden]``; None without either."""
    inputs = call_input_ids(args, kwargs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
        return int(inputs.shape[-1])
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
        return int(embeds.shape[1])
    return None


def _requested(name: str, kwargs: Dict[str, Any], generation_config) -> Optional[int]:
    value = kwargs.get(name)
    return value if value is not None else getattr(generation_config, name, None)


def fit_to_positions(config, generation_config, args: tuple, kwargs: Dict[str, Any],
                     fixed_rotary_tables: bool = False) -> None:
    """Refuse a prompt the model's positions cannot continue; cut a longer request to the positions.

    Sequences (prompt and new tokens) hold at most ``max_position_embeddings`` tokens. A request past that
    (``max_new_tokens``, or ``max_length`` without it; not transformers' default length) is set to end
    there in ``kwargs`` (``max_new_tokens = positions - prompt``, or ``max_length = positions``; ``min_new_tokens`` /
    ``min_length`` likewise), with one warning: the output is what the model alone returns up to the last position,
    with or without speculative decoding.

    Args:
        config: the target's transformers config.
        generation_config: the call's generation config (the one passed, else the model's).
        args, kwargs: ``generate()``'s arguments; ``kwargs`` is changed in place.
        fixed_rotary_tables: the runtime's rotary tables end at the positions (IPEX's graphs: past them the logits
            are NaN), so a scaled rotary embedding does not lift the limit (:func:`max_positions`).

    Raises:
        ValueError: a prompt of ``max_position_embeddings`` tokens or more (no position left for a new token).
    """
    positions, prompt = max_positions(config, fixed_rotary_tables), prompt_tokens(args, kwargs)
    if positions is None or prompt is None:
        return
    if prompt >= positions:
        raise ValueError(
            f"the prompt has {prompt} tokens, but this model has {positions} positions "
            f"(config.max_position_embeddings={positions}): no position is left for a new token. Shorten the prompt "
            f"to at most {positions - 1} tokens (e.g. tokenizer(text, truncation=True, max_length={positions - 1}), "
            "or keep its last tokens), or use a model with more positions."
        )
    room = positions - prompt
    max_new = _requested("max_new_tokens", kwargs, generation_config)
    if max_new is not None:  # transformers: max_new_tokens wins over max_length
        if prompt + max_new <= positions:
            return
        asked = f"max_new_tokens={max_new}"
        kwargs["max_new_tokens"] = room
    else:
        max_length = kwargs.get("max_length")
        if max_length is None:
            max_length = getattr(generation_config, "max_length", None)
            if max_length is None or max_length == GenerationConfig().max_length:
                return  # transformers' default length (20 in all): no request of the user's to cut
        if max_length <= positions:
            return
        asked = f"max_length={max_length}"
        kwargs["max_length"] = positions
    min_new = _requested("min_new_tokens", kwargs, generation_config)
    if min_new is not None and min_new > room:
        kwargs["min_new_tokens"] = room
    min_length = _requested("min_length", kwargs, generation_config)
    if min_length is not None and min_length > positions:
        kwargs["min_length"] = positions
    logger.warning(
        "%s asks for more tokens than this model's %d positions (config.max_position_embeddings) hold after a "
        "%d-token prompt: generation stops at %d tokens (at most %d new), as transformers' max_length does. Ask for "
        "max_new_tokens <= %d, or use a model with more positions.", asked, positions, prompt, positions, room, room)
