#!/usr/bin/env bash
# Long context on real prose, for 2 CPU cores (docs/LONG_CONTEXT.md).
#
# A copy curriculum in five stages (four with DISTRACT_STEPS=0 or MULTIKEY_STEPS=0, three with both), for one model
# with ANN attention (out/prose_ann) and, as the control, the same model with dense attention
# (out/prose_dense), each alone on every core:
#   1. induction: random token ids, one span repeated (scripts/probe_induction.py), where copying is
#      the only thing to learn, so the content match (find the current token earlier, copy what
#      followed) forms;
#   2. copy: training prose with copy documents (random words of a stretch of prose, repeated) and
#      single needles, which carries the copy over to real text;
#   3. needles: mostly needle documents of all three tasks (280-448 tokens) over training prose, copy documents
#      kept in the mix, the wide key match (three tokens) training from WIDE_SHIFT_FROM;
#   4. distractors (DISTRACT_STEPS): the stage-3 data again, retrieval in DISTRACT_LAYERS only and
#      cross-batch distractors (--ann_batch_distractors), so a copy learns to win against the other
#      rows' blocks (and, with DISTRACT_MEMORY > 0, those of that many earlier batches; with
#      DISTRACT_BLOCKS > 0 a query keeps its TOP_N own blocks and attends that many of the best foreign
#      ones besides); the dense control trains the same steps on the same data;
#   5. multikey (MULTIKEY_STEPS): needle documents that are all multikey (2-8 labelled numbers, one
#      asked; MULTIKEY_TASKS may add multivalue), with the stage-4 flags, so the label is the only
#      thing that tells the answer; in the mixed stages a copy of any key's number lowers most of the loss.
# Then both are evaluated: needles in held-out prose (scripts/eval_needles.py) and held-out loss by
# position (scripts/eval_perplexity.py), collected in $OUT/results (scripts/collect_long_context.py).
#
#   bash scripts/train_prose_long_context.sh                      # ANN model, then the dense control
#   ATTNS=ann SEED=2 bash scripts/train_prose_long_context.sh      # another seed of the ANN model
#   INDUCTION_STEPS=3 COPY_STEPS=3 NEEDLE_STEPS=3 DISTRACT_STEPS=3 MULTIKEY_STEPS=3 HIDDEN=32 LAYERS=1 BATCH=2 \
#       COPY_DOCS=40 NEEDLE_COPY_DOCS=20 EVAL_LENGTHS=1024 EVAL_TRIALS=1 PPL_TOKENS=2048 OUT=/tmp/prose \
#       PROSE=/tmp/prose/data bash scripts/train_prose_long_context.sh   # smoke run
#
# The run is defined by its steps and schedules (constant rate in stage 1, a cosine schedule in each
# trainer stage), the same on any machine (a slower one takes longer). SAFETY_MINUTES only guards
# against a runaway trainer stage; when it stops one early the script says so, and that model is
# not the recipe's.
#
# Settings (environment): ATTNS ("ann dense"), SEED (1), INDUCTION_STEPS (800), COPY_STEPS (600),
# NEEDLE_STEPS (1200), DISTRACT_STEPS (1200; 0: no stage 4), MULTIKEY_STEPS (800; 0: no stage 5),
# MULTIKEY_TASKS ("multikey": the needle tasks of stage 5; "multikey multivalue" keeps answers of
# several numbers in the last stage), DISTRACT_LAYERS ("1"), DISTRACT_MEMORY (0), DISTRACT_BLOCKS (0: own and
# foreign blocks compete for TOP_N; N: TOP_N own blocks and the N best foreign ones), WIDE_SHIFT_FROM (0:
# the step of stage 3 from which the wide key match trains; stages 1 and 2 hold it),
# WIDE_SHIFT_LR_SCALE (1: its learning rate as a multiple of the schedule's), KEY_SHIFT (3: the
# previous tokens a key mixes in; beyond the first they are the wide shift), QUERY_SHIFT (2: a
# query's; a key matches the query of the token before it, so KEY_SHIFT = QUERY_SHIFT + 1 matches
# that many tokens), HIDDEN (128), LAYERS (4), WINDOW (16), TOP_N (4), BATCH (8), SEQ_LEN (512),
# LR (1e-3), DENSE_INDUCTION_LR (LR: the dense control's stage-1 rate; at 1e-3 its content match does not form
# in 800 steps, at 3e-3 it does), NEEDLE_TASKS ("single multikey multivalue": the tasks of stages 3 and 4),
# NEEDLE_MIN_TOKENS (280: the shortest needle document of stages 3 and 4, which must hold the
# longest template of NEEDLE_TASKS; 112, as in stage 2, for single alone), COPY_DOCS (12000),
# NEEDLE_COPY_DOCS (4000), SAFETY_MINUTES (120), BLOCK_SUMMARY (keys: each block scored by its best
# keys, found by HNSW over keys in the hnsw evaluation; bounds: by channel-wise bounds), THREADS (2),
# DATA_DIR (../shared/data), PROSE (dataset/prose), TOKENIZER (model/tokenizer_prose),
# EVAL_LENGTHS ("4096 16384 65536"), EVAL_TRIALS (5), PPL_TOKENS (131072), OUT (out).
set -euo pipefail
cd "$(dirname "$0")/.."

ATTNS=${ATTNS:-"ann dense"}
SEED=${SEED:-1}
INDUCTION_STEPS=${INDUCTION_STEPS:-800}
COPY_STEPS=${COPY_STEPS:-600}
NEEDLE_STEPS=${NEEDLE_STEPS:-1200}
DISTRACT_STEPS=${DISTRACT_STEPS:-1200}
MULTIKEY_STEPS=${MULTIKEY_STEPS:-800}
MULTIKEY_TASKS=${MULTIKEY_TASKS:-multikey}
DISTRACT_LAYERS=${DISTRACT_LAYERS:-1}
DISTRACT_MEMORY=${DISTRACT_MEMORY:-0}
DISTRACT_BLOCKS=${DISTRACT_BLOCKS:-0}
WIDE_SHIFT_FROM=${WIDE_SHIFT_FROM:-0}
WIDE_SHIFT_LR_SCALE=${WIDE_SHIFT_LR_SCALE:-1}
KEY_SHIFT=${KEY_SHIFT:-3}
QUERY_SHIFT=${QUERY_SHIFT:-2}
HIDDEN=${HIDDEN:-128}
LAYERS=${LAYERS:-4}
WINDOW=${WINDOW:-16}
TOP_N=${TOP_N:-4}
BATCH=${BATCH:-8}
SEQ_LEN=${SEQ_LEN:-512}
LR=${LR:-1e-3}
DENSE_INDUCTION_LR=${DENSE_INDUCTION_LR:-$LR}
NEEDLE_TASKS=${NEEDLE_TASKS:-"single multikey multivalue"}
COPY_MIX_MIN_TOKENS=112
MULTIKEY_MIX_MIN_TOKENS=280  # the longest multikey template (8 keys) needs 257 English tokens
NEEDLE_MIN_TOKENS=${NEEDLE_MIN_TOKENS:-$MULTIKEY_MIX_MIN_TOKENS}
COPY_DOCS=${COPY_DOCS:-12000}
NEEDLE_COPY_DOCS=${NEEDLE_COPY_DOCS:-4000}
SAFETY_MINUTES=${SAFETY_MINUTES:-120}
BLOCK_SUMMARY=${BLOCK_SUMMARY:-keys}
THREADS=${THREADS:-2}
DATA_DIR=${DATA_DIR:-../shared/data}
PROSE=${PROSE:-dataset/prose}
TOKENIZER=${TOKENIZER:-model/tokenizer_prose}
EVAL_LENGTHS=${EVAL_LENGTHS:-"4096 16384 65536"}
EVAL_TRIALS=${EVAL_TRIALS:-5}
PPL_TOKENS=${PPL_TOKENS:-131072}
OUT=${OUT:-out}

# A mix is (re)built when missing, older than the code that writes it, or built with other flags
# (its build_flags file). Both have the same train / held-out split; copy documents are 112-448
# tokens long, needle documents from COPY_MIX_MIN_TOKENS (stage 2) or NEEDLE_MIN_TOKENS to 448.
stale() {  # $1: folder, $2: its flags
    [ "$(cat "$1/build_flags" 2>/dev/null)" = "$2" ] || return 0
    for source in scripts/make_prose_data.py dataset/prose.py evaluation/needles.py "$TOKENIZER/tokenizer.json"; do
        [ "$1/prose_train.jsonl" -nt "$source" ] || return 0; done; return 1; }
build_mix() {  # $1: folder, then make_prose_data.py flags of this mix
    local folder=$1; shift
    local flags=(--data_dir "$DATA_DIR" --tokenizer "$TOKENIZER" --chunk_tokens $((SEQ_LEN - 24))
        --needle_max_tokens $((SEQ_LEN - 64)) "$@")
    if stale "$folder" "${flags[*]}"; then
        python scripts/make_prose_data.py --out_dir "$folder" "${flags[@]}"
        echo "${flags[*]}" > "$folder/build_flags"
    fi
}
# Stage 2: 69% copy documents, the prose chunks, 30% of the rest single needles (half of them over a
# repeated passage). Stage 3: 80% needle documents, with copy documents kept.
build_mix "$PROSE/copy" --needle_min_tokens "$COPY_MIX_MIN_TOKENS" --needle_fraction 0.3 --repeat_fraction 0.5 --tasks single --copy_documents "$COPY_DOCS" --seed 5
# shellcheck disable=SC2086  # NEEDLE_TASKS is a list of words
build_mix "$PROSE/needles" --needle_min_tokens "$NEEDLE_MIN_TOKENS" --needle_fraction 0.8 --tasks $NEEDLE_TASKS --copy_documents "$NEEDLE_COPY_DOCS" --seed 6
if [ "$MULTIKEY_STEPS" -gt 0 ]; then  # stage 5: the stage-3 mix with multikey (MULTIKEY_TASKS) documents alone
    # shellcheck disable=SC2086  # MULTIKEY_TASKS is a list of words
    build_mix "$PROSE/multikey" --needle_min_tokens "$MULTIKEY_MIX_MIN_TOKENS" --needle_fraction 0.8 --tasks $MULTIKEY_TASKS \
        --copy_documents "$NEEDLE_COPY_DOCS" --seed 7
fi
mkdir -p "$OUT"
# HNSW settings saved with the models: graphs over keys as the long-context evaluations use them
# (docs/LONG_CONTEXT_EXPERIMENTS.md, Fewer keys per search: 32 keys per head, efSearch 32), graphs over bounds
# summaries with the passkey recipe's search breadth.
hnsw_settings=(--hnsw_ef_search 256)
[ "$BLOCK_SUMMARY" = keys ] && hnsw_settings=(--hnsw_m 16 --hnsw_ef_construction 64 --hnsw_ef_search 32
    --hnsw_keys_per_head 32)

trainer_stage() {  # $1: ann | dense, $2: from model, $3: data, $4: out dir, $5: steps, $6: wide shift from,
    # then extra trainer flags
    OMP_NUM_THREADS="$THREADS" python trainer/train_pretrain.py --from_weight "$2" --seed "$SEED" --data_path "$3" \
        --out_dir "$4" --tokenizer_path "$TOKENIZER" --wide_shift_from_step "$6" \
        --wide_shift_lr_scale "$WIDE_SHIFT_LR_SCALE" --ann_block_summary "$BLOCK_SUMMARY" "${hnsw_settings[@]}" \
        --max_seq_len "$SEQ_LEN" --batch_size "$BATCH" --accumulation_steps 1 --learning_rate "$LR" \
        --warmup_steps 30 --epochs 100 --max_steps "$5" --max_minutes "$SAFETY_MINUTES" --log_interval 25 \
        --save_interval 200 "${@:7}" > "$4.log" 2>&1 || { echo "training $1 ($4) failed, see $4.log" >&2; return 1; }
    last=$(tail -n 1 "$4/metrics.jsonl")
    step=$(python -c 'import json, sys; print(json.loads(sys.argv[1])["step"])' "$last")
    if [ "$step" -lt "$5" ]; then
        echo "WARNING: $4 stopped by SAFETY_MINUTES=$SAFETY_MINUTES at step $step of $5: not the recipe's model" >&2
    fi
    echo "trained $4 to step $step of $5, last metrics: $last"
}

train() {  # $1: ann | dense. Everything but the attention (and DENSE_INDUCTION_LR, if set) is identical in the two runs.
    # What the passkey recipe learned (docs/LONG_CONTEXT_EXPERIMENTS.md): a small window so far copies go
    # through retrieved blocks, capped block positions, RoPE base 1e4, keys smeared over one token
    # first and over KEY_SHIFT once the copy has formed.
    local stages="$OUT/prose_$1/stages" induction_lr=$LR
    [ "$1" = dense ] && induction_lr=$DENSE_INDUCTION_LR
    mkdir -p "$stages"
    OMP_NUM_THREADS="$THREADS" python scripts/probe_induction.py --attn "$1" --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --ann_window "$WINDOW" --ann_top_n "$TOP_N" --key_shift "$KEY_SHIFT" --query_shift "$QUERY_SHIFT" \
        --hold_wide_shift --min_span 20 --max_span 64 --length 256 --batch 16 --lr "$induction_lr" --steps "$INDUCTION_STEPS" \
        --block_summary "$BLOCK_SUMMARY" --seed "$SEED" --threads "$THREADS" --json "$stages/induction.json" \
        --save "$stages/induction" \
        > "$stages/induction.log" 2>&1 || { echo "stage 1 of $1 failed, see $stages/induction.log" >&2; return 1; }
    echo "stage 1 (induction), last row: $(tail -n 1 "$stages/induction.log")"
    trainer_stage "$1" "$stages/induction" "$PROSE/copy/prose_train.jsonl" "$stages/copy" "$COPY_STEPS" "$COPY_STEPS"
    # Stages 3-5 (4 and 5 when they have steps), each from the one before; the last one is the model.
    local last=needles
    [ "$DISTRACT_STEPS" -gt 0 ] && last=distractors
    [ "$MULTIKEY_STEPS" -gt 0 ] && last=multikey
    out_of() { if [ "$1" = "$last" ]; then echo "$OUT/prose_$attn"; else echo "$stages/$1"; fi; }
    local attn=$1 distractors=()
    # shellcheck disable=SC2086  # DISTRACT_LAYERS is a list of words
    [ "$1" = ann ] && distractors=(--ann_retrieval_layers $DISTRACT_LAYERS --ann_batch_distractors
        --ann_distractor_memory "$DISTRACT_MEMORY" --ann_distractor_blocks "$DISTRACT_BLOCKS")
    trainer_stage "$1" "$stages/copy/model" "$PROSE/needles/prose_train.jsonl" "$(out_of needles)" "$NEEDLE_STEPS" \
        "$WIDE_SHIFT_FROM"
    local from
    from="$(out_of needles)/model"
    if [ "$DISTRACT_STEPS" -gt 0 ]; then
        trainer_stage "$1" "$from" "$PROSE/needles/prose_train.jsonl" "$(out_of distractors)" "$DISTRACT_STEPS" \
            0 "${distractors[@]}"
        from="$(out_of distractors)/model"
    fi
    if [ "$MULTIKEY_STEPS" -gt 0 ]; then
        trainer_stage "$1" "$from" "$PROSE/multikey/prose_train.jsonl" "$OUT/prose_$1" "$MULTIKEY_STEPS" \
            0 "${distractors[@]}"
    fi
}

# shellcheck disable=SC2086  # ATTNS is a list of words
for attn in $ATTNS; do
    echo "training the $attn model: $INDUCTION_STEPS + $COPY_STEPS + $NEEDLE_STEPS + $DISTRACT_STEPS + $MULTIKEY_STEPS steps"
    train "$attn"
done

# shellcheck disable=SC2086  # ATTNS and EVAL_LENGTHS are lists of words
for attn in $ATTNS; do
    echo "== needles in held-out prose, $attn attention =="
    OMP_NUM_THREADS="$THREADS" python scripts/eval_needles.py --load "$OUT/prose_$attn/model" --data_dir "$DATA_DIR" \
        --lengths $EVAL_LENGTHS --trials "$EVAL_TRIALS" --retrievals exact hnsw --threads "$THREADS" \
        --json "$OUT/prose_$attn/needles.json"
done
if [[ " $ATTNS " == *" ann "* ]]; then
    dense=()
    [[ " $ATTNS " == *" dense "* ]] && dense=(--dense "$OUT/prose_dense/model" --dense_max_tokens $((SEQ_LEN * 2)))
    echo "== held-out loss by position =="
    OMP_NUM_THREADS="$THREADS" python scripts/eval_perplexity.py --load "$OUT/prose_ann/model" "${dense[@]}" \
        --texts "$PROSE"/copy/prose_heldout_*.txt --max_tokens "$PPL_TOKENS" --threads "$THREADS" \
        --json "$OUT/prose_ann/perplexity.json"
fi
echo "== every result of this run together =="
python scripts/collect_long_context.py --needles "$OUT"/prose_*/needles.json \
    $([ -f "$OUT/prose_ann/perplexity.json" ] && echo --perplexity "$OUT/prose_ann/perplexity.json") --out_dir "$OUT/results"
