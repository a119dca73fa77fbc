"""optimum-ipex-spec: fast causal-LM generation and speculative decoding on Intel CPUs with IPEX.

Heavy modules (torch, transformers, IPEX) are imported lazily so that ``optimum-cli --help`` and
``python -m optimum_ipex_spec.provisioning.provision --help`` stay fast.
"""

from .version import __version__

__all__ = ["IPEXModelForCausalLM", "IPEXFusedCache", "__version__"]


def __getattr__(name):
    if name == "IPEXModelForCausalLM":
        from .modeling import IPEXModelForCausalLM

        return IPEXModelForCausalLM
    if name == "IPEXFusedCache":
        from .backends.ipex.cache import IPEXFusedCache

        return IPEXFusedCache
    raise AttributeError(f"module 'optimum_ipex_spec' has no attribute {name!r}")
