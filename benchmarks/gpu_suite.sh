#!/usr/bin/env bash
# The GPU benchmark suite behind docs/benchmarks.md: kernel checks, throughput, latency, prefill and
# the multi-turn prefix-caching run. Name steps to run only those. OUTDIR ends up with three files:
# summary.txt (each step's exit code, time and last lines), gpu.txt, and suite.tgz (every log and
# JSON result).
#   bash benchmarks/gpu_suite.sh OUTDIR [STEP ...]
set -u
out=${1:-logs}
shift || true
steps=${*:-smoke kernel_tests graph_tests kernel_check throughput_qwen3 latency_qwen3 latency_llama8b prefill_llama8b multi_turn_qwen3}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
qwen=benchmarks/qwen3-0.6b
llama=benchmarks/llama-3.1-8b
step() {  # the command of one step, and its time limit in seconds
  case $1 in
    smoke) echo 60 python3 -m ferry generate "'def fibonacci(n):'" --device cuda --dtype bfloat16 --max-tokens 48 ;;
    kernel_tests) echo 120 python3 -m pytest -q -x tests/test_triton_kernels.py ;;
    graph_tests) echo 300 python3 -m pytest -q -rs tests/test_cuda_graph.py ;;
    kernel_check) echo 180 python3 -m ferry.bench.kernel_check ;;
    throughput_qwen3) echo 150 python3 -m ferry.bench.throughput --config-dir $qwen --dtype bfloat16 --device cuda \
      --num-prompts 256 --input-len 100 1024 --output-len 512 --seed 0 --json "$out/tp_qwen3.json" ;;
    latency_qwen3) echo 150 python3 -m ferry.bench.latency --config-dir $qwen --dtype bfloat16 --device cuda \
      --input-len 512 --output-len 256 --no-enforce-eager --json "$out/lat_qwen3.json" ;;
    latency_llama8b) echo 240 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
      --input-len 512 --output-len 256 --max-model-len 16384 --no-enforce-eager --json "$out/lat_llama8b.json" ;;
    prefill_llama8b) echo 60 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
      --input-len 8192 --output-len 1 --max-model-len 16384 --num-iters-warmup 2 --num-iters 5 \
      --json "$out/prefill_llama8b.json" ;;
    multi_turn_qwen3) echo 120 python3 -m ferry.bench.multi_turn --model $qwen --load-format dummy \
      --dtype bfloat16 --device cuda --turns 100 --user-tokens 20 60 --output-tokens 16 ;;
    *) echo "unknown step $1" >&2; return 1 ;;
  esac
}
for name in $steps; do
  read -r limit cmd <<< "$(step "$name")" || continue
  start=$SECONDS
  eval timeout "$limit" "$cmd" > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log" >> "$out/summary.txt"
done
(cd "$out" && tar -czf suite.tgz --remove-files -- *.log *.json 2>/dev/null)
ls "$out"
