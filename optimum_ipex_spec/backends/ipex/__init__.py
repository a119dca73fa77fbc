"""The IPEX backend: export through ``ipex.llm.optimize`` and tracing (export.py), the fused KV cache (cache.py), the
runner of the traced graphs (runner.py), and the patch manager, the one place that changes another library's
attributes and reverts them (patching.py)."""
