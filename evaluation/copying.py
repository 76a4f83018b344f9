"""Which part of copying a model has learned: the loss on each passkey answer digit, by kind and
distance, and the loss on a real-text passage read again (repeated_passage_losses).

Every answer "What is the pass key? The pass key is 71432." splits two ways:
  - first digit (` 7`, the token after "key is": the only space-prefixed digit) vs the four later
    ones (`1`, `4`, `3`, `2`: the token after a digit), and the later ones again by whether the
    digit before them occurs once in the key or more (in 22429, "the digit after 2" is ambiguous
    to a copy that matches one token, so those digits need the token before it too);
  - whether the key's last mention before the answer is within a split distance (by default the
    ANN window) or beyond it (then only retrieved blocks hold it).
"""

import random

import torch
import torch.nn.functional as F

from evaluation.passkey import ANSWERED_QUESTION, KEY_DIGITS, make_passkey_training


def answer_spans(text):
    """text -> [(answer's first char, char of the key's previous mention)] for every answer."""
    spans = []
    for match in ANSWERED_QUESTION.finditer(text):
        start, key = match.start(1), match.group(1)
        spans.append((start, text.rfind(key, 0, start)))
    return spans


def after_repeated_digit(key):
    """'22429' -> [True, True, False, True]: for each later digit, whether the digit before it occurs
    more than once in the key."""
    return [key.count(previous) > 1 for previous in key[:-1]]


def digit_losses(model, tokenizer, text, window):
    """One text -> [(beyond_window, first digit NLL, [later digit NLLs], key)] for its answers whose
    digits are single tokens (the shipped tokenizer writes ` 71432` as ` 7` `1` `4` `3` `2`)."""
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    token_at = {}
    for index, (begin, end) in enumerate(offsets):
        for char in range(begin, end):
            token_at.setdefault(char, index)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    nll = F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="none")
    results = []
    for start, mention in answer_spans(text):
        first, previous = token_at[start], token_at[mention]
        digits = ids[first : first + KEY_DIGITS]
        if tokenizer.decode(digits).strip() != text[start : start + KEY_DIGITS]:
            continue
        losses = nll[first - 1 : first - 1 + KEY_DIGITS].tolist()
        results.append((first - previous > window, losses[0], losses[1:], text[start : start + KEY_DIGITS]))
    return results


def probe(model, tokenizer, num_docs, seed, split=None):
    """-> {(beyond split, "first" | "later" | "after unique" | "after repeated"): (mean NLL, count)}
    over num_docs held-out documents in the training format (drills and passkey documents that ask
    once, from their own seed); split: tokens between mention and answer that count as beyond
    (default: the model's window)."""
    window = split or model.config.ann_window
    sums = {}
    for record in make_passkey_training(random.Random(f"probe:{seed}"), num_docs, max_questions=1):
        for beyond, first, later, key in digit_losses(model, tokenizer, record["text"], window):
            repeated = after_repeated_digit(key)
            parts = (("first", [first]), ("later", later),
                     ("after unique", [loss for loss, ambiguous in zip(later, repeated) if not ambiguous]),
                     ("after repeated", [loss for loss, ambiguous in zip(later, repeated) if ambiguous]))
            for part, values in parts:
                total, count = sums.get((beyond, part), (0.0, 0))
                sums[(beyond, part)] = (total + sum(values), count + len(values))
    return {key: (total / count, count) for key, (total, count) in sums.items()}


def repeated_passage_losses(model, passages, length):
    """How much a model gains from having read a passage before: the induction test on real text.

    passages: token-id lists of P tokens each; each is repeated to `length` tokens and scored ->
    (mean NLL of the first reading's tokens, mean NLL of the repeated readings' tokens). A model that
    copies from P tokens back brings the second number near 0; one that cannot, near the first.
    """
    first, repeated = [], []
    device = next(model.parameters()).device
    for passage in passages:
        ids = torch.tensor((passage * (length // len(passage) + 1))[:length], device=device)[None]
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        nll = F.cross_entropy(logits.float(), ids[0, 1:], reduction="none")
        first.append(nll[: len(passage) - 1])
        repeated.append(nll[len(passage) - 1 :])
    return torch.cat(first).mean().item(), torch.cat(repeated).mean().item()
