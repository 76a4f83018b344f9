"""Talk to a trained MiniMind: score it on the preset prompts, answer one prompt, or chat.

    python scripts/eval_chat.py                                   # preset prompts, out/sft/model
    python scripts/eval_chat.py --mode chat --history_turns 2     # interactive; empty line or Ctrl-D quits
    python scripts/eval_chat.py --prompt "What is 3 + 5?" --temperature 0
    python scripts/eval_chat.py --load out/pretrain/checkpoints/step_0000100.pt --raw --prompt "Zorvia is"
    python scripts/eval_chat.py --attn ann --retrieval hnsw        # same weights, ANN attention
    torchrun --standalone --nproc_per_node 2 scripts/eval_chat.py --load out/long_ann --raw --prompt "..."

--load takes a saved model folder, an out dir (its model/ folder, else its newest checkpoint) or a
checkpoint .pt written by the trainers. Attention settings change no weights, so --attn/--retrieval
may switch any model between dense and ANN attention.

Answers stream as they are generated. The prompt is the chat template over the system prompt, the
last --history_turns exchanges and the new message; when it does not fit --max_context together
with --max_new_tokens, the oldest exchanges go first, then the start of the new message.

Under torchrun (ANN attention only) every prompt is sharded over the ranks (model/context_parallel.py):
rank 0 reads the chat's input and prints, the others follow; answers are rank 0's choices, the same
as one process's (greedy) or draws of the same random generator (sampled).

In chat mode, `/set temperature 0.5` (also top_p, top_k, max_new_tokens) changes a setting,
`/clear` forgets the history and `/help` lists the commands; Ctrl-C stops the current answer.
Exit codes: 0 done, 2 bad arguments or nothing loadable.
"""

import sys
import time
from collections import deque
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers.utils import logging as transformers_logging

from common.cli import OneLineParser, UsageError
from common.cpu_memory import retain_freed_memory
from evaluation.chat import PromptBuilder, preset_prompts, token_chooser
from evaluation.loading import check_device, load_model, resolve_load_path
from evaluation.trials import join_trial_group
from model.config import ATTN_IMPLS, RETRIEVERS
from model.context_parallel import shard_prompt
from model.model import check_sampling

SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int}


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind chat and preset evaluation")
    p.add_argument("--load", default=None, help="model folder, out dir or checkpoint .pt (default out/sft/model, "
                   "else out/pretrain/model)")
    p.add_argument("--mode", choices=["preset", "chat"], default="preset")
    p.add_argument("--prompt", default=None, help="answer this one prompt and exit")
    p.add_argument("--raw", action="store_true", help="continue the prompt as plain text, no chat template "
                   "(for a pretrain-only model)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--history_turns", type=int, default=0, help="earlier exchanges kept in the prompt")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--max_context", type=int, default=None, help="prompt + answer tokens "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--temperature", type=float, default=0.85, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.85)
    p.add_argument("--top_k", type=int, default=0, help="0 = no top-k cut")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--attn", choices=ATTN_IMPLS, default=None, help="override the model's attention")
    p.add_argument("--retrieval", choices=RETRIEVERS, default=None, help="override the ANN block retrieval")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def validate_args(args):
    try:
        check_sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.history_turns < 0:
        raise UsageError(f"--history_turns must be >= 0, got {args.history_turns}")
    check_device(args.device)


# ----------------------------------------------------------------------------- generation


def answer_tokens(model, prompt_ids, sampling, eos_token_id, group=None):
    """The answer's token ids as they are generated: model.stream_generate in one process, the
    sharded prompt's ContextParallelLM.stream under a context-parallel group."""
    if group is None:
        input_ids = torch.tensor([prompt_ids], device=model.device)
        for token in model.stream_generate(input_ids, eos_token_id=eos_token_id, **sampling):
            yield int(token)
        return
    sharded, local_ids = shard_prompt(model, group, prompt_ids)
    choose = token_chooser(sampling["temperature"], sampling["top_p"], sampling["top_k"])
    yield from sharded.stream(local_ids, sampling["max_new_tokens"], choose)


def stream_answer(tokens, tokenizer, prompt_length, out):
    """Print the answer as its tokens arrive; returns the answer text.

    Each step decodes the whole answer and prints only what is new, holding back a trailing U+FFFD:
    a Chinese character often spans several byte-level tokens and is undecodable until complete.
    """
    answer_ids, printed, first_token_s = [], "", None
    start = time.perf_counter()
    try:
        for token in tokens:
            if first_token_s is None:
                first_token_s = time.perf_counter() - start
            if token == tokenizer.eos_token_id:
                break
            answer_ids.append(token)
            text = tokenizer.decode(answer_ids, skip_special_tokens=True).rstrip("\ufffd")
            out.write(text[len(printed) :])
            out.flush()
            printed = text
    except KeyboardInterrupt:
        out.write(" [interrupted]")
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    out.write(text[len(printed) :] + "\n")
    out.write(f"[{len(answer_ids)} tokens, {len(answer_ids) / max(elapsed, 1e-9):.1f} tokens/s, "
              f"prompt {prompt_length} tokens, first token after {first_token_s or 0:.2f}s]\n")
    return text


class Session:
    """The loaded model, the prompt builder, the sampling settings and the conversation so far."""

    def __init__(self, model, tokenizer, builder, sampling, history_turns, out, group=None):
        self.model, self.tokenizer, self.builder, self.out, self.group = model, tokenizer, builder, out, group
        self.sampling = sampling
        self.history = deque(maxlen=history_turns)

    def say(self, text):
        self.out.write(text + "\n")

    def answer(self, message):
        prompt_ids, notes = self.builder.build(message, self.history, self.sampling["max_new_tokens"])
        for note in notes:
            self.say(f"note: {note}")
        self.out.write("🤖: ")
        tokens = answer_tokens(self.model, prompt_ids, self.sampling, self.tokenizer.eos_token_id, self.group)
        text = stream_answer(tokens, self.tokenizer, len(prompt_ids), self.out)
        self.history.append((message, text))  # a deque of maxlen 0 keeps nothing
        return text

    def command(self, line):
        """Handle a /command from the chat; a bad one says why and changes nothing."""
        words = line.split()
        if words == ["/clear"]:
            self.history.clear()
            self.say("history cleared")
        elif len(words) == 3 and words[0] == "/set" and words[1] in SETTABLE:
            name, kind = words[1], SETTABLE[words[1]]
            try:
                proposed = {**self.sampling, name: kind(words[2])}
            except ValueError:
                self.say(f"error: {name} takes {'an integer' if kind is int else 'a number'}, got {words[2]!r}")
                return
            try:
                check_sampling(**proposed)
                self.builder.build("", [], proposed["max_new_tokens"])  # still room for a prompt?
            except (ValueError, UsageError) as error:
                self.say(f"error: {error}; {name} stays {self.sampling[name]}")
                return
            self.sampling = proposed
            self.say(f"{name} = {proposed[name]}")
        else:
            settings = ", ".join(f"{key}={value}" for key, value in self.sampling.items())
            self.say(f"commands: /set {{{'|'.join(SETTABLE)}}} VALUE, /clear (forget the history), /help; "
                     f"now {settings}")


def run_preset(session):
    prompts = preset_prompts()
    correct = 0
    for prompt, expected in prompts:
        session.say(f"\n👶: {prompt}")
        found = expected in session.answer(prompt)
        correct += found
        session.say(f"{'✓' if found else '✗'} expected {expected!r}")
    session.say(f"\n{correct}/{len(prompts)} preset answers contain the expected text")


def read_line(group):
    """The next line of the chat's input (None at its end), read on rank 0 and sent to every rank."""
    line = None
    if group is None or group.rank == 0:
        try:
            line = input("\n👶: ")
        except (EOFError, KeyboardInterrupt):
            line = None
    return line if group is None else group.broadcast_text(line, 0)


def run_chat(session):
    session.say("chat: an empty line or Ctrl-D quits, /help lists the commands")
    while True:
        line = read_line(session.group)
        if line is None:
            session.say("")
            return
        if not line:
            return
        if not line.strip():
            session.say("empty input, type something (an empty line quits)")
        elif line.startswith("/"):
            session.command(line)
        else:
            session.answer(line)


def main(argv=None):
    transformers_logging.disable_progress_bar()  # the weight-loading bar would only clutter the chat
    retain_freed_memory()
    try:
        args = parse_args(argv)
        validate_args(args)
        path = resolve_load_path(args.load)
        model, tokenizer = load_model(path, args.attn, args.retrieval, torch.device(args.device))
        config = model.config
        max_context = config.max_position_embeddings if args.max_context is None else args.max_context
        if max_context > config.max_position_embeddings:
            positions = config.max_position_embeddings
            raise UsageError(f"--max_context {max_context} exceeds the model's {positions} positions")
        builder = PromptBuilder(tokenizer, args.raw, args.system, max_context)
        builder.build("", [], args.max_new_tokens)  # fails now, not mid-chat, when no prompt can fit
        group = join_trial_group(config, path)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)
    attention = config.attn_impl + (f" ({config.ann_retrieval} retrieval)" if config.attn_impl == "ann" else "")
    print(f"model: {path}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {attention} "
          f"attention, context {max_context}, device {args.device}"
          + (f", sharded over {group.size} ranks" if group else ""))
    if args.retrieval and config.attn_impl != "ann":
        print("note: --retrieval only matters with ANN attention (--attn ann)")
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    max_new_tokens=args.max_new_tokens)
    # Preset answers are scored one by one, so they never see each other.
    history_turns = args.history_turns if args.mode == "chat" and not args.raw else 0
    session = Session(model, tokenizer, builder, sampling, history_turns, sys.stdout, group)
    if args.prompt is not None:
        session.say(f"👶: {args.prompt}")
        session.answer(args.prompt)
    elif args.mode == "preset":
        run_preset(session)
    else:
        run_chat(session)
    return 0


if __name__ == "__main__":
    sys.exit(main())
