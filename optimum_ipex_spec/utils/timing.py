"""Per-token timing of ``generate()`` through transformers' streamer hook.

``TokenTimer`` is a ``BaseStreamer``: transformers calls ``put`` once with the prompt and then once
per emitted token (or block of tokens in assisted generation), so it measures time to first token
(prefill + first step) and decode throughput without touching the generation loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

from transformers.generation.streamers import BaseStreamer


@dataclass
class GenerationTiming:
    """Timings of one ``generate()`` call.

    Attributes:
        new_tokens: tokens emitted after the prompt.
        ttft_s: seconds from the start of ``generate`` to the first new token (prefill + one step).
        decode_tokens_per_s: (new_tokens - 1) / seconds between the first and the last new token.
        total_s: wall time of the whole call, seconds.
    """

    new_tokens: int
    ttft_s: float
    decode_tokens_per_s: float
    total_s: float


class TokenTimer(BaseStreamer):
    def __init__(self):
        self.start = time.perf_counter()
        self._prompt_seen = False
        self.stamps: List[float] = []
        self.counts: List[int] = []

    def put(self, value):
        now = time.perf_counter()
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.stamps.append(now)
        self.counts.append(int(value.numel()))

    def end(self):
        self.finish = time.perf_counter()

    def timing(self) -> GenerationTiming:
        total = sum(self.counts)
        if not self.stamps:
            return GenerationTiming(0, float("nan"), float("nan"), self.finish - self.start)
        ttft = self.stamps[0] - self.start
        decode_tokens = total - self.counts[0]
        span = self.stamps[-1] - self.stamps[0]
        rate = decode_tokens / span if span > 0 and decode_tokens > 0 else float("nan")
        return GenerationTiming(total, ttft, rate, self.finish - self.start)


def timed_generate(model, inputs, **kwargs):
    """Run ``model.generate(**inputs, streamer=TokenTimer(), **kwargs)``; return (output ids, timing)."""
    timer = TokenTimer()
    out = model.generate(**inputs, streamer=timer, **kwargs)
    return out, timer.timing()
