"""Needle tasks in real prose (RULER style, Hsieh et al. 2024) in one place: their wording in English
and Chinese, how needles are drawn and hidden in a haystack, how a prompt is cut to a length in
tokens, the training documents, and how an answer is read and scored.

Tasks:
    single      one key sentence ("The special magic number for amber falcon is 4821937.") asked
                for at the end
    multikey    2-8 key sentences with different labels, asked for one of them (the others are
                distractors)
    multivalue  one label with 2-4 numbers in separate sentences; the answer must hold them all

A document is an instruction, haystack sentences with the key sentences between them, and the
question; a training document also holds the answer, the evaluation's prompt stops right before it.
A drill (training only) is a multikey document whose every key sentence is followed at once by its
own question and answer: a copy target every few dozen tokens, each a short way back, where a
needle document holds one at its end.
Numbers have 5-7 digits (the first not 0; optionally no digit twice) and differ within a document; labels are an adjective and
a noun from word lists. Everything is drawn from a random.Random, so a seed fixes a document.
Data building (scripts/make_prose_data.py) and evaluation (scripts/eval_needles.py) both take the
wording from here, so a model is asked exactly what it was trained on.
"""

import random
import re
from dataclasses import dataclass

from dataset.prose import HaystackSpan

TASKS = ("single", "multikey", "multivalue")
KEY_RANGE = {"single": (1, 1), "multikey": (2, 8), "multivalue": (1, 1)}  # key sentences with distinct labels
VALUE_RANGE = {"single": (1, 1), "multikey": (1, 1), "multivalue": (2, 4)}  # numbers per label
DIGITS_RANGE = (5, 7)


@dataclass(frozen=True)
class NeedleTexts:
    intro: str
    key: str  # formatted with label=..., value=...
    multivalue_key: str
    question: str  # formatted with label=...
    multivalue_question: str
    value_separator: str  # between the numbers of a multivalue answer
    answer_end: str
    joiner: str  # between the parts: a space in English, nothing in Chinese
    adjectives: tuple
    nouns: tuple


NEEDLE_TEXTS = {
    "en": NeedleTexts(
        intro=("Some special magic numbers are hidden within the following text. Make sure to memorize "
               "them. I will quiz you about the numbers afterwards."),
        key="The special magic number for {label} is {value}.",
        multivalue_key="One of the special magic numbers for {label} is {value}.",
        question="What is the special magic number for {label}? The special magic number for {label} is",
        multivalue_question=("What are all the special magic numbers for {label}? "
                             "The special magic numbers for {label} are"),
        value_separator=", ",
        answer_end=".",
        joiner=" ",
        adjectives=("amber", "silver", "quiet", "crimson", "hollow", "golden", "frozen", "velvet", "ancient",
                    "bitter", "distant", "gentle", "hidden", "iron", "lucky", "misty", "northern", "pale"),
        nouns=("falcon", "lantern", "river", "meadow", "harbor", "orchard", "tower", "violin", "compass",
               "garden", "mirror", "anchor", "forest", "candle", "bridge", "saddle", "beacon", "kettle"),
    ),
    "zh": NeedleTexts(
        intro="下面的文字里藏着一些特别的魔法数字。请记住它们，之后我会考你这些数字。",
        key="特别魔法数字中，{label}是{value}。",
        multivalue_key="特别魔法数字之一，{label}是{value}。",
        question="特别魔法数字中，{label}是多少？特别魔法数字中，{label}是",
        multivalue_question="特别魔法数字中，{label}都有哪些？特别魔法数字中，{label}是",
        value_separator="、",
        answer_end="。",
        joiner="",
        adjectives=("金色", "银色", "安静", "深红", "古老", "遥远", "温柔", "隐秘", "铁制", "幸运", "北方",
                    "苍白", "寒冷", "青色", "明亮", "孤独", "高大", "细长"),
        nouns=("猎鹰", "灯笼", "河流", "草地", "港口", "果园", "高塔", "琵琶", "罗盘", "花园", "铜镜", "船锚",
               "森林", "蜡烛", "石桥", "马鞍", "烽火", "茶壶"),
    ),
}


@dataclass(frozen=True)
class Needles:
    """What one document hides and asks: key sentences (label, value, depth in 0..1) and the label
    asked for; the answer is every value of that label, in the order the text holds them."""
    task: str
    lang: str
    sentences: tuple  # ((label, value, depth), ...)
    asked: str
    drilled: bool = False  # each key sentence followed by its question and answer

    @property
    def values(self):
        return tuple(value for label, value, _ in self.ordered() if label == self.asked)

    def ordered(self):
        """The key sentences in text order (by depth; ties keep drawing order)."""
        return sorted(self.sentences, key=lambda sentence: sentence[2])


def check_task(task, lang):
    if task not in TASKS:
        raise ValueError(f"unknown needle task {task!r}; choose from {', '.join(TASKS)}")
    if lang not in NEEDLE_TEXTS:
        raise ValueError(f"unknown language {lang!r}; choose from {', '.join(NEEDLE_TEXTS)}")


def random_value(rng, taken, distinct_digits=False):
    """A number of 5-7 digits, the first not 0, not in `taken`; with distinct_digits no digit
    twice, from the same draws of `rng`, so what a document draws after it does not change."""
    while True:
        digits = rng.randint(*DIGITS_RANGE)
        value = rng.randint(10 ** (digits - 1), 10**digits - 1)
        if distinct_digits:
            value = without_repeated_digits(value)
        if value not in taken:
            return value


def without_repeated_digits(value):
    """A number as long as `value`, no digit twice, the first not 0, chosen by `value`."""
    pick = random.Random(value)
    first = pick.choice("123456789")
    rest = pick.sample([digit for digit in "0123456789" if digit != first], len(str(value)) - 1)
    return int(first + "".join(rest))


def draw_needles(rng, task, lang, depth, num_keys=None, num_values=None, drilled=False, distinct_digits=False):
    """The needles of one document: the asked-for sentence (multivalue: the first of its label's)
    at `depth`, every other key sentence at a depth drawn uniformly from 0..1.

    num_keys / num_values default to a draw from the task's range (KEY_RANGE, VALUE_RANGE).
    drilled: a drill (multikey only): every key sentence is asked right after it.
    distinct_digits: numbers with no digit twice (random_value), the document otherwise the same.
    """
    check_task(task, lang)
    if drilled and task != "multikey":
        raise ValueError(f"a drill is a multikey document, got task {task!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    texts = NEEDLE_TEXTS[lang]
    num_keys = rng.randint(*KEY_RANGE[task]) if num_keys is None else num_keys
    num_values = rng.randint(*VALUE_RANGE[task]) if num_values is None else num_values
    for name, count, (low, high) in (("keys", num_keys, KEY_RANGE[task]), ("values", num_values, VALUE_RANGE[task])):
        if not low <= count <= high:
            raise ValueError(f"{task} takes {low}-{high} {name}, got {count}")
    labels = [f"{adjective}{texts.joiner}{noun}" for adjective, noun in
              zip(rng.sample(texts.adjectives, num_keys), rng.sample(texts.nouns, num_keys))]
    asked = labels[rng.randrange(num_keys)]
    taken, sentences = set(), []
    for label in labels:
        for index in range(num_values):
            value = random_value(rng, taken, distinct_digits)
            taken.add(value)
            if label == asked and index == 0:
                at = depth
            else:
                # A multivalue label's other numbers lie after the one at `depth`.
                at = rng.uniform(depth, 1.0) if task == "multivalue" else rng.random()
            sentences.append((label, value, at))
    return Needles(task, lang, tuple(sentences), asked, drilled)


def key_sentence(needles, label, value):
    texts = NEEDLE_TEXTS[needles.lang]
    template = texts.multivalue_key if needles.task == "multivalue" else texts.key
    return template.format(label=label, value=value)


def question(needles, label=None):
    """The question for `label` (default: the asked one)."""
    texts = NEEDLE_TEXTS[needles.lang]
    template = texts.multivalue_question if needles.task == "multivalue" else texts.question
    return template.format(label=needles.asked if label is None else label)


def inserted_text(needles, label, value):
    """What goes into the haystack for one key sentence: the sentence, in a drill followed by its
    question and answer ("... is 4821937. What is ...? The special magic number for L is 4821937.")."""
    sentence = key_sentence(needles, label, value)
    if not needles.drilled:
        return sentence
    texts = NEEDLE_TEXTS[needles.lang]
    return texts.joiner.join([sentence, question(needles, label)]) + texts.joiner + str(value) + texts.answer_end


def answer(needles):
    """What follows the prompt in a training document: " 4821937." / "4821937。", for multivalue
    every value joined (" 123456, 98765." / "123456、98765。")."""
    texts = NEEDLE_TEXTS[needles.lang]
    return texts.joiner + texts.value_separator.join(map(str, needles.values)) + texts.answer_end


def prompt_text(needles, pieces):
    """Instruction, the haystack pieces with each key sentence after round(depth * len(pieces)) of
    them (at a sentence boundary), and the question."""
    texts = NEEDLE_TEXTS[needles.lang]
    inserts = {}
    for label, value, at in needles.ordered():
        inserts.setdefault(round(at * len(pieces)), []).append(inserted_text(needles, label, value))
    parts = [texts.intro + texts.joiner]
    for index in range(len(pieces) + 1):
        for sentence in inserts.get(index, []):
            if texts.joiner and not parts[-1][-1:].isspace():
                parts.append(texts.joiner)
            parts.append(sentence + texts.joiner)
        if index < len(pieces):
            parts.append(pieces[index])
    return "".join(parts).rstrip() + texts.joiner + question(needles)


def fit_pieces(tokenizer, needles, span_texts, length, counts=None):
    """(token ids, pieces used): the prompt of `needles` over a prefix of span_texts whose token
    count is as close to `length` as whole pieces allow (within about one piece).

    span_texts must hold at least `length` tokens; the number of pieces is estimated from their
    token counts (`counts`, computed when not given) and corrected by encoding the whole prompt a
    few times.
    """
    def encode(count):
        # verbose=False: prompts longer than the tokenizer's nominal limit would warn.
        return tokenizer(prompt_text(needles, span_texts[:count]), add_special_tokens=False, verbose=False).input_ids

    fixed = len(encode(0))
    if length < fixed:
        raise ValueError(f"a {needles.lang} {needles.task} prompt with {len(needles.sentences)} key sentences "
                         f"needs at least {fixed} tokens, asked for {length}")
    if counts is None:
        counts = [len(ids) for ids in tokenizer(list(span_texts), add_special_tokens=False).input_ids]
    best, tried, budget = None, set(), length - fixed
    while True:
        # As many pieces as the token budget holds; the budget is corrected by what encoding found.
        count, running = 0, 0
        while count < len(span_texts) and running + counts[count] <= budget:
            running += counts[count]
            count += 1
        if count in tried:
            break
        tried.add(count)
        ids = encode(count)
        if best is None or abs(len(ids) - length) < abs(len(best[0]) - length):
            best = (ids, count)
        if len(ids) == length:
            break
        budget += length - len(ids)
    return best


# ----------------------------------------------------------------------------- answers


NUMBER = re.compile(r"\d+")


def parse_numbers(text):
    """Every integer in the text, in order (digits may touch letters or Chinese)."""
    return [int(match) for match in NUMBER.findall(text)]


def score(needles, text):
    """1.0 when the answer is right, else 0.0: single and multikey, the first integer of the text
    is the asked value; multivalue, every value of the label is among the text's integers."""
    numbers = parse_numbers(text)
    if needles.task == "multivalue":
        return float(set(needles.values) <= set(numbers))
    return float(bool(numbers) and numbers[0] == needles.values[0])


def other_values(needles):
    """The numbers of every label but the asked one, in text order (multikey's distractors)."""
    return tuple(value for label, value, _ in needles.ordered() if label != needles.asked)


def answered_other_key(needles, text):
    """True when the answer's first integer is another label's number: the model copied a
    distractor, rather than garbling or inventing a number."""
    numbers = parse_numbers(text)
    return bool(numbers) and numbers[0] in other_values(needles)


# ----------------------------------------------------------------------------- documents in a haystack


def build_prompt(tokenizer, stream, needles, length, start, passage_tokens=None):
    """(token ids, HaystackSpan of the pieces used): the prompt of `needles` at about `length`
    tokens over the pieces `stream` (dataset/prose.py's PieceStream) reads from `start`.

    With passage_tokens, the haystack is one passage of whole pieces holding at least that many
    tokens, read from `start` and repeated: a haystack whose only surprise is the key sentences, as
    in passkey filler, but in real prose.

    Pieces tokenized one by one take a few percent more tokens than joined (a line break merges
    with what follows it), so the span is read with a margin; the span's token counts are the
    prompt's, split between held-out and training text in the proportion of the pieces' counts.
    """
    if passage_tokens is None:
        indices = stream.take(start, int(length * 1.1) + 64).indices
    else:
        passage = stream.take(start, passage_tokens)
        indices = passage.indices * (int(length * 1.1) // passage.tokens + 2)
    ids, count = fit_pieces(tokenizer, needles, [stream.pieces[i] for i in indices], length,
                            [stream.token_count(i) for i in indices])
    used = indices[:count]
    piece_tokens = sum(stream.token_count(i) for i in used)
    heldout_share = sum(stream.token_count(i) for i in used if i < stream.heldout) / max(piece_tokens, 1)
    wrapped = passage_tokens is None and len(used) > len(stream.pieces)
    return ids, HaystackSpan(used, len(ids), round(len(ids) * heldout_share), wrapped)


def shortest_prompt(tokenizer, task, lang):
    """Tokens of the task's longest fixed text (most keys and values, longest numbers) with no
    haystack: the least length a document of the task may ask for."""
    low, high = KEY_RANGE[task]
    texts = NEEDLE_TEXTS[lang]
    labels = [f"{adjective}{texts.joiner}{noun}" for adjective, noun in zip(texts.adjectives, texts.nouns)][:high]
    values_per_label = VALUE_RANGE[task][1]
    value = 10 ** DIGITS_RANGE[1] - 1
    sentences = tuple((label, value, 0.0) for label in labels for _ in range(values_per_label))
    needles = Needles(task, lang, sentences, labels[0])
    return len(tokenizer(prompt_text(needles, []) + answer(needles), add_special_tokens=False).input_ids)


DRILL_KEYS = (2, 6)
PASSAGE_TOKENS = (32, 96)  # a repeated haystack's passage: longer than a 16-token window, within top 4 blocks of 16


def training_documents(rng, streams, tokenizer, count, tasks, min_tokens, max_tokens, drill_fraction=0.0,
                       repeat_fraction=0.0):
    """`count` training documents {"text", "task", "lang", "tokens", "drill", "repeated"}: each a
    uniformly drawn task and language (streams: {lang: PieceStream of training prose}), length in
    min_tokens..max_tokens (prompt tokens; the answer follows), depth uniform in 0..1, haystack from
    a random piece. A share `drill_fraction` of them are drills (task multikey, DRILL_KEYS keys),
    lengthened where their key lines alone exceed the drawn length. A share `repeat_fraction` has a
    repeated haystack: one passage of PASSAGE_TOKENS tokens over and over (build_prompt)."""
    langs = sorted(streams)
    for _ in range(count):
        # No draw for a kind the mix does not hold: a mix without it stays what it was.
        repeated = repeat_fraction > 0 and rng.random() < repeat_fraction
        drilled = drill_fraction > 0 and rng.random() < drill_fraction
        task, lang = ("multikey" if drilled else rng.choice(tasks)), rng.choice(langs)
        needles = draw_needles(rng, task, lang, rng.random(), num_keys=rng.randint(*DRILL_KEYS) if drilled else None,
                               drilled=drilled)
        stream = streams[lang]
        length = rng.randint(min_tokens, max_tokens)
        if drilled:
            length = max(length, len(tokenizer(prompt_text(needles, []), add_special_tokens=False).input_ids) + 16)
        passage = rng.randint(*PASSAGE_TOKENS) if repeated else None
        ids, span = build_prompt(tokenizer, stream, needles, length, rng.randrange(stream.rotate), passage)
        text = prompt_text(needles, stream.texts(span)) + answer(needles)
        yield {"text": text, "task": task, "lang": lang, "tokens": len(ids), "drill": drilled, "repeated": repeated}
