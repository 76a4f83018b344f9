#!/usr/bin/env bash
# Long-context recipe for 2 CPU cores in about 30 minutes (docs/LONG_CONTEXT.md).
#
# Trains the same small model twice on the passkey training mix (dataset/sample/passkey_train.jsonl:
# passkey documents of ~100-400 tokens and key drills) at --max_seq_len 512: with ANN attention
# (out/long_ann) and, as the control, with dense attention (out/long_dense). Both runs go side by
# side, one thread each, for TRAIN_MINUTES; then scripts/eval_passkey.py tests both at
# EVAL_LENGTHS, far beyond the trained length.
#
#   bash scripts/train_long_context.sh                          # the full recipe (~30 min + evaluation)
#   TRAIN_MINUTES=1 STEPS=60 EVAL_LENGTHS="256 1024" bash scripts/train_long_context.sh   # smoke run
#
# Settings (environment): TRAIN_MINUTES (26), STEPS (1700: the cosine schedule's length; the
# minutes stop training first if the machine is slower), EVAL_LENGTHS ("512 4096 16384"),
# EVAL_TRIALS (5 depths per length), OUT (out), PARALLEL (1; 0 trains one model after the other).
set -euo pipefail
cd "$(dirname "$0")/.."

TRAIN_MINUTES=${TRAIN_MINUTES:-26}
STEPS=${STEPS:-1700}
EVAL_LENGTHS=${EVAL_LENGTHS:-"512 4096 16384"}
EVAL_TRIALS=${EVAL_TRIALS:-5}
OUT=${OUT:-out}
PARALLEL=${PARALLEL:-1}
DATA=dataset/sample/passkey_train.jsonl

[ -f "$DATA" ] || python scripts/make_sample_data.py --out_dir dataset/sample --passkey_training_docs 40000
mkdir -p "$OUT"

train() {  # $1: ann | dense. Everything but the attention is identical in the two runs.
    # One thread per run: two small runs side by side use 2 cores better than one run on both.
    # Smeared keys and RoPE base 1e4: see docs/LONG_CONTEXT.md (copying forms within the budget).
    OMP_NUM_THREADS=1 python trainer/train_pretrain.py --attn "$1" --data_path "$DATA" --out_dir "$OUT/long_$1" \
        --preset tiny --hidden_size 128 --num_hidden_layers 4 --rope_theta 10000 --key_shift 1 \
        --max_seq_len 512 --batch_size 8 --accumulation_steps 1 --learning_rate 1e-2 --warmup_steps 30 \
        --max_steps "$STEPS" --max_minutes "$TRAIN_MINUTES" --log_interval 25 --save_interval 300 \
        > "$OUT/long_$1.log" 2>&1 || { echo "training $1 failed, see $OUT/long_$1.log" >&2; return 1; }
    echo "trained $OUT/long_$1, last metrics: $(tail -n 1 "$OUT/long_$1/metrics.jsonl")"
}

echo "training ANN and dense models for $TRAIN_MINUTES minutes each"
if [ "$PARALLEL" = 1 ]; then
    train ann & ann_job=$!
    train dense & dense_job=$!
    failed=0
    wait "$ann_job" || failed=1
    wait "$dense_job" || failed=1
    [ "$failed" = 0 ] || exit 1
else
    train ann
    train dense
fi

for attn in ann dense; do
    echo "== passkey retrieval, $attn attention =="
    # shellcheck disable=SC2086  # EVAL_LENGTHS is a list of words
    python scripts/eval_passkey.py --load "$OUT/long_$attn/model" --lengths $EVAL_LENGTHS \
        --trials "$EVAL_TRIALS" --threads 1 --json "$OUT/long_$attn/passkey.json"
done
