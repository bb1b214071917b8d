"""Thin forwards installed on the model's LoRA layers: the base GEMM, then ``backend.run_*``.

A *site* is what one backend call serves: a single LoRA layer (``LinearSite``, ``EmbeddingSite``)
or a fused group of siblings (``FusedSite``). Each member module of a site gets an instance-level
``forward`` that takes the call's ``CallContext`` from the model state once, decides from it and
the forward's arguments whether the fast path applies, and passes it down; when the fast path does
not apply, the member's original forward (PEFT's) runs, unchanged. No kernel details live here.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from ..call_context import CallContext
from ..compat.modules import has_forward_hooks, is_dtensor, local
from ..compat.peft import (base_layer_of, is_lora_layer, layer_adapters_disabled, layer_dropout_active,
                           layer_is_merged)
from ..compat.tensor_parallel import (tp_gather_finish, tp_gather_partial, tp_group, tp_rowwise_finish,
                                      tp_rowwise_finish_columns, tp_rowwise_partial, tp_sum, tp_vocab_ids,
                                      tp_vocab_partial)
from ..instance_methods import InstancePatches
from .beside import LoraBeside
from .fusion import FusedGroup, int8_dequantize
from .pool import SitePool
from ..decode.capture import GraphUnsafe
from ..ops.glu_expand import BLOCK_M as GLU_EXPAND_BLOCK_M
from ..ops.glu_lora import check_glu_lora, GluLora, MAX_RANK

_VARIANT_KWARGS = ("alora_offsets",)
# the row tile of decode-sized forwards (the 8-bit path computes their LoRA beside the int8 GEMM)
DECODE_MAX_BLOCK_M = 16


class Site:
    """Common part: the members, their saved forwards, and the pool."""

    kind = "linear"
    # a 2-D input of len(names) * S rows is the forward's tokens flattened row by row (as
    # transformers' MoE blocks hand them to a shared expert); not an embedding's (rows, S) ids
    takes_flat_tokens = True

    def __init__(self, name: str, members: List[nn.Module], pool: SitePool):
        self.name = name
        self.members = members
        self.pool = pool
        self.lora_layers = [m for m in members if is_lora_layer(m)]
        # where its pool lives and its kernels launch (layers of one model may sit on several
        # GPUs under accelerate's device_map)
        self.device = local(base_layer_of(members[0]).weight).device
        self._patches = InstancePatches()

    # -- installing -------------------------------------------------------------------------
    def install(self, state):
        for i, m in enumerate(self.members):
            # an instance-level forward someone else installed (accelerate hooks do this) is the
            # original this one calls, and comes back on ``uninstall``
            original = m.forward

            def patched(module, x, *args, _i=i, _orig=original, **kwargs):
                context = state.context()
                if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
                    with torch.cuda.device(self.device):  # Triton launches on the current device
                        return self.member_forward(state, context, _i, _orig, x, args, kwargs)
                return self.member_forward(state, context, _i, _orig, x, args, kwargs)

            self._patches.bind(m, "forward", patched)

    def uninstall(self):
        self._patches.restore()

    # -- deciding ---------------------------------------------------------------------------
    def fast_path_info(self, state, context: CallContext, x, args, kwargs):
        """The batch info when this call can take the fast path, else None."""
        bi = self._fast_path_info(state, context, x, args, kwargs)
        if bi is None and state.stored:
            self._refuse_registered(state, context, kwargs)
        if bi is None and context.graphed and (_names(context, kwargs) is not None
                                               or context.segments is not None):
            # PEFT's path indexes rows from host lists: captured, it would replay stale indices
            raise GraphUnsafe(f"{self.name} would leave the static path")
        return bi

    def _fast_path_info(self, state, context: CallContext, x, args, kwargs):
        names = _names(context, kwargs)
        segments = context.segments if names is None else None
        if (names is None and segments is None) or args:
            return None
        if any(k != "adapter_names" and not (k in _VARIANT_KWARGS and v is None) for k, v in kwargs.items()):
            return None
        if not isinstance(x, torch.Tensor):
            return None
        if torch.is_grad_enabled():
            state.warn_once(
                "a forward with adapter_names and gradients enabled runs PEFT's own (slow) mixed-batch "
                "path; for inference, call the model inside torch.no_grad() or torch.inference_mode()")
            return None
        if segments is not None:
            return self._segments_info(state, context, x)
        rows = x.shape[0] if x.dim() >= 1 else -1
        # under graph capture the batch is padded to its bucket (padding rows have no adapter)
        graph_rows = context.graph_batch_info.bs if context.graphed else None
        # flattened tokens only in a layout an earlier layer of the forward established (a 2-D
        # input that is a plain batch of another size keeps PEFT's length error)
        flat = (self.takes_flat_tokens and x.dim() == 2 and rows != len(names) and not context.graphed
                and len(names) > 0 and rows % len(names) == 0
                and state.batch_infos.holds(names, len(names), rows // len(names)))
        if rows < 0 or (len(names) != rows and rows != graph_rows and not flat) or x.device != self.device:
            return None  # PEFT's forward raises its own error for a length mismatch
        if self._blocked(state, x):  # e.g. after model.to(torch.float64): PEFT's path serves it
            return None
        bi = state.batch_info(context, names, x, self)
        if bi is None or any(s in self.pool.unsupported for s in bi.slots_in_batch):
            return None
        return state.batch_info_on(bi, self.device)

    def _refuse_registered(self, state, context: CallContext, kwargs):
        """Adapters registered by name exist only on fastlora's path: a forward that cannot take it
        is refused with the reason, instead of PEFT's path failing on a name it does not know."""
        segments = context.segments
        names = _names(context, kwargs) or (segments.names if segments is not None else ())
        used = sorted({n for n in names if n in state.stored})
        if not used:
            return
        why = ("gradients are enabled (call it under torch.no_grad() or torch.inference_mode())"
               if torch.is_grad_enabled() else
               "it cannot take fastlora's path here (dropout in training mode, merged or disabled adapters, "
               "or an input dtype or device the backend does not take)")
        raise ValueError(f"fastlora: registered adapter(s) {', '.join(used)} are served only by fastlora's "
                         f"path, and this forward of {self.name} cannot take it: {why}")

    def _segments_info(self, state, context: CallContext, x):
        """Continuous batching: x is one row of ``segments.num_tokens`` tokens."""
        segments = context.segments
        flat = self.takes_flat_tokens and x.dim() == 2 and x.shape[0] == segments.num_tokens  # (tokens, hidden)
        if not flat and (x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != segments.num_tokens):
            raise RuntimeError(
                f"{self.name}: a continuous-batching forward of {segments.num_tokens} tokens got an "
                f"input of shape {tuple(x.shape)}")
        if x.device != self.device or self._blocked(state, x):
            return None
        bi = state.segment_batch_info(context)
        if any(s in self.pool.unsupported for s in bi.slots_in_batch):
            return None
        return state.batch_info_on(bi, self.device)

    def _blocked(self, state, x) -> bool:
        """What sends a forward to PEFT's path whatever its adapters (the reason is PEFT's)."""
        if is_dtensor(x):  # tensor parallelism off its local inference path
            return True
        for layer in self.lora_layers:
            if layer_dropout_active(layer) or layer_is_merged(layer) or layer_adapters_disabled(layer):
                return True
        dtype = x.dtype if x.is_floating_point() else base_layer_of(self.members[0]).weight.dtype
        supported = getattr(state.backend, "supported_dtypes", None)
        return supported is not None and dtype not in supported

    def peft_forward(self, context: CallContext, original, x, args, kwargs, lora: bool = True):
        """This member's own (PEFT's) forward. In a continuous-batching forward it gets one row
        per token and each token's adapter name: PEFT's per-row path, exactly, never the active
        adapter applied to every sequence. ``lora``: the member is a LoRA layer (a fused group's
        plain sibling takes no adapter names)."""
        if not lora:
            return original(x, *args, **kwargs)
        if kwargs.get("adapter_names") is None and context.names is not None:
            # the call's names, which PEFT's hooks would have passed (fastlora took them instead)
            return original(x, *args, adapter_names=list(context.names), **kwargs)
        segments = context.segments
        if segments is None or kwargs.get("adapter_names") is not None:
            return original(x, *args, **kwargs)
        if self.takes_flat_tokens and x.dim() == 2:  # (tokens, hidden), flattened by the model
            return original(x.unsqueeze(1), *args, adapter_names=segments.token_names(), **kwargs).squeeze(1)
        rows = x.reshape(segments.num_tokens, 1, *x.shape[2:])
        out = original(rows, *args, adapter_names=segments.token_names(), **kwargs)
        return out.reshape(1, segments.num_tokens, *out.shape[2:])

    def member_forward(self, state, context: CallContext, i, original, x, args, kwargs):
        raise NotImplementedError


def _names(context: CallContext, kwargs):
    """The forward's adapter names: PEFT's hooks pass them to every LoRA layer, or fastlora holds
    them for the call (``FastLoRAState.serve_adapter_names``)."""
    names = kwargs.get("adapter_names")
    return names if names is not None else context.names


def _as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.reshape(-1, width)


def _folded(context: CallContext, pool: SitePool, bi) -> bool:
    """Whether this forward takes the shrink from the folded GEMM: one of at most
    ``Tuning.fold_max_tokens`` tokens, and at a per-call site where the call uses enough of its
    arena (``CallContext.folds``)."""
    if bi.num_tokens > pool.tuning.fold_max_tokens or not pool.folded():
        return False
    return not pool.fold.per_call or context.folds()


def _prefill_sized(context: CallContext, x: torch.Tensor, min_tokens: Optional[int]) -> bool:
    """Whether a gate/up call may add its deltas inside the activation's launch
    (``ops.glu_expand``): at least ``min_tokens`` tokens (None: never), and neither a
    continuous-batching step (one row of many sequences: its tiles mix them) nor a captured decode
    step. From the input's shape alone: the MLPs' other calls pay nothing more."""
    if min_tokens is None or context.segments is not None or context.graphed or x.dim() < 2:
        return False
    return x.numel() >= min_tokens * x.shape[-1]


def _rows_fill_tiles(bi) -> bool:
    """Whether each row of the forward brings at least ``ops.glu_expand``'s row tile of tokens, so
    that a tile holds one adapter's tokens but where two rows meet. The forwards that reach it
    (never a continuous-batching step) have rows of one length, padded as HF pads a batch: the
    mean is every row's."""
    return bi.num_tokens >= bi.bs * GLU_EXPAND_BLOCK_M


def _fold_forward(state, pool: SitePool, x2: torch.Tensor, bi, bias: bool = True) -> torch.Tensor:
    """Base output and LoRA delta of a folded site: one GEMM over ``[W; A]`` gives the base output
    and every arena row's shrink, the expand adds the batch's deltas into the first N columns.
    Returns the GEMM's whole (s, N + arena rows) output."""
    full = pool.fold.linear_with_tail(x2, bias)
    n = pool.offsets[-1]
    state.backend.run_packed_expand(full[:, n:], pool.fold_weights(), base_output=full[:, :n], layer_ranks=pool.ranks,
                                    layer_scalings=pool.scalings, batch_info=bi)
    return full


def _int8_beside_forward(state, pool: SitePool, x2: torch.Tensor, bi, group) -> Optional[torch.Tensor]:
    """A decode-sized forward of a site over bitsandbytes' 8-bit layers without an outlier threshold
    (``group``: the site's ``SeparateGroup``, joined): the LoRA delta started beside the input's
    quantization and the int8 GEMM (``lora.beside``), the product dequantized with the delta (on a
    GPU in one launch). None where it does not apply: a prefill (the GEMM fills the GPU), DoRA
    tables (their scale reads the base output)."""
    if (group is None or bi.block_m > DECODE_MAX_BLOCK_M or pool.packed.dora is not None
            or not group.joined_intact() or group.joined.threshold != 0.0):
        return None
    joined = group.joined
    branch = LoraBeside(state.side_streams, state.backend, pool, x2, bi)
    # started before the input's quantization: the LoRA gets ahead while the quantization runs
    # (started after it, the LoRA and the GEMM met head on and the step was slower)
    branch.start()
    try:
        quantized, row_scales = joined.quantize(x2)
        product = joined.int8_gemm(quantized)
    finally:  # joined even on an error: the side stream must not outlive the buffers it writes
        delta = branch.join()
    return int8_dequantize(joined, product, row_scales, x2.dtype, delta)


class _OneLayerSite(Site):
    """A site of one LoRA layer: its base output, then the LoRA delta added in place."""

    def member_forward(self, state, context: CallContext, i, original, x, args, kwargs):
        bi = self.fast_path_info(state, context, x, args, kwargs)
        if bi is None:
            return self.peft_forward(context, original, x, args, kwargs)
        folded = self._folded_forward(state, context, x, bi)
        if folded is not None:
            return folded
        base = base_layer_of(self.members[0])
        result = self._base_output(base, x)
        pool = state.pool_for(self, x.dtype if x.is_floating_point() else result.dtype)
        out = self._add_lora(state, base, x, result.reshape(-1, result.shape[-1]), pool, bi)
        return out.view(*result.shape[:-1], out.shape[-1])  # (a gathered layer returns more columns)

    def _base_output(self, base, x):
        return base(x)

    def _folded_forward(self, state, context: CallContext, x, bi) -> Optional[torch.Tensor]:
        """The output through a folded GEMM (see ``_fold_forward``), or None where it does not apply."""
        return None

    def _add_lora(self, state, base, x, out, pool, bi):
        raise NotImplementedError


class LinearSite(_OneLayerSite):
    """One PEFT LoRA ``Linear`` (base ``nn.Linear`` or GPT-2 ``Conv1D``).

    Under transformers' tensor parallelism (``tp``: "colwise" or "rowwise"), the pool holds this
    rank's shards. Colwise: the base layer returns this rank's output columns, and B's rows
    match them. Rowwise: this rank's input columns give a partial sum of the base output and,
    through A's columns, of the LoRA delta (the expand is linear); both are added before the one
    all-reduce the layer makes without LoRA, then the bias. "colwise_gather" (the LM head): this
    rank's output columns and their delta, then the one all-gather.
    """

    kind = "linear"

    def __init__(self, name, members, pool, tp: Optional[str] = None):
        super().__init__(name, members, pool)
        self.tp = tp
        self.tp_group = tp_group(members[0]) if tp in ("rowwise", "colwise_gather") else None
        self.int8 = None  # a bitsandbytes 8-bit base held as a join of one

    def _folded_forward(self, state, context, x, bi):
        if self.int8 is not None:  # (never under tensor parallelism)
            res = _int8_beside_forward(state, state.pool_for(self, x.dtype), _as_rows(x, x.shape[-1]).contiguous(),
                                       bi, self.int8)
            return None if res is None else res.view(*x.shape[:-1], res.shape[-1])
        if self.pool.fold is None or self.tp == "colwise_gather":
            return None
        pool = state.pool_for(self, x.dtype)
        if not _folded(context, pool, bi):
            return None
        n = pool.offsets[-1]
        # row-sharded: partial sums of the base output and of every shrink (the expand is linear),
        # reduced together in the layer's one all-reduce, then the bias
        rowwise = self.tp == "rowwise"
        full = _fold_forward(state, pool, _as_rows(x, x.shape[-1]).contiguous(), bi, bias=not rowwise)
        if rowwise:
            full = tp_rowwise_finish_columns(base_layer_of(self.members[0]), full, n, self.tp_group)
        res = full[:, :n]  # rows one stride apart: a view, not a copy
        return res.view(*x.shape[:-1], n)

    def _base_output(self, base, x):
        if self.int8 is not None and self.int8.joined_intact():
            return self.int8.linear(x)  # (fastlora's dequantization on a GPU, as the groups')
        if self.tp == "rowwise":
            return tp_rowwise_partial(base, x)
        if self.tp == "colwise_gather":
            return tp_gather_partial(base, x)
        return base(x)

    def _add_lora(self, state, base, x, out, pool, bi):
        out = state.backend.run_packed_lora(_as_rows(x, x.shape[-1]).contiguous(), pool.packed,
                                            base_output=out, layer_ranks=pool.ranks,
                                            layer_scalings=pool.scalings, batch_info=bi)
        if self.tp == "rowwise":
            return tp_rowwise_finish(base, out, self.tp_group)
        if self.tp == "colwise_gather":
            return tp_gather_finish(base, out, self.tp_group)
        return out


class EmbeddingSite(_OneLayerSite):
    """One PEFT LoRA ``Embedding``: a lookup in A, then the expand.

    Under transformers' tensor parallelism (``tp`` "vocab": the vocabulary rows sharded), each rank
    looks up the ids it holds in its rows of the base weight and of A (zeros for the others), adds
    the delta, and the ranks' parts are summed: one all-reduce, as without LoRA."""

    kind = "embedding"
    takes_flat_tokens = False

    def __init__(self, name, members, pool, tp: Optional[str] = None):
        super().__init__(name, members, pool)
        self.tp = tp
        self.tp_group = tp_group(members[0]) if tp == "vocab" else None

    def _base_output(self, base, x):
        return tp_vocab_partial(base, x) if self.tp == "vocab" else base(x)

    def _add_lora(self, state, base, x, out, pool, bi):
        ids, vocab = x.reshape(-1), base.num_embeddings
        if self.tp == "vocab":  # ids this rank does not hold are past its vocabulary: no delta
            ids, _, vocab = tp_vocab_ids(base, ids)
        out = state.backend.run_packed_embedding_lora(
            ids.contiguous(), pool.packed, vocab, base_output=out,
            layer_ranks=pool.ranks, layer_scalings=pool.scalings, batch_info=bi)
        return tp_sum(out, self.tp_group) if self.tp == "vocab" else out


class FusedSite(Site):
    """Sibling projections computed by one base GEMM and one stacked LoRA call.

    The first member called computes every member's output and leaves the others in a stash keyed
    by the input tensor's identity; each sibling called with that same tensor takes its output from
    the stash (once); the stash is dropped when the last sibling has taken its output. Any other
    call runs the member's own forward.
    """

    def __init__(self, name: str, group: FusedGroup, pool: SitePool, parent: Optional[nn.Module] = None):
        super().__init__(name, group.members, pool)
        self.group = group
        self.kind = group.kind
        self.parent = parent  # the module holding the members (a gate/up site's: the MLP)
        self._stash = None  # (input tensor, [output or None per member])
        self._glu_checked = None  # the scratch whose operands ``ops.glu_lora`` has checked

    def gated(self, state, mlp: nn.Module, stream, act: str, glu_min_tokens: Optional[int]):
        """For the gate/up site of a gated ``mlp``: ``x -> act(gate(x)) * up(x)`` with both LoRA
        deltas applied in the activation's launch, or None where that does not apply and the MLP
        calls the members as usual. Two launches take it, for an unstaged site without a LoRA bias
        or DoRA: ``StreamLinears.gated_lora`` (65-128 rows of a folded site: the base GEMM and the
        shrink too; ``stream`` None: never) and, at prefill (``_prefill_sized`` from
        ``glu_min_tokens`` tokens, None: never; ``_rows_fill_tiles``), ``ops.glu_expand`` after the
        base GEMM and the shrink."""
        gate, up = self.members

        def forward(x):
            if (self.group.separate or mlp.gate_proj is not gate or mlp.up_proj is not up
                    or getattr(state.backend, "name", None) != "triton"
                    or not self.group.is_intact() or self.group.ext_bias is not None
                    or has_forward_hooks(gate) or has_forward_hooks(up)):
                return None
            context = state.context()
            prefill = _prefill_sized(context, x, glu_min_tokens)
            if stream is None and not prefill:
                return None
            bi = self._fast_path_info(state, context, x, (), {})
            if bi is None:
                return None  # the members' forwards decide (PEFT's path, or a graph-unsafe refusal)
            pool = state.pool_for(self, x.dtype)
            n = pool.offsets[1]
            if (pool.staging is not None or pool.bias is not None or pool.dora is not None
                    or list(pool.offsets) != [0, n, 2 * n]):
                return None
            if _folded(context, pool, bi):
                lora = self._glu_lora(pool, bi, x) if stream is not None and pool.glu_buffers is not None else None
                return None if lora is None else stream.gated_lora(x, pool.fold.ext, n, act, lora)
            if not (prefill and _rows_fill_tiles(bi)):
                return None
            x2 = _as_rows(x, x.shape[-1]).contiguous()
            out = state.backend.run_packed_glu(x2, pool.packed, self.group.linear(x2), act, layer_ranks=pool.ranks,
                                               layer_scalings=pool.scalings, batch_info=bi)
            return out.view(*x.shape[:-1], n)

        return forward

    def _glu_lora(self, pool: SitePool, bi, x):
        """The site's ``ops.glu_lora.GluLora`` for this batch, its operands checked once per scratch;
        None where an adapter's rank is past what the kernel takes."""

        buffers = pool.glu_buffers
        packed = pool.packed
        if packed.max_rank > MAX_RANK:
            return None
        lora = GluLora(bi.token_slot, pool.col_slot, pool.region_start(1), packed.b, pool.ranks, pool.scalings,
                       packed.a_rows, packed.b_offs, buffers.scratch, buffers.counters, packed.max_rank, packed.align,
                       buffers.bt, buffers.t0_pad)
        if self._glu_checked is not buffers.scratch:
            check_glu_lora(x.reshape(-1, x.shape[-1])[: min(x.numel() // x.shape[-1], buffers.scratch.shape[0])],
                           pool.fold.ext, pool.offsets[1], lora)
            self._glu_checked = buffers.scratch
        return lora

    def clear_stash(self):
        self._stash = None

    def member_forward(self, state, context: CallContext, i, original, x, args, kwargs):
        stash = self._stash
        if stash is not None and stash[0] is x and stash[1][i] is not None and not args:
            out, stash[1][i] = stash[1][i], None
            if all(o is None for o in stash[1]):
                # every sibling served: keep neither the input nor the fused output alive (a
                # prefill's would otherwise stay pinned, every layer's, for the rest of the forward)
                self._stash = None
            return out
        bi = self.fast_path_info(state, context, x, args, kwargs)
        if bi is None or not self.group.is_intact():
            return self.peft_forward(context, original, x, args, kwargs, lora=is_lora_layer(self.members[i]))
        pool = state.pool_for(self, x.dtype)
        x2 = _as_rows(x, x.shape[-1]).contiguous()
        res = _fold_forward(state, pool, x2, bi)[:, :pool.offsets[-1]] if _folded(context, pool, bi) else None
        if res is None and self.group.separate == "int8":
            res = _int8_beside_forward(state, pool, x2, bi, self.group)
        if res is None:
            res = self.group.linear(x2)
            state.backend.run_packed_lora(x2, pool.packed, base_output=res, layer_ranks=pool.ranks,
                                          layer_scalings=pool.scalings, batch_info=bi)
        res = res.view(*x.shape[:-1], res.shape[-1])
        outs = [res[..., lo:hi] for lo, hi in zip(pool.offsets[:-1], pool.offsets[1:])]
        mine = outs[i]
        outs[i] = None
        self._stash = (x, outs)
        return mine

