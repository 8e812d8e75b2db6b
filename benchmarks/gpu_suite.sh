#!/usr/bin/env bash
# The GPU benchmark suite behind docs/benchmarks.md: kernel checks, throughput, latency, prefill and
# the multi-turn prefix-caching run, one after another. Logs go to the folder given (default: logs/).
#   bash benchmarks/gpu_suite.sh OUTDIR
set -u
out=${1:-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
run() {  # run NAME SECONDS CMD...: one step, its log, its wall time; a failure does not stop the rest
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 25 "$out/$name.log" >> "$out/summary.txt"
}
qwen=benchmarks/qwen3-0.6b
llama=benchmarks/llama-3.1-8b
run smoke 120 python3 -m ferry generate "def fibonacci(n):" --device cuda --dtype bfloat16 --max-tokens 48
run kernel_tests 240 python3 -m pytest -q -x tests/test_triton_kernels.py
run kernel_check 240 python3 -m ferry.bench.kernel_check
run throughput_qwen3 240 python3 -m ferry.bench.throughput --config-dir $qwen --dtype bfloat16 --device cuda \
  --num-prompts 256 --input-len 100 1024 --output-len 512 --seed 0 --json "$out/tp_qwen3.json"
run latency_qwen3 120 python3 -m ferry.bench.latency --config-dir $qwen --dtype bfloat16 --device cuda \
  --input-len 512 --output-len 256 --json "$out/lat_qwen3.json"
run latency_llama8b 180 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
  --input-len 512 --output-len 256 --max-model-len 16384 --json "$out/lat_llama8b.json"
run prefill_llama8b 180 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
  --input-len 8192 --output-len 1 --max-model-len 16384 --num-iters-warmup 2 --num-iters 5 --json "$out/prefill_llama8b.json"
run multi_turn_qwen3 240 python3 -m ferry.bench.multi_turn --model $qwen --load-format dummy --dtype bfloat16 \
  --device cuda --turns 100 --user-tokens 20 60 --output-tokens 16
