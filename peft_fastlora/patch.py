"""``patch`` / ``unpatch``: the entry points. The model instance gets a ``FastLoRAState``
(``state.py``); nothing of a transformers or PEFT class is changed, and ``unpatch`` restores
everything.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from torch import nn

from .backend import check_backend_name
from .continuous.graphs import EngineWarmup
from .decode.generate import WarmupReport, warm_up
from .options import DEFAULT_BUCKETS, PatchOptions
from .report import PatchReport
from .tuning import Tuning
from .state import FastLoRAState

logger = logging.getLogger("peft_fastlora")
_STATE_ATTR = "_fastlora_state"


def get_state(model: nn.Module) -> Optional[FastLoRAState]:
    return model.__dict__.get(_STATE_ATTR)


def patch(model: nn.Module, backend: str = "auto", *, fuse: bool = True,
          max_loras_per_batch: Optional[int] = None, cuda_graphs="auto",
          graph_buckets: Optional[Sequence[int]] = None, max_graphs: Optional[int] = None,
          cache_budget_bytes: Optional[int] = None, decode_attention="auto",
          fuse_norms="auto", fuse_rotary="auto", fuse_silu_mul="auto",
          fuse_kv_write="auto", grouped_experts="auto", engine_attention: str = "auto", fold_shrink="auto",
          stream_gemm="auto", defer_stop_check: bool = True, tuning: Optional[Tuning] = None) -> PatchReport:
    """Serve the LoRA adapters of ``model`` (a ``PeftModel``) through a fastlora backend.

    Args:
        model: a PEFT model with one or more LoRA adapters; or a transformers model without PEFT,
            which gets the base-model speedups alone. Anything else raises ``TypeError``.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` or ``"torch_native"``.
        fuse: run sibling q/k/v and gate/up projections as one GEMM and one LoRA call each;
            on CUDA also the siblings no adapter targets (a plain model's among them).
        max_loras_per_batch: most distinct adapters in one batch, and the slots of the stacks (GPU
            memory on CUDA): with fewer than the adapters, each call's adapters are loaded into
            slots on demand, least recently used out (default: a slot for every adapter).
        cuda_graphs: replay the decode steps of ``generate`` from CUDA graphs: ``"auto"`` (on
            when the model is on CUDA), ``True``, ``False``, or ``"emulate"`` (the same runner with
            the graphs re-executed eagerly: a testing aid that needs no GPU).
        graph_buckets: batch sizes graphs are captured for; a batch is padded to the next one,
            a larger batch decodes eagerly (default ``options.DEFAULT_BUCKETS``, 1 to 256).
        max_graphs: captured graphs kept at most, least recently used dropped first (default:
            one per bucket; two where some sites fold their shrink only for the calls that use
            enough of their adapters' rows, see ``fold_shrink``).
        cache_budget_bytes: most bytes of static KV cache fastlora keeps for its graphs; a call
            that would need more decodes eagerly (default None: the largest call's needs).
        decode_attention: one-token steps use fastlora's Triton decode attention (split KV,
            grouped-query heads without repeated K/V, only filled positions read) through
            transformers' attention registry: ``"auto"`` (on CUDA), ``True`` or ``False``.
            Models it does not cover (sliding windows, soft-capping) keep their attention.
        fuse_norms: Llama-family RMSNorm modules run as one Triton kernel each (inference only):
            ``"auto"`` (on CUDA), ``True`` or ``False``.
        fuse_rotary: attention modules that call the Llama-family ``apply_rotary_pos_emb`` rotate
            q and k in one Triton kernel (inference only): ``"auto"`` (on CUDA with graphs on),
            ``True`` or ``False``. Where the whole attention forward is the Llama family's (Llama,
            Mistral, Qwen2, Gemma, ...) and ``fuse_kv_write`` is on, that kernel also writes the
            step's keys and values into fastlora's static caches. With it, the decode graphs read
            the rotary embedding module's cos / sin from a table of its own outputs (static rope
            types; calls that pass ``position_ids`` keep the module).
        fuse_silu_mul: Llama-family gated MLPs whose activation is SiLU or torch's GELU-tanh
            (Gemma) compute ``act(gate) * up`` in one Triton kernel (inference only; the report's
            "act-mul"): ``"auto"`` (on CUDA with graphs on), ``True`` or ``False``.
        fuse_kv_write: the static caches fastlora owns for its graphs write a step's keys and
            values in one Triton kernel (full-attention layers): ``"auto"``/``True`` or ``False``.
        grouped_experts: routed experts that no adapter targets (transformers' fused 3-D layout,
            under its ``eager`` or ``grouped_mm`` experts implementation) are computed as the
            grouped GEMMs over (token, chosen expert) pairs that LoRA'd experts get; another
            implementation the model chose is kept, with the reason in the report: ``"auto"`` (on
            CUDA), ``True`` or ``False``.
        engine_attention: the attention of transformers' continuous-batching engine while a
            manager runs: ``"paged"`` (fastlora's Triton kernel reading the engine's paged cache in
            place, with no gathered copy of the keys: a query block holds a kv head's query
            heads, the keys split across programs; sliding-window layers take the varlen path),
            ``"varlen"`` (PyTorch's flash varlen kernel over each request's own keys gathered out
            of the paged cache; off CUDA or in fp32 a slow per-request reference, for tests),
            ``"auto"`` (where the flash varlen kernel applies, CUDA and fp16 / bf16: "paged" on
            an sm80 or newer GPU with Triton, else "varlen"; elsewhere the engine's own) or
            ``"engine"`` (the engine's own).
        fold_shrink: store each site's LoRA A under its base weight, so that decode-sized
            forwards get every adapter's shrink from the base GEMM itself and run only the expand
            after it: ``"auto"`` (on CUDA), ``True`` or ``False``. A site whose A rows add at most
            1/8 of the base weight's rows folds for every call; where every adapter has a GPU
            slot, one of up to as many rows as the base weight's folds for the calls whose
            adapters use at least a third of them (the GEMM computes every row); with fewer
            slots than adapters such a site stores a *staging* area there instead, sized for a
            call of average adapters, and a call that folds copies its adapters' A blocks into
            it first (a call whose blocks do not fit keeps the fused kernel). Under tensor
            parallelism each rank folds its own shards.
        stream_gemm: the base GEMMs of forwards of at most 64 rows (decode steps) in bf16 / fp16
            run through fastlora's weight-streaming Triton GEMM instead of cuBLAS, layers of 4,096
            to 65,536 outputs (the LM head and narrow layers keep cuBLAS): ``"auto"`` (on a Hopper
            GPU with graphs on: the tiles were chosen on an H200, and an eager step pays each
            Triton launch's host time), ``True`` (on CUDA; on the CPU under Triton's interpreter,
            for tests) or ``False``.
        defer_stop_check: on calls whose decode steps the graphs replay on CUDA, transformers'
            loop learns that every row has finished one step late (its ``DeferredStopCheck``, the
            one extra step undone), so the host queues the next step while the GPU runs this one.
            Calls that return the cache (``return_dict_in_generate``), pass ``custom_generate``,
            a tokenizer (stop strings) or use a mode other than greedy / sampling check every step.
            Greedy calls among these also select each step's tokens in one kernel (the argmax,
            minimum lengths, EOS and padding: ``decode/greedy_loop.py``) where their logits
            processors and stopping criteria are ones it reproduces; the report's "token selection"
            and the graph runner's ``stats["selection_reasons"]`` say which calls did not.
        tuning: thresholds and tiles of these paths (``Tuning``; default: the values measured on an
            H200). Benchmarks and tests change them here.
    Returns:
        the ``PatchReport``. Patching a patched model with the same options returns its report;
        with other options it raises ``ValueError`` (``unpatch`` first).
    """
    _check_patchable(model)
    options = PatchOptions(
        backend=backend, fuse=fuse, max_loras_per_batch=max_loras_per_batch, cuda_graphs=cuda_graphs,
        graph_buckets=DEFAULT_BUCKETS if graph_buckets is None else graph_buckets, max_graphs=max_graphs,
        cache_budget_bytes=cache_budget_bytes, decode_attention=decode_attention, fuse_norms=fuse_norms,
        fuse_rotary=fuse_rotary, fuse_silu_mul=fuse_silu_mul, fuse_kv_write=fuse_kv_write,
        grouped_experts=grouped_experts, engine_attention=engine_attention, fold_shrink=fold_shrink,
        stream_gemm=stream_gemm,
        defer_stop_check=defer_stop_check, tuning=Tuning() if tuning is None else tuning)
    check_backend_name(options.backend)  # before the options are compared with a patched model's
    state = get_state(model)
    if state is not None:
        diffs = state.options.differences(options)
        if diffs:
            raise ValueError(
                "fastlora.patch: the model is already patched with other options ("
                + "; ".join(diffs) + "); call fastlora.unpatch(model) first")
        return state.report
    state = FastLoRAState(model, options)
    model.__dict__[_STATE_ATTR] = state
    try:
        report = state.build()
    except Exception:
        state.teardown()
        del model.__dict__[_STATE_ATTR]
        raise
    logger.info("%s", report)
    return report


def _check_patchable(model) -> None:
    """``patch`` takes a PEFT model holding LoRA adapters, or a transformers model that generates
    (its base-model speedups alone). Anything else raises ``TypeError`` saying so."""
    if not isinstance(model, nn.Module) or not callable(getattr(model, "generate", None)):
        raise TypeError(
            "fastlora.patch takes a PeftModel holding LoRA adapters (get_peft_model, PeftModel.from_pretrained), "
            "or a transformers model that generates (AutoModelForCausalLM and the like); "
            f"got {type(model).__module__}.{type(model).__name__}")


def unpatch(model: nn.Module) -> None:
    """Restore the original forwards and parameter storage. A no-op on an unpatched model."""
    state = get_state(model)
    if state is None:
        return
    state.teardown()
    del model.__dict__[_STATE_ATTR]


def warmup(model: nn.Module, batch_sizes: Optional[Sequence[int]] = None, max_length: int = 512,
           adapter_names: Optional[Sequence[str]] = None) -> WarmupReport:
    """Capture the decode graphs of a patched model before traffic arrives.

    For each batch size (mapped to its bucket; default: every bucket), largest first, runs a
    three-token ``generate`` whose static cache holds ``max_length`` tokens: the shared cache
    buffer is sized once for the largest bucket, and later calls up to ``max_length`` tokens reuse
    these caches and graphs. ``adapter_names``: the adapters of the warm-up rows (cycled; default:
    every adapter in turn, or the first ones that fill the GPU slots). Where some sites fold their
    shrink per call (``fold_shrink``), a bucket is also warmed with no adapter and with the
    adapters most likely to make a call fold (default names only), so that calls of either choice
    find their graph. Returns a ``WarmupReport``.
    """
    state = get_state(model)
    if state is None:
        raise ValueError("fastlora.warmup: the model is not patched (call fastlora.patch first)")
    return warm_up(state, batch_sizes, max_length, adapter_names)


def warmup_engine(manager) -> EngineWarmup:
    """Capture a continuous-batching manager's CUDA graphs before it serves.

    ``manager``: made by ``init_continuous_batching`` on a patched model, not started yet. Runs the
    engine's own warm-up, then, where fastlora's attention lets the engine key its graphs by the
    step's query count alone, one made-up step of every query count a step can have (on each of
    async batching's two IO pairs): a server's first requests then meet no capture. A no-op
    (nothing captured) where the engine runs no graphs. Returns an ``EngineWarmup``.
    """
    warm = getattr(manager, "fastlora_warmup", None)
    if warm is None:
        raise ValueError("fastlora.warmup_engine takes a continuous-batching manager of a fastlora-patched "
                         f"model, got {type(manager).__name__}")
    return warm()
