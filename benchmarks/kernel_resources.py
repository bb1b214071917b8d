"""Each Triton kernel of an 8B decode step, compiled for Hopper on a machine with no GPU: registers a
thread, spills, shared memory, and how many of its programs an SM can hold on those counts.

A one-layer model of Llama-3-8B's widths (bf16, 8 adapters of rank 16 on all 7 projections, or
none) is patched with every kernel on and decodes a few tokens at each batch under Triton's
interpreter with the launches recorded but not run (``tests/hopper_compile.py``: the values are
garbage, the launches are the step's own: widths, tiles, constexprs, warps, grids). Each distinct
launch is then compiled for sm_90 by this machine's Triton (which may be another version than
the device's), and its cubin's resources are read. Programs an SM holds: the least of 65,536
registers, 228 KB of shared memory (1 KB of it the runtime's per program), 64 warps and 32
programs, the register count rounded as the hardware allocates (8 a thread, 256 a warp).

    python benchmarks/kernel_resources.py --out benchmarks/results/kernel_resources_8b_sm90_triton36.csv
    python benchmarks/kernel_resources.py --jit --out benchmarks/results/kernel_resources_8b_jit_h200.csv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

H200_SMS = 132
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """Programs of one kernel an SM holds at once on Hopper, from its resources."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_shared = (228 * 1024) // (shared + 1024)
    return max(0, min(by_regs, by_shared, 64 // warps, 32))


def _record_step(path: str, batches, adapters: int, layers: int, smoke: bool = False):
    """In this process (interpreted): decode at each batch with launches recorded, not run."""
    os.environ["TRITON_INTERPRET"] = "1"
    # launch parameters chosen from the SM count (decode attention's splits and block_n) as on an
    # H200, not as for the interpreter's few programs (read when peft_fastlora is first imported)
    os.environ["FASTLORA_INTERPRETER_SMS"] = str(H200_SMS)
    import hopper_compile

    hopper_compile.record(path, execute=False)
    _decode(batches, adapters, layers, smoke, device="cpu", label=lambda text: hopper_compile.CONTEXT.update(label=text))


def _decode(batches, adapters: int, layers: int, smoke: bool, device: str, label=lambda text: None):
    """The one-layer model of the 8B widths (module doc), patched, decoding a few tokens at each batch
    with 8 adapters on every row and with none; ``device="cuda"``: real graphs on the GPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft_fastlora as fastlora

    torch.manual_seed(0)
    widths = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2) if smoke \
        else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    cfg = LlamaConfig(vocab_size=256, num_hidden_layers=layers, **widths, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16).eval()
    base.generation_config.eos_token_id = None
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=all7), adapter_name="a0")
    for i in range(1, adapters):
        model.add_adapter(f"a{i}", LoraConfig(r=16, lora_alpha=32, target_modules=all7))
    model.eval()
    options = dict(backend="triton", cuda_graphs="emulate" if device == "cpu" else "auto", fold_shrink=True,
                   stream_gemm=True, decode_attention=True, fuse_norms=True, fuse_rotary=True, fuse_silu_mul=True,
                   fuse_kv_write=True)
    with fastlora.patched(model, **options):
        for batch in batches:
            for mixed in (True, False):
                names = [f"a{i % adapters}" if mixed else "__base__" for i in range(batch)]
                label(f"{'mixed' if mixed else 'no-adapter'} batch {batch}")
                ids = torch.randint(3, 256, (batch, 4), device=device)
                with torch.no_grad():
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                                   max_new_tokens=3, do_sample=False, pad_token_id=0)


def jit_table(out: str, batches, adapters: int, layers: int) -> int:
    """On a GPU: decode as ``_record_step`` does, through real graphs, then write what Triton's JIT
    itself built for every kernel of ``peft_fastlora.ops`` (its registers and spills as the driver
    reports them, and as cuobjdump reads the cubin): the reference the CPU table is checked against."""
    import torch
    import triton
    from triton.runtime.jit import JITFunction

    import harness as hx
    import hopper_compile

    if not torch.cuda.is_available():
        print("--jit needs a CUDA GPU; nothing run")
        return 0
    _decode(batches, adapters, layers, smoke=False, device="cuda")
    import peft_fastlora.ops as ops

    rows = []
    for module_name in sorted(m for m in sys.modules if m.startswith(ops.__name__ + ".")):
        for name, fn in sorted(vars(sys.modules[module_name]).items()):
            if not isinstance(fn, JITFunction) or getattr(fn, "__module__", module_name) != module_name:
                continue
            for caches in fn.device_caches.values():
                for compiled in caches[0].values():
                    compiled._init_handles()
                    consts = {fn.arg_names[k[0]]: v for k, v in compiled.src.constants.items() if len(k) == 1}
                    regs, stack = hopper_compile.resources(compiled)
                    rows.append(dict(kernel=name, constexprs=" ".join(f"{k}={v}" for k, v in sorted(consts.items())
                                                                     if k.isupper() and k != "LIBDEVICE"),
                                     specialized=" ".join(f"{k}={v}" for k, v in sorted(consts.items()) if not k.isupper()),
                                     num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
                                     registers=compiled.n_regs, spills=compiled.n_spills, cubin_registers=regs,
                                     stack_bytes=stack, shared_bytes=compiled.metadata.shared,
                                     triton=triton.__version__, gpu=torch.cuda.get_device_name()))
                    print(f"{name:32s} warps {rows[-1]['num_warps']}: {compiled.n_regs:3d} registers, "
                          f"{compiled.n_spills} spills, {compiled.metadata.shared:6d} B shared", flush=True)
    hx.write_csv(rows, out)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/kernel_resources_8b_sm90.csv")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="narrow widths: exercises the script only")
    p.add_argument("--jit", action="store_true",
                   help="on a GPU: decode through real graphs and write what the JIT built (the CPU table's check)")
    p.add_argument("--record-only", default=None, help=argparse.SUPPRESS)  # (the child process's part)
    args = p.parse_args(argv)
    if args.jit:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        return jit_table(args.out, args.batches, args.adapters, args.layers)
    if args.record_only:
        _record_step(args.record_only, args.batches, args.adapters, args.layers, args.smoke)
        return 0
    records = os.path.join(tempfile.mkdtemp(prefix="kernel_resources_"), "launches.jsonl")
    open(records, "w").close()
    child = [sys.executable, os.path.abspath(__file__), "--record-only", records, "--adapters", str(args.adapters),
             "--layers", str(args.layers), "--batches", *map(str, args.batches)] + (["--smoke"] if args.smoke else [])
    run = subprocess.run(child, env=dict(os.environ, TRITON_INTERPRET="1"), cwd=ROOT)
    if run.returncode:
        print(f"recording the step's launches failed (exit {run.returncode})")
        return 1
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, json; sys.path[:0] = [%r, %r]; import kernel_resources as k; "
            "sys.exit(k.compile_and_write(%r, %r))" % (os.path.join(ROOT, "tests"), HERE, records, args.out))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode


def compile_and_write(records: str, out: str) -> int:
    """Compile each distinct recorded launch for sm_90 and write the resources table (CSV)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    import harness as hx
    import hopper_compile

    host = torch.cuda.get_device_name() if torch.cuda.is_available() else "a machine with no GPU"
    target = GPUTarget("cuda", 90, 32)
    rows, compiled_by_key = [], {}
    with open(records) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    for e in entries:
        e["constexprs"] = hopper_compile.as_on_the_device(e)
        key = json.dumps({k: e.get(k) for k in ("module", "name", "signature", "constexprs", "attrs", "options")},
                         sort_keys=True)
        if key not in compiled_by_key:
            kernel = getattr(__import__(e["module"], fromlist=[e["name"]]), e["name"])
            c = triton.compile(hopper_compile.source_of(kernel, e, target), target=target, options=e["options"])
            compiled_by_key[key] = (c, *hopper_compile.resources(c))
        compiled, regs, stack = compiled_by_key[key]
        warps = e["options"].get("num_warps", 4)
        grid = e.get("grid") or []
        programs = 1
        for g in grid:
            programs *= g
        per_sm = programs_per_sm(regs, compiled.metadata.shared, warps)
        rows.append(dict(step=e.get("context") or "", kernel=e["name"], constexprs=" ".join(f"{k}={v}" for k, v in sorted(e["constexprs"].items())
                                                              if k.isupper() and k not in ("LIBDEVICE",)),
                         num_warps=warps, num_stages=e["options"].get("num_stages", ""), grid="x".join(map(str, grid)),
                         programs=programs, registers=regs, stack_bytes=stack, shared_bytes=compiled.metadata.shared,
                         programs_per_sm=per_sm,
                         waves_on_132_sms=round(programs / (H200_SMS * per_sm), 2) if per_sm else "",
                         triton=triton.__version__, target=f"sm_90 (compiled ahead of time on {host}; nothing run)"))
        print(f"{rows[-1]['step']:16s} {e['name']:32s} warps {warps} grid {rows[-1]['grid']:>12s}: {regs:3d} registers, {stack} B stack, "
              f"{compiled.metadata.shared:6d} B shared -> {per_sm} programs an SM", flush=True)
    hx.write_csv(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
