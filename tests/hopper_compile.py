"""Compile, for Hopper (sm_90), every Triton kernel specialization that CPU tests launch, on a machine
with no GPU.

Triton's interpreter runs the kernels on CPU tensors but never compiles them, so what only the
compiler rejects (a name given another type in one branch of an ``if``, say) would show first on
a GPU. This records each launch the given tests make under the
interpreter (the kernel, its arguments' types, its constexpr values, warps and stages), then, in a
process without the interpreter, compiles each distinct one to a cubin for ``cuda:90``. Nothing
runs on a GPU; the CPU's Triton (whose version may differ from the device's) is the compiler.

    python tests/hopper_compile.py tests/kernels/test_rms_norm.py tests/kernels/test_expand_wide.py
    python tests/hopper_compile.py --records launches.jsonl   # compile recorded launches only
    python tests/hopper_compile.py --resources tests/kernels/test_expand_wide.py   # and each one's registers
    python tests/hopper_compile.py --ptx /tmp/before tests/kernels/test_stream_gemm.py   # then again after a refactor: diff -r

Exit status 1 when a specialization does not compile (each one's error printed).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))


def as_on_the_device(entry: dict) -> dict:
    """A recorded launch's constexprs as the device's launch sets them where the interpreter sets
    its own: libdevice, PDL (``pdl.FULL``), and no float32 upcast of 16-bit operands (the
    interpreter's bfloat16 dot is wrong, so its GEMMs upcast)."""
    consts = dict(entry["constexprs"])
    sixteen = any(t in ("*bf16", "*fp16") for t in entry["signature"].values())
    for name, value in (("LIBDEVICE", True), ("USE_PDL", 2), ("UPCAST", not sixteen)):
        if name in consts:
            consts[name] = value
    return consts


def _constexpr_names(fn) -> set:
    names = set()
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        if ann is not inspect.Parameter.empty and ("constexpr" in str(ann) or getattr(ann, "__name__", "") == "constexpr"):
            names.add(p.name)
    return names


def _arg_type(value):
    """The compiler's signature entry for a runtime argument, or None for a constexpr one."""
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
             torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.int16: "i16",
             torch.float64: "fp64"}
    if isinstance(value, torch.Tensor):
        return "*" + names[value.dtype]
    base, block = getattr(value, "base", None), getattr(value, "block_shape", None)
    if isinstance(base, torch.Tensor) and block is not None:  # a host TMA descriptor (TensorDescriptor)
        return f"tensordesc<{names[base.dtype]}[{','.join(str(int(b)) for b in block)}]>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


CONTEXT = {"label": None}  # a caller's label for the launches it records next (a batch, say)


def _specializer():
    """``value -> (type, key)`` as the JIT's launch specializes an argument for sm_90 (Triton's own
    function): integers equal to 1 become constexprs, and pointers 16-byte aligned and integers
    divisible by 16 are marked ``"D"`` (the compiler may then vectorise loads and drop masks)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(GPUTarget("cuda", 90, 32))
    return lambda value, specialize, align: native_specialize_impl(backend, value, False, specialize, align)


def record(path: str, execute: bool = True):
    """Wrap the interpreter's launch so that each launch appends one JSON line to ``path`` (with its
    grid, and its arguments specialized as a device launch would specialize them: the CPU tensors'
    alignment stands for the GPU's); ``execute=False``: the kernels are not run (their outputs keep
    whatever they held)."""
    import torch
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run
    specialize = _specializer()
    seen = set()

    def run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        constexprs = _constexpr_names(fn)
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        jit_kwargs = getattr(self, "kwargs", None) or {}
        signature, values, attrs = {}, {}, {}
        for index, name in enumerate(self.arg_names):
            value = bound.get(name, inspect.signature(fn).parameters[name].default)
            if name in constexprs or value is None:
                signature[name] = "constexpr"
                values[name] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
                continue
            if isinstance(value, (torch.Tensor, int, float)):  # (bool is an int)
                kind, key = specialize(value, name not in (jit_kwargs.get("do_not_specialize") or ()),
                                       name not in (jit_kwargs.get("do_not_specialize_on_alignment") or ()))
            else:  # a host TMA descriptor: its type by name, no attributes
                kind, key = _arg_type(value), None
            signature[name] = kind
            if kind == "constexpr":
                values[name] = key
            elif key:
                attrs[str(index)] = key
        options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        shape = None if callable(grid) else [int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))]
        entry = dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=values, attrs=attrs,
                     options=options, grid=shape, context=CONTEXT["label"])
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            with open(path, "a") as f:
                f.write(key + "\n")
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    interpreter.InterpretedFunction.run = run


class _Recorder:
    """A pytest plugin: records the session's launches (``record``) from its start."""

    def __init__(self, path):
        self.path = path

    def pytest_configure(self, config):
        record(self.path)


def _chosen(entries, max_per_kernel):
    """The distinct entries, at most ``max_per_kernel`` a kernel (None: all): those whose constexpr
    values no earlier entry of the kernel had come first."""
    by_kernel, seen = {}, set()
    for e in entries:
        e = {k: v for k, v in e.items() if k not in ("grid", "context")}
        key = json.dumps(e, sort_keys=True)
        if key not in seen:
            seen.add(key)
            by_kernel.setdefault((e["module"], e["name"]), []).append(e)
    chosen = []
    for group in by_kernel.values():
        consts, first, rest = set(), [], []
        for e in group:
            c = json.dumps(e["constexprs"], sort_keys=True)
            (rest if c in consts else first).append(e)
            consts.add(c)
        # the device's dtype, which the interpreter's tests seldom take: a float16 launch's twin
        twin = next((t for t in map(_bf16_twin, group) if t is not None), None)
        if twin is not None and json.dumps(twin, sort_keys=True) not in seen:
            first.insert(1, twin)
        chosen += (first + rest)[:max_per_kernel]
    return chosen


def _bf16_twin(entry):
    """``entry`` with its float16 pointers as bfloat16, or None where it has none."""
    signature = entry["signature"]
    if not any(t == "*fp16" for t in signature.values()):
        return None
    return dict(entry, signature={k: "*bf16" if t == "*fp16" else t for k, t in signature.items()})


def resources(compiled):
    """(registers a thread, stack bytes: spills) of a compiled kernel, read from its cubin with the
    ``cuobjdump`` Triton ships."""
    import re

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", dump), re.search(r"STACK:(\d+)", dump)
    return (int(regs.group(1)) if regs else -1), (int(stack.group(1)) if stack else -1)


def source_of(kernel, entry: dict, target):
    """The compiler's input for a recorded launch: its signature, constexprs and the alignment and
    divisibility attributes its arguments had (``record``)."""
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(target)
    attrs = {(int(i),): backend.parse_attr(key) for i, key in (entry.get("attrs") or {}).items()}
    return ASTSource(fn=kernel, signature=entry["signature"], constexprs=entry["constexprs"], attrs=attrs)


def kernel_ptx(compiled) -> str:
    """A compiled kernel's PTX up to the end of its body, without line markers or comments: what
    two versions of a source must share to generate the same code (the debug sections after it
    change with every line moved)."""
    body = []
    for line in compiled.asm["ptx"].splitlines():
        if line.lstrip().startswith((".loc", ".file", "//", "$L__tmp")):  # (line markers and their labels)
            continue
        body.append(line.split("//")[0].rstrip())
        if line == "}":
            break
    return "\n".join(body) + "\n"


def compile_records(path: str, max_per_kernel=None, show_resources: bool = False, ptx_dir=None) -> int:
    """Compile the recorded launches for sm_90 (``_chosen``); prints failures (and with ``show_resources``
    each kernel's registers, spills and shared memory), returns how many failed."""
    import triton
    from triton.backends.compiler import GPUTarget

    with open(path) as f:
        entries = _chosen([json.loads(line) for line in f if line.strip()], max_per_kernel)
    done, failures = set(), 0
    target = GPUTarget("cuda", 90, 32)
    for e in entries:
        done.add(json.dumps(e, sort_keys=True))
        e["constexprs"] = as_on_the_device(e)
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        try:
            src = source_of(kernel, e, target)
            compiled = triton.compile(src, target=target, options=e["options"])
            if ptx_dir:  # one file a specialization, named by it: diff two directories after a refactor
                name = f"{e['name']}_{hashlib.sha1(json.dumps(e, sort_keys=True).encode()).hexdigest()[:12]}.ptx"
                with open(os.path.join(ptx_dir, name), "w") as f:
                    f.write(kernel_ptx(compiled))
            if show_resources:
                consts = {k: v for k, v in e["constexprs"].items() if k.isupper()}
                regs, stack = resources(compiled)
                print(f"{e['name']} {consts} {e['options']}: {regs} registers, {stack} B stack, "
                      f"{compiled.metadata.shared} B shared", flush=True)
        except Exception as exc:  # noqa: BLE001 (every compiler error is reported the same way)
            failures += 1
            consts = {k: v for k, v in e["constexprs"].items() if k.isupper()}
            print(f"FAILED {e['module']}.{e['name']} {consts} {e['options']}:\n{exc}\n", flush=True)
    print(f"compiled {len(done) - failures} of {len(done)} kernel specializations for sm_90", flush=True)
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests", nargs="*", help="pytest arguments: the tests whose launches to compile")
    p.add_argument("--records", default=None, help="a JSONL file of launches (written when tests are given)")
    p.add_argument("--resources", action="store_true",
                   help="print each specialization's registers a thread, spills and shared memory")
    p.add_argument("--ptx", default=None, metavar="DIR",
                   help="write each specialization's kernel PTX (no line markers) to DIR: two runs' directories "
                        "compare a refactor's generated code")
    p.add_argument("--max-per-kernel", type=int, default=None,
                   help="compile at most this many specializations of each kernel (distinct constexprs first)")
    args, pytest_args = p.parse_known_args(argv)
    args.tests += pytest_args
    records = args.records or os.path.join(tempfile.mkdtemp(prefix="hopper_compile_"), "launches.jsonl")
    if args.tests:
        open(records, "w").close()
        env = dict(os.environ, TRITON_INTERPRET="1")
        code = ("import sys, pytest; sys.path.insert(0, %r); import hopper_compile as h; "
                "sys.exit(pytest.main(sys.argv[1:], plugins=[h._Recorder(%r)]))" % (_HERE, records))
        run = subprocess.run([sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              *args.tests], env=env, cwd=os.path.dirname(_HERE))
        if run.returncode not in (0, 5):
            print(f"the tests failed (exit {run.returncode}); compiling what they launched", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, %r); import hopper_compile as h; "
            "sys.exit(min(1, h.compile_records(%r, %r, %r, %r)))" % (_HERE, records, args.max_per_kernel, args.resources,
                                                                     args.ptx))
    if args.ptx:
        os.makedirs(args.ptx, exist_ok=True)
    return subprocess.run([sys.executable, "-c", code], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
