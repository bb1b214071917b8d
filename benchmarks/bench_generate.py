"""End-to-end decode benchmark: PEFT's mixed batch vs fastlora (eager, graphs) vs the base model.

Random-weight Llama shapes in bf16, N adapters of rank r on all seven projections, a round-robin
adapter mix. Every number comes from this one run, on this GPU:

- decode ms/step = (time of generate with T new tokens - time with 1 new token) / (T - 1);
- prefill ms = time of generate with 1 new token;
- floor ms = (weight bytes + LoRA bytes of the adapters the batch uses + KV bytes read) / measured
  copy bandwidth, the KV read at the mean filled length.

    python benchmarks/bench_generate.py --models 1b 8b --batches 1 32 128 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib
import os
import platform
import statistics
import sys
import time

import torch

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),  # --smoke on CPU: checks the script, measures nothing
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # #16's 32B-class shape (Qwen2.5-32B's widths, Llama's layers), for tensor parallelism
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    # #13's coverage shapes: sliding windows (Mistral), alternating windows and soft-capping (Gemma 2,
    # eager attention, as transformers runs it)
    "mistral7b": dict(arch="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096),
    "gemma2-9b": dict(arch="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                      sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, tie_word_embeddings=True),
    "tiny-gemma2": dict(arch="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                        sliding_window=16, attn_logit_softcapping=50.0, tie_word_embeddings=True),
}
ARCHS = {  # arch -> (config class, model class, attention implementation)
    "llama": ("LlamaConfig", "LlamaForCausalLM", None),
    "mistral": ("MistralConfig", "MistralForCausalLM", None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "eager"),
}


def shape_of(shape: str) -> dict:
    """The config fields of a shape, with its head dim and arch filled in."""
    s = dict(SHAPES[shape])
    s.setdefault("arch", "llama")
    s.setdefault("head_dim", s["hidden_size"] // s["num_attention_heads"])
    return s
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_model_args(parser, adapters: int):
    """--model, --adapters, --rank: the arguments every single-model benchmark shares."""
    parser.add_argument("--model", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--adapters", type=int, default=adapters)
    parser.add_argument("--rank", type=int, default=16)


def add_decode_args(parser, new_tokens: int, reps: int):
    """--batches, --prompt, --new-tokens, --reps, --out, --smoke: the decode benchmarks' run arguments."""
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")


def write_csv(rows, folder: str, name: str) -> str:
    """The rows (dicts with the same keys) as ``folder/name``; the path written."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_out(rows, path: str) -> int:
    """A probe's last step: the rows as the CSV at ``path`` (printed); 0, its exit status."""
    print("written", write_csv(rows, os.path.dirname(path) or ".", os.path.basename(path)))
    return 0


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def versions():
    import peft
    import transformers
    import triton

    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke test)"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, peft=peft.__version__, python=platform.python_version())


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy, the copies queued back to
    back (as the kernel probes time it): a copy after an idle GPU pays its launch and the clocks'
    ramp, which would understate the bandwidth and so the floor's time."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, far past the L2
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for a, b in events:
        a.record()
        dst.copy_(src)
        b.record()
    torch.cuda.synchronize()
    seconds = statistics.median(a.elapsed_time(b) for a, b in events) / 1e3
    del src, dst
    return 2 * (1 << 30) / seconds


def kernel_times(gen, steps: int) -> list:
    """GPU time by kernel of one decode step: the profiler's kernel totals over ``gen(1 + steps)``
    (a generate-like callable of that many new tokens) minus those over ``gen(1)`` (prefill and
    set-up cancel), per step; rows of kernel, launches_per_step, us_per_step, slowest first.
    CUPTI sees the kernels a graph replay launches. On the CPU the ops' CPU times stand in."""
    from torch.profiler import ProfilerActivity, profile

    cuda = DEVICE == "cuda"

    def totals(k):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            gen(k)
            sync()
        out = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
            if us > 0:
                n, t = out.get(e.key, (0, 0.0))
                out[e.key] = (n + e.count, t + us)
        return out

    one, many = totals(1), totals(1 + steps)
    rows = []
    for key, (n, t) in many.items():
        n1, t1 = one.get(key, (0, 0.0))
        if n > n1:
            rows.append(dict(kernel=key[:160], launches_per_step=round((n - n1) / steps, 2),
                             us_per_step=round((t - t1) / steps, 2)))
    return sorted(rows, key=lambda r: -r["us_per_step"])


# kernel families of a decode step, by name (cuBLAS's nvjet / cutlass GEMMs and their split-K
# reductions; the decode attention; fastlora's LoRA launches); the rest is "other"
KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce", "xmma")),
                ("attention", ("decode_attention", "flash", "sdpa")), ("lora", ("lora_",)))


def kernel_split(rows) -> dict:
    """us a step by kernel family (``KERNEL_KINDS``) and in all, from ``kernel_times`` rows."""
    out = {f"{kind}_us": 0.0 for kind, _ in KERNEL_KINDS}
    out["other_us"] = 0.0
    for r in rows:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in r["kernel"] for x in keys)), "other")
        out[f"{kind}_us"] += r["us_per_step"]
    out = {k: round(v, 1) for k, v in out.items()}
    out["kernels_us"] = round(sum(r["us_per_step"] for r in rows), 1)
    return out


def build_base(shape: str):
    import transformers

    fields = dict(SHAPES[shape])
    config_cls, model_cls, attn = ARCHS[fields.pop("arch", "llama")]
    cfg = getattr(transformers, config_cls)(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if attn is not None:
        cfg._attn_implementation = attn
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = getattr(transformers, model_cls)(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model.eval()


def add_adapters(model, n: int, rank: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    # adapters in the model's dtype, as a server would hold them (PEFT would upcast them to fp32)
    peft_model = get_peft_model(model, cfg, adapter_name="a0", autocast_adapter_dtype=False)
    for i in range(1, n):
        peft_model.add_adapter(f"a{i}", cfg, autocast_adapter_dtype=False)
    return peft_model.eval()


def weight_bytes(model) -> int:
    total = 0
    for name, p in model.named_parameters():
        if "lora_" in name or "embed_tokens" in name:
            continue  # LoRA counted per batch; the embedding reads only a few rows
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    if model.config.tie_word_embeddings:
        total += emb.numel() * emb.element_size()  # the LM head reads the whole table
    return total


def lora_bytes_per_adapter(shape: str, rank: int, esize: int = 2) -> int:
    s = shape_of(shape)
    h, i, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    in_out = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return L * sum(rank * (a + b) for a, b in in_out) * esize


def kv_bytes(shape: str, batch: int, ctx: float, esize: int = 2) -> float:
    s = shape_of(shape)
    return 2 * s["num_hidden_layers"] * batch * s["num_key_value_heads"] * s["head_dim"] * ctx * esize


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ReplayTimes:
    """GPU time of every CUDA graph replay while active (events around ``CUDAGraph.replay``): a
    decode step's time in ``generate`` minus its replay is host time the GPU waited for (transformers'
    loop synchronises at every step)."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        self._replay = torch.cuda.CUDAGraph.replay
        events, replay = self.events, self._replay

        def timed_replay(graph):
            if getattr(graph, "fastlora_step_advance", False):  # the next inputs' graph, not a step's
                return replay(graph)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            replay(graph)
            b.record()
            events.append((a, b))

        torch.cuda.CUDAGraph.replay = timed_replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.replay = self._replay

    def median_ms(self):
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in self.events) if self.events else None


def measure(gen, new_tokens: int, reps: int):
    """(prefill ms, decode ms/step, tokens of the long run) for a generate-like callable;
    ``measure.replay_ms``: the median GPU time of one graph replay in the long runs (None: none)."""
    gen(2)  # warm-up: kernels compiled, graphs captured
    t1 = timed(lambda: gen(1), reps)
    out = {}
    replays = ReplayTimes()
    if DEVICE == "cuda":
        with replays:
            tn = timed(lambda: out.setdefault("tokens", gen(new_tokens)), reps)
    else:
        tn = timed(lambda: out.setdefault("tokens", gen(new_tokens)), reps)
    measure.replay_ms = replays.median_ms() if DEVICE == "cuda" else None
    return 1e3 * t1, 1e3 * (tn - t1) / (new_tokens - 1), out["tokens"]


# the base model under fastlora's graph harness: with transformers' own attention and small ops,
# and with fastlora's decode attention, RMSNorm, rotary, SiLU-mul and KV-write kernels
HF_OPS = dict(decode_attention=False, fuse_norms=False, fuse_rotary=False, fuse_silu_mul=False,
              fuse_kv_write=False)
FAST_OPS = {}  # the defaults, as fastlora_graphs below
PATCH_EXTRA = {}  # options every fastlora method here is patched with (--stream-gemm off)


def model_runner_stats(model):
    """The graph runner's counters that say how the steps ran (None: no runner)."""
    import peft_fastlora as fastlora

    runner = fastlora.get_state(model).graph_runner
    if runner is None:
        return None
    return {k: v for k, v in runner.stats.items() if k in (
        "replays", "eager_steps", "advanced_calls", "advanced_steps", "advance_reasons", "selection_reasons",
        "early_edges", "early_launch_off", "rotary_table_off")}


def run_model(shape, batches, args, bw, vers, rows, kernel_rows=None):
    kernel_rows = [] if kernel_rows is None else kernel_rows
    import peft_fastlora as fastlora

    model = build_base(shape)
    wbytes = weight_bytes(model)
    prompt = args.prompt
    gen_ids = {b: torch.randint(3, 1000, (b, prompt), device=DEVICE) for b in batches}
    graphs = "emulate" if DEVICE == "cpu" else "auto"

    def kw(b, n):
        return dict(input_ids=gen_ids[b], attention_mask=torch.ones_like(gen_ids[b]), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)

    results = {}
    quick = args.graphs_only  # the two graphed rows alone: fastlora's and its base model's
    # 1. HF's eager base model
    for b in batches if not quick else ():
        results[("hf_eager_base", b)] = measure(lambda n: model.generate(**kw(b, n)), args.short_tokens, 1)
    # 2. the base model alone, patched by fastlora (no adapters): graphs with HF's ops, then with
    # fastlora's (what fastlora_graphs uses by default)
    for method, ops in (("base_graphs", HF_OPS), ("base_graphs_attn", FAST_OPS))[quick:]:
        report = fastlora.patch(model, cuda_graphs=graphs, **ops, **PATCH_EXTRA)
        print(method, report, flush=True)
        if method == "base_graphs_attn" and report.decode_attention != "on":
            fastlora.unpatch(model)
            continue
        for b in batches:
            results[(method, b)] = measure(lambda n, b=b: model.generate(**kw(b, n)), args.new_tokens, args.reps)
            results[(method, b, "replay")] = measure.replay_ms
            if model_runner_stats(model) is not None:
                print(method, b, "graph runner:", model_runner_stats(model), flush=True)
            if args.kernel_split:
                results[(method, b, "kernels")] = kernel_times(lambda n, b=b: model.generate(**kw(b, n)),
                                                               args.kernel_split)
        fastlora.unpatch(model)
    gc.collect()
    mem = torch.cuda if DEVICE == "cuda" else None
    if mem:
        mem.empty_cache()
    mem_before = mem.memory_allocated() if mem else 0
    peft_model = add_adapters(model, args.adapters, args.rank)
    names = {b: [f"a{i % args.adapters}" for i in range(b)] for b in batches}
    # 3. PEFT's own mixed batch
    for b in batches if not quick else ():
        results[("peft_native", b)] = measure(
            lambda n: peft_model.generate(**kw(b, n), adapter_names=names[b]), args.short_tokens, 1)
    mem_peft = mem.memory_allocated() if mem else 0
    if mem:
        mem.reset_peak_memory_stats()
    # 4. fastlora eager without fusion, 5. eager with fusion, 6. graphs
    for method, opts in (("fastlora_eager_unfused", dict(fuse=False, cuda_graphs=False)),
                         ("fastlora_eager", dict(cuda_graphs=False)),
                         ("fastlora_graphs", dict(cuda_graphs=graphs)))[2 if quick else 0:]:
        report = fastlora.patch(peft_model, **opts, **PATCH_EXTRA)
        mem_patched = mem.memory_allocated() if mem else 0
        print(report, flush=True)
        steps = args.new_tokens if method == "fastlora_graphs" else args.short_tokens
        for b in batches:
            results[(method, b)] = measure(
                lambda n: peft_model.generate(**kw(b, n), adapter_names=names[b]), steps,
                args.reps if method == "fastlora_graphs" else 1)
            results[(method, b, "replay")] = measure.replay_ms
            if args.kernel_split and method == "fastlora_graphs":
                results[(method, b, "kernels")] = kernel_times(
                    lambda n: peft_model.generate(**kw(b, n), adapter_names=names[b]), args.kernel_split)
        if method == "fastlora_graphs" and fastlora.get_state(peft_model).graph_runner is not None:
            st = fastlora.get_state(peft_model).graph_runner.stats
            print("graph runner:", {k: v for k, v in st.items()}, flush=True)
        fastlora.unpatch(peft_model)
        rows_mem = dict(mem_base_gb=mem_before / 2**30, mem_peft_gb=mem_peft / 2**30,
                        mem_patched_gb=mem_patched / 2**30,
                        peak_gb=(mem.max_memory_allocated() if mem else 0) / 2**30)
        print(method, {k: round(v, 3) for k, v in rows_mem.items()}, flush=True)
        results[(method, "mem")] = rows_mem

    for b in batches:
        used = min(b, args.adapters)
        peft = results.get(("peft_native", b))
        # fastlora_graphs runs with fastlora's decode attention when it could be enabled: its
        # base-model reference is then the base model with the same attention
        ref = "base_graphs_attn" if ("base_graphs_attn", b) in results else "base_graphs"
        for method in ("hf_eager_base", "base_graphs", "base_graphs_attn", "peft_native",
                       "fastlora_eager_unfused", "fastlora_eager", "fastlora_graphs"):
            if (method, b) not in results:
                continue
            prefill, decode, toks = results[(method, b)]
            replay = results.get((method, b, "replay"))
            base_ref = ref if method in ("fastlora_graphs", "base_graphs_attn") else "base_graphs"
            n = toks.shape[1] - prompt
            lora = 0 if "base" in method else used * lora_bytes_per_adapter(shape, args.rank)
            floor = 1e3 * (wbytes + lora + kv_bytes(shape, b, prompt + n / 2)) / bw
            match = ""
            if peft is not None and "base" not in method:
                k = min(toks.shape[1], peft[2].shape[1])
                match = f"{(toks[:, prompt:k] == peft[2][:, prompt:k]).float().mean().item():.3f}"
            mrow = results.get((method, "mem"), {})
            rows.append(dict(**vers, model=shape if "arch" in SHAPES[shape] else f"llama-{shape}", batch=b, adapters=args.adapters if "base" not in method else 0,
                             rank=args.rank, method=method, new_tokens=n, prefill_ms=round(prefill, 2),
                             decode_ms_per_step=round(decode, 3), tokens_per_s=round(1e3 * b / decode, 1),
                             ratio_to_base_graphs=(round(decode / results[(base_ref, b)][1], 3)
                                                   if (base_ref, b) in results else ""),
                             base_reference=base_ref,
                             floor_ms=round(floor, 3), ratio_to_floor=round(decode / floor, 3),
                             # the replayed step's GPU time alone, and against the floor
                             graph_replay_ms=round(replay, 3) if replay else "",
                             replay_to_floor=round(replay / floor, 3) if replay else "",
                             speedup_vs_peft=round(peft[1] / decode, 2) if peft is not None else "",
                             greedy_match_vs_peft=match, copy_bw_tbs=round(bw / 1e12, 3),
                             peak_mem_gb=round(mrow.get("peak_gb", 0), 2),
                             mem_after_patch_gb=round(mrow.get("mem_patched_gb", 0), 2),
                             mem_before_patch_gb=round(mrow.get("mem_peft_gb", 0), 2)))
            if args.kernel_split:  # the step's kernels by family; GEMMs + attention alone against the floor
                ks = results.get((method, b, "kernels"))
                split = kernel_split(ks) if ks else {}
                rows[-1].update({k: split.get(k, "") for k in ("gemm_us", "attention_us", "lora_us", "other_us",
                                                               "kernels_us")})
                rows[-1]["gemm_attention_to_floor"] = (
                    round((split["gemm_us"] + split["attention_us"]) / 1e3 / floor, 3) if ks else "")
                for r in ks or ():
                    kernel_rows.append(dict(model=rows[-1]["model"], batch=b, method=method, **r))
    peft_model = model = None  # (the lambdas above close over both names: rebinding frees them too)
    gc.collect()
    if mem:
        mem.empty_cache()


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models):
        sub = [r for r in rows if r["model"] == m]
        methods = list(dict.fromkeys(r["method"] for r in sub))
        batches = sorted({r["batch"] for r in sub})
        w = 0.8 / len(methods)
        for i, meth in enumerate(methods):
            ys = [next(r["tokens_per_s"] for r in sub if r["method"] == meth and r["batch"] == b) for b in batches]
            ax.bar([j + i * w for j in range(len(batches))], ys, w, label=meth)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (log)")
        ax.set_title(f"{m}, {sub[0]['gpu']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# A/B switches that set one module attribute to (flag == "on"): flag, default, module, attribute, help
# (what "off" or "on" does); each is recorded in the CSV rows under the flag's name
SWITCHES = [
    ("tma-gemm", "on", "peft_fastlora.base_ops.stream_linears", "TMA_GEMM",
     "off: 65-128-row GEMMs on cuBLAS instead of the TMA kernel's table"),
    ("tma-add", "on", "peft_fastlora.base_ops.stream_linears", "ADD_TMA",
     "off: a 65-128-row folded down_proj whose residual add rides along keeps cuBLAS and an add kernel "
     "where the TMA table has no deep tile"),
    ("glu-lora", "on", "peft_fastlora.base_ops.stream_linears", "GLU_LORA",
     "off: a 65-128-row folded LoRA gate/up takes the folded GEMM, expand and act-mul instead of "
     "ops.glu_lora's one launch"),
    ("attention-dense-spans", "on", "peft_fastlora.ops.decode_attention", "DENSE_SPANS",
     "off: decode attention's blocks read the mask even where the span is dense"),
    ("attention-lean", "on", "peft_fastlora.ops.decode_attention", "LEAN",
     "off: decode attention with four warps in every shape class, block_n 128 over its whole mid class"),
    ("rotary-kv", "on", "peft_fastlora.base_ops.attention_forwards", "ONE_KERNEL",
     "off: the rotary and the KV write as two kernels"),
    ("step-advance", "on", "peft_fastlora.decode.step_advance", "ENABLED",
     "off: greedy steps' next inputs built on the host"),
    ("step-record", "on", "peft_fastlora.decode.deferred_stop", "FLAG_CHECK",
     "off: greedy steps keep transformers' deferred stop check and the loop's ids copy"),
    ("rotary-table", "on", "peft_fastlora.base_ops.rotary_tables", "ENABLED",
     "off: graphs compute rotary cos/sin with the module's forward"),
    ("early-launch", "on", "peft_fastlora.decode.early_launch", "ENABLED",
     "off: expands behind cuBLAS GEMMs launch as they complete"),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--short-tokens", type=int, default=8, help="new tokens for the slow eager methods")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--csv", default="generate_h200.csv",
                   help="file name in --out (the PNG takes the same stem): another for other shapes")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU: exercises the script only")
    p.add_argument("--stream-gemm", choices=["auto", "off"], default="auto",
                   help="off: the base GEMMs on cuBLAS (patch(stream_gemm=False)), for an A/B")
    p.add_argument("--narrow-gemms", choices=["on", "off"], default="on",
                   help="off: layers narrower than 4,096 outputs (a 1B model's q/k/v, o, down) keep cuBLAS, for an A/B")
    p.add_argument("--epilogue-folds", choices=["on", "off"], default="on",
                   help="off: the KV length's increment, the MLP's residual add and (plain gate/up) its "
                        "activation as kernels of their own, for an A/B")
    p.add_argument("--attention-prewait", choices=["auto", "off", "span"], default="auto",
                   help="what decode attention's programs do before their PDL wait (ops.decode_attention.PREWAIT), for an A/B")
    p.add_argument("--attention-block-n", choices=["auto", "64"], default="auto",
                   help="64: decode attention's block_n at one to three programs per SM stays 64, for an A/B")
    p.add_argument("--attention-lean-block-n", type=int, choices=[16, 32, 64], default=None,
                   help="decode attention's block_n in its one-warp class (ops.decode_attention.LEAN_BLOCK_N), "
                        "for an A/B")
    p.add_argument("--token-select", choices=["fused", "hf"], default="fused",
                   help="hf: greedy calls keep transformers' token selection (decode.greedy_loop.ENABLED), for an A/B")
    p.add_argument("--expand", choices=["library", "blocks"], default="library",
                   help="decode expand launch: the library's (rank-sized spans) or the column blocks of before")
    p.add_argument("--kernel-split", type=int, default=0, metavar="STEPS",
                   help="the graphed rows' step time by kernel family over STEPS steps (GEMMs, attention, LoRA, "
                        "other), GEMMs + attention alone against the floor, and <csv stem>_kernels.csv")
    p.add_argument("--graphs-only", action="store_true",
                   help="only fastlora_graphs and base_graphs_attn (a quick check of the graphed step)")
    for flag, default, module, attr, text in SWITCHES:
        p.add_argument(f"--{flag}", choices=["on", "off"], default=default,
                       help=f"{text} ({module}.{attr}), for an A/B")
    args = p.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_generate needs a CUDA GPU (or --smoke); nothing measured")
        return 0
    os.makedirs(args.out, exist_ok=True)
    if args.expand == "blocks":
        importlib.import_module("peft_fastlora.ops.lora_expand_wide").ENABLED = False
    if args.stream_gemm == "off":
        PATCH_EXTRA["stream_gemm"] = False
    if args.narrow_gemms == "off":
        sl = importlib.import_module("peft_fastlora.base_ops.stream_linears")
        sl.MIN_N = sl.NARROW_N
    if args.epilogue_folds == "off":
        importlib.import_module("peft_fastlora.decode.static_cache").KV_TICKET = False
        importlib.import_module("peft_fastlora.base_ops.stream_linears").EPILOGUE_FOLDS = False
    attention = importlib.import_module("peft_fastlora.ops.decode_attention")
    attention.PREWAIT = args.attention_prewait
    if args.attention_block_n == "64":
        attention.MID_BLOCK_N = 64
    if args.attention_lean_block_n:
        attention.LEAN_BLOCK_N = args.attention_lean_block_n
    importlib.import_module("peft_fastlora.decode.greedy_loop").ENABLED = args.token_select == "fused"
    switches = {}  # recorded in every CSV row
    for flag, _, module, attr, _ in SWITCHES:
        switches[flag.replace("-", "_")] = value = getattr(args, flag.replace("-", "_"))
        setattr(importlib.import_module(module), attr, value == "on")
    vers = dict(versions(), expand=args.expand, stream_gemm=args.stream_gemm, narrow_gemms=args.narrow_gemms,
                epilogue_folds=args.epilogue_folds, attention_prewait=args.attention_prewait,
                attention_block_n=args.attention_block_n, attention_lean_block_n=attention.LEAN_BLOCK_N,
                token_select=args.token_select, **switches)
    bw = copy_bandwidth() if DEVICE == "cuda" else 1e11
    print(vers, f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, kernel_rows = [], []
    for shape in args.models:
        run_model(shape, args.batches, args, bw, vers, rows, kernel_rows)
        write_csv(rows, args.out, args.csv)
        if kernel_rows:
            write_csv(kernel_rows, args.out, os.path.splitext(args.csv)[0] + "_kernels.csv")
    plot(rows, os.path.join(args.out, os.path.splitext(args.csv)[0] + ".png"))
    cols = ["model", "batch", "method", "prefill_ms", "decode_ms_per_step", "graph_replay_ms", "tokens_per_s",
            "ratio_to_base_graphs", "ratio_to_floor", "replay_to_floor", "speedup_vs_peft", "greedy_match_vs_peft"]
    cols += ["gemm_us", "attention_us", "kernels_us", "gemm_attention_to_floor"] if args.kernel_split else []
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
