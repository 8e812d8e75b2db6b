#!/usr/bin/env bash
# The GPU benchmark suite behind docs/benchmarks.md: kernel checks, throughput, latency, prefill,
# server start-up, the HTTP request-rate sweep and the multi-turn prefix-caching run, with the
# Hugging Face baselines beside them. Name steps to run only those, in the order given.
#   bash benchmarks/gpu_suite.sh OUTDIR [STEP ...]
# OUTDIR ends up with three files, rewritten after every step so that a run cut short keeps what
# it measured: summary.txt (each step's exit code, time and last lines), gpu.txt, and suite.tgz
# (every log and JSON result). SUITE_BUDGET (seconds, default 570) caps the whole run: a step
# gets what is left of it when that is less than its own limit, and is skipped when under 20 s.
# HF_BASELINES names the folder of the baseline scripts (hf_static.py, hf_cb.py). FERRY_ARGS is added
# to every ferry engine command; a step named NAME+sync runs NAME with --no-async-scheduling added
# (asynchronous scheduling is the default on CUDA), so that `throughput_qwen3 throughput_qwen3+sync`
# compares the two in one run; NAME+nopdl runs it with FERRY_PDL=0 (kernels launched one after
# another, without programmatic dependent launch); NAME+fp8 adds --quantization fp8 and NAME+fp8kv
# --kv-cache-dtype fp8 (both: NAME+fp8+fp8kv), so that `latency_llama8b latency_llama8b+fp8` is
# the FP8 comparison, side by side.
set -u
out=${1:-logs}
shift || true
steps=${*:-smoke kernel_tests graph_tests kernel_check throughput_qwen3 latency_qwen3 latency_llama8b prefill_llama8b multi_turn_qwen3}
budget=${SUITE_BUDGET:-570}
baselines=${HF_BASELINES:-../shared/device/baselines}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
qwen=benchmarks/qwen3-0.6b
llama=benchmarks/llama-3.1-8b
ferry_args=${FERRY_ARGS:-}
# The request-rate sweep: the same fixed-length requests through HTTP and offline.
sweep_prompts=512 sweep_in=512 sweep_out=256 sweep_rates=16,32,64,128,inf

# Start `ferry serve` with the given arguments on port 8000 and print the seconds until /health
# answers 200 (start-up: model load, KV cache, graph capture); fail after $1 seconds.
serve_ready() {
  local limit=$1; shift
  local start=$(date +%s.%N)
  python3 -m ferry serve --port 8000 --no-access-log "$@" > "$logs/$name.serve.log" 2>&1 &
  server=$!
  python3 - "$start" "$limit" $server <<'PY' || return 1
import os, sys, time, urllib.request
start, limit, pid = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
while True:
    try:
        urllib.request.urlopen("http://localhost:8000/health", timeout=1)
        break
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("ferry serve exited")
    if time.time() - start > limit:
        sys.exit(f"not ready in {limit} s")
    time.sleep(0.2)
print(f"ferry serve ready in {time.time() - start:.1f} s")
PY
  echo "  (ferry serve $*)"
}
serve_stop() { kill -TERM $server 2>/dev/null; wait $server; }

serve_startup() {  # start to ready, then one request, as a user would check it
  serve_ready 120 --model $llama --load-format dummy --dtype bfloat16 --device cuda --max-model-len 16384 \
    --no-enforce-eager || return 1
  python3 -c 'import json, urllib.request as u; print(u.urlopen(u.Request("http://localhost:8000/v1/completions",
    json.dumps({"prompt": [1, 2, 3, 4], "max_tokens": 8, "ignore_eos": True}).encode(),
    {"Content-Type": "application/json"})).read().decode())'
  serve_stop
  grep -i "captured\|startup\|loaded\|kv cache" "$logs/$name.serve.log"
}

# Offline first (the server would hold the memory), then HTTP at each rate. Every rate sends the same
# prompts, so both sides run without prefix caching: else every rate after the first would find its
# prompts cached, and HTTP would skip the prefill that the offline run computes.
serve_sweep() {
  python3 -m ferry.bench.throughput --config-dir $qwen --dtype bfloat16 --device cuda --no-enforce-eager $fa \
    --no-enable-prefix-caching --num-prompts $sweep_prompts --input-len $sweep_in --output-len $sweep_out \
    --json "$logs/$name.offline.json" || return 1
  serve_ready 90 --model $qwen --load-format dummy --dtype bfloat16 --device cuda --no-enforce-eager $fa \
    --no-enable-prefix-caching --max-num-seqs 256 || return 1
  # Greedy, as the offline run samples by default: the same requests on both sides.
  python3 -m ferry bench serve --base-url http://localhost:8000 --prompt-token-ids --ignore-eos --disable-tqdm \
    --extra-body '{"temperature": 0}' \
    --num-prompts $sweep_prompts --random-input-len $sweep_in --random-output-len $sweep_out --random-range-ratio 0 \
    --num-warmups 8 --request-rate-sweep $sweep_rates --save-result "$logs/$name.http.json"
  local rc=$?
  python3 -c 'import urllib.request as u; print(u.urlopen("http://localhost:8000/metrics").read().decode())' \
    > "$logs/$name.metrics.txt"
  serve_stop
  return $rc
}

step() {  # the time limit in seconds of one step, and its command
  case $1 in
    smoke) echo 60 python3 -m ferry generate "'def fibonacci(n):'" --device cuda --dtype bfloat16 --max-tokens 48 ;;
    kernel_tests) echo 300 python3 -m pytest -q -x tests/test_triton_kernels.py ;;
    graph_tests) echo 200 python3 -m pytest -q -rs tests/test_cuda_graph.py ;;
    kernel_check) echo 180 python3 -m ferry.bench.kernel_check ;;
    gemv_tests) echo 200 python3 -m pytest -q -x tests/test_gemv.py tests/test_fused_ops.py ;;
    gemv_paths) echo 150 python3 -m ferry.bench.gemv ;;
    profile_qwen3) echo 60 python3 -m ferry.bench.step_profile --config-dir $qwen --dtype bfloat16 --device cuda \
      --top 16 $fa ;;
    profile_llama8b) echo 90 python3 -m ferry.bench.step_profile --config-dir $llama --dtype bfloat16 --device cuda \
      --max-model-len 16384 --top 16 $fa ;;
    throughput_qwen3) echo 150 python3 -m ferry.bench.throughput --config-dir $qwen --dtype bfloat16 --device cuda \
      --no-enforce-eager $fa --num-prompts 256 --input-len 100 1024 --output-len 512 --seed 0 --json "$logs/$name.json" ;;
    throughput_nanovllm) echo 150 python3 -m ferry.bench.throughput --config-dir $qwen --dtype bfloat16 --device cuda \
      --no-enforce-eager $fa --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --seed 0 \
      --phases --json "$logs/$name.json" ;;
    latency_qwen3) echo 150 python3 -m ferry.bench.latency --config-dir $qwen --dtype bfloat16 --device cuda \
      --input-len 512 --output-len 256 --no-enforce-eager $fa --json "$logs/$name.json" ;;
    latency_llama8b) echo 240 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
      --input-len 512 --output-len 256 --max-model-len 16384 --no-enforce-eager $fa --json "$logs/$name.json" ;;
    prefill_llama8b) echo 90 python3 -m ferry.bench.latency --config-dir $llama --dtype bfloat16 --device cuda \
      --input-len 8192 --output-len 1 --max-model-len 16384 --num-iters-warmup 2 --num-iters 5 \
      --phases --json "$logs/$name.json" ;;
    verify_llama8b) echo 120 python3 -m ferry.bench.verify_step --config-dir $llama --dtype bfloat16 \
      --batch-sizes 1 8 32 --contexts 512 4096 --no-check ;;
    verify_check_llama8b) echo 120 python3 -m ferry.bench.verify_step --config-dir $llama --dtype float32 \
      --batch-sizes 4 --no-timing --num-kv-blocks 4096 ;;
    multi_token_tests) echo 200 python3 -m pytest -q -x tests/test_multi_token_rows.py ;;
    # Speculative decoding: the draft's graphs on CUDA, the oracle on Llama-3.1-8B's shape (acceptance
    # 0.7, k = 4), the bundled model with its draft and with prompt lookup.
    spec_tests) echo 200 python3 -m pytest -q -x tests/test_speculative.py -k "'graphs or bundled'" ;;
    spec_llama8b) echo 300 python3 -m ferry.bench.spec_decode --config-dir $llama --dtype bfloat16 --acceptance 0.7 \
      -k 4 --batch-sizes 1 8 32 128 --input-len 256 --output-len 512 --max-model-len 4096 --phases --json "$logs/$name.json" ;;
    spec_bundled) echo 150 python3 -m ferry.bench.spec_decode --prompts code --dtype bfloat16 --batch-sizes 1 32 \
      --output-len 256 --speculative-config "'{\"model\": \"ferry-default-draft\", \"num_speculative_tokens\": 3}'" \
      --phases --json "$logs/$name.json" ;;
    spec_bundled_confident) echo 150 python3 -m ferry.bench.spec_decode --prompts code --dtype bfloat16 --batch-sizes 1 32 \
      --output-len 256 --speculative-config "'{\"model\": \"ferry-default-draft\", \"num_speculative_tokens\": 8, \"draft_confidence_threshold\": 0.6}'" \
      --phases --json "$logs/$name.json" ;;
    spec_bundled_ngram) echo 120 python3 -m ferry.bench.spec_decode --prompts code --dtype bfloat16 --batch-sizes 1 32 \
      --output-len 256 --speculative-config "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'" \
      --phases --json "$logs/$name.json" ;;
    fp8_tests) echo 240 python3 -m pytest -q tests/test_fp8_kernels.py tests/test_gemv.py tests/test_triton_kernels.py \
      -k "'fp8 or FP8'" ;;
    # TensorRT-LLM's perf-overview shapes for Llama-3.1-8B (its FP8 figures: 27,911 and 17,744 tok/s).
    throughput_llama8b_128) echo 150 python3 -m ferry.bench.throughput --config-dir $llama --dtype bfloat16 \
      --device cuda --no-enforce-eager --max-model-len 4096 --seed 0 $fa --num-prompts 3000 --input-len 128 \
      --output-len 128 --json "$logs/$name.json" ;;
    throughput_llama8b_1000) echo 300 python3 -m ferry.bench.throughput --config-dir $llama --dtype bfloat16 \
      --device cuda --no-enforce-eager --max-model-len 4096 --seed 0 $fa --num-prompts 1000 --input-len 1000 \
      --output-len 1000 --json "$logs/$name.json" ;;
    multi_turn_qwen3) echo 120 python3 -m ferry.bench.multi_turn --model $qwen --load-format dummy \
      --dtype bfloat16 --device cuda --turns 100 --user-tokens 20 60 --output-tokens 16 ;;
    serve_startup_llama8b) echo 150 serve_startup ;;
    serve_sweep_qwen3) echo 300 serve_sweep ;;
    hf_static) echo 360 python3 "$baselines/hf_static.py" ;;
    hf_static_qwen3) echo 240 python3 "$baselines/hf_static.py" qwen ;;
    hf_static_llama8b) echo 240 python3 "$baselines/hf_static.py" llama ;;
    hf_cb) echo 300 python3 "$baselines/hf_cb.py" ;;
    *) echo "unknown step $1" >&2; return 1 ;;
  esac
}
caller_pdl=${FERRY_PDL-}
for name in $steps; do
  fa=$ferry_args
  [ "${name%+sync}" != "$name" ] && fa="$fa --no-async-scheduling"
  case $name in *+fp8kv*) fa="$fa --kv-cache-dtype fp8" ;; esac
  case $name in *+fp8+*|*+fp8) fa="$fa --quantization fp8" ;; esac
  if [ "${name%+nopdl}" != "$name" ]; then export FERRY_PDL=0; else export FERRY_PDL=$caller_pdl; fi
  base=${name%%+*}
  read -r limit cmd <<< "$(step "$base")" || continue
  left=$((budget - SECONDS))
  if [ $left -lt 20 ]; then
    echo "== $name: skipped, $left s of the budget left" | tee -a "$out/summary.txt"
    continue
  fi
  [ $left -lt "$limit" ] && limit=$left
  start=$SECONDS
  if declare -F "${cmd%% *}" > /dev/null; then  # a shell function: time it in a subshell
    ( eval "$cmd" ) > "$logs/$name.log" 2>&1 &
    pid=$!
    ( sleep "$limit"; pkill -TERM -P $pid; kill -TERM $pid ) 2>/dev/null &
    watchdog=$!
    wait $pid
    rc=$?
    kill $watchdog 2>/dev/null
  else
    eval timeout "$limit" "$cmd" > "$logs/$name.log" 2>&1
    rc=$?
  fi
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  tail -n 25 "$logs/$name.log" >> "$out/summary.txt"
  (cd "$logs" && tar -czf "$out/suite.tgz" -- *)
done
ls "$out"
