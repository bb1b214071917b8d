"""What every benchmark shares: model shapes, random-weight models and adapters, timing, the byte
floor, the copy bandwidth behind it, and CSV rows that carry the GPU and the package versions.

Decode is memory-bound, so each result is set against a floor: the bytes one step must read (the
base weights, the LoRA weights of the adapters the batch uses, the KV cache it attends) over the
copy bandwidth measured in the same run (``copy_bandwidth``: back-to-back 1 GiB device copies), with
the GPU's specified bandwidth (``SPEC_BANDWIDTH``) beside it. Random weights cost the same bytes as
trained ones, so speed needs no checkpoint.

``DEVICE`` is "cuda" for a measurement and "cpu" for a script's ``--smoke`` run (a tiny model that
checks the script, measures nothing); ``use_cpu()`` switches it.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import platform
import statistics
import tempfile
import time

import torch

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # Qwen2.5-32B's widths on Llama's layers: a model that wants tensor parallelism
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064),
    # other architectures: sliding windows (Mistral); alternating windows, soft-capping and eager
    # attention (Gemma 2, as transformers runs it)
    "mistral7b": dict(arch="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096),
    "gemma2-9b": dict(arch="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                      sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, tie_word_embeddings=True),
    # --smoke runs on the CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "tiny-gemma2": dict(arch="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                        sliding_window=16, attn_logit_softcapping=50.0, tie_word_embeddings=True),
}
ARCHS = {  # arch -> (config class, model class, attention implementation)
    "llama": ("LlamaConfig", "LlamaForCausalLM", None),
    "mistral": ("MistralConfig", "MistralForCausalLM", None),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "eager"),
}
# ``fastlora.patch`` options that keep transformers' own attention and small ops (the base model under
# fastlora's graphs alone, without its decode kernels)
HF_OPS = dict(decode_attention=False, fuse_norms=False, fuse_rotary=False, fuse_silu_mul=False,
              fuse_kv_write=False, grouped_experts=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the memory bandwidth each GPU is specified at (bytes/s), reported beside the measured copy bandwidth
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
SMOKE_BANDWIDTH = 1e11  # a stand-in on the CPU: the floor columns exist, their values mean nothing
# dense bf16 tensor-core peak each GPU is specified at (FLOP/s): the compute floor of prefill-heavy work
SPEC_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}
SMOKE_FLOPS = 1e12

DEVICE = "cuda"


def use_cpu() -> None:
    """``--smoke``: everything on the CPU (tiny shapes, emulated graphs)."""
    global DEVICE
    DEVICE = "cpu"


def needs_gpu(name: str) -> bool:
    """True (and a line saying so) where a measurement was asked for and there is no CUDA GPU."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU (or --smoke); nothing measured")
        return True
    return False


def model_label(shape: str) -> str:
    return shape if "arch" in SHAPES[shape] else f"llama-{shape}"


def shape_of(shape: str) -> dict:
    """The config fields of a shape, with its head dim and arch filled in."""
    s = dict(SHAPES[shape])
    s.setdefault("arch", "llama")
    s.setdefault("head_dim", s["hidden_size"] // s["num_attention_heads"])
    return s


# ---- models and adapters ---------------------------------------------------------------------------
def build_base(shape: str, layers: int = None):
    """A random-weight causal LM of ``shape`` in bf16 on ``DEVICE`` (``layers``: fewer layers),
    that never stops early (random weights would emit EOS at random)."""
    import transformers

    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config_cls, model_cls, attn = ARCHS[fields.pop("arch", "llama")]
    cfg = getattr(transformers, config_cls)(**fields, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if attn is not None:
        cfg._attn_implementation = attn
    return instantiate(model_cls, cfg)


def context_length(shape: str) -> int:
    """The most positions a model of ``shape`` takes (its config's ``max_position_embeddings``)."""
    import transformers

    fields = dict(SHAPES[shape])
    config_cls = ARCHS[fields.pop("arch", "llama")][0]
    return getattr(transformers, config_cls)(**fields).max_position_embeddings


def instantiate(model_cls: str, cfg):
    """transformers' ``model_cls`` built from ``cfg`` with seeded random weights, in bf16 on
    ``DEVICE``, in eval mode, never stopping early (random weights would emit EOS at random)."""
    import transformers

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = getattr(transformers, model_cls)(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None
    return model.eval()


# bitsandbytes bases: 4-bit (dq: double quantization), 8-bit with transformers' default outlier
# threshold (6.0) and 8-bit without outlier decomposition (llm_int8_threshold=0.0)
QUANTS = ("nf4", "nf4dq", "fp4", "int8", "int8t0")


def quantize_base(model, quant: str):
    """The model's linear layers but the LM head as bitsandbytes layers (``QUANTS``), in place, on
    their device: the base a QLoRA adapter is served over (what ``BitsAndBytesConfig`` loads)."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or name == "lm_head":
                continue
            weight, bias, device = child.weight.data.to("cpu"), child.bias, child.weight.device
            shape = (child.in_features, child.out_features)
            if quant.startswith("int8"):
                q = bnb.nn.Linear8bitLt(*shape, bias=bias is not None, has_fp16_weights=False,
                                        threshold=0.0 if quant == "int8t0" else 6.0)
                q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            else:
                kind, double = quant[:3], quant.endswith("dq")
                q = bnb.nn.Linear4bit(*shape, bias=bias is not None, compute_dtype=weight.dtype,
                                      compress_statistics=double, quant_type=kind)
                q.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=double, quant_type=kind)
            if bias is not None:
                q.bias = torch.nn.Parameter(bias.data.to("cpu"), requires_grad=False)
            setattr(parent, name, q.to(device))  # quantized on the move
    # what PEFT reads to give these layers its bitsandbytes LoRA classes
    model.is_loaded_in_8bit = quant.startswith("int8")
    model.is_loaded_in_4bit = not model.is_loaded_in_8bit
    return model


def add_adapters(model, n: int, rank: int, targets=TARGETS, prefix: str = "a", **config):
    """A PeftModel over ``model`` (or ``model`` itself, when it is one) with adapters
    ``{prefix}0 .. {prefix}{n-1}`` of ``rank`` (B non-zero; ``config``: more ``LoraConfig`` fields,
    ``lora_bias=True`` or ``use_dora=True`` say), in the model's dtype as a server holds them (PEFT
    would upcast them to fp32)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, **config)
    peft_model = model
    for i in range(n):
        if not isinstance(peft_model, PeftModel):
            peft_model = get_peft_model(model, cfg, adapter_name=f"{prefix}{i}", autocast_adapter_dtype=False)
        else:
            peft_model.add_adapter(f"{prefix}{i}", cfg, autocast_adapter_dtype=False)
    return peft_model.eval()


def adapter_state_dicts(model, n: int, ranks, targets=TARGETS, seed: int = 0, pin: bool = False, prefix: str = "r"):
    """``{prefix}0 .. {prefix}{n-1}``: (state dict, LoraConfig) pairs in PEFT's saved key format, for
    ``fastlora.register_adapters`` on ``model`` (a PeftModel whose LoRA layers cover ``targets``),
    ranks drawn from ``ranks``, random weights in bf16, on the host (pinned with ``pin``)."""
    from peft import LoraConfig

    shapes = {}
    for name, module in model.named_modules():
        if name.endswith(tuple(f".{t}" for t in targets)) and hasattr(module, "base_layer"):
            base = module.base_layer
            shapes[name] = (base.in_features, base.out_features)
    rng, gen = random.Random(seed), torch.Generator(device=DEVICE).manual_seed(seed)
    out = {}
    for i in range(n):
        r = rng.choice(ranks)
        layout = [(f"{name}.lora_{ab}.weight", shape) for name, (fan_in, fan_out) in shapes.items()
                  for ab, shape in (("A", (r, fan_in)), ("B", (fan_out, r)))]
        total = sum(a * b for _, (a, b) in layout)
        # one random draw and one (pinned) host buffer per adapter; its tensors are views of it
        flat = torch.randn(total, generator=gen, device=DEVICE, dtype=torch.bfloat16).mul_(0.02)
        host = torch.empty(total, dtype=torch.bfloat16, pin_memory=pin)
        host.copy_(flat)
        sd, at = {}, 0
        for key, (a, b) in layout:
            sd[key] = host[at:at + a * b].view(a, b)
            at += a * b
        out[f"{prefix}{i}"] = (sd, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets)))
    return out


def round_robin(batch: int, adapters: int) -> list:
    """One adapter name per row: a0, a1, ... cycling."""
    return [f"a{i % adapters}" for i in range(batch)]


# ---- bytes: the floor ------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """Bytes of base weights one decode step reads: every parameter but the LoRA ones (counted per
    batch) and the input embedding (a few rows are read), the whole table where the LM head shares it."""
    total = 0
    for name, p in model.named_parameters():
        if "lora_" in name or "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    if model.config.tie_word_embeddings:
        total += emb.numel() * emb.element_size()
    return total


def lora_bytes_per_adapter(shape: str, rank: int, esize: int = 2) -> int:
    """Bytes of one adapter of ``rank`` on all seven projections of ``shape``."""
    s = shape_of(shape)
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    in_out = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    return layers * sum(rank * (a + b) for a, b in in_out) * esize


def kv_bytes(shape: str, batch: int, ctx: float, esize: int = 2) -> float:
    """KV-cache bytes one decode step reads at a filled length of ``ctx`` positions."""
    s = shape_of(shape)
    return 2 * s["num_hidden_layers"] * batch * s["num_key_value_heads"] * s["head_dim"] * ctx * esize


def spec_bandwidth(gpu: str):
    """The GPU's specified memory bandwidth in bytes/s (None where this table does not know it)."""
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in gpu), None)


def spec_flops(gpu: str):
    """The GPU's specified dense bf16 peak in FLOP/s (a stand-in on the CPU; None where unknown)."""
    if gpu.startswith("cpu"):
        return SMOKE_FLOPS
    return next((f for key, f in SPEC_BF16_FLOPS.items() if key in gpu), None)


def floor_columns(step_ms: float, floor_bytes: float, bw: float, gpu: str) -> dict:
    """The floor of ``floor_bytes`` at the measured bandwidth and ``step_ms`` against it, and the same
    at the GPU's specified bandwidth."""
    floor = 1e3 * floor_bytes / bw
    spec = spec_bandwidth(gpu)
    spec_floor = 1e3 * floor_bytes / spec if spec else None
    return dict(floor_ms=round(floor, 3), ratio_to_floor=round(step_ms / floor, 3),
                spec_bw_tbs=round(spec / 1e12, 2) if spec else "",
                ratio_to_spec_floor=round(step_ms / spec_floor, 3) if spec else "")


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB (far past the L2), the
    copies queued back to back: a copy after an idle GPU pays its launch and the clocks' ramp, which
    would understate the bandwidth and so make the floor lenient. On the CPU: a stand-in."""
    if DEVICE != "cuda":
        return SMOKE_BANDWIDTH
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
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


# ---- timing ----------------------------------------------------------------------------------------
def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls, the device synchronised around each."""
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
    decode step's time in ``generate`` minus its replay is host time the GPU waited for. Graphs that
    only build the next step's inputs (``fastlora_step_advance``) are not steps and are not timed."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        self._replay = torch.cuda.CUDAGraph.replay
        events, replay = self.events, self._replay

        def timed_replay(graph):
            if getattr(graph, "fastlora_step_advance", False):
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
    """(prefill ms, decode ms/step, tokens of the long run) for ``gen(n)``, a ``generate`` of n new
    tokens: decode = (time of n tokens - time of 1) / (n - 1), so prefill and set-up cancel.
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


measure.replay_ms = None


class GpuTimer:
    """Median microseconds of a callable, timed with CUDA events, the L2 evicted before each call
    by a 256 MiB memset (in a model the other layers' weights pass through between two calls of one
    layer; the memset also keeps the GPU busy while the host enqueues the call, so a graph replay
    is timed on the GPU alone). With ``warm_l2``: the mean of ``iters`` calls back to back between
    two events, what the calls read left in L2 from the one before (as a kernel reads the
    activations the previous one just wrote); calls shorter than the host takes to launch one are
    timed at its launch rate, so this mode cannot rank them. On the CPU: wall time, for
    ``--smoke`` runs."""

    def __init__(self, iters: int, warm_l2: bool = False):
        self.iters, self.warm_l2 = iters, warm_l2
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if DEVICE == "cuda" else None

    def __call__(self, fn) -> float:
        if self.flush is None:
            return 1e6 * timed(fn, max(1, min(self.iters, 2)))
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        if self.warm_l2:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(self.iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            return 1e3 * a.elapsed_time(b) / self.iters
        events = []
        for _ in range(self.iters):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        return 1e3 * statistics.median(a.elapsed_time(b) for a, b in events)


class _Eager:
    """``capture``'s stand-in on the CPU: ``replay`` runs the function."""

    def __init__(self, fn):
        self.replay = fn


def capture(fn):
    """``fn`` captured in a CUDA graph (compiled and warmed up on a side stream first); on the CPU
    an object whose ``replay`` calls it."""
    if DEVICE != "cuda":
        return _Eager(fn)
    import gc

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # a collected Triton kernel object must not unload its module mid-capture
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        gc.enable()
    return graph


def launch_floor(timer: GpuTimer, n_launches: int) -> float:
    """Microseconds of a graph of ``n_launches`` empty Triton kernels: what launches alone cost."""
    import triton

    @triton.jit
    def _empty(ptr):
        pass

    buf = torch.empty(1, device=DEVICE)

    def launches():
        for _ in range(n_launches):
            _empty[(1,)](buf)

    return timer(capture(launches).replay)


def kernel_times(gen, steps: int) -> list:
    """GPU time by kernel of one decode step: the profiler's kernel totals over ``gen(1 + steps)``
    minus those over ``gen(1)`` (prefill and set-up cancel), per step; rows of kernel,
    launches_per_step, us_per_step, slowest first. CUPTI sees the kernels a graph replay launches.
    Under PDL a kernel's time includes its wait for the one before: read families, not single small
    kernels. On the CPU the ops' CPU times stand in."""
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


# kernel families of a step, by name, the first that matches: the attention (fastlora's decode and
# paged kernels and the merge of their splits, flash kernels, whose names carry cutlass types, so
# before the GEMMs); cuBLAS's nvjet / cutlass GEMMs and their split-K reductions, fastlora's GEMMs;
# fastlora's LoRA launches; the rest is "other"
KERNEL_KINDS = (("attention", ("decode_attention", "paged_varlen", "merge_splits", "flash", "sdpa")),
                ("gemm", ("nvjet", "gemm", "cutlass", "splitKreduce", "xmma", "glu_lora")), ("lora", ("lora_",)))


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


class TritonCompiles:
    """Triton kernels compiled (not found in the process's in-memory cache) from construction to
    ``stop()``, and the seconds their compiles took, through Triton's public JIT hooks: a run whose
    steps meet new shapes compiles inside the timed window. On the CPU (Triton's interpreter)
    nothing is compiled; an older Triton without the hooks reports nothing."""

    def __init__(self):
        self.count, self.seconds, self._started = 0, 0.0, []
        try:
            import triton
        except ImportError:
            triton = None
        self._runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if self._runtime is None or not hasattr(self._runtime, "jit_post_compile_hook"):
            self._runtime = None
            return
        self._saved = (self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook)
        self._runtime.jit_cache_hook = self._before
        self._runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kwargs):
        self._started.append(time.perf_counter())
        return None  # None: compile as usual

    def _after(self, *args, **kwargs):
        self.count += 1
        if self._started:
            self.seconds += time.perf_counter() - self._started.pop()
        return None

    def stop(self) -> dict:
        if self._runtime is None:
            return {}
        self._runtime.jit_cache_hook, self._runtime.jit_post_compile_hook = self._saved
        self._runtime = None
        return dict(triton_compiles=self.count, triton_compile_s=round(self.seconds, 2))


class GpuWindow:
    """Where a running process's GPU time goes over a window of wall time: kernels, copies and the
    idle gaps between them, from every thread (CUPTI records the device's activity, so an engine's
    background thread is seen too). ``start()``, let the work run, ``stop()`` -> the columns
    ``summary`` names. On the CPU (smoke runs) the profiler's CPU ops stand in and the GPU columns
    are empty."""

    GAP_US = 100  # an idle gap this long is the host (or a sync) keeping the GPU waiting

    def __init__(self):
        self.prof = None
        self.kernels = []  # after stop(): ``top_kernels``

    def start(self):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self) -> dict:
        sync()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:  # (the export replaces the file it is given)
            path = os.path.join(folder, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
        self.kernels = self.top_kernels(events)
        return self.summary(events, wall)

    @staticmethod
    def top_kernels(events, n: int = 20) -> list:
        """The ``n`` kernels (by name, cut to 90 characters) that took the most GPU time: rows of
        name, launches, total and mean time, share of all kernel time."""
        total, by_name = 0.0, {}
        for e in events:
            if e.get("cat") == "kernel":
                dur = float(e.get("dur", 0))
                total += dur
                count, us = by_name.get(e.get("name", "")[:90], (0, 0.0))
                by_name[e.get("name", "")[:90]] = (count + 1, us + dur)
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:n]
        return [dict(kernel=name, launches=count, total_ms=round(us / 1e3, 3), mean_us=round(us / count, 1),
                     kernel_time_share=round(us / total, 4)) for name, (count, us) in top]

    @classmethod
    def summary(cls, events, wall: float) -> dict:
        """The window's columns from chrome-trace events (``ph`` "X", ``ts``/``dur`` in us)."""
        busy, by_kind = [], {f"{kind}_share": 0.0 for kind, _ in KERNEL_KINDS}
        by_kind["other_kernels_share"] = 0.0
        copies = syncs = graphs = launches = 0
        copy_us = sync_us = 0.0
        for e in events:
            cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0))
            if cat == "kernel":
                busy.append((float(e["ts"]), float(e["ts"]) + dur))
                kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), None)
                by_kind[f"{kind}_share" if kind else "other_kernels_share"] += dur
            elif cat in ("gpu_memcpy", "gpu_memset"):
                busy.append((float(e["ts"]), float(e["ts"]) + dur))
                copies += 1
                copy_us += dur
            elif cat in ("cuda_runtime", "cuda_driver"):
                if "Synchronize" in name:
                    syncs += 1
                    sync_us += dur
                elif name == "cudaGraphLaunch":
                    graphs += 1
                elif "LaunchKernel" in name:
                    launches += 1
        busy.sort()
        union, gaps, long_gaps, end = 0.0, 0.0, 0, None
        for a, b in busy:
            if end is None or a > end:
                if end is not None:
                    gaps += a - end
                    long_gaps += a - end >= cls.GAP_US
                union += b - a
                end = b
            elif b > end:
                union += b - end
                end = b
        span = (end - busy[0][0]) if busy else 0.0
        window_us = max(span, 1.0)
        # the wall time before the GPU's first activity and after its last: host work the busy and
        # idle shares (taken over the GPU's span) do not see
        outside_ms = round(max(0.0, 1e3 * wall - span / 1e3), 3) if busy else ""
        out = dict(window_s=round(wall, 6), outside_gpu_span_ms=outside_ms,
                   gpu_busy_share=round(union / window_us, 3) if busy else "",
                   idle_gaps_over_100us=long_gaps, idle_share=round(gaps / window_us, 3) if busy else "",
                   copies=copies, copy_share=round(copy_us / window_us, 4) if busy else "",
                   host_syncs=syncs, host_sync_ms=round(sync_us / 1e3, 2), graph_launches=graphs,
                   kernel_launches=launches)
        out.update({k: round(v / window_us, 3) if busy else "" for k, v in by_kind.items()})
        return out


# ---- what a row carries, and where it goes ------------------------------------------------------------
def versions() -> dict:
    """The GPU (or "cpu (smoke test)") and the versions every CSV row carries."""
    import peft
    import transformers
    import triton

    cuda = DEVICE == "cuda" and torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else "cpu (smoke test)"
    return dict(gpu=gpu, torch=torch.__version__, cuda=torch.version.cuda or "", triton=triton.__version__,
                transformers=transformers.__version__, peft=peft.__version__, python=platform.python_version())


def gpu_tag(gpu: str = None) -> str:
    """The GPU's short name for file names ("h200"; "cpu" in smoke runs)."""
    gpu = gpu or versions()["gpu"]
    if gpu.startswith("cpu"):
        return "cpu"
    model = re.search(r"\b[A-Z]\d{2,3}\b", gpu)  # "NVIDIA H100 80GB HBM3" -> h100, as run_gpu_suite.sh
    return (model.group(0) if model else gpu.split()[-1]).lower()


def run_in_child(script: str, argv, extra, drop=("--modes", "--out", "--isolate")) -> dict:
    """Run ``script`` in a fresh process with this one's arguments (``argv``; None: the command
    line's) less the options in ``drop``, plus ``extra`` and ``--child-result FILE``; returns the
    JSON the child wrote there. Each mode of a benchmark measured this way finds the GPU as empty
    as the first did, whatever the modes before it left allocated."""
    import subprocess
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for token in argv:
        if token.startswith("--"):
            skip = token.split("=")[0] in drop
            if skip:
                continue
        elif skip:
            continue
        kept.append(token)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        subprocess.run([sys.executable, os.path.abspath(script), *kept, *extra, "--child-result", path], check=True)
        with open(path) as f:
            return json.load(f)


def write_csv(rows, path: str) -> str:
    """The rows (dicts; the header is the union of their keys, in order of appearance) as ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    print("written", path, flush=True)
    return path


def add_model_args(parser, adapters: int, model: str = "8b"):
    """--model, --adapters, --rank: the arguments every single-model benchmark shares."""
    parser.add_argument("--model", default=model, choices=sorted(SHAPES))
    parser.add_argument("--adapters", type=int, default=adapters)
    parser.add_argument("--rank", type=int, default=16)


RESULTS = "benchmarks/results"


def add_run_args(parser):
    """--out (a folder) and --smoke."""
    parser.add_argument("--out", default=RESULTS, help="folder for the CSV (empty: none written)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script only")


def start(args, name: str) -> bool:
    """After parsing: ``--smoke`` moves everything to the CPU and writes nothing unless ``--out``
    names a folder; a measurement without a GPU says so. False: nothing to run."""
    if args.smoke:
        use_cpu()
        if args.out == RESULTS:
            args.out = None
        return True
    return not needs_gpu(name)


def out_path(folder: str, stem: str, gpu: str) -> str:
    """``folder/<stem>_<gpu tag>.csv`` (None where no folder was given)."""
    return os.path.join(folder, f"{stem}_{gpu_tag(gpu)}.csv") if folder else None
