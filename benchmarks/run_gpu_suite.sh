#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device machine: GPU tests, soak, kernel
# benchmark, end-to-end benchmark. Results land in $OUT (and are committed under
# benchmarks/results/). Parts: all (default) or any of tests soak kernels generate host pdl
# profile attention continuous prefill many resources; never part of all: tma (probe_tma_gemm.py rewrites the TMA kernel's
# tile table in the tree, then the 8B steps at TMA_BATCHES with the kernel off and on), advance (the
# step-advance path's GPU tests, 8B A/B and timeline), ncu (Nsight Compute over one graphed 8B step,
# base and mixed at NCU_BATCHES, a kernel a line), cublaslt (every cuBLASLt algorithm at the 8B
# decode GEMMs, built with the machine's nvcc); and, on the two-GPU
# machine only, multigpu (TP_MODEL, TP_ARGS: e.g. 32b --skip-tp1) and devicemap.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off in every process (the device machines' rule; torchrun's ranks inherit it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
parts=" ${*:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
if want tests; then
  files=${GPU_TESTS:-$(ls tests/*_gpu.py)}
  timeout ${TESTS_LIMIT:-480} python3 -m pytest -m gpu -q -p no:cacheprovider $files 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
  timeout 120 python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart_gpu.log" | tail -12
fi
if want soak; then
  for m in ${SOAK_MODELS:-tiny-llama tiny-qwen2 8b}; do
    if [[ $m == 8b ]]; then args="--calls ${SOAK8B_CALLS:-50} --time-limit ${SOAK8B_LIMIT:-200}"
    else args="--calls ${SOAK_CALLS:-300} --compare-peft --time-limit ${SOAK_LIMIT:-200}"; fi
    timeout 450 python3 benchmarks/soak_graphs.py --model $m $args --out "$OUT" 2>&1 | grep -v -i warn \
      | tee "$OUT/soak_$m.log" | tail -3
  done
fi
if want kernels; then
  timeout 240 python3 benchmarks/bench_kernels.py --out "$OUT/kernels_h200.csv" 2>&1 | tee "$OUT/bench_kernels.log" | tail -40
fi
if want generate; then
  timeout 420 python3 benchmarks/bench_generate.py --models ${MODELS:-1b 8b} --csv ${GEN_CSV:-generate_h200.csv} --out "$OUT" 2>&1 | tee "$OUT/bench_generate.log" | grep -v -i warn | tail -45
fi
if want host; then  # the host's part of the graphed step: per-step check, deferred, deferred + step mask
  for m in ${HOST_MODELS:-1b 8b}; do
    timeout 300 python3 benchmarks/probe_deferred_stop.py --model $m --batches 1 32 128 \
      --out "$OUT/probe_host_${m}_h200.csv" 2>&1 | grep -v -i warn | tee "$OUT/probe_host_$m.log" | tail -4
  done
fi
if want pdl; then  # programmatic dependent launch: on, on where a kernel has a preamble, off
  for m in ${PDL_MODELS:-1b 8b}; do
    timeout 300 python3 benchmarks/probe_pdl.py --model $m --batches 1 32 128 --base \
      --modes pdl pdl_preamble_only no_pdl --out "$OUT/probe_pdl_${m}_h200.csv" 2>&1 | grep -v -i warn \
      | tee "$OUT/probe_pdl_$m.log" | tail -4
  done
fi
if want profile; then
  timeout 150 python3 benchmarks/profile_step.py --model 8b --batch 32 --out "$OUT/profile_step_h200.csv" 2>&1 | grep -v -i warn | tail -40
fi
if want attention; then
  timeout 200 python3 benchmarks/bench_attention.py --out "$OUT/attention_h200.csv" 2>&1 | tee "$OUT/bench_attention.log" | tail -30
fi
if want continuous; then
  timeout 560 python3 benchmarks/bench_continuous.py --model ${CB_MODEL:-8b} --requests ${CB_REQUESTS:-2000} \
    --static-requests ${CB_STATIC_REQUESTS:-0} --static-batch ${CB_STATIC_BATCH:-32} --modes ${CB_MODES:-base fastlora static} --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/bench_continuous.log" | tail -8
fi
if want prefill; then
  timeout 300 python3 benchmarks/bench_prefill.py --model ${PREFILL_MODEL:-8b} --out "$OUT" 2>&1 | grep -v -i warn \
    | tee "$OUT/bench_prefill.log" | tail -6
fi
if want resources; then  # what the JIT built for an 8B step's kernels (the CPU table's check: kernel_resources.py)
  timeout 300 python3 benchmarks/kernel_resources.py --jit --out "$OUT/kernel_resources_8b_jit_h200.csv" 2>&1 \
    | grep -v -i warn | tee "$OUT/kernel_resources_jit.log" | tail -4
fi
if want many; then
  timeout 400 python3 benchmarks/bench_many_adapters.py --model ${MANY_MODEL:-8b} --adapters ${MANY_ADAPTERS:-512} \
    --slots ${MANY_SLOTS:-64} --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/bench_many_adapters.log" | tail -6
fi
if [[ $parts == *" tma "* ]]; then
  timeout ${TMA_PROBE_LIMIT:-300} python3 benchmarks/probe_tma_gemm.py --glu --out "$OUT/probe_tma_gemm_h200.csv" 2>&1 \
    | grep -v -i warn | tee "$OUT/probe_tma_gemm.log" | tail -24
  cp peft_fastlora/base_ops/tma_tiles_h200.json "$OUT/"
  for t in ${TMA_AB:-off on}; do
    timeout ${TMA_BENCH_LIMIT:-200} python3 benchmarks/bench_generate.py --models 8b --graphs-only \
      --batches ${TMA_BATCHES:-128} --tma-gemm $t --csv generate_tma_${t}_h200.csv --out "$OUT" 2>&1 \
      | grep -v -i warn | tee "$OUT/bench_tma_$t.log" | tail -6
  done
fi
if [[ $parts == *" advance "* ]]; then  # never part of all: the step-advance path's GPU tests, then 8B on / off / on
  timeout 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_step_advance_gpu.py \
    tests/test_greedy_select_gpu.py 2>&1 | tee "$OUT/gpu_tests_advance.log" | tail -20
  for v in on off on2; do
    timeout 120 python3 benchmarks/bench_generate.py --models 8b --graphs-only --batches 1 32 128 \
      --step-advance ${v%2} --out "$OUT" --csv generate_advance_${v}_h200.csv 2>&1 | grep -v -i warn \
      | tee "$OUT/bench_advance_$v.log" | tail -8
  done
  timeout 150 python3 benchmarks/step_timeline.py --model 8b --batches 1 32 --new-tokens 40 --step-advance on \
    --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/step_timeline_advance.log" | tail -4
fi
if [[ $parts == *" ncu "* ]]; then  # never part of all: per-kernel DRAM and L2 counters of one decode step
  for b in ${NCU_BATCHES:-32 128}; do for m in base mixed; do
    timeout 200 ncu --profile-from-start off --graph-profiling node --clock-control none --csv --page raw \
      --metrics "$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import ncu_step; print(ncu_step.METRICS)')" \
      --log-file "$OUT/ncu_step_${m}_b$b.csv" python3 benchmarks/ncu_step.py --method $m --batch $b --layers 4 \
      > "$OUT/ncu_step_${m}_b$b.out" 2>&1
    python3 benchmarks/ncu_step.py --summarize "$OUT/ncu_step_${m}_b$b.csv" | tee "$OUT/ncu_step_${m}_b$b.txt" | head -16
  done; done
fi
if [[ $parts == *" cublaslt "* ]]; then  # never part of all: cuBLASLt's algorithms at the 8B GEMMs (32 and 128 rows)
  lib=$(python3 -c "import glob, nvidia, os; print(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], '*', 'lib', 'libcublasLt.so*')))[0])")
  mkdir -p /tmp/cublaslt && ln -sf "$lib" /tmp/cublaslt/libcublasLt.so && ln -sf "$(dirname "$lib")"/libcublas.so.* /tmp/cublaslt/libcublas.so
  nvcc -O2 -std=c++17 -arch=sm_90a benchmarks/cublaslt_search.cu -L/tmp/cublaslt -lcublasLt -lcublas -o /tmp/cublaslt/search \
    && LD_LIBRARY_PATH=$(dirname "$lib"):${LD_LIBRARY_PATH:-} timeout 330 /tmp/cublaslt/search "$OUT/cublaslt_search_h200.csv" 128 32 \
    | tee "$OUT/cublaslt_search.log"
fi
if [[ $parts == *" multigpu "* ]]; then
  nvidia-smi topo -m | tee "$OUT/multi_gpu_topology.txt" | head -5
  timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_multi_gpu.py 2>&1 \
    | tee "$OUT/multi_gpu_tests.log" | tail -30
  PYTHONHASHSEED=0 timeout 120 torchrun --standalone --nproc_per_node 2 examples/serve_tp.py 2>&1 \
    | grep -v -i warn | tee "$OUT/serve_tp_gpu.log" | tail -7
  if [[ ${TP_BENCH:-1} == 1 ]]; then
    PYTHONHASHSEED=0 timeout 300 torchrun --standalone --nproc_per_node 2 benchmarks/bench_tp.py \
      --model ${TP_MODEL:-8b} ${TP_ARGS:-} --out "$OUT" 2>&1 | grep -v -i warn | tee "$OUT/bench_tp.log" | tail -14
  fi
fi
if [[ $parts == *" devicemap "* ]]; then  # two-GPU machine only: accelerate's device_map, PEFT vs fastlora
  timeout 400 python3 benchmarks/bench_device_map.py --model ${DM_MODEL:-8b} --out "$OUT" 2>&1 | grep -v -i warn \
    | tee "$OUT/bench_device_map.log" | tail -8
fi
