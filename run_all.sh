#!/usr/bin/env bash
# The main job in one command: install what is missing, make offline sample data unless real data
# is present, pretrain, SFT, then chat on the preset prompts. ANN attention throughout.
#
#   bash run_all.sh            offline demo: tiny model, ~11 minutes on 2 CPU cores
#   REAL=1 bash run_all.sh     minimind's recipe: download the real data (modelscope), small model
#                              (26M), full epochs; meant for a GPU (add GPUS=N for torchrun DDP)
#
# Outputs: out/pretrain and out/sft, each with model/, metrics.jsonl, loss.png and checkpoints/.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
ATTN=${ATTN:-ann}

if ! "$PYTHON" -c "import torch, faiss, transformers, tokenizers, matplotlib, tqdm, modelscope" 2>/dev/null; then
    echo "== installing requirements"
    "$PYTHON" -m pip install -q -r requirements.txt
fi

if [[ "${REAL:-0}" == 1 ]]; then
    echo "== real data (modelscope: gongjy/minimind_dataset)"
    "$PYTHON" scripts/download_data.py --files pretrain_hq.jsonl sft_mini_512.jsonl --out_dir dataset
    if [[ "${GPUS:-1}" -gt 1 ]]; then
        LAUNCH=(torchrun --nproc_per_node "$GPUS")
    else
        LAUNCH=("$PYTHON")
    fi
    "${LAUNCH[@]}" trainer/train_pretrain.py --preset small --attn "$ATTN" --epochs 1 --batch_size 32 \
        --accumulation_steps 8 --learning_rate 5e-4 --max_seq_len 512 --data_path dataset/pretrain_hq.jsonl \
        --out_dir out/pretrain
    "${LAUNCH[@]}" trainer/train_full_sft.py --from_weight out/pretrain/model --attn "$ATTN" --epochs 2 \
        --batch_size 16 --learning_rate 5e-5 --max_seq_len 512 --data_path dataset/sft_mini_512.jsonl \
        --out_dir out/sft
else
    echo "== sample data (offline, deterministic)"
    "$PYTHON" scripts/make_sample_data.py --out_dir dataset/sample
    echo "== pretrain (tiny model, $ATTN attention)"
    # Step caps let the cosine schedule finish; the minute caps keep slower machines in budget.
    "$PYTHON" trainer/train_pretrain.py --preset tiny --attn "$ATTN" --data_path dataset/sample/pretrain_hq.jsonl \
        --max_seq_len 256 --batch_size 16 --accumulation_steps 1 --learning_rate 2e-3 --warmup_steps 20 \
        --epochs 2 --max_steps 340 --max_minutes "${PRETRAIN_MINUTES:-6.5}" --log_interval 10 --save_interval 100 \
        --out_dir out/pretrain
    echo "== SFT"
    "$PYTHON" trainer/train_full_sft.py --from_weight out/pretrain/model --attn "$ATTN" \
        --data_path dataset/sample/sft_mini_512.jsonl --max_seq_len 160 --batch_size 16 --learning_rate 1e-3 \
        --warmup_steps 10 --epochs 2 --max_steps 300 --max_minutes "${SFT_MINUTES:-3.5}" --log_interval 10 \
        --save_interval 100 --out_dir out/sft
fi

echo "== chat on the preset prompts"
"$PYTHON" scripts/eval_chat.py --load out/sft/model --mode preset --temperature 0

cat <<DONE

Done. Model:   out/sft/model (pretrain: out/pretrain/model)
      Metrics: out/pretrain/metrics.jsonl, out/sft/metrics.jsonl
      Plots:   out/pretrain/loss.png, out/sft/loss.png
Chat with it: python scripts/eval_chat.py --load out/sft/model --mode chat
DONE
