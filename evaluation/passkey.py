"""The passkey retrieval task in one place: its wording, the documents the long-context recipe
trains on, the prompts the evaluation asks and how an answer is read.

A passkey text (Landmark Attention format) is an instruction, filler sentences with one key line
hidden among them, and the question; a training document also holds the answer, the evaluation's
prompt stops right before it. Data building (scripts/make_sample_data.py) and evaluation
(scripts/eval_passkey.py, scripts/probe_copying.py) take the wording from here, so a model is
asked exactly what it was trained on.
"""

import re
from dataclasses import dataclass

PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
                 "Find it and memorize them. I will quiz you about the important information there.")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"
KEY_DIGITS = 5
ANSWERED_QUESTION = re.compile(re.escape(PASSKEY_QUESTION) + rf" (\d{{{KEY_DIGITS}}})\.")


@dataclass(frozen=True)
class PasskeyTexts:
    intro: str
    filler: str
    key_line: str  # formatted with key=...
    question: str
    joiner: str  # between the parts: a space in English, nothing in Chinese


PASSKEY_TEXTS = {
    "en": PasskeyTexts(
        intro=PASSKEY_INTRO,
        filler=PASSKEY_FILLER,
        key_line=PASSKEY_KEY_LINE,
        question=PASSKEY_QUESTION,
        joiner=" ",
    ),
    "zh": PasskeyTexts(
        intro="在大量无关的文字中藏着一条重要信息。找到它并记住它。我会就其中的重要信息考你。",
        filler="草是绿的。天是蓝的。太阳是黄的。我们出发吧。去了又回来。",
        key_line="通行密钥是{key}。记住它。{key}是通行密钥。",
        question="通行密钥是什么？通行密钥是",
        joiner="",
    ),
}


def random_key(rng):
    """A key of KEY_DIGITS digits, the first not 0, drawn from a random.Random."""
    return rng.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS - 1)


def answered_question(key):
    """The question with its answer, as training text writes it (ANSWERED_QUESTION matches it)."""
    return f"{PASSKEY_QUESTION} {key}."


# ----------------------------------------------------------------------------- training documents


def passkey_document(rng, num_fillers, num_questions=1):
    """Intro, fillers, the key line at a random depth, more fillers, the question and its answer.

    With num_questions > 1 the question (and answer) also comes earlier, at random points among
    the fillers after the key line; the document still ends with it, as the evaluation's prompt does.
    """
    key = random_key(rng)
    depth = rng.randint(0, num_fillers)
    after_key = num_fillers - depth
    earlier_questions = sorted(rng.randint(0, after_key) for _ in range(num_questions - 1))
    parts = [PASSKEY_INTRO] + [PASSKEY_FILLER] * depth + [PASSKEY_KEY_LINE.format(key=key)]
    fillers_so_far = 0
    for at in earlier_questions + [after_key]:
        parts += [PASSKEY_FILLER] * (at - fillers_so_far) + [answered_question(key)]
        fillers_so_far = at
    return " ".join(parts)


def make_passkey(rng, num_docs, min_fillers=4, max_fillers=31):
    # The filler is ~29 tokens and the rest ~95, so 4..31 fillers give roughly 200..1000-token documents.
    for _ in range(num_docs):
        yield {"text": passkey_document(rng, rng.randint(min_fillers, max_fillers))}


def make_passkey_training(rng, num_docs, drill_fraction=0.4, max_fillers=10, max_questions=1):
    """The long-context recipe's data (scripts/train_long_context.sh): passkey documents of 0 ..
    max_fillers fillers (~100-420 tokens) that ask for the key 1 .. max_questions times, mixed with
    drills of 2-6 keys, each asked right away.

    A drill puts a copy target in every ~5th token, so the copying circuit forms in a few hundred
    steps; the documents then teach fetching the key from beyond the window. Asking several times
    multiplies the answers whose first digit must come from a retrieved block: with a 16-token
    window that gave the recipe's model both halves of the copy (docs/LONG_CONTEXT_EXPERIMENTS.md), so the
    recipe asks 1-4 times (max_questions 4).
    """
    for _ in range(num_docs):
        if rng.random() < drill_fraction:
            keys = [random_key(rng) for _ in range(rng.randint(2, 6))]
            yield {"text": " ".join(f"{PASSKEY_KEY_LINE.format(key=key)} {answered_question(key)}" for key in keys)}
        else:
            num_fillers = rng.randint(0, max_fillers)
            # No draw for the question count when it is fixed: the recipe's file stays what it was.
            num_questions = rng.randint(1, max_questions) if max_questions > 1 else 1
            yield {"text": passkey_document(rng, num_fillers, num_questions)}


# ----------------------------------------------------------------------------- evaluation prompts


def filler_sentences(texts):
    """The filler split into its sentences, so a prompt can stop mid-filler on a sentence boundary."""
    return [sentence for sentence in re.split(r"(?<=[.。])\s*", texts.filler) if sentence]


def prompt_text(texts, num_sentences, key_after, key):
    """Instruction, num_sentences filler sentences with the key line after the first key_after, question."""
    sentences = filler_sentences(texts)
    filler = [sentences[i % len(sentences)] for i in range(num_sentences)]
    parts = [texts.intro, *filler[:key_after], texts.key_line.format(key=key), *filler[key_after:], texts.question]
    return texts.joiner.join(parts)


def build_prompt(tokenizer, length, depth, key, lang="en"):
    """Token ids of a passkey prompt of about `length` tokens with the key line at `depth` (0..1).

    Whole filler sentences are added or removed until the prompt is as close to `length` as they
    allow (within half a sentence, ~3 tokens); the key line goes after round(depth * sentences).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    texts = PASSKEY_TEXTS[lang]

    def encode(num_sentences):
        text = prompt_text(texts, num_sentences, round(depth * num_sentences), key)
        # verbose=False: the tokenizer would warn that prompts longer than its nominal limit overflow.
        return tokenizer(text, add_special_tokens=False, verbose=False).input_ids

    shortest = len(encode(0))
    if length < shortest:
        raise ValueError(f"a {lang} passkey prompt needs at least {shortest} tokens, asked for {length}")
    cycle = len(filler_sentences(texts))
    tokens_per_sentence = (len(encode(cycle)) - shortest) / cycle
    num_sentences = round((length - shortest) / tokens_per_sentence)
    ids = encode(num_sentences)
    # The estimate is off by a sentence or two at most; walk to the closest count.
    step = 1 if len(ids) < length else -1
    while num_sentences + step >= 0:
        candidate = encode(num_sentences + step)
        if abs(len(candidate) - length) >= abs(len(ids) - length):
            break
        num_sentences, ids = num_sentences + step, candidate
    return ids


# ----------------------------------------------------------------------------- answers


def parse_answer(text):
    """The first integer in the text (digits may touch letters), or None."""
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def digits_right(key, text):
    """How many of the key's digits the answer (its first integer) has at the same place: tells a
    model that misses one digit from one that retrieves nothing."""
    answer = parse_answer(text)
    return 0 if answer is None else sum(a == b for a, b in zip(str(key), str(answer)))
