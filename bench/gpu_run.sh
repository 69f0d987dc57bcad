#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): runs the stages named as arguments, each under
# its own time limit; each stage's log goes to /tmp/gpu_logs (its last $TAIL lines are printed) and all
# logs are packed into $OUT/logs.tgz at the end.
#   bash bench/gpu_run.sh info tests attn-quick decode      # first call: correctness, then a quick grid
#   bash bench/gpu_run.sh attn-medium; then attn-rest      # the whole grid in two calls (the full `attn`
#                                                           # grid does not fit one 10-minute call)
# The GPU image has jax 0.11.2 (+ CUDA 13 plugin) preinstalled and no network: the pinned flax/optax/orbax
# travel as wheels in .whl/ (see the device README) and are put first on PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
LOG=/tmp/gpu_logs  # one archive back, not one file per stage: the device tool returns at most 8 files
mkdir -p "$LOG"
trap '[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$LOG" .' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi

source bench/stage.sh  # stage NAME LIMIT_S CMD...

for s in "$@"; do
  case $s in
    info) stage info 60 bash -c "nvidia-smi; $PY -c 'import jax, flax, optax, orbax.checkpoint as o; \
print(jax.__version__, flax.__version__, optax.__version__, jax.devices(), jax.devices()[0].core_count)'" ;;
    # the Triton-style kernels compiled (the TPU family's interpret-mode tests deselected); the XLA
    # reference (the oracle) at full float32 precision: XLA's GPU default multiplies float32 in TF32
    tests) JAX_DEFAULT_MATMUL_PRECISION=highest stage tests 240 $PY -m pytest -q -x -p no:cacheprovider \
             -k "not tpu" tests/test_pallas_attention.py tests/test_pallas_model.py ;;
    attn-quick) stage attn_quick 200 $PY bench/bench_attention.py --quick --reps 10 ;;
    attn) stage attn 560 $PY bench/bench_attention.py --reps 10 ;;
    attn-decode) stage attn_decode 400 $PY bench/bench_attention.py --only decode --reps 10 ;;
    attn-train) stage attn_train 400 $PY bench/bench_attention.py --only train --reps 5 ;;
    attn-medium) stage attn_medium 520 $PY bench/bench_attention.py --reps 5 --batches 1,8,32 --ks 16,32 \
                   --caches 8192,32768 --lengths 2048,4096,8192 ;;
    attn-rest) stage attn_rest 300 $PY bench/bench_attention.py --only decode --reps 5 --batches 1,8,32 --ks 16,32 \
                 --caches 4096,16384 ;;
    tune) stage tune 330 $PY bench/tune_decode.py ;;
    decode) for impl in xla pallas; do for b in 1 16; do
              stage "decode_${impl}_b$b" 120 $PY bench/bench_decode.py --hidden 2048 --layers 16 --heads 32 \
                --kv-heads 8 --vocab 32000 --intermediate 8192 --batch $b --prompt 512 --new 256 --dtype bfloat16 \
                --attention $impl --reps 3 --out "$LOG/decode_${impl}_b$b.md"
            done; done ;;
    # Llama-3.1-8B shapes, random bf16 weights, Pallas attention (what "auto" picks on a GPU)
    decode8b-b*) b=${s#decode8b-b}; stage "decode8b_b$b" 560 $PY bench/bench_decode.py --shape llama3-8b \
                   --dtype bfloat16 --attention pallas --batch "$b" --prompt 1024 --new 256 --tpf "${TPF:-4,8}" --reps 3 \
                   ${UNROLL:+--unroll $UNROLL} --out "$LOG/decode8b_b$b.md" ;;
    # LAYOUT=stacked|per-layer (the weights as training stacks them, or as decoders use them)
    profile8b) for u in ${UNROLLS:-1}; do stage "profile8b_${LAYOUT:-per-layer}_u$u" 300 $PY bench/profile_decode.py \
                 --shape llama3-8b --dtype bfloat16 --attention pallas --batch "${PB:-1}" --prompt 1024 --new 64 \
                 --tpf 4 --unroll "$u" --layout "${LAYOUT:-per-layer}" --top 30 --out-dir "/tmp/profile8b_u$u"; done ;;
    continuous8b) stage continuous8b 560 $PY bench/bench_continuous.py --shape llama3-8b --dtype bfloat16 \
                    --attention pallas --slots "${SLOTS:-16,64}" --rounds 1 --gamma 36.3 --pad-multiple 128 \
                    ${UNROLL:+--unroll $UNROLL} ;;
    # decode.py end to end on a random export (SHAPE, default llama3.2-1b): flags, bandwidth line, summary
    decodecli) stage make_export 200 $PY bench/make_random_export.py --shape "${SHAPE:-llama3.2-1b}" --dtype bfloat16 \
                 --out /tmp/rexport --prompts "${NP:-64}" \
               && stage decodecli 400 $PY decode.py --model /tmp/rexport --input /tmp/rexport/prompts.jsonl \
                 --output /tmp/rexport_out.jsonl --overwrite --max-new-tokens 256 --batch-size "${SLOTS:-16}" \
                 --gamma 36.3 --ignore-eos --compare-ar --dtype bfloat16 --pad-multiple 128 --no-progress \
                 --summary "$LOG/decodecli_summary.json" ;;
    # issue 22 point 7: decode.py on a random Llama-3.1-8B bf16 export at the memory plan's shapes (prompts of
    # 1024-2048 ids, max_new_tokens U[16, 512]), SBD (gamma 36.3: ~4 tokens per forward) and AR, SLOTS slots each
    decodecli8b) stage make_export8b 150 $PY bench/make_random_export.py --shape llama3-8b --dtype bfloat16 \
                   --out /tmp/rexport8b --prompts "${NP:-64}" --prompt-len 1024,2048 --max-new 16,512 \
                 && for n in ${SLOTS:-16 64}; do stage "decodecli8b_s$n" "${LIMIT:-220}" $PY decode.py \
                   --model /tmp/rexport8b --input /tmp/rexport8b/prompts.jsonl --output "/tmp/rexport8b_s$n.jsonl" \
                   --overwrite --max-new-tokens 512 --batch-size "$n" --gamma 36.3 --ignore-eos --compare-ar \
                   --dtype bfloat16 --pad-multiple 128 --no-progress --summary "$LOG/decodecli8b_s$n.json"; done ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
