#!/usr/bin/env bash
# Everything that needs the GPU, in one command: GPU tests, soaks, benchmarks. Results land in $OUT
# (default benchmarks/results) under the names benchmarks/results/README.md maps the published
# numbers to, with the GPU's short name (h200, h100) in each.
#
#   bash benchmarks/run_gpu_suite.sh                    # all the single-GPU parts
#   bash benchmarks/run_gpu_suite.sh generate prefill   # some of them
#
# Parts of "all": tests soak kernels attention gemm generate coverage peft prefill continuous serving
# many profile resources. Never part of "all": serving-soak (minutes of load through the endpoint, memory
# watched), kinds (DoRA and lora_bias against plain adapters), moe (LoRA on routed experts), qlora (bitsandbytes bases; needs its
# wheel), ab (bench_ab.py: AB_OLD's tree against this one), tma (bench_gemm.py at 65-128 rows rewrites the TMA
# kernel's tile table in the tree), ncu (Nsight Compute over one graphed 8B step, a kernel a line),
# and, on a two-GPU machine, multigpu (tests, serve_tp, bench_tp: TP_MODEL, TP_ARGS) and devicemap.
set -uo pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off in every process (torchrun's ranks inherit it)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# transformers 5.25's from_pretrained fetches hub kernels by default; a GPU machine without the hub
# fails there (the quantized GPU tests load their models so)
export USE_HUB_KERNELS=${USE_HUB_KERNELS:-0}
parts=" ${*:-all} "
want() { [[ $parts == *" all "* || $parts == *" $1 "* ]]; }
only() { [[ $parts == *" $1 "* ]]; }
quiet() { grep -v -i warn; }
TAG=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]\d{2,3}\b', n); print((m.group(0) if m else n.split()[-1]).lower())")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_$TAG.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu_$TAG.txt"

if want tests; then
  files=${GPU_TESTS:-$(ls tests/*/*_gpu.py)}
  timeout ${TESTS_LIMIT:-480} python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -o faulthandler_timeout=${TEST_STALL_S:-120} $files 2>&1 | tee "$OUT/gpu_tests_$TAG.log" | tail -30
  timeout 120 python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart_$TAG.log" | tail -12
fi
if want soak; then
  # the 8B mix (up to 300 rows of 600-token prompts beside the graphs' cache) fits a 141 GB card, not an 80 GB one
  big_rows=${SOAK_BIG_ROWS:-$(python3 -c "import torch; print(300 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 128)")}
  for m in ${SOAK_MODELS:-tiny-llama tiny-qwen2 8b}; do
    if [[ $m == 8b || $m == 1b ]]; then args="--calls ${SOAK_BIG_CALLS:-50} --max-rows $big_rows --time-limit ${SOAK_LIMIT:-200}"
    else args="--calls ${SOAK_CALLS:-300} --compare-peft --time-limit ${SOAK_LIMIT:-200}"; fi
    timeout 450 python3 benchmarks/soak_graphs.py --model $m $args --out "$OUT" 2>&1 | quiet \
      | tee "$OUT/soak_${m}_$TAG.log" | tail -3
  done
  # every call in the 65-128-row range (the TMA GEMMs and the one-launch gate/up)
  timeout 450 python3 benchmarks/soak_graphs.py --model 8b --calls 75 --min-rows 65 --max-rows 128 \
    --time-limit ${SOAK_LIMIT:-200} --tag 65_128 --out "$OUT" 2>&1 | quiet | tee "$OUT/soak_8b_65_128_$TAG.log" | tail -3
fi
if want kernels; then
  timeout 240 python3 benchmarks/bench_kernels.py --out "$OUT" 2>&1 | tee "$OUT/kernels_$TAG.log" | tail -40
fi
if want attention; then
  timeout 200 python3 benchmarks/bench_attention.py --out "$OUT" 2>&1 | tee "$OUT/attention_$TAG.log" | tail -30
fi
if want gemm; then
  timeout 300 python3 benchmarks/bench_gemm.py --batches 1 16 32 64 --out "$OUT" 2>&1 | quiet | tail -24
fi
if want generate; then  # the graphed step and its like-for-like base
  timeout 420 python3 benchmarks/bench_generate.py --models ${MODELS:-8b 1b} --graphs-only --out "$OUT" 2>&1 \
    | quiet | tee "$OUT/generate_$TAG.log" | tail -20
fi
if want coverage; then  # other architectures: sliding windows, soft-capping
  timeout 300 python3 benchmarks/bench_generate.py --name coverage --models mistral7b gemma2-9b --graphs-only \
    --batches 32 --new-tokens 64 --out "$OUT" 2>&1 | quiet | tee "$OUT/coverage_$TAG.log" | tail -8
fi
if want peft; then  # every method: PEFT's mixed batch, HF's eager base model, fastlora eager and graphed
  timeout 560 python3 benchmarks/bench_generate.py --models 8b 1b --csv generate_with_peft_$TAG.csv --out "$OUT" 2>&1 \
    | quiet | tee "$OUT/generate_with_peft_$TAG.log" | tail -45
fi
if want prefill; then
  timeout 300 python3 benchmarks/bench_prefill.py --model ${PREFILL_MODEL:-8b} --glu-expand --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/prefill_$TAG.log" | tail -6
fi
if want continuous; then  # the host's part of a step first (seconds), on this machine's CPU and CUDA
  timeout 120 python3 benchmarks/bench_host_step.py --out "$OUT" 2>&1 | quiet | tail -2
fi
if want continuous; then  # profiled first (its profile files stay), then the throughput run (the profiler slows the engine)
  for profile in "--profile 3" ""; do
    timeout ${CB_LIMIT:-1200} python3 benchmarks/bench_continuous.py --model ${CB_MODEL:-8b} --requests ${CB_REQUESTS:-2000} \
      --modes ${CB_MODES:-base_patched_paged fastlora_paged base_patched_varlen fastlora_varlen} --async-batching on \
      $profile --out "$OUT" 2>&1 | quiet \
      | tee "$OUT/continuous${profile:+_profiled}_$TAG.log" | tail -8
  done
fi
if want serving; then  # the OpenAI endpoint at Poisson arrival rates, patched base beside the adapters, and
  # the clients alone against a stub endpoint at the same rates (their own lateness and latency)
  timeout ${SERVE_LIMIT:-1500} python3 benchmarks/bench_serving.py --model ${SERVE_MODEL:-8b} --adapters 32 \
    --modes stub base_patched fastlora --rates ${SERVE_RATES:-4 8 16 32} --duration ${SERVE_DURATION:-60} --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/serving_$TAG.log" | tail -12
fi
if [[ $parts == *" serving-soak "* ]]; then  # zero failed requests, memory flat (under ten minutes in all)
  timeout ${SOAK_SERVE_LIMIT:-570} python3 benchmarks/bench_serving.py --model ${SERVE_MODEL:-8b} --adapters 32 \
    --modes fastlora --rates ${SERVE_SOAK_RATE:-4} --soak ${SERVE_SOAK:-120} --drain ${SERVE_DRAIN:-100} --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/serving_soak_$TAG.log" | tail -6
fi
if want many; then
  timeout 400 python3 benchmarks/bench_many_adapters.py --model ${MANY_MODEL:-8b} --adapters ${MANY_ADAPTERS:-512} \
    --slots ${MANY_SLOTS:-64} --out "$OUT" 2>&1 | quiet | tee "$OUT/many_adapters_$TAG.log" | tail -6
fi
if want profile; then  # where the step's time goes, kernel by kernel
  timeout 300 python3 benchmarks/profile_step.py --model 8b --batches 1 32 128 --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/profile_step_$TAG.log" | tail -6
fi
if want resources; then  # what the JIT built for an 8B step's kernels (the CPU table's check: kernel_resources.py)
  timeout 300 python3 benchmarks/kernel_resources.py --jit --out "$OUT/kernel_resources_8b_jit_$TAG.csv" 2>&1 \
    | quiet | tee "$OUT/kernel_resources_jit_$TAG.log" | tail -4
fi
if only tma; then  # the TMA kernel's tile table: measured, written into the tree, then the 8B step with it
  timeout ${TMA_LIMIT:-300} python3 benchmarks/bench_gemm.py --batches 80 128 --fold-rows 0 128 --glu --tag tma \
    --table peft_fastlora/base_ops/tma_tiles_h200.json --out "$OUT" 2>&1 | quiet | tail -24
  cp peft_fastlora/base_ops/tma_tiles_h200.json "$OUT/"
  timeout 200 python3 benchmarks/bench_generate.py --models 8b --graphs-only --batches 128 \
    --tag tma --out "$OUT" 2>&1 | quiet | tail -6
fi
if only moe; then  # LoRA on routed experts: Qwen3-30B-A3B's widths on fewer layers, Mixtral-8x7B's on four
  timeout ${MOE_LIMIT:-300} python3 benchmarks/bench_moe.py --model qwen3-30b-a3b --layers ${MOE_LAYERS:-12} --batch 32 \
    --new-tokens 24 --out "$OUT" 2>&1 | quiet | tee "$OUT/moe_qwen3-30b-a3b_$TAG.log" | tail -7
  timeout ${MOE_LIMIT:-300} python3 benchmarks/bench_moe.py --model mixtral-8x7b --layers 4 --batch 32 \
    --new-tokens 24 --out "$OUT" 2>&1 | quiet | tee "$OUT/moe_mixtral-8x7b_$TAG.log" | tail -7
fi
if only kinds; then  # DoRA and lora_bias adapters against plain ones, the same rows (8B, graphs)
  timeout ${KINDS_LIMIT:-500} python3 benchmarks/bench_generate.py --name kinds --models 8b --graphs-only --batches ${KINDS_BATCHES:-32} \
    --kinds lora_bias dora --kind-rounds ${KIND_ROUNDS:-2} --out "$OUT" 2>&1 | quiet | tee "$OUT/kinds_$TAG.log" | tail -8
fi
if only qlora; then  # bitsandbytes bases (bitsandbytes' wheel carried): patched base, PEFT and fastlora over each
  for q in ${QLORA_QUANTS:-nf4 int8t0 int8}; do  # int8t0: no outlier threshold (graphs); int8: the default (eager)
    timeout ${QLORA_LIMIT:-400} python3 benchmarks/bench_generate.py --name qlora --tag $q --quant $q --models 8b \
      --batches ${QLORA_BATCHES:-32} --out "$OUT" 2>&1 | quiet | tee "$OUT/qlora_${q}_$TAG.log" | tail -10
  done
fi
if only ab; then  # the graphed step of another tree (AB_OLD: a folder with its peft_fastlora) against this one
  timeout ${AB_LIMIT:-560} python3 benchmarks/bench_ab.py --old "${AB_OLD:?a folder with the old peft_fastlora}" \
    --new . --model ${AB_MODEL:-8b} --rounds ${AB_ROUNDS:-1} --out "$OUT" 2>&1 | quiet | tee "$OUT/ab_$TAG.log" | tail -10
fi
if only ncu; then  # per-kernel DRAM and L2 counters of one decode step
  for b in ${NCU_BATCHES:-32 128}; do for m in base mixed; do
    timeout 200 ncu --profile-from-start off --graph-profiling node --clock-control none --csv --page raw \
      --metrics "$(python3 benchmarks/profile_step.py --print-metrics)" --log-file "$OUT/ncu_step_${m}_b${b}_$TAG.csv" \
      python3 benchmarks/profile_step.py --view ncu --methods $m --batches $b --layers 4 > "$OUT/ncu_step_${m}_b$b.out" 2>&1
    python3 benchmarks/profile_step.py --summarize "$OUT/ncu_step_${m}_b${b}_$TAG.csv" | head -16
  done; done
fi
if only multigpu; then
  nvidia-smi topo -m | head -5
  timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider tests/e2e/test_multi_gpu.py 2>&1 \
    | tee "$OUT/gpu_tests_multi_gpu_$TAG.log" | tail -30
  PYTHONHASHSEED=0 timeout 120 torchrun --standalone --nproc_per_node 2 examples/serve_tp.py 2>&1 \
    | quiet | tee "$OUT/serve_tp_$TAG.log" | tail -7
  PYTHONHASHSEED=0 timeout 300 torchrun --standalone --nproc_per_node 2 benchmarks/bench_tp.py \
    --model ${TP_MODEL:-8b} ${TP_ARGS:-} --out "$OUT" 2>&1 | quiet | tee "$OUT/tp_${TP_MODEL:-8b}_$TAG.log" | tail -14
fi
if only devicemap; then  # accelerate's device_map over every visible GPU, PEFT vs fastlora
  timeout 400 python3 benchmarks/bench_device_map.py --model ${DM_MODEL:-8b} --out "$OUT" 2>&1 | quiet \
    | tee "$OUT/device_map_$TAG.log" | tail -8
fi
