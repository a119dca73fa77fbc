"""Speculative decoding beside the backends: strategy selection (strategy.py), candidate generators (candidates.py),
the cost model that decides how far to draft (cost_model.py), and a draft that shares the target's KV cache
(shared_kv.py)."""
