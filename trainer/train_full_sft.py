"""Full-parameter SFT on chat data (JSONL lines {"conversations": [{"role", "content"}, ...]}).

Starts from a pretrained model folder; the loss covers the assistant turns only (see dataset/lm_dataset.py).

    python trainer/train_full_sft.py --from_weight out/pretrain/model --max_minutes 10

Flags: trainer/cli.py (python trainer/train_full_sft.py --help); the loop: trainer/loop.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dataset.lm_dataset import SFTDataset
from trainer.cli import Stage
from trainer.loop import main

STAGE = Stage(
    name="sft",
    dataset_class=SFTDataset,
    learning_rate=5e-5,
    epochs=2,
    batch_size=16,
    accumulation_steps=1,
    max_seq_len=512,
    out_dir="out/sft",
)

if __name__ == "__main__":
    main(STAGE)
