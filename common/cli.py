"""Command-line habits every script and trainer shares: a bad argument is one line on stderr, exit 2."""

import argparse

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class UsageError(Exception):
    """Bad arguments, a bad input file or nothing to load: one line on stderr, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in the same one-line form as every other usage error."""

    def error(self, message):
        raise UsageError(f"{message} (see --help)")
