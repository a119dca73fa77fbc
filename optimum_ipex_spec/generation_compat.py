"""What transformers' ``GenerationMixin.generate`` reads from ``PreTrainedModel`` besides ``forward``.

``IPEXModelForCausalLM`` is an optimum ``OptimizedModel`` (not a ``PreTrainedModel``), so it supplies
these members itself. transformers 4.4x-4.5x read few of them; 5.x reads more (experts switching, compiled
calls, multimodal checks). Each answers as a plain text-only causal LM without MoE or tensor parallelism.
"""

from __future__ import annotations


class GenerationCompatMixin:
    """PreTrainedModel members read by ``GenerationMixin.generate`` (transformers 4.48-5.x)."""

    input_modalities = ("text",)
    tp_plan = None
    hf_quantizer = None

    @property
    def base_model(self):
        return self

    def get_experts_implementation(self) -> dict:
        """No mixture-of-experts layers: nothing to switch for decoding (5.x ``_optimize_model_for_decode``)."""
        return {}

    def set_experts_implementation(self, *args, **kwargs) -> None:
        return None

    def get_compiled_call(self, compile_config):
        """Our forward is already a traced graph (IPEX) or the chosen PyTorch path; generate() calls it as is."""
        return self.__call__

    def is_remote_code(self) -> bool:
        return False

    def get_input_embeddings(self):
        return self._eager_module("get_input_embeddings")

    def get_output_embeddings(self):
        """Raises NotImplementedError: the LM head is baked into the traced graph (IPEX) or packed for the
        decoder (PyTorch path). transformers >= 4.52 asks for it when a *transformers* target samples with an
        ``IPEXModelForCausalLM`` draft of another tokenizer (it prunes the draft's head in place)."""
        raise NotImplementedError(
            "IPEXModelForCausalLM does not expose its LM head for replacement. Universal speculative sampling "
            "(do_sample=True, tokenizer= and assistant_tokenizer=) with a transformers target prunes the draft's "
            "LM head: use an IPEXModelForCausalLM target (it keeps the head and masks instead), a transformers "
            "draft, or greedy decoding"
        )

    def _eager_module(self, name):
        getter = getattr(getattr(self, "model", None), name, None)
        if getter is None:
            raise NotImplementedError(
                f"{name}() is not available on the IPEX backend (the weights live inside the traced graph); "
                "load with backend='torch' to reach the embeddings"
            )
        return getter()
