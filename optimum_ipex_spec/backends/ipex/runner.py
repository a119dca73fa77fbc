"""The IPEX runner: the traced decode graph (IPEX's fused attention and KV cache) and the exact verify graph.

Routing (field notes: IPEX's fused attention is silently wrong for a chunk of several tokens on a non-empty
cache): prefill and one-token decode run the decode graph; a chunk of ``q > 1`` tokens on a cache of
``past > 0`` tokens (speculative decoding's verification) runs the verify graph, traced with
:func:`~optimum_ipex_spec.backends.ipex.export.exact_chunk_attention`; without a verify graph (or for a padded
batch) such a chunk runs one token per call: exact, slower, logged once. Where warm-up found that the verify graph
multiplies :data:`PADDED_STEP_ROWS` rows faster than the decode graph one (:meth:`IPEXGraphRunner.choose_step_rows`),
one-token steps and chunks shorter than that run on the verify graph padded to that many rows.

Inputs are checked here before they reach IPEX's kernels, which crash the process (SIGFPE/SIGSEGV/SIGABRT) or
return NaN instead of raising on bad shapes.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import warnings
from typing import Any, Dict, Optional

import torch

from .cache import IPEXFusedCache
from ..base import kept_positions
from ..base import Runner, causal_lm_loss, check_token_ids, mask_and_positions, output, passed_to_forward

logger = logging.getLogger("optimum_ipex_spec")

#: TorchScript's profiling executor re-specializes a graph for each new input shape (2 static
#: specializations, then dynamic ones). Speculative decoding feeds ever-changing shapes (cache length,
#: chunk length); going dynamic at once avoids repeated re-optimization: measured on a tiny Llama,
#: 85 ms -> 0.6 ms per decode step; on SmolLM2 the steady decode is unchanged (35-36 ms). Applied only
#: around our graph calls and restored after each.
GRAPH_FUSION_STRATEGY = [("DYNAMIC", 20)]

#: Rows a one-token decode step, and a verification chunk of fewer tokens, may be padded to (the last token
#: repeated) so that it runs the verify graph: some CPUs multiply a few rows faster than one or two. Measured on an
#: AMD EPYC Zen 4, 1 thread, fp32 (oneDNN, the kernel of our fp32 export; ``python benchmarks/linear_rows.py``):
#: SmolLM2's decoder matrices in 36 ms for 1 row, 31 for 4, 29 for 5; Qwen2.5-Coder-0.5B's in 107 ms for 1 row, 78
#: for 4. A whole decode step: SmolLM2 41-47 -> 37-39 ms, Qwen 0.5B 139-153 -> 116-131 ms, same tokens; a chunk of 2
#: tokens on a 300-token cache: SmolLM2 51 -> 38 ms, Qwen 0.5B 160 -> 132 ms (3 tokens: 41 -> 38 ms, 141 -> 149 ms,
#: within the noise). On a CPU with AMX, and in bf16 here, 4 rows cost more than 1.
PADDED_STEP_ROWS = 4
#: The padded step is chosen (at warm-up, by timing both) only when it takes at most this share of a decode step.
PADDED_STEP_GAIN = 0.93


def _unavailable(name: str) -> str:
    """The message for ``name`` (``output_hidden_states`` / ``output_attentions``) asked of the IPEX backend."""
    return (f"{name}=True is not available on the IPEX backend (the fused graph does not return them); load with "
            "backend='torch' to get them (IPEXModelForCausalLM.from_pretrained(checkpoint, export=True, "
            "backend='torch'))")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


class IPEXGraphRunner(Runner):
    """Runs an export's TorchScript graphs over an :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache`.

    Args:
        decode: the decode graph (signature in :mod:`optimum_ipex_spec.backends.ipex.export`).
        verify: the exact verify graph, or None (export format 1 without its verify file).
        config: the model's transformers config (vocabulary size, layers, ``max_position_embeddings``).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
    """

    backend = "ipex"
    token_id_dtypes = (torch.int64,)  # the graphs were traced with int64 ids
    supports_beam_search = False
    can_draft = True

    def __init__(self, decode: torch.jit.ScriptModule, verify: Optional[torch.jit.ScriptModule], config, dtype):
        self.decode = decode
        self.verify = verify
        #: rows that one-token steps and shorter chunks are padded to (1: none); chosen by :meth:`choose_step_rows`
        self.step_rows = 1
        self.dtype = dtype
        text_config = config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.vocab_size = text_config.vocab_size
        self.max_positions = getattr(text_config, "max_position_embeddings", None)

    def graph_for(self, past: int, q: int, batch: int, unpadded: bool) -> Optional[torch.jit.ScriptModule]:
        """The graph that computes a ``q``-token chunk exactly on a cache of ``past`` tokens; None when no graph
        can (a chunk on a cache without the verify graph, or with a padded batch: run it token by token)."""
        if past > 0 and q > 1:
            return self.verify if (self.verify is not None and batch == 1 and unpadded) else None
        return self.decode

    def forward(self, input_ids, attention_mask, cache, position_ids, use_cache, kwargs: Dict[str, Any]):
        """Raises:
            TypeError: a cache that is not an ``IPEXFusedCache``; non-integer ``input_ids``.
            ValueError: empty or non-2-D ``input_ids``, token ids outside the vocabulary, a cache of another batch
                size or layer count, an ``attention_mask`` of the wrong length, more positions than
                ``max_position_embeddings`` (IPEX's rotary tables end there: the logits would be NaN), or
                ``output_attentions`` / ``output_hidden_states`` (the fused graph does not return them).
        """
        labels = kwargs.pop("labels", None)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)  # the traced graph computes every position; sliced after
        for unsupported in ("output_attentions", "output_hidden_states"):
            if kwargs.get(unsupported):
                raise ValueError(_unavailable(unsupported))
        cache = self._checked_cache(input_ids, cache)
        batch, q = input_ids.shape
        past = cache.get_seq_length()
        attention_mask, position_ids, unpadded = mask_and_positions(attention_mask, position_ids, batch, past, q)
        if self._pads(past, q, batch, unpadded):
            logits = self._padded_chunk(input_ids, position_ids, cache, past)
            loss = causal_lm_loss(logits, labels) if labels is not None else None
            return output(kept_positions(logits, logits_to_keep), cache, use_cache, loss=loss)
        graph = self.graph_for(past, q, batch, unpadded)
        if graph is None:
            logits = self._chunk_token_by_token(input_ids, attention_mask, position_ids, cache)
            return output(kept_positions(logits, logits_to_keep), cache, use_cache)
        if graph is self.verify and q > 1:
            cache.reserve(past + q)  # the verify graph writes the chunk into the buffers without growing them
        logits = self._run_graph(graph, input_ids, attention_mask, cache, position_ids)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return output(kept_positions(logits, logits_to_keep), cache, use_cache, loss=loss)

    def layer_outputs_runner(self, names):
        """Raises:
            ValueError: always: the fused graph returns logits and the cache only (``generate()`` refuses before
                anything runs; a draft's nested call gets none of them asked)."""
        raise ValueError(_unavailable(names[0]))

    def new_cache(self, batch_size: int, capacity: int = 0) -> IPEXFusedCache:
        """An empty :class:`~optimum_ipex_spec.backends.ipex.cache.IPEXFusedCache` (IPEX grows it itself: ``capacity``
        unused)."""
        return IPEXFusedCache(self.num_layers, batch_size, self.dtype)

    def prepare_inputs_for_generation(self, input_ids, cache, attention_mask, kwargs):
        past = cache.get_seq_length() if cache is not None else 0
        return {
            "input_ids": input_ids[:, past:],
            "attention_mask": attention_mask,
            "past_key_values": cache,
            "use_cache": kwargs.get("use_cache", True),
            **passed_to_forward(kwargs),
        }

    def prepare_cache_for_generation(self, generation_config, model_kwargs, rows, transformers_args):
        """Raises:
            TypeError: a user cache that is not an ``IPEXFusedCache``."""
        user_cache = model_kwargs.get("past_key_values")
        if user_cache is not None:
            if not isinstance(user_cache, IPEXFusedCache):
                raise TypeError(
                    "past_key_values passed to generate() must be an IPEXFusedCache for the IPEX backend, "
                    f"got {type(user_cache).__name__}"
                )
            return
        if generation_config.use_cache is False:
            return
        model_kwargs["past_key_values"] = self.new_cache(rows)

    def warmup(self, steps: int = 3) -> None:
        """Run the graphs on a short prompt, a few decode steps and a few chunks so TorchScript's profiling
        executor specializes them before the first user call (IPEX's one-time "JIT pass will be deprecated"
        warning is emitted here and silenced); then :meth:`choose_step_rows` times the two ways of a decode step."""
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids = torch.ones(1, 8, dtype=torch.long)
            out = self.forward(ids, None, None, None, True, {})
            for _ in range(steps):
                self.forward(ids[:, :1], None, out.past_key_values, None, True, {})
            if self.verify is not None:
                # the first chunk calls of the verification graph compile its dynamic-shape fusions (~1 s)
                for chunk in (4, 2, 5):
                    self.forward(ids[:, :chunk], None, out.past_key_values, None, True, {})
                out.past_key_values.crop(ids.shape[1])
                self.choose_step_rows(out.past_key_values)

    def _checked_cache(self, input_ids, cache) -> IPEXFusedCache:
        check_token_ids(input_ids, self.vocab_size, dtypes=self.token_id_dtypes)
        batch, q = input_ids.shape
        if cache is None:
            cache = self.new_cache(batch)
        if not isinstance(cache, IPEXFusedCache):
            raise TypeError(f"past_key_values must be an IPEXFusedCache for the IPEX backend, got {type(cache).__name__}")
        if cache.batch_size != batch or cache.num_layers != self.num_layers:
            raise ValueError(
                f"past_key_values was made for batch {cache.batch_size} and {cache.num_layers} layers; this call has "
                f"batch {batch} and the model {self.num_layers} layers"
            )
        total = cache.get_seq_length() + q
        if self.max_positions and total > self.max_positions:
            raise ValueError(
                f"{total} positions exceed max_position_embeddings={self.max_positions} of this model: IPEX's rotary "
                "tables end there and would return NaN. Shorten the prompt or max_new_tokens."
            )
        return cache

    def _pads(self, past: int, q: int, batch: int, unpadded: bool) -> bool:
        """True when a ``q``-token forward on a cache of ``past`` tokens runs padded to :attr:`step_rows` rows: a
        padded step was chosen, ``q`` is shorter, the cache is not empty, batch 1 without padding, and the padded
        positions stay within ``max_position_embeddings`` (past it IPEX's rotary tables give NaN, which the
        attention's zero weights would carry into the real rows)."""
        rows = self.step_rows
        return (0 < q < rows and past > 0 and self.verify is not None and batch == 1 and unpadded
                and not (self.max_positions and past + rows > self.max_positions))

    def _padded_chunk(self, input_ids, position_ids, cache, past: int) -> torch.Tensor:
        """A ``q``-token step or chunk (``q < step_rows``) run on the verify graph as ``step_rows`` rows, the last
        token repeated (exact, as every verification: causal attention keeps the real rows from seeing the copies);
        the copies' cache rows are dropped. Returns the real tokens' logits ``[1, q, vocab]``."""
        rows, q = self.step_rows, input_ids.shape[1]
        padded = torch.cat([input_ids, input_ids[:, -1:].expand(1, rows - q)], dim=1)
        copies = position_ids[:, -1:] + torch.arange(1, rows - q + 1, dtype=position_ids.dtype)
        positions = torch.cat([position_ids, copies], dim=1)
        cache.reserve(past + rows)
        logits = self._run_graph(self.verify, padded, torch.ones(1, past + rows, dtype=torch.long), cache, positions)
        cache.hold(past + q)
        return logits[:, :q]

    @staticmethod
    def _run_graph(graph, input_ids, attention_mask, cache, position_ids) -> torch.Tensor:
        """Call ``graph`` on ``cache`` under :data:`GRAPH_FUSION_STRATEGY` and adopt the layers it returns; returns
        the logits ``[batch, q, vocab]``."""
        previous = torch.jit.set_fusion_strategy(GRAPH_FUSION_STRATEGY)
        try:
            logits, layers = graph(input_ids=input_ids, attention_mask=attention_mask,
                                   past_key_values=cache.ipex_layers, position_ids=position_ids)
        finally:
            torch.jit.set_fusion_strategy(previous)
        cache.replace(layers)
        return logits

    def choose_step_rows(self, cache: IPEXFusedCache, rounds: int = 3) -> int:
        """Time a decode step on the decode graph and padded to :data:`PADDED_STEP_ROWS` rows (interleaved, after
        one untimed call of each, the cache cropped back after each) and keep the padded step where it takes at
        most :data:`PADDED_STEP_GAIN` of the other. Sets and returns :attr:`step_rows`."""
        if self.verify is None:
            self.step_rows = 1
            return 1
        past = cache.get_seq_length()
        token = torch.ones(1, 1, dtype=torch.long)
        times = {1: [], PADDED_STEP_ROWS: []}
        for round_index in range(rounds + 1):
            for rows in times:
                self.step_rows = rows
                start = time.perf_counter()
                self.forward(token, None, cache, None, True, {})
                if round_index:
                    times[rows].append(time.perf_counter() - start)
                cache.crop(past)
        padded, plain = statistics.median(times[PADDED_STEP_ROWS]), statistics.median(times[1])
        self.step_rows = PADDED_STEP_ROWS if padded <= PADDED_STEP_GAIN * plain else 1
        logger.debug("decode step %.1f ms, padded to %d rows %.1f ms: step_rows = %d", 1e3 * plain,
                     PADDED_STEP_ROWS, 1e3 * padded, self.step_rows)
        return self.step_rows

    def _chunk_token_by_token(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        _warn_once(
            "A chunk of several tokens on a non-empty IPEX cache without the exact verify graph (or with a padded "
            "batch) runs one token per forward: exact, but slower."
        )
        past = cache.get_seq_length()
        logits = []
        for i in range(input_ids.shape[1]):
            step = self.forward(input_ids[:, i: i + 1], attention_mask[:, : past + i + 1], cache,
                                position_ids[:, i: i + 1], True, {})
            logits.append(step.logits)
        return torch.cat(logits, dim=1)
