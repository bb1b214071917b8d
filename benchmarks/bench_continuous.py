"""Continuous batching with one adapter per request: throughput and latency on a server-like load.

    python benchmarks/bench_continuous.py --model 8b --adapters 32 --requests 2000   # continuous_8b_h200.csv
    python benchmarks/bench_continuous.py --model 8b --requests 300 --async-batching on --profile 3
    python benchmarks/bench_continuous.py --smoke      # CPU: checks the script, measures nothing

Requests have log-normal prompt and output lengths (means ``--prompt-mean`` / ``--output-mean``,
outputs capped at ``--output-cap``) and adapters drawn from a Zipf distribution over the adapters
(random weights never emit EOS: every request produces exactly its output length). All are queued
at once (offline throughput). Modes, each on the same requests:

- ``base`` / ``base_graphs``: the unpatched HF base model through the same engine, its CUDA graphs
  off / on (``use_cuda_graph=True``; warmed up before the clock starts, as a server would be), the
  engine's own attention;
- ``base_varlen``: the unpatched base model, graphs on, its engine attention replaced by fastlora's
  ``paged|fastlora_varlen`` (each request's queries against its own keys, PyTorch's flash varlen
  kernel) instead of the engine's masked attention over the whole step;
- ``base_patched`` / ``base_patched_graphs`` / ``base_patched_varlen``: the base model patched by
  fastlora (``fastlora.patch`` on the plain model, no adapters) through the same engine: the
  like-for-like references of the three fastlora modes;
- ``fastlora`` / ``fastlora_graphs`` / ``fastlora_varlen``: the patched PeftModel through the engine,
  one adapter per request (``add_request(..., adapter_name=...)``), graphs off / on / on with the
  varlen attention (``patch(engine_attention=...)``: "engine" for the first two, "varlen" for the third);
- ``base_patched_paged`` / ``fastlora_paged``: graphs on, the engine's paged cache read in place
  (``engine_attention="paged"``);
- ``static``: the patched model through ``generate`` in static batches of ``--static-batch`` rows
  (left-padded; every row waits for the longest), on the first ``--static-requests`` requests;
- ``peft``: PEFT's own mixed-batch ``generate`` (unpatched) in the same static batches, on a sample:
  the first ``--peft-requests`` requests with outputs capped at ``--peft-tokens`` (it is far slower).

Per mode: output tokens/s (the tokens the requests asked for; a static batch computes more),
request latency p50/p99 (queued to last token), time to first token
p50/p99 (from the engine's timestamps); for the fastlora modes the time per output token against
the patched base model in the same engine mode (``time_per_token_vs_base_patched``) and against the
unpatched one (``time_per_token_vs_base``). One CSV row per mode, with the GPU and package versions.
``--rounds N`` measures the modes N times, each mode in a fresh process and each round in the reverse
order of the one before (repeats on one machine spread by a few percent, and the order they run in
may matter): one row per mode and round (column ``round``), each row's ratios to its own round's
references.

Each row also sets the run against the workload's floor (``workload_floor``: its FLOPs at the GPU's
specified peak, and its bytes at the engine's measured step count and the measured copy bandwidth)
and, where fastlora's hook counts the engine's steps, the tokens a step carried. ``--profile S``
summarises S seconds of the GPU's timeline under full load per engine mode (busy and idle shares,
kernel families, copies, host syncs, steps, the engine thread's milliseconds per step in each phase
of its loop: ``continuous_profile_<model>_<gpu>.csv``; the kernels that took the most time:
``continuous_profile_kernels_<model>_<gpu>.csv``). ``--async-batching on|off`` sets the engine's
async batching (the files' names then end in ``_async_on`` / ``_async_off``); left unset, the
engine chooses (on where its graphs run and it builds no attention mask); the ``async_batching``
column says what each mode ran. Every row of a
patched model also carries the whole run's host milliseconds per step by phase (``run_host_*``).
``--host-profile N`` runs the engine thread under cProfile and writes its N costliest functions per
step (``continuous_host_profile_<model>_<gpu>.csv``): where the host's part of a step goes.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import math
import os
import random
import pstats
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as hx  # noqa: E402


def workload(args):
    rng = random.Random(args.seed)
    sigma = 0.8  # log-normal spread; mu chosen so the mean is what was asked

    def lognormal(mean, cap):
        return max(1, min(cap, int(rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma))))

    weights = [1 / (k + 1) ** args.zipf for k in range(args.adapters)]
    names = [f"a{i}" for i in range(args.adapters)]
    vocab = hx.SHAPES[args.model]["vocab_size"]
    reqs = []
    for _ in range(args.requests):
        prompt = [rng.randrange(3, vocab) for _ in range(lognormal(args.prompt_mean, args.prompt_cap))]
        reqs.append((prompt, rng.choices(names, weights)[0], lognormal(args.output_mean, args.output_cap)))
    return reqs


def engine_config(args, graphs: bool):
    from transformers import ContinuousBatchingConfig

    kw = dict(max_batch_tokens=args.max_batch_tokens, use_cuda_graph=graphs,
              use_async_batching={"unset": None, "on": True, "off": False}[args.async_batching])
    if args.cache_tokens:
        kw["num_blocks"] = max(1, args.cache_tokens // 256)
    return ContinuousBatchingConfig(**kw)


# the engine loop's phases, as fastlora's hook times them; "adapters" is the part of "forward" spent on
# the step's adapters before the launch
PHASES = ("schedule", "prepare", "forward", "outputs", "update", "adapters")


def engine_counts(manager) -> dict:
    """What fastlora's hook counted of the engine so far (a patched model; else empty): steps, graph
    captures, and the engine thread's seconds in each phase of its loop."""
    clock = getattr(manager, "fastlora_step_seconds", None)
    if clock is None:
        return {}
    graphs = getattr(manager, "fastlora_graphs", None)
    counts = {phase: clock.get(phase, 0.0) for phase in PHASES}
    counts.update(steps=clock["steps"], captures=graphs.stats["captures"] if graphs is not None else 0)
    return counts


def window_counts(before: dict, after: dict, window_s: float) -> dict:
    """The profile's engine columns over a window: steps, captures, the mean step and the host's
    milliseconds per step in each phase (``outputs``: the engine's step around the forward, which
    includes waiting for the GPU's outputs)."""
    if not after:
        return {}
    steps = after["steps"] - before.get("steps", 0)
    out = dict(engine_steps=steps, engine_captures=after["captures"] - before.get("captures", 0),
               step_ms=round(1e3 * window_s / max(1, steps), 3))
    for phase in PHASES:
        out[f"host_{phase}_ms"] = round(1e3 * (after[phase] - before.get(phase, 0.0)) / max(1, steps), 3)
    return out


@contextlib.contextmanager
def profiled_engine_thread(manager, prof):
    """The manager's engine thread, started inside, runs under ``prof`` (a ``cProfile.Profile``,
    which sees only the thread that enables it); None: nothing changes."""
    if prof is None:
        yield
        return
    original = threading.Thread.run

    def run(thread):
        if getattr(thread, "_target", None) != getattr(manager, "_run_generation_loop", None):
            return original(thread)
        prof.enable()
        try:
            return original(thread)
        finally:
            prof.disable()

    threading.Thread.run = run
    try:
        yield
    finally:
        threading.Thread.run = original


def host_functions(prof, steps: int, top: int) -> list:
    """The ``top`` functions by time spent in them and below, and the ``top`` by time spent in
    them alone, per engine step: calls, own and total
    milliseconds (cProfile's clock: the profiler slows small calls, compare shares)."""
    def where(file, line, name):
        for root in ("site-packages/", "dist-packages/", "/lib/", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                     + os.sep):
            if root in file:
                file = file.split(root, 1)[1]
        return f"{file}:{line}({name})"

    stats = pstats.Stats(prof).stats
    chosen = set(sorted(stats, key=lambda k: -stats[k][3])[:top]) | set(sorted(stats, key=lambda k: -stats[k][2])[:top])
    items = sorted(((k, stats[k]) for k in chosen), key=lambda kv: -kv[1][3])
    return [dict(function=where(*key)[-160:], calls_per_step=round(nc / steps, 2),
                 own_ms_per_step=round(1e3 * tt / steps, 4), total_ms_per_step=round(1e3 * ct / steps, 4))
            for key, (_, nc, tt, ct, _) in items]


def memory_breakdown(model) -> dict:
    """Where the GPU's memory is as the engine sizes its cache from what is free: the model's
    parameters, PEFT's LoRA parameters among them, fastlora's stacks (``LoRAPlan.stack_bytes``),
    the rest allocated, and what is free once the allocator's cache is given back (as the engine
    does before it measures). GB; empty off CUDA."""
    if hx.DEVICE != "cuda":
        return {}
    import peft_fastlora as fastlora

    torch.cuda.empty_cache()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    lora = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    state = fastlora.get_state(model)
    stacks = state.lora_plan.stack_bytes if state is not None else 0
    allocated = torch.cuda.memory_allocated()
    gb = lambda b: round(b / 2**30, 2)  # noqa: E731
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return dict(free_gb=gb(free), gpu_params_gb=gb(params), gpu_peft_lora_gb=gb(lora),
                gpu_stacks_gb=gb(stacks), gpu_other_allocated_gb=gb(allocated - params - stacks),
                gpu_reserved_unused_gb=gb(reserved - allocated), gpu_outside_torch_gb=gb(total - free - reserved))


def run_engine(model, reqs, args, with_adapters: bool, graphs: bool = False):
    """(seconds, [latency], [time to first token], graph stats, profile) for every request through
    one manager; with graphs, the warm-up (on a patched model ``fastlora.warmup_engine``: every
    step size) runs before the clock starts. With ``--profile S``, S seconds of the GPU's timeline
    are summarised (``harness.GpuWindow``) from the moment a quarter of the requests are done: the
    engine under full load."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.output_cap)
    memory = memory_breakdown(model)
    free_gb = memory.pop("free_gb", None)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=engine_config(args, graphs))
    warm = {}
    if graphs:  # as a server starts: fastlora's warm-up (every step size) on a patched model
        import peft_fastlora as fastlora

        t = time.perf_counter()
        if fastlora.get_state(model) is not None:
            fastlora.warmup_engine(manager)
        else:
            manager.warmup()
        warm = dict(getattr(getattr(manager, "fastlora_graphs", None), "stats", {}), warmup_s=time.perf_counter() - t)
        print(f"warm-up {warm['warmup_s']:.1f} s", file=sys.stderr)
    # the hook's clock timed the warm-up's forwards too: left out below (where the engine kept the processor)
    warmed, warm_clock = engine_counts(manager), getattr(manager, "fastlora_step_seconds", None)
    engine_prof = cProfile.Profile() if args.host_profile else None
    with profiled_engine_thread(manager, engine_prof):
        manager.start()
    compiles = hx.TritonCompiles()
    queued, latency, ttft = {}, [], []
    window, profile, steps_at = hx.GpuWindow(), {}, None
    async_ran = None  # whether the engine ran async batching (its IO pairs), seen once it runs
    try:
        t0 = time.perf_counter()
        for i, (prompt, name, new) in enumerate(reqs):
            kw = dict(adapter_name=name) if with_adapters else {}
            rid = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new, record_timestamps=True, **kw)
            queued[rid] = time.perf_counter()
        done = 0
        while done < len(reqs):
            r = manager.get_result(timeout=5)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("the engine stopped")
                continue
            if async_ran is None and manager.batch_processor is not None:
                async_ran = getattr(manager.batch_processor.inputs_and_outputs, "io_pairs", None) is not None
            if not r.is_finished():
                continue
            if r.error is not None:
                raise RuntimeError(f"{r.request_id}: {r.error}")
            now = time.perf_counter()
            latency.append(now - queued[r.request_id])
            stamps = getattr(r, "timestamps", None) or []
            if stamps:
                ttft.append(stamps[0] - r.created_time)
            done += 1
            if args.profile and steps_at is None and done >= len(reqs) // 4:
                steps_at = (engine_counts(manager), time.perf_counter())
                window.start()
            elif steps_at is not None and not profile and time.perf_counter() - steps_at[1] >= args.profile:
                profile = window.stop()
                profile.update(window_counts(steps_at[0], engine_counts(manager), profile["window_s"]))
        seconds = time.perf_counter() - t0
        if steps_at is not None and not profile:  # the run ended first
            profile = window.stop()
            profile.update(window_counts(steps_at[0], engine_counts(manager), profile["window_s"]))
    finally:
        manager.stop(block=True)
        compiled = compiles.stop()
    lora_graphs = getattr(manager, "fastlora_graphs", None)
    stats = dict(lora_graphs.stats) if lora_graphs is not None else {}
    for key in ("captures", "capture_s"):  # those of the run (the warm-up's apart)
        if key in stats:
            stats[key] -= warm.get(key, 0)
    stats.update(warmup_s=round(warm.get("warmup_s", 0.0), 2), warmup_captures=warm.get("captures", ""))
    stats.update(compiled)
    stats["async_batching"] = async_ran
    # what the engine sized from free memory (its cache bounds how many requests run at once)
    resolved = getattr(manager, "continuous_batching_config", None)
    stats["cache_blocks"] = getattr(resolved, "num_blocks", None)
    stats["max_requests_per_batch"] = getattr(resolved, "max_requests_per_batch", None)
    stats["max_memory_percent"] = getattr(resolved, "max_memory_percent", None)
    stats["gpu_free_gb_at_start"] = free_gb
    stats.update(memory)
    run = engine_counts(manager)
    if getattr(manager, "fastlora_step_seconds", None) is not warm_clock:
        warmed = {}
    steps = run.get("steps", 0) - warmed.get("steps", 0)
    if steps:  # the timed run's host milliseconds per step, by phase
        stats.update({f"run_host_{phase}_ms": round(1e3 * (run[phase] - warmed.get(phase, 0.0)) / steps, 3)
                      for phase in PHASES}, engine_steps=steps)
    if profile:
        profile["top_kernels"] = window.kernels
    if engine_prof is not None:
        profile["host_functions"] = host_functions(engine_prof, max(1, steps), args.host_profile)
    return seconds, latency, ttft, stats, profile


def run_static(model, reqs, args):
    """Static ``generate`` batches, in arrival order; ``reqs`` carry each request's output length."""
    seconds, latency = 0.0, []
    order = list(range(len(reqs)))
    t0 = time.perf_counter()
    for lo in range(0, len(order), args.static_batch):
        group = [reqs[i] for i in order[lo:lo + args.static_batch]]
        width = max(len(p) for p, _, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _, _) in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        with torch.no_grad():
            model.generate(input_ids=ids.to(hx.DEVICE), attention_mask=mask.to(hx.DEVICE),
                           adapter_names=[n for _, n, _ in group], max_new_tokens=max(k for _, _, k in group),
                           do_sample=False, pad_token_id=0)
        hx.sync()
        latency += [time.perf_counter() - t0] * len(group)  # all were queued at t0
    seconds = time.perf_counter() - t0
    return seconds, latency, [], {}, {}


def workload_floor(model, shape: str, used, steps, bw: float, gpu: str) -> dict:
    """The least time the requests ``used`` can take on this GPU, the larger of two bounds:
    FLOPs (every prompt and output token through every layer, attention over its context, the LM
    head once per output token) at the specified bf16 peak, and bytes at the engine's measured
    ``steps`` (the base weights once a step, each output token's KV context once) at the measured
    copy bandwidth. Without a step count (an unpatched model: no hook counts them) only FLOPs."""
    s = hx.shape_of(shape)
    layer_params = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and "lora_" not in n)
    head = s["vocab_size"] * s["hidden_size"]
    attn_width = s["num_hidden_layers"] * s["num_attention_heads"] * s["head_dim"]
    kv_per_position = hx.kv_bytes(shape, 1, 1)
    flops = kv = 0.0
    for prompt, _, new in used:
        p = len(prompt)
        flops += 2 * layer_params * (p + new) + 2 * head * new
        flops += 4 * attn_width * (p * (p + 1) / 2 + new * p + new * (new - 1) / 2)
        kv += kv_per_position * (new * p + new * (new - 1) / 2)
    peak = hx.spec_flops(gpu)
    flops_s = flops / peak if peak else None
    bytes_s = (steps * hx.weight_bytes(model) + kv) / bw if steps else None
    floor = max(t for t in (flops_s, bytes_s) if t is not None) if (flops_s or bytes_s) else None

    def sig(x):
        return float(f"{x:.4g}") if x else ""

    return dict(flops_floor_s=sig(flops_s), bytes_floor_s=sig(bytes_s), floor_s=sig(floor))


def pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


MODES = ["base", "base_graphs", "base_varlen", "base_patched", "base_patched_graphs", "base_patched_varlen",
         "base_patched_paged", "fastlora", "fastlora_graphs", "fastlora_varlen", "fastlora_paged", "static", "peft"]
# each fastlora mode's references: the patched base model and the unpatched one, same engine mode
REFERENCES = {"fastlora": ("base_patched", "base"), "fastlora_graphs": ("base_patched_graphs", "base_graphs"),
              "fastlora_varlen": ("base_patched_varlen", "base_varlen"),
              "fastlora_paged": ("base_patched_paged", "base_varlen")}


def varlen_attention_on(model, on: bool):
    """The unpatched model's engine attention: fastlora's varlen one (on) or the model's own, through
    transformers' public attention registry."""
    from transformers import AttentionInterface

    from peft_fastlora.base_ops.paged_attention import PAGED_NAME, paged_varlen_attention
    from peft_fastlora.compat.engine import cb_set_attention

    if on:
        model.__dict__["_bench_attn"] = model.config._attn_implementation
        AttentionInterface.register(PAGED_NAME, paged_varlen_attention)
        cb_set_attention(model, PAGED_NAME)
    elif "_bench_attn" in model.__dict__:
        cb_set_attention(model, model.__dict__.pop("_bench_attn"))


def engine_attention(mode: str) -> str:
    return {"_varlen": "varlen", "_paged": "paged"}.get(mode[mode.rfind("_"):], "engine")


def tuning_of(args):
    """The ``Tuning`` the patched PeftModel runs with: the library's, or with ``--fold-max-tokens``."""
    from peft_fastlora import Tuning

    return Tuning() if args.fold_max_tokens is None else Tuning(fold_max_tokens=args.fold_max_tokens)


def run_mode(mode, base, model, reqs, args):
    """(requests used, (seconds, latencies, times to first token, graph stats), the PeftModel): one
    mode's run; the PeftModel is made at the first mode that needs it (after every base mode: adding
    adapters changes the base model's modules in place)."""
    import peft_fastlora as fastlora

    graphs = mode.endswith(("_graphs", "_varlen", "_paged"))
    if mode in ("base", "base_graphs", "base_varlen"):
        varlen_attention_on(base, mode == "base_varlen")
        try:
            return reqs, run_engine(base, reqs, args, False, graphs), model
        finally:
            varlen_attention_on(base, False)
    if mode.startswith("base_patched"):
        print(fastlora.patch(base, engine_attention=engine_attention(mode)), file=sys.stderr)
        try:
            return reqs, run_engine(base, reqs, args, False, graphs), model
        finally:
            fastlora.unpatch(base)
    if model is None:  # registered: PEFT holds one adapter of its own ("seed0"), which no request uses
        model = (hx.add_adapters(base, 1, args.rank, prefix="seed") if args.adapter_source == "registered"
                 else hx.add_adapters(base, args.adapters, args.rank))
    state = fastlora.get_state(model)
    if mode == "peft":  # PEFT's own path: unpatched, on a capped sample
        if state is not None:
            fastlora.unpatch(model)
        used = [(q, n, min(k, args.peft_tokens)) for q, n, k in reqs[:args.peft_requests]]
        return used, run_static(model, used, args), model
    attention = engine_attention(mode) if mode.startswith("fastlora") else (
        state.options.engine_attention if state is not None else "engine")
    if state is None or state.options.engine_attention != attention:
        if state is not None:
            fastlora.unpatch(model)
        print(fastlora.patch(model, engine_attention=attention, tuning=tuning_of(args)), file=sys.stderr)
        if args.adapter_source == "registered":  # as the endpoint serves them: pinned on the host, stacks on the GPU
            fastlora.register_adapters(model, hx.adapter_state_dicts(model, args.adapters, [args.rank], prefix="a",
                                                                     seed=args.seed, pin=hx.DEVICE == "cuda"))
    if mode.startswith("fastlora"):
        return reqs, run_engine(model, reqs, args, True, graphs), model
    used = reqs[:args.static_requests or len(reqs)]
    return used, run_static(model, used, args), model


def shrink_tiles(config, rank: int) -> str:
    """The shrink's launch at an engine step's 32-row tiles as the tree chooses it, "K tile x K
    ranges" at the hidden size (q/k/v, o, gate/up) / at the MLP's width (down)."""
    from peft_fastlora.ops import shrink_config

    cfgs = (shrink_config(32, rank, k) for k in (config.hidden_size, config.intermediate_size))
    return "/".join(f"{c['block_k']}x{c['split_k']}" for c in cfgs)


def measure_modes(modes, args, reqs, info):
    """(row, profile) of each mode, one after the other in this process, on one base model."""
    base = hx.build_base(args.model)
    bw = hx.copy_bandwidth()
    model = None
    for mode in modes:
        used, (seconds, latency, ttft, stats, profile), model = run_mode(mode, base, model, reqs, args)
        out_tokens = sum(n for _, _, n in used)
        steps = stats.get("engine_steps") or (stats.get("graphed_steps", 0) + stats.get("eager_steps", 0)) or None
        floor = workload_floor(base, args.model, used, steps, bw, info["gpu"]) if mode != "peft" else {}
        row = dict(mode=mode, model=args.model, adapters=0 if mode.startswith("base") else args.adapters,
                   rank=args.rank, adapter_source=args.adapter_source if mode.startswith("fastlora") else "",
                   fold_max_tokens=tuning_of(args).fold_max_tokens if mode.startswith("fastlora") else "",
                   shrink_32_rows=shrink_tiles(base.config, args.rank) if mode.startswith("fastlora") else "",
                   alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                   requests=len(used), output_tokens=out_tokens, seconds=round(seconds, 3),
                   tokens_per_s=round(out_tokens / seconds, 1),
                   latency_p50_s=round(pct(latency, 0.5), 3), latency_p99_s=round(pct(latency, 0.99), 3),
                   ttft_p50_s=round(pct(ttft, 0.5), 3), ttft_p99_s=round(pct(ttft, 0.99), 3),
                   mean_prompt=round(statistics.mean(len(q) for q, _, _ in used), 1),
                   max_batch_tokens=args.max_batch_tokens, lora_graphed_steps=stats.get("graphed_steps", ""),
                   lora_eager_steps=stats.get("eager_steps", ""), engine_captures=stats.get("captures", ""),
                   async_batching=stats.get("async_batching", ""), cache_blocks=stats.get("cache_blocks", ""),
                   max_requests_per_batch=stats.get("max_requests_per_batch", ""),
                   max_memory_percent=stats.get("max_memory_percent", ""),
                   gpu_free_gb_at_start=stats.get("gpu_free_gb_at_start", "") or "",
                   **{k: stats.get(k, "") for k in ("gpu_params_gb", "gpu_peft_lora_gb", "gpu_stacks_gb",
                                                    "gpu_other_allocated_gb", "gpu_reserved_unused_gb",
                                                    "gpu_outside_torch_gb")},
                   engine_graphs_dropped=stats.get("graphs_dropped", ""),
                   capture_s=round(stats["capture_s"], 2) if "capture_s" in stats else "",
                   warmup_s=stats.get("warmup_s", ""), warmup_captures=stats.get("warmup_captures", ""),
                   triton_compiles=stats.get("triton_compiles", ""), triton_compile_s=stats.get("triton_compile_s", ""),
                   time_per_token_vs_base_patched="",
                   time_per_token_vs_base="", prompt_tokens=sum(len(q) for q, _, _ in used),
                   tokens_per_step=round(sum(len(q) + n for q, _, n in used) / steps, 1) if steps else "",
                   **floor, ratio_to_floor=round(seconds / floor["floor_s"], 2) if floor.get("floor_s") else "",
                   copy_bw_tbs=round(bw / 1e12, 3),
                   **{k: v for k, v in stats.items() if k.startswith("run_host_")}, **info)
        yield row, profile


def round_orders(modes, rounds: int) -> list:
    """The modes of each round, every round in the reverse order of the one before."""
    return [list(modes) if r % 2 == 0 else list(modes)[::-1] for r in range(rounds)]


def fill_ratios(table, rnd: int) -> None:
    """Each fastlora row of round ``rnd``: its time per output token against that round's
    adapter-free runs through the same engine mode (whichever of the two ran first)."""
    rows = [r for r in table if r["round"] == rnd]
    for row in rows:
        patched, unpatched = REFERENCES.get(row["mode"], (None, None))
        for ref in rows:
            if ref["mode"] == patched:
                row["time_per_token_vs_base_patched"] = round(ref["tokens_per_s"] / row["tokens_per_s"], 3)
            if ref["mode"] == unpatched:
                row["time_per_token_vs_base"] = round(ref["tokens_per_s"] / row["tokens_per_s"], 3)


def run_child(mode: str, argv) -> tuple:
    """(row, profile) of one mode measured in a fresh process: every engine then sizes its KV cache
    from the same free memory, whatever the modes before it left behind."""
    result = hx.run_in_child(__file__, argv, ["--modes", mode, "--isolate", "off", "--rounds", "1", "--out", ""])
    return result["row"], result["profile"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hx.add_model_args(p, adapters=32)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompt-mean", type=float, default=300)
    p.add_argument("--prompt-cap", type=int, default=4000)
    p.add_argument("--output-mean", type=float, default=200)
    p.add_argument("--output-cap", type=int, default=1000)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--cache-tokens", type=int, default=0, help="0: the engine sizes its cache from free memory")
    p.add_argument("--static-batch", type=int, default=32)
    p.add_argument("--static-requests", type=int, default=128,
                   help="static mode on the first N requests only (0: all); its tokens/s is over those")
    p.add_argument("--peft-requests", type=int, default=32)
    p.add_argument("--peft-tokens", type=int, default=16)
    p.add_argument("--modes", nargs="+", default=["base_patched_paged", "fastlora_paged", "base_patched_varlen",
                                                  "fastlora_varlen"],
                   choices=MODES, help="the CSV is rewritten after each mode, so a cut-off run keeps what finished")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fold-max-tokens", type=int, default=None,
                   help="Tuning.fold_max_tokens for the patched PeftModel (default: the library's): steps of at most "
                        "this many tokens take the shrink from the folded base GEMMs")
    p.add_argument("--adapter-source", choices=["peft", "registered"], default="peft",
                   help="the fastlora modes' adapters: PEFT's (add_adapter: PEFT's parameters and fastlora's stacks "
                        "on the GPU) or registered by name (fastlora.register_adapters, as the endpoint loads them: "
                        "the weights pinned on the host, the stacks on the GPU)")
    p.add_argument("--async-batching", choices=["unset", "on", "off"], default="unset",
                   help="the engine's async batching (use_async_batching): left unset (the engine chooses: on "
                        "where its graphs run and it builds no attention mask), or set")
    p.add_argument("--profile", type=float, default=0,
                   help="seconds of the GPU's timeline summarised per engine mode, under full load "
                        "(continuous_profile_<model>_<gpu>.csv)")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="the engine thread under cProfile: its N costliest functions per step, per mode "
                        "(continuous_host_profile_<model>_<gpu>.csv; the profiler slows the run: quote shares)")
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="each mode in a fresh process (auto: on CUDA with several modes), so that every engine "
                        "sizes its cache from the same free memory")
    p.add_argument("--rounds", type=int, default=1,
                   help="the modes this many times, each round in the reverse order of the one before (A B, B A, "
                        "...): repeats on one machine with the order's effect balanced, one row per mode and round "
                        "(column round), each row's ratios to its own round's references")
    p.add_argument("--child-result", default="", help=argparse.SUPPRESS)
    hx.add_run_args(p)
    args = p.parse_args(argv)
    if args.adapter_source == "registered" and "peft" in args.modes:
        p.error("the peft mode runs PEFT's own adapters: it needs --adapter-source peft")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.rounds > 1 and args.isolate == "off":
        p.error("--rounds measures each mode in a fresh process (a mode after another in one process inherits "
                "its model): not with --isolate off")
    if not hx.start(args, "bench_continuous"):
        return 0
    if args.smoke:
        args.model, args.adapters, args.requests = "tiny", 4, 12
        args.prompt_mean, args.output_mean, args.output_cap, args.prompt_cap = 20, 6, 12, 60
        args.max_batch_tokens, args.cache_tokens, args.static_batch, args.static_requests = 64, 4096, 4, 0

    reqs = workload(args)
    info = hx.versions()
    modes = sorted(set(args.modes), key=MODES.index)
    isolate = args.isolate == "on" or args.rounds > 1 or (args.isolate == "auto" and hx.DEVICE == "cuda"
                                                           and len(modes) > 1)
    if args.child_result:  # one mode for a parent process (--isolate)
        row, profile = next(measure_modes(modes, args, reqs, info))
        with open(args.child_result, "w") as f:
            json.dump(dict(row=row, profile=profile), f)
        return 0
    results = (((r, *run_child(mode, argv)) for r, order in enumerate(round_orders(modes, args.rounds))
                for mode in order) if isolate
               else ((0, row, profile) for row, profile in measure_modes(modes, args, reqs, info)))
    table, profiles, kernels, functions = [], [], [], []
    suffix = "" if args.async_batching == "unset" else f"_async_{args.async_batching}"  # in the files' names
    for rnd, row, profile in results:
        mode = row["mode"]
        row["round"] = rnd
        table.append(row)
        if profile.get("host_functions"):
            functions += [dict(mode=mode, model=args.model, **f, gpu=info["gpu"]) for f in profile.pop("host_functions")]
            if args.out:
                hx.write_csv(functions, hx.out_path(args.out, f"continuous_host_profile_{args.model}{suffix}",
                                                    info["gpu"]))
        if profile:
            kernels += [dict(mode=mode, model=args.model, **k, gpu=info["gpu"]) for k in profile.pop("top_kernels")]
            profiles.append(dict(mode=mode, model=args.model, **profile, **info))
            print({k: v for k, v in profile.items() if k.startswith(("gpu_busy", "host_", "step_ms", "engine_"))},
                  file=sys.stderr)
            if args.out:
                hx.write_csv(profiles, hx.out_path(args.out, f"continuous_profile_{args.model}{suffix}", info["gpu"]))
                if kernels:  # (none on the CPU)
                    stem = f"continuous_profile_kernels_{args.model}{suffix}"
                    hx.write_csv(kernels, hx.out_path(args.out, stem, info["gpu"]))
        fill_ratios(table, rnd)
        print(row, file=sys.stderr)
        if args.out:
            hx.write_csv(table, hx.out_path(args.out, f"continuous_{args.model}{suffix}", info["gpu"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
