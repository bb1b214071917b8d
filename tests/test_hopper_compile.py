"""Every Triton kernel of ``peft_fastlora.ops`` compiles for Hopper (sm_90) on this CPU machine, in
the specializations its kernel tests launch (``hopper_compile.py``): what Triton's interpreter
never checks (the compiler's typing of each name across branches, layouts, the TMA descriptors)
fails here, before a device machine is started."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))
# fast kernel tests that launch every kernel of ops/ (a few specializations of each are compiled)
KERNEL_TESTS = [
    "tests/test_triton_kernels.py::test_shrink", "tests/test_triton_kernels.py::test_lora_b_in_place",
    "tests/test_triton_kernels.py::test_embedding_a", "tests/test_triton_kernels.py::test_extra_token_embedding",
    "tests/test_triton_fused.py::test_fused_decode", "tests/test_expand_wide.py::test_wide_packed",
    "tests/test_decode_attention.py::test_kernel_matches_reference",
    "tests/test_kv_cache.py::test_write_equals_index_copy", "tests/test_rotary_kv.py::test_one_kernel_equals_the_two",
    "tests/test_rotary_silu.py::test_rotary_equals_formula", "tests/test_rotary_silu.py::test_silu_mul_equals_torch",
    "tests/test_rotary_silu.py::test_gelu_tanh_mul_equals_torch", "tests/test_rms_norm.py",
    "tests/test_stream_gemm.py::test_matches_reference", "tests/test_stream_gemm.py::test_glu_equals_gemm_then_act_mul",
    "tests/test_stream_gemm.py::test_add_on_the_first_columns", "tests/test_tma_gemm.py",
    "tests/test_segment_copy.py",
]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="records launches under the interpreter (no GPU)")
def test_kernels_compile_for_hopper():
    run = subprocess.run([sys.executable, os.path.join(HERE, "hopper_compile.py"), "--max-per-kernel", "3",
                          *KERNEL_TESTS], capture_output=True, text=True, cwd=os.path.dirname(HERE), timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "compiled" in out and " of 0 " not in out, out[-2000:]
