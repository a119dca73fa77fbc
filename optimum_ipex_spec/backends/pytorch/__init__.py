"""Our pure-PyTorch decoder: the forward (decoder.py), compiled or not (compiled_step.py), over its weight formats
(dense: ../dense_weights.py, shared with the eager runner; int8_weights.py, int4_weights.py, gguf_weights.py), its KV
cache (cache.py) and its runner (runner.py)."""
