"""Every Triton kernel of ``peft_fastlora.ops`` compiles for Hopper (sm_90) on this CPU machine, in
the specializations its kernel tests launch (``hopper_compile.py``): what Triton's interpreter
never checks (the compiler's typing of each name across branches, layouts, the TMA descriptors)
fails here, before any GPU run."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where hopper_compile.py is
# fast kernel tests that launch every kernel of ops/ (a few specializations of each are compiled)
KERNEL_TESTS = ["tests/kernels/" + test for test in [
    "test_triton_kernels.py::test_shrink", "test_triton_kernels.py::test_lora_b_in_place",
    "test_triton_kernels.py::test_embedding_a", "test_triton_kernels.py::test_extra_token_embedding",
    "test_triton_fused.py::test_fused_decode", "test_expand_wide.py::test_wide_packed",
    "test_decode_attention.py::test_kernel_matches_reference",
    "test_paged_varlen.py::test_decode_rows_equal_the_reference[8-2-fp16]",
    "test_paged_varlen.py::test_splits_merge_to_the_same_output[2]",
    "test_kv_cache.py::test_write_equals_index_copy", "test_rotary_kv.py::test_one_kernel_equals_the_two",
    "test_rotary_silu.py::test_rotary_equals_formula", "test_rotary_silu.py::test_silu_mul_equals_torch",
    "test_rotary_silu.py::test_gelu_tanh_mul_equals_torch", "test_rms_norm.py",
    "test_stream_gemm.py::test_matches_reference", "test_stream_gemm.py::test_glu_equals_gemm_then_act_mul",
    "test_stream_gemm.py::test_add_on_the_first_columns", "test_tma_gemm.py",
    "test_segment_copy.py", "test_greedy_select.py",
    "test_glu_lora.py::test_matches_reference[70-33-64-dtype1-aligned]",
    "test_glu_lora.py::test_b_columns_through_a_descriptor_match_reference[dtype1-up-wider-64-row-shrink]",
    "test_glu_lora.py::test_b_columns_kernel_lays_b_out_as_the_arena_rows", "test_int8_dequant.py",
    "test_glu_expand.py::test_matches_reference[bf16-aligned-prefill-default_tiles]",
    "test_glu_expand.py::test_ranks_past_one_rank_block[fp16-blocks_of_16]",
]]


def _compile_for_hopper(tests, ptx_dir=None) -> str:
    extra = ["--ptx", str(ptx_dir)] if ptx_dir is not None else []
    run = subprocess.run([sys.executable, os.path.join(TESTS, "hopper_compile.py"), "--max-per-kernel", "3", *extra,
                          *tests], capture_output=True, text=True, cwd=os.path.dirname(TESTS), timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "compiled" in out and " of 0 " not in out, out[-2000:]
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under the interpreter (no GPU)")
def test_kernels_compile_for_hopper():
    _compile_for_hopper(KERNEL_TESTS)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under the interpreter (no GPU)")
def test_split_k_shrink_compiles_for_hopper_with_its_handshake(tmp_path):
    """The shrink's split-K launch (one test case: a split of one, its bfloat16 twin, a split of
    three): its partials stored, a barrier, one thread's acquire-release count, and the last
    program's loads past L1."""
    _compile_for_hopper(["tests/kernels/test_triton_kernels.py::test_shrink_split_k[fp16-mixed-3-padded]"], tmp_path)
    split = [ptx for ptx in (f.read_text() for f in tmp_path.glob("_lora_shrink_kernel_*.ptx")) if "atom." in ptx]
    assert len(split) == 1, [f.name for f in tmp_path.iterdir()]
    ptx = split[0]
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert "bar.sync" in ptx[:ptx.index("atom.global")]


_COPY_KERNEL = """
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=offs < n), mask=offs < n)
"""
_COMPILE = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import hopper_compile, triton
from triton.backends.compiler import GPUTarget
from copy_module import copy_kernel
target = GPUTarget("cuda", 90, 32)
for line in open(sys.argv[3]):
    entry = json.loads(line)
    ptx = triton.compile(hopper_compile.source_of(copy_kernel, entry, target), target=target,
                         options=entry["options"]).asm["ptx"]
    print("vector" if ".v4." in ptx else "scalar")
"""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under the interpreter (no GPU)")
def test_launches_are_recorded_as_the_jit_specializes_them(tmp_path, monkeypatch):
    """A device launch compiles its kernel for its arguments' specialization: integers equal to 1
    become constexprs, 16-byte aligned pointers and integers divisible by 16 are marked so (the
    compiler may then load 16 bytes at a time). The record carries the same, and the compile (in a
    process without the interpreter) uses it: the aligned launch's copy loads vectors, the
    misaligned one's single elements."""
    import importlib
    import json

    import torch
    from triton.runtime import interpreter

    (tmp_path / "copy_module.py").write_text(_COPY_KERNEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(TESTS)
    import hopper_compile

    copy_kernel = importlib.import_module("copy_module").copy_kernel
    path = str(tmp_path / "launches.jsonl")
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run)
    hopper_compile.record(path, execute=False)
    x = torch.zeros(1040, dtype=torch.bfloat16)  # 1,024 elements: 32 a thread of one warp
    copy_kernel[(1,)](x, x, 1024, 1, BLOCK=1024, num_warps=1)
    copy_kernel[(1,)](x[1:], x[1:], 1023, 1, BLOCK=1024, num_warps=1)
    aligned, odd = [json.loads(line) for line in open(path)]
    assert aligned["signature"]["stride"] == "constexpr" and aligned["constexprs"]["stride"] == 1
    assert aligned["attrs"] == {"0": "D", "1": "D", "2": "D"}
    assert odd["attrs"] == {} and odd["signature"]["n"] == "i32"

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, TESTS, str(tmp_path), path], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["vector", "scalar"], run.stdout
