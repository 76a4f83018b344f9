#!/usr/bin/env bash
# Long context on real prose, for 2 CPU cores (docs/LONG_CONTEXT.md, "The prose recipe").
#
# Builds the prose data (scripts/make_prose_data.py: the last 10% of each text held out, the
# training mix of prose chunks and needle documents over training prose), trains one model with
# ANN attention (out/prose_ann) and, as the control, the same model with dense attention
# (out/prose_dense), each alone on every core, then evaluates both: needles in held-out prose
# (scripts/eval_needles.py) and held-out loss by position (scripts/eval_perplexity.py), and collects
# their results in $OUT/results (scripts/collect_long_context.py).
#
#   bash scripts/train_prose_long_context.sh                      # ANN model, then the dense control
#   ATTNS=ann SEED=2 bash scripts/train_prose_long_context.sh      # another seed of the ANN model
#   STEPS=20 SAFETY_MINUTES=5 EVAL_LENGTHS="1024 2048" EVAL_TRIALS=2 PPL_TOKENS=4096 OUT=/tmp/prose \
#       bash scripts/train_prose_long_context.sh                   # smoke run
#
# The run is defined by its steps and schedule: STEPS optimizer steps of a cosine schedule, the
# same on any machine (a slower one takes longer). SAFETY_MINUTES only guards against a runaway
# run; when it stops a model early the script says so, and that model is not the recipe's.
#
# Settings (environment): ATTNS ("ann dense"), SEED (1), STEPS (1500), WIDE_SHIFT_FROM (1050, 70% of STEPS:
# the step from which the two-token match trains), HIDDEN (128), LAYERS (4), WINDOW (16), TOP_N (4),
# BATCH (8), SEQ_LEN (512), LR (1e-2), SAFETY_MINUTES (180), THREADS (2), DATA_DIR
# (../shared/data), PROSE (dataset/prose), TOKENIZER (model/tokenizer_prose), EVAL_LENGTHS
# ("4096 16384 65536"), EVAL_TRIALS (5), PPL_TOKENS (131072), OUT (out).
set -euo pipefail
cd "$(dirname "$0")/.."

ATTNS=${ATTNS:-"ann dense"}
SEED=${SEED:-1}
STEPS=${STEPS:-1500}
WIDE_SHIFT_FROM=${WIDE_SHIFT_FROM:-$((STEPS * 7 / 10))}
HIDDEN=${HIDDEN:-128}
LAYERS=${LAYERS:-4}
WINDOW=${WINDOW:-16}
TOP_N=${TOP_N:-4}
BATCH=${BATCH:-8}
SEQ_LEN=${SEQ_LEN:-512}
LR=${LR:-1e-2}
SAFETY_MINUTES=${SAFETY_MINUTES:-180}
THREADS=${THREADS:-2}
DATA_DIR=${DATA_DIR:-../shared/data}
PROSE=${PROSE:-dataset/prose}
TOKENIZER=${TOKENIZER:-model/tokenizer_prose}
EVAL_LENGTHS=${EVAL_LENGTHS:-"4096 16384 65536"}
EVAL_TRIALS=${EVAL_TRIALS:-5}
PPL_TOKENS=${PPL_TOKENS:-131072}
OUT=${OUT:-out}
DATA=$PROSE/prose_train.jsonl

# The mix is (re)built when missing or older than the code that writes it.
stale() { for source in scripts/make_prose_data.py dataset/prose.py evaluation/needles.py "$TOKENIZER/tokenizer.json"; do
    [ "$DATA" -nt "$source" ] || return 0; done; return 1; }
if stale; then
    python scripts/make_prose_data.py --data_dir "$DATA_DIR" --out_dir "$PROSE" --tokenizer "$TOKENIZER" \
        --chunk_tokens $((SEQ_LEN - 24)) --needle_max_tokens $((SEQ_LEN - 64))
fi
mkdir -p "$OUT"

train() {  # $1: ann | dense. Everything but the attention is identical in the two runs.
    # What the passkey recipe learned (docs/LONG_CONTEXT.md): a small window so far copies go
    # through retrieved blocks, capped block positions and bounds summaries (the defaults), RoPE
    # base 1e4, keys smeared over one token and then two (from WIDE_SHIFT_FROM), HNSW efSearch 256.
    OMP_NUM_THREADS="$THREADS" python trainer/train_pretrain.py --attn "$1" --seed "$SEED" --data_path "$DATA" \
        --out_dir "$OUT/prose_$1" --tokenizer_path "$TOKENIZER" --preset tiny --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --rope_theta 10000 --ann_window "$WINDOW" --ann_top_n "$TOP_N" \
        --key_shift 2 --query_shift 1 --wide_shift_from_step "$WIDE_SHIFT_FROM" --hnsw_ef_search 256 \
        --max_seq_len "$SEQ_LEN" --batch_size "$BATCH" --accumulation_steps 1 --learning_rate "$LR" \
        --warmup_steps 30 --epochs 100 --max_steps "$STEPS" --max_minutes "$SAFETY_MINUTES" --log_interval 25 \
        --save_interval 250 > "$OUT/prose_$1.log" 2>&1 || { echo "training $1 failed, see $OUT/prose_$1.log" >&2; return 1; }
    last=$(tail -n 1 "$OUT/prose_$1/metrics.jsonl")
    step=$(python -c 'import json, sys; print(json.loads(sys.argv[1])["step"])' "$last")
    if [ "$step" -lt "$STEPS" ]; then
        echo "WARNING: $1 stopped by SAFETY_MINUTES=$SAFETY_MINUTES at step $step of $STEPS: not the recipe's model" >&2
    fi
    echo "trained $OUT/prose_$1 to step $step of $STEPS, last metrics: $last"
}

# shellcheck disable=SC2086  # ATTNS is a list of words
for attn in $ATTNS; do
    echo "training the $attn model: $STEPS steps (safety cap $SAFETY_MINUTES minutes)"
    train "$attn"
done

# shellcheck disable=SC2086  # ATTNS and EVAL_LENGTHS are lists of words
for attn in $ATTNS; do
    echo "== needles in held-out prose, $attn attention =="
    OMP_NUM_THREADS="$THREADS" python scripts/eval_needles.py --load "$OUT/prose_$attn/model" --data_dir "$DATA_DIR" \
        --lengths $EVAL_LENGTHS --trials "$EVAL_TRIALS" --threads "$THREADS" --json "$OUT/prose_$attn/needles.json"
done
if [[ " $ATTNS " == *" ann "* ]]; then
    dense=()
    [[ " $ATTNS " == *" dense "* ]] && dense=(--dense "$OUT/prose_dense/model" --dense_max_tokens $((SEQ_LEN * 2)))
    echo "== held-out loss by position =="
    OMP_NUM_THREADS="$THREADS" python scripts/eval_perplexity.py --load "$OUT/prose_ann/model" "${dense[@]}" \
        --texts "$PROSE"/prose_heldout_*.txt --max_tokens "$PPL_TOKENS" --threads "$THREADS" \
        --json "$OUT/prose_ann/perplexity.json"
fi
echo "== every result of this run together =="
python scripts/collect_long_context.py --needles "$OUT"/prose_*/needles.json \
    $([ -f "$OUT/prose_ann/perplexity.json" ] && echo --perplexity "$OUT/prose_ann/perplexity.json") --out_dir "$OUT/results"
