"""Processes under torchrun: joining the process group, and the few exchanges the trainer makes across ranks.

Every helper is a plain pass-through when the run has one process.
"""

import os

import torch
import torch.distributed as dist


def setup_distributed(device_name):
    """(rank, world_size, device); under torchrun (WORLD_SIZE > 1) joins the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, torch.device(device_name)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device_name.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return rank, world_size, torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return rank, world_size, torch.device("cpu")


def teardown_distributed():
    if dist.is_initialized():
        dist.destroy_process_group()


def all_ranks_sum(values, world_size):
    """values (a tensor), summed in place over all ranks."""
    if world_size > 1:
        dist.all_reduce(values)
    return values


def gather_from_all_ranks(value, world_size):
    """[each rank's value (any picklable object)], on every rank."""
    values = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(values, value)
    else:
        values[0] = value
    return values


def from_rank_0(value, world_size):
    """Rank 0's value (any picklable object), on every rank."""
    box = [value]
    if world_size > 1:
        dist.broadcast_object_list(box)
    return box[0]
