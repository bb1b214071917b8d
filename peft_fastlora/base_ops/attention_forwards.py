"""Llama-family attention forwards whose rotary embedding and KV-cache write are one Triton launch
(``ops.rotary_kv``) on fastlora's static caches, on this model instance only.

A class's forward is taken only when it computes what the Llama family's does (``match.py``):
Llama, Gemma, Granite, and Mistral and Qwen2 with their ``sliding_window`` argument; transformers
names the cache argument ``past_key_values`` before 5.2x and ``cache`` after, and passes its
``kwargs`` to the cache's ``update`` after, and all the forms are recognised. The instance forward
calls the same projections, the same attention function and ``o_proj`` with the same arguments, in
the same order. Where the cache layer is one of fastlora's that its KV kernel writes (a plain static
layer, ``decode/static_cache.py``) and ``ops.rotary`` takes the tensors, the rotary and the layer's
``update`` are one kernel; otherwise the call runs the forward that ``rotary_forwards`` would have
installed (the class's own code with the one-kernel rotary).
"""

from __future__ import annotations

import inspect
import itertools
from typing import Callable, NamedTuple, Optional

from ..compat.attention import attention_function
from .match import code_shape, reference_shape
from ..decode.static_cache import kernel_writes, rotary_update

_TEMPLATE = '''
def forward(self, hidden_states, position_embeddings{default}, attention_mask{default}, {cache}=None, **kwargs):
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if {cache} is not None:
        key_states, value_states = {cache}.update(key_states, value_states, self.layer_idx{update})

    attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, eager_attention_forward
    )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,{sliding}
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights
'''
_SLIDING = {None: "", "module": "\n        sliding_window=self.sliding_window,",
            "config": '\n        sliding_window=getattr(self.config, "sliding_window", None),'}


class Form(NamedTuple):
    """What differs between the recognised forwards."""

    cache: str  # the cache argument's name
    update_kwargs: bool  # the cache's update also gets ``kwargs=kwargs``
    sliding: Optional[str]  # the attention function's sliding_window: none, the module's, the config's


_FORMS = {reference_shape(_TEMPLATE.format(default=default, cache=f.cache, sliding=_SLIDING[f.sliding],
                                           update=", kwargs=kwargs" if f.update_kwargs else "")): f
          for default, f in itertools.product(
              ("=None", ""), (Form(c, u, s) for c in ("past_key_values", "cache") for u in (False, True)
                              for s in _SLIDING))}


def attention_form(forward: Callable) -> Optional[Form]:
    """The form of a Llama-family attention forward, or None for any other code."""
    return _FORMS.get(code_shape(forward))


def _fastlora_layer(cache, layer_idx):
    """The cache's layer ``layer_idx`` when it is one of fastlora's static layers and the cache's own
    ``update`` would only call that layer's (no offloading); else None."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layer_idx, int) or not isinstance(layers, list) or not 0 <= layer_idx < len(layers) \
            or getattr(cache, "offloading", False):
        return None
    layer = layers[layer_idx]
    return layer if getattr(layer, "_fastlora_kernel_writes", False) else None


def make_attention_forward(form: Form, original: Callable, fallback: Callable, fast_apply: Callable,
                           rotary_applies: Callable) -> Callable:
    """The instance forward for a class whose ``original`` forward has ``form``. ``fallback``: the
    forward to run where the one kernel does not apply; ``fast_apply``: the one-kernel
    ``apply_rotary_pos_emb``; ``rotary_applies(q, k, cos, sin)``: whether ``ops.rotary`` takes them."""

    scope = inspect.unwrap(original).__globals__
    registry, eager = scope["ALL_ATTENTION_FUNCTIONS"], scope["eager_attention_forward"]
    other_name = "cache" if form.cache == "past_key_values" else "past_key_values"

    def fused_rotary_kv_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args,
                                **kwargs):
        layer = _fastlora_layer(kwargs.get(form.cache), getattr(self, "layer_idx", None))
        if args or layer is None or position_embeddings is None or other_name in kwargs or (
                form.sliding is not None and "sliding_window" in kwargs):
            return fallback(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        cache = kwargs.pop(form.cache)
        input_shape = hidden_states.shape[:-1]
        # the template's three projections, called in its order (q first: a fused sibling group
        # computes all three on the first call and hands the others theirs)
        query_states, key_states, value_states = (
            proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        if rotary_applies(query_states, key_states, cos, sin) and kernel_writes(
                layer, key_states, value_states):
            query_states, key_states, value_states = rotary_update(layer, query_states, key_states, value_states,
                                                                   cos, sin)
        else:
            query_states, key_states = fast_apply(query_states, key_states, cos, sin)
            extra = {"kwargs": kwargs} if form.update_kwargs else {}
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, **extra)
        attention_interface = attention_function(self.config, registry, eager)
        if form.sliding is not None:
            kwargs["sliding_window"] = (self.sliding_window if form.sliding == "module"
                                        else getattr(self.config, "sliding_window", None))
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    return fused_rotary_kv_forward
