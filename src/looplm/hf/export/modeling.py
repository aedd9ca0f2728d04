""":class:`LoopLMForCausalLM`: a looplm model behind transformers' ``PreTrainedModel`` and
``GenerationMixin``.

The looplm model is held whole (``.model``, a :class:`~looplm.model.LoopLM`), so every
configuration runs unchanged and the weights keep looplm's names under ``model.``. The
adapter translates transformers' calling convention: the 2-D attention mask covers past and
new positions (looplm takes the new ones; the past's validity lives in the cache), labels
are unshifted, and the cache is a :class:`~looplm.hf.export.cache.LoopLMCache` the model creates
itself (``generate()`` never builds a ``DynamicCache`` for it).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from looplm.config_base import ConfigError
from looplm.hf.export.cache import LoopLMCache
from looplm.hf.export.configuration import LoopLMConfig
from looplm.model import LoopLM
from looplm.targets import IGNORE_INDEX

#: transformers 5.24 renamed the cache argument and output field ``past_key_values`` to
#: ``cache``; the adapter takes either name and fills whichever field this version has.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class LoopLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A :class:`~looplm.model.LoopLM` for ``AutoModelForCausalLM`` and ``generate()``."""

    config_class = LoopLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}  # applied iff tie_word_embeddings

    def __init__(self, config: LoopLMConfig):
        super().__init__(config)
        self.model = LoopLM(config.model_config())
        # transformers builds the model on the meta device and fills every tensor from the
        # checkpoint; non-persistent buffers (rotary tables, decay rates, stream initial
        # states) would be left empty, so they are saved and loaded like the weights here.
        persistent = self.model.state_dict().keys()
        for name, buffer in list(self.model.named_buffers()):
            if name not in persistent:
                owner, _, attr = name.rpartition(".")
                self.model.get_submodule(owner).register_buffer(attr, buffer, persistent=True)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own LoopLMCache (forward with use_cache)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """``generate()``'s hook for the cache it starts with: a :class:`LoopLMCache` unless the
        caller passed one or turned caching off. Assisted decoding needs the cache to exist
        before the first forward (it crops rejected draft tokens from it)."""
        given = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if given is None and generation_config.use_cache is not False:
            model_kwargs[_CACHE_FIELD] = LoopLMCache()

    def create_masks_for_generate(self, attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
        """The 2-D padding mask unchanged: transformers would build 4-D masks for a static
        cache, while looplm builds every mask it needs from the padding and the cache."""
        return attention_mask

    def _init_weights(self, module: nn.Module) -> None:
        """Nothing: looplm's own init (:mod:`looplm.init`) ran when the model was built, and
        loading fills every tensor from the checkpoint."""

    def load_looplm(self, model: LoopLM) -> None:
        """Take the weights (and buffers) of a looplm model of the same config (strict)."""
        state = model.state_dict()
        state.update({name: buf for name, buf in model.named_buffers() if name not in state})
        self.model.load_state_dict(state)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.head = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[LoopLMCache] = None,
        cache: Optional[LoopLMCache] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        iterations: Optional[int] = None,
        logits_to_keep: int = 0,
        return_dict: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
    ) -> Union[CausalLMOutputWithPast, tuple]:
        """input_ids [B, T]; attention_mask [B, past + T] (1 real, 0 left padding) or
        [B, T]; labels [B, T] unshifted (-100 ignored); iterations: loop count (default
        ``config.iterations``, else the trained count). Returns logits [B, T, V] (the last
        ``logits_to_keep`` positions when > 0), the loss with looplm's auxiliary losses,
        and the cache when ``use_cache`` (a tuple of the set fields with ``return_dict=False``).
        The cache comes in as ``cache`` (transformers >= 5.24) or ``past_key_values``."""
        if output_attentions or output_hidden_states:
            raise ConfigError("output_attentions/output_hidden_states", True,
                              "False: use looplm's model.model(..., output_attentions=True, output_states=True)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and past_key_values is not None:
            raise ConfigError("past_key_values", "<given with cache>", "one of cache or past_key_values")
        cache = past_key_values if cache is None else cache
        if cache is not None and not isinstance(cache, LoopLMCache):
            raise ConfigError("cache", type(cache).__name__, "a LoopLMCache (or None: the model makes one)")
        if cache is None and use_cache:
            cache = LoopLMCache()
        mask = self._new_mask(attention_mask, input_ids, cache)
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX) if labels is not None else None
        out = self.model(input_ids, targets, attention_mask=mask, cache=cache.loop if cache is not None else None,
                         iterations=self.config.iterations if iterations is None else iterations,
                         logits_to_keep=logits_to_keep if targets is None else 0)
        if cache is not None:
            cache.after_forward()
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep > 0 else out.logits
        output = CausalLMOutputWithPast(loss=out.loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return output.to_tuple() if return_dict is False else output

    @staticmethod
    def _new_mask(attention_mask: Optional[torch.Tensor], input_ids: torch.Tensor,
                  cache: Optional[LoopLMCache]) -> Optional[torch.Tensor]:
        """The new positions' columns of a mask over past + new positions (left padding only)."""
        if attention_mask is None:
            return None
        past, new = (cache.get_seq_length() if cache is not None else 0), input_ids.shape[1]
        if attention_mask.dim() != 2 or attention_mask.shape[1] not in (new, past + new):
            raise ValueError(f"attention_mask of shape {tuple(attention_mask.shape)}: expected [B, {past + new}] "
                             f"(past + new positions) or [B, {new}]")
        if bool((attention_mask[:, :-1] > attention_mask[:, 1:]).any()):
            raise ConfigError("attention_mask", "<a 0 after a 1>",
                              "left padding only (0s before the 1s of each row); generate() builds such a mask "
                              "when pad_token_id occurs inside a prompt: pass attention_mask explicitly")
        return attention_mask[:, -new:]
