"""Each step's new tokens out of transformers' `generate`, as a Python generator.

`generate` is one blocking loop that pushes tokens to a streamer; `stream_steps` runs it in a
worker thread (the pattern of transformers' TextIteratorStreamer) and yields what the streamer
receives, so callers can stop reading at any token and generation stops one step later.
"""

import queue
import threading

import torch
from transformers.generation import BaseStreamer, StoppingCriteria, StoppingCriteriaList

END = object()


class StepQueue(BaseStreamer):
    """A streamer that queues each step's new tokens (b,); generate puts the prompt first, it is skipped."""

    def __init__(self):
        self.steps = queue.Queue()
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.steps.put(value)
        self.prompt_seen = True

    def end(self):
        """Nothing: the worker queues END itself, also when generate raises."""


class StopRequested(StoppingCriteria):
    """Ends every row at the next step once the reader has stopped reading."""

    def __init__(self):
        self.requested = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.requested.is_set(), dtype=torch.bool, device=input_ids.device)


def stream_steps(generate, input_ids, **generate_kwargs):
    """Yield the new tokens (b,), on the CPU, of each step of generate(input_ids, **generate_kwargs).

    The worker runs under the caller's autocast setting (autocast is thread-local). Closing the
    generator stops generation after the step in progress and waits for the worker; an error
    raised by generate is raised here.
    """
    steps, stop, failures = StepQueue(), StopRequested(), []
    device_type = input_ids.device.type
    autocast = torch.autocast(
        device_type, dtype=torch.get_autocast_dtype(device_type), enabled=torch.is_autocast_enabled(device_type)
    )

    def work():
        try:
            with autocast:
                generate(input_ids, streamer=steps, stopping_criteria=StoppingCriteriaList([stop]), **generate_kwargs)
        except BaseException as error:  # handed to the reader, which raises it
            failures.append(error)
        finally:
            steps.steps.put(END)

    worker = threading.Thread(target=work, name="generate", daemon=True)
    worker.start()
    try:
        while (tokens := steps.steps.get()) is not END:
            yield tokens
    finally:
        stop.requested.set()
        worker.join()
    if failures:
        raise failures[0]
