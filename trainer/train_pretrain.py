"""Pretraining: next-token prediction on plain text (JSONL lines {"text": ...}).

    python trainer/train_pretrain.py --max_minutes 20             # CPU demo, tiny preset
    torchrun --nproc_per_node 2 trainer/train_pretrain.py --preset small --dtype bfloat16

Flags: trainer/cli.py (python trainer/train_pretrain.py --help); the loop: trainer/loop.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataset.lm_dataset import PretrainDataset
from trainer.cli import Stage
from trainer.loop import main

STAGE = Stage(
    name="pretrain",
    dataset_class=PretrainDataset,
    learning_rate=5e-4,
    epochs=1,
    batch_size=32,
    accumulation_steps=8,
    max_seq_len=512,
    out_dir="out/pretrain",
)

if __name__ == "__main__":
    main(STAGE)
