"""The worker thread that owns the model: it runs every request, one step of each in turn.

A step is one prefill chunk or one generated token of one request, so up to `max_active` requests
progress together and a long prompt never stalls the answers being streamed meanwhile; more wait
in a queue. Each request has its own batch-1 cache: from the prefix cache when its prompt starts
with an entry's tokens (only the rest is prefilled), else a new one.

Two caches of a request go into the prefix cache. A copy taken before the prompt's last token
(prompt minus one token: the same prompt again, or any follow-up turn, reuses it), and the cache
itself when the request ends, however it ends (done, stop string, cancelled), holding the prompt
and the answer tokens fed so far: kept only when the answer's text tokenizes back to those ids,
since a follow-up prompt is text rendered by the chat template and tokenized anew (a model can emit
token sequences that tokenization never produces, e.g. bytes of an incomplete character).

Requests talk to their caller through `emit(event)`, called on the worker thread; a caller that
goes away sets `cancelled`, and the request ends before its next step.
"""

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .prefix_cache import fork_cache
from .text_stream import TextStream


@dataclass
class Started:
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class Text:
    piece: str


@dataclass
class Finished:
    reason: str  # "stop" (eos or a stop string), "length" (max_tokens) or "cancelled"
    completion_tokens: int


@dataclass
class Failed:
    message: str


@dataclass
class Job:
    """One request: the prompt, how much and how to sample, and where its events go."""

    prompt_ids: list
    max_tokens: int
    emit: Callable
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = None
    stops: list = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


def next_token(logits, temperature, top_p, generator):
    """logits (vocab,) float -> the next token id: the argmax at temperature 0, else sampled from
    the temperature-scaled distribution cut to its top_p nucleus (the smallest set of most likely
    tokens whose probability reaches top_p, as transformers' TopPLogitsWarper keeps)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class Running:
    """A job being served: its cache, the tokens the cache holds, what is left to prefill, the answer so far."""

    def __init__(self, job, cache, cached_ids, tokenizer):
        self.job = job
        self.cache = cache
        self.fed = list(cached_ids)  # token ids the cache holds
        self.to_prefill = job.prompt_ids[len(cached_ids) :]
        self.text = TextStream(tokenizer, job.stops)
        self.last_token = None
        self.generated = 0
        self.generator = torch.Generator().manual_seed(job.seed if job.seed is not None else time.time_ns())


class Engine:
    def __init__(self, model, tokenizer, prefix_cache, max_active=8, prefill_chunk=512):
        self.model, self.tokenizer, self.prefix_cache = model, tokenizer, prefix_cache
        self.max_active, self.prefill_chunk = max_active, prefill_chunk
        self.eos_id = tokenizer.eos_token_id
        self.waiting = queue.Queue()
        self.active = []
        self.cancelled = 0  # requests ended because their caller went away
        self.stats = self.snapshot()
        self.thread = threading.Thread(target=self.serve_forever, name="engine", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def submit(self, job):
        """Queue a job (any thread); its events arrive through job.emit."""
        self.waiting.put(job)

    def snapshot(self):
        """What /health shows, replaced whole so other threads never read it half-updated."""
        return {"active": len(self.active), "waiting": self.waiting.qsize(), "cache_entries": len(self.prefix_cache),
                "cache_bytes": self.prefix_cache.nbytes, "cancelled": self.cancelled}

    def serve_forever(self):
        with torch.inference_mode():
            while True:
                self.admit()
                for running in list(self.active):
                    try:
                        self.step(running)
                    except Exception as error:  # a failure ends this request only; its cache may be half-written
                        if running in self.active:
                            self.active.remove(running)
                        running.job.emit(Failed(f"generation failed: {type(error).__name__}: {error}"))
                self.stats = self.snapshot()

    def admit(self):
        """Move waiting jobs into free slots; blocks while there is nothing to do."""
        while len(self.active) < self.max_active:
            try:
                job = self.waiting.get(block=not self.active)
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.cancelled += 1
                job.emit(Finished("cancelled", 0))
                continue
            self.active.append(self.begin(job))

    def begin(self, job):
        # At least one prompt token is always prefilled: its logits give the first answer token.
        entry = self.prefix_cache.take(job.prompt_ids[:-1])
        if entry is None:
            cache, cached_ids = self.model.new_cache(reserve=len(job.prompt_ids) + job.max_tokens), []
        else:
            cache, cached_ids = entry.cache, entry.token_ids
        job.emit(Started(len(cached_ids)))
        return Running(job, cache, cached_ids, self.tokenizer)

    def forward(self, running, token_ids):
        """Feed token_ids to the running job's cache -> logits (vocab,) float of the last one."""
        input_ids = torch.tensor([token_ids], device=self.model.device)
        logits = self.model(input_ids, cache=running.cache, use_cache=True, logits_to_keep=1).logits
        running.fed.extend(token_ids)
        return logits[0, -1].float()

    def step(self, running):
        job = running.job
        if job.cancelled.is_set():
            return self.end(running, "cancelled")
        if running.to_prefill:
            # The last prompt token goes alone, after a copy of the cache holding the rest is kept.
            size = min(self.prefill_chunk, len(running.to_prefill) - 1) or 1
            if len(running.to_prefill) == 1 and running.fed and self.prefix_cache.budget_bytes:
                self.prefix_cache.put(running.fed, fork_cache(running.cache))
            chunk, running.to_prefill = running.to_prefill[:size], running.to_prefill[size:]
            logits = self.forward(running, chunk)
            if running.to_prefill:
                return None
        else:
            logits = self.forward(running, [running.last_token])
        token = next_token(logits, job.temperature, job.top_p, running.generator)
        running.generated += 1
        running.last_token = token
        if token == self.eos_id:
            return self.end(running, "stop")
        piece = running.text.add(token)
        if piece:
            job.emit(Text(piece))
        if running.text.stopped:
            return self.end(running, "stop")
        if running.generated >= job.max_tokens:
            return self.end(running, "length")
        return None

    def end(self, running, reason):
        self.active.remove(running)
        self.cancelled += reason == "cancelled"
        piece = running.text.finish() if reason != "cancelled" else ""
        if piece:
            running.job.emit(Text(piece))
        answer_ids = running.fed[len(running.job.prompt_ids) :]
        if self.tokenizer(running.text.text, add_special_tokens=False).input_ids[: len(answer_ids)] == answer_ids:
            self.prefix_cache.put(running.fed, running.cache)
        running.job.emit(Finished(reason, running.generated))
