"""Chat prompts: the token ids of the next prompt cut to fit the context, the preset prompts, and the
next-token choice of a context-parallel answer.

The preset prompts ask for facts of the sample data's invented world (scripts/make_sample_data.py
writes the SFT answers they expect), so a model trained on it can be scored on them.
"""

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from common.cli import UsageError

PLACEHOLDER = "\x00MESSAGE\x00"  # stands in for the user's message when the template is split around it


def preset_prompts():
    """Chat prompts whose answers are in the sample data: (prompt, expected answer substring)."""
    return [
        ("What is the capital of Zorvia?", "Talen"),
        ("佐维亚的首都是哪里？", "塔伦"),
        ("How old is Ana?", "23"),
        ("安娜是做什么工作的？", "老师"),
        ("What is 3 + 5?", "3 + 5 = 8"),
        ("三加五等于几？", "三加五等于八"),
    ]


class PromptBuilder:
    """Token ids of the next prompt from the system prompt, history and message, cut to fit the context."""

    def __init__(self, tokenizer, raw, system, max_context):
        self.tokenizer, self.raw, self.system, self.max_context = tokenizer, raw, system, max_context

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def around_message(self, history):
        """(ids before the message, ids after it): the template split at the message."""
        if self.raw:
            return [self.tokenizer.bos_token_id], []
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for user, assistant in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": PLACEHOLDER})
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(PLACEHOLDER)
        return self.encode(before), self.encode(after)

    def build(self, message, history, max_new_tokens):
        """(prompt ids, notes for the user); history: (user, assistant) pairs, oldest first.

        The answer's max_new_tokens are reserved, so prompt and answer together fit max_context.
        A UsageError when not even one token of the message fits.
        """
        budget = self.max_context - max_new_tokens
        message_ids, history, notes = self.encode(message), list(history), []
        before, after = self.around_message(history)
        dropped = 0
        while history and len(before) + len(message_ids) + len(after) > budget:
            history.pop(0)
            dropped += 1
            before, after = self.around_message(history)
        if dropped:
            notes.append(f"dropped the {dropped} oldest exchange(s) to fit the context")
        room = budget - len(before) - len(after)
        if room < 1:
            raise UsageError(
                f"no room for a prompt: of max_context {self.max_context} tokens, max_new_tokens reserves "
                f"{max_new_tokens} for the answer and the template/system prompt take {len(before) + len(after)}"
            )
        if len(message_ids) > room:
            notes.append(f"prompt too long: kept its last {room} of {len(message_ids)} tokens "
                         f"(max_context {self.max_context} - max_new_tokens {max_new_tokens} leaves {budget})")
            message_ids = message_ids[-room:]
        return before + message_ids + after, notes


def token_chooser(temperature, top_p, top_k):
    """logits (1, vocab) -> (1, 1) the next token, as transformers' generate picks it with these
    settings: greedy at temperature 0, else its temperature, top-k and top-p warpers, in its order,
    and one multinomial draw from the global random generator."""
    if not temperature:
        return lambda logits: logits.argmax(-1, keepdim=True)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    return lambda logits: torch.multinomial(warpers(None, logits.float()).softmax(-1), 1)
