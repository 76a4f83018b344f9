"""What each rank reads: the stage's dataset, and the order and batches of its samples in each epoch."""

import math

import numpy as np
import torch
from torch.utils.data import DataLoader

from common.cli import UsageError
from dataset.lm_dataset import DataFormatError, resolve_data_path


def load_dataset(stage, args, tokenizer):
    """The stage's dataset from --data_path (or its default file); a bad or missing file -> UsageError."""
    try:
        data_path = resolve_data_path(stage.name, args.data_path)
        return stage.dataset_class(data_path, tokenizer, args.max_seq_len, skip_bad_lines=args.skip_bad_lines)
    except (DataFormatError, FileNotFoundError) as error:
        raise UsageError(str(error)) from None


class EpochPlan:
    """Which micro-batches of which samples each rank sees in each epoch.

    Like DistributedSampler, the permutation is padded by wrapping so all ranks get the same
    number of micro-batches (an uneven count would hang DDP); unlike it, the order is a pure
    function of (seed, epoch), so a checkpoint only has to store how far into it we are.
    Micro-batch m of all ranks together is samples [m * B, (m + 1) * B) of the padded order, with
    B = batch_size * world_size, whatever the world size.
    """

    def __init__(self, num_samples, batch_size, accumulation_steps, seed, rank, world_size):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.per_rank = math.ceil(num_samples / world_size)
        self.samples_per_micro_batch = batch_size * world_size  # all ranks together
        self.micro_batches = math.ceil(self.per_rank / batch_size)
        self.steps = math.ceil(self.micro_batches / accumulation_steps)

    def batches(self, epoch):
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        order = np.resize(order, self.per_rank * self.world_size)  # wraps around to pad
        mine = order[self.rank :: self.world_size].tolist()
        return [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]


def batch_loader(dataset, batches, num_workers, pin_memory):
    """A DataLoader yielding (input_ids, labels) for each list of sample indices in `batches`."""
    # An explicit generator keeps the DataLoader from drawing on the global torch RNG we checkpoint.
    return DataLoader(
        dataset,
        batch_sampler=batches,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator(),
    )


def trim_padding(input_ids, labels):
    """input_ids, labels (b, s) -> both (b, length), cut after the last supervised (label != -100) column.

    Right padding past the last label changes no loss of a causal model.
    """
    supervised = labels != -100
    length = int(supervised.any(dim=0).nonzero().max()) + 1 if bool(supervised.any()) else 1
    return input_ids[:, :length], labels[:, :length]
