"""Plain induction: can a model learn to copy at all? Random token ids, a span of P tokens repeated.

Each sequence is one span of P random ids (P drawn per batch from [min_span, max_span]) repeated
to the sequence length. The first reading cannot be predicted (its NLL stays near ln(vocab) or
above); every later token has its copy exactly P tokens back, so a model that has formed the
induction mechanism (find the earlier occurrence of the current token, copy what followed it)
brings the repeated readings' NLL near 0. With P varying, the distance cannot be learned as a
fixed offset: only a content match copies. With P beyond the ANN window every copy comes through
retrieved blocks.

Every batch is fresh random data, so the losses logged while training are held-out losses.
"""

import math

import torch
import torch.nn.functional as F

FIRST_TOKEN_ID = 3  # ids 0-2 are the special tokens (padding, begin, end)


def repeated_spans(generator, batch, length, min_span, max_span, vocab):
    """-> (ids (batch, length) LongTensor, span P): one random span per row, repeated to `length`."""
    span = int(torch.randint(min_span, max_span + 1, (1,), generator=generator))
    spans = torch.randint(FIRST_TOKEN_ID, vocab, (batch, span), generator=generator)
    return spans.repeat(1, math.ceil(length / span))[:, :length], span


def reading_losses(logits, ids, span):
    """logits (b, s, vocab), ids (b, s), span P -> (first reading NLL, repeated readings NLL).

    The first reading is tokens 1..P-1 (token 0 has no prediction); the repeated ones are P+1 on.
    Token P, the second reading's first, is left out: the token before it (P-1) occurred only once,
    so nothing earlier says what follows it.
    """
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return nll[:, : span - 1].mean().item(), nll[:, span:].mean().item()


def train_induction(model, steps, lr, batch, length, min_span, max_span, seed, log_every=25, on_row=None, held=()):
    """Train `model` on repeated random spans with AdamW (constant lr, clip 1.0); the parameters in
    `held` keep their values and stay out of the gradient-norm clip.

    -> rows [{"step", "loss", "first_nll", "repeated_nll"}] every `log_every` steps and at the last,
    each measured on that step's batch before the update; on_row(row) is called with each as it comes.
    """
    if not 2 <= min_span <= max_span or 2 * max_span > length:
        raise ValueError(f"spans must satisfy 2 <= {min_span} <= {max_span} and two readings of the longest "
                         f"must fit in {length} tokens")
    generator = torch.Generator().manual_seed(seed)
    held_ids = {id(weights) for weights in held}
    trained = [weights for weights in model.parameters() if id(weights) not in held_ids]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    vocab, device = model.config.vocab_size, next(model.parameters()).device
    rows = []
    model.train()
    for step in range(steps + 1):
        ids, span = repeated_spans(generator, batch, length, min_span, max_span, vocab)
        ids = ids.to(device)
        output = model(input_ids=ids, labels=ids)
        if step % log_every == 0 or step == steps:
            first, repeated = reading_losses(output.logits.detach(), ids, span)
            rows.append({"step": step, "loss": round(output.loss.item(), 4), "first_nll": round(first, 4),
                         "repeated_nll": round(repeated, 4)})
            if on_row:
                on_row(rows[-1])
        if step == steps:
            break
        output.loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return rows
