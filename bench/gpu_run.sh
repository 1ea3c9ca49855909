#!/usr/bin/env bash
# The whole H200 measurement in one go (bench/gpu.md): run from the repo root with PYTHONPATH set to
# the installed wheels and this tree; OUT names a folder for the logs (default ./gpu-out).
# STEPS picks steps (default: test engine turns cvec; also: probe, spec, cache, transfer, and the
# same-call A/Bs cacheab, cachereaders, cvecab, cvecvariants, turnsab, engineab, decodeprobe and decodepairs). spec needs the real
# SmolLM2 file in SMOLLM2 (bench/gpu.md: carried in two parts like the wheels).
# Every script's figures go as JSON lines (bench/harness.py) to $OUT/results.jsonl; BENCH_COMMIT names
# the code where the device copy has no git. Back here: the logs go to bench/results/raw/ as
# sN-runM-<log name>.txt with a line each in bench/results/README.md, the JSON lines onto
# bench/results/results.jsonl.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export BENCH_RESULTS=${BENCH_RESULTS:-$OUT/results.jsonl}
STEPS=${STEPS:-"test engine turns cvec"}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
  $py -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device(), "cuda", mx.cuda.is_available())'; } 2>&1 | tee "$OUT/env.txt"
for step in $STEPS; do
  case $step in
    test) timeout ${TEST_TIMEOUT:-240} $py -m pytest tests/engine/test_steering_kernels.py tests/engine/test_attention.py tests/engine/test_first_step_merge.py -q -p no:cacheprovider 2>&1 | tail -40 > "$OUT/cvec_test.txt" ;;
    spec) timeout ${SPEC_TIMEOUT:-200} $py bench/spec.py --model "${SMOLLM2:?set SMOLLM2 to the SmolLM2 GGUF}" --rounds ${SPEC_ROUNDS:-10} \
          --max-tokens ${SPEC_TOKENS:-192} > "$OUT/spec_smollm2.txt" 2>&1 ;;
    cache) timeout 150 $py bench/cache.py --session-only --random-shape llama1b --session-tokens 8192 --repeats ${CACHE_REPEATS:-5} \
          > "$OUT/cache_llama1b.txt" 2>&1 ;;
    engine) for s in llama1b smollm2; do
        timeout ${ENGINE_TIMEOUT:-150} $py bench/engine.py --random-shape $s --prompt-tokens 512 --gen 128 --rounds ${ROUNDS:-20} --no-llama \
          > "$OUT/engine_$s.txt" 2>&1; done ;;
    turns) timeout ${TURNS_TIMEOUT:-200} $py bench/turns.py --random-shape llama1b --rounds ${TURNS_ROUNDS:-10} > "$OUT/turns_llama1b.txt" 2>&1 ;;
    probe) timeout 60 $py bench/sdpa_probe.py > "$OUT/sdpa_probe.txt" 2>&1 ;;
    transfer) timeout ${TRANSFER_TIMEOUT:-150} $py bench/transfer_probe.py --mib 256 > "$OUT/transfer_probe.txt" 2>&1 ;;
    cacheab) # session files: saving over the last file (ext4 flushes the replaced data at the rename) and to new names
      for v in "" --fresh-names; do
        timeout ${CACHE_TIMEOUT:-150} $py bench/cache.py --session-only --random-shape llama1b --session-tokens 8192 \
          --repeats ${CACHE_REPEATS:-5} $v > "$OUT/cache_llama1b${v:+_fresh}.txt" 2>&1; done ;;
    engineab) # a prompt's last chunk merged with the first decode step (default) or prefilled apart
      for s in llama1b smollm2; do for m in "" --no-merge; do
        timeout ${ENGINE_TIMEOUT:-150} $py bench/trace_run.py --every 600 $m bench/engine.py --random-shape $s --prompt-tokens 512 \
          --gen 128 --rounds ${ROUNDS:-12} --no-llama > "$OUT/engine_${s}_merge${m:-on}.txt" 2>&1; done; done ;;
    cachereaders) # a GPU restore's reader threads: 4 (the default since session 6) and 2, alternating runs
      i=0; for v in "" "--gpu-readers 2" "" "--gpu-readers 2"; do i=$((i+1))
        timeout ${CACHE_TIMEOUT:-150} $py bench/cache.py --session-only --random-shape llama1b --session-tokens 8192 \
          --repeats ${CACHE_REPEATS:-10} --fresh-names $v > "$OUT/cache_r${i}${v:+_readers2}.txt" 2>&1; done ;;
    decodepairs) # raw mlx-lm and a whole request only, so each pair of runs is close in time
      for s in llama1b smollm2; do
        timeout ${PROBE_TIMEOUT:-150} $py bench/decode_probe.py --random-shape $s --rounds ${ROUNDS:-30} --paths raw,request \
          > "$OUT/decode_pairs_$s.txt" 2>&1; done ;;
    decodeprobe) for s in llama1b smollm2; do
        timeout ${PROBE_TIMEOUT:-150} $py bench/decode_probe.py --random-shape $s --rounds ${ROUNDS:-10} > "$OUT/decode_probe_$s.txt" 2>&1; done ;;
    cvecab) # the steering op: the shared kernel vs mx.compile'd MLX ops, same command
      for op in ${CVEC_OPS:-auto portable}; do
        timeout ${CVEC_TIMEOUT:-120} $py bench/cvec.py --random-shape ${CVEC_SHAPE:-smollm2} --repeat 8 --prompt-tokens 512 \
          --decode-tokens 128 --steps 60 --chunk 512 --chunks 8 --kernel-iters 100 --steering-op $op \
          > "$OUT/cvec_${CVEC_SHAPE:-smollm2}_$op.txt" 2>&1; done ;;
    cvecvariants) # the steering kernel against its floor (the block's plain residual add) and the registers variant
      for v in "auto" "residual-add" "auto --shader bench/kernels/cvec_registers.metal"; do set -- $v
        timeout ${CVEC_TIMEOUT:-120} $py bench/cvec.py --random-shape ${CVEC_SHAPE:-smollm2} --repeat 8 --prompt-tokens 512 \
          --decode-tokens 128 --steps 60 --chunk 512 --chunks 8 --kernel-iters 100 --steering-op $v \
          > "$OUT/cvec_${CVEC_SHAPE:-smollm2}_$1${2:+_registers}.txt" 2>&1; done ;;
    turnsab) # a returning turn's first-step merge on/off, same command
      for m in "" --no-merge; do
        timeout ${TURNS_TIMEOUT:-200} $py bench/trace_run.py --every 600 $m bench/turns.py --random-shape llama1b \
          --rounds ${TURNS_ROUNDS:-8} > "$OUT/turns_merge${m:-on}.txt" 2>&1; done ;;
    cvec) for s in smollm2 llama1b; do
        timeout 90 $py bench/cvec.py --random-shape $s --repeat 8 --prompt-tokens 512 --decode-tokens 128 \
          --steps 60 --chunk 512 --chunks 8 --kernel-iters 100 > "$OUT/cvec_$s.txt" 2>&1; done ;;
  esac
  echo "step $step done $(date -u +%T)" | tee -a "$OUT/env.txt"
done
