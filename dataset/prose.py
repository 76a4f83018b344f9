"""Real prose for long-context training and evaluation: the corpus files, their split by position
into a training part and a held-out part, sentence pieces, and haystacks measured in tokens.

The corpus is three public-domain texts (kjv.txt and tinyshakespeare.txt in English, sanguo.txt in
Chinese) read from a data folder, never copied into the repo. The last HELDOUT_FRACTION of each
file (from the first line break after that point) is held out: it is never trained on, and held-out
loss and needle haystacks are cut from it. A haystack longer than a language's held-out text
continues with its training text, and wraps around when even the whole corpus is too short; every
haystack says how many of its tokens were held out (HaystackSpan).
"""

import re
from dataclasses import dataclass
from pathlib import Path

from common.cli import UsageError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
SOURCES = {"kjv": "en", "tinyshakespeare": "en", "sanguo": "zh"}  # file stem -> language
LANGS = ("en", "zh")
HELDOUT_FRACTION = 0.1
# A sentence runs to its closing punctuation, the quotes that close with it and the whitespace after
# it, so the pieces of a text join back into exactly that text.
SENTENCE = re.compile(r"[^.!?。！？]*[.!?。！？]+[\"'”’」』）)]*\s*|[^.!?。！？]+\Z")
TOKENIZE_BATCH = 2048  # pieces whose token counts are computed together


def read_corpus(data_dir, sources=tuple(SOURCES)):
    """{source name: text} for the named sources of data_dir; a missing file is a UsageError."""
    texts = {}
    for name in sources:
        path = Path(data_dir) / f"{name}.txt"
        if not path.is_file():
            raise UsageError(f"{path}: text file not found (the prose corpus needs {', '.join(sources)})")
        texts[name] = path.read_text(encoding="utf-8-sig")
    return texts


def heldout_start(text, fraction=HELDOUT_FRACTION):
    """Index of the held-out part's first character: the first line start at or after (1 - fraction)
    of the text, so neither part ends mid-line (a text without a later line break is cut right there)."""
    at = int(len(text) * (1 - fraction))
    newline = text.find("\n", max(at - 1, 0))
    return at if newline < 0 else newline + 1


def split_text(text, fraction=HELDOUT_FRACTION):
    """(training part, held-out part): text[:heldout_start], text[heldout_start:]."""
    cut = heldout_start(text, fraction)
    return text[:cut], text[cut:]


def sentences(text):
    """The text cut after each sentence's end ("".join of the pieces is the text)."""
    return [match.group() for match in SENTENCE.finditer(text)]


@dataclass(frozen=True)
class HaystackSpan:
    """Which pieces a haystack took: piece indices in reading order, its held-out token count, and
    whether it wrapped around the whole corpus (then some text occurs twice)."""
    indices: tuple
    tokens: int
    heldout_tokens: int
    wrapped: bool


class PieceStream:
    """Sentence pieces of one language in reading order, held-out pieces first, with their token
    counts (computed lazily, a batch at a time, so a short haystack tokenizes a short stretch).

    A stream is read from a start among its first `rotate` pieces: pieces[start:rotate] and
    pieces[:start] come first, the rest after, and reading wraps around at the end. Held-out
    haystacks rotate within the held-out pieces, so every haystack uses all of them before any
    training text; training haystacks have rotate = len(pieces).
    """

    def __init__(self, pieces, heldout, tokenizer):
        """pieces: list of str; heldout: how many leading pieces are held-out text."""
        if not pieces:
            raise ValueError("a piece stream needs at least one piece")
        self.pieces, self.heldout, self.tokenizer = pieces, heldout, tokenizer
        self.counts = [None] * len(pieces)

    @property
    def rotate(self):
        return self.heldout or len(self.pieces)

    def index(self, start, position):
        """The piece read `position`-th from `start` (0 <= start < rotate)."""
        position %= len(self.pieces)
        return (start + position) % self.rotate if position < self.rotate else position

    def token_count(self, i):
        if self.counts[i] is None:
            batch = range(i, min(i + TOKENIZE_BATCH, len(self.pieces)))
            encoded = self.tokenizer([self.pieces[j] for j in batch], add_special_tokens=False).input_ids
            for j, ids in zip(batch, encoded):
                self.counts[j] = len(ids)
        return self.counts[i]

    def take(self, start, num_tokens):
        """A HaystackSpan of whole pieces read from `start` until they hold >= num_tokens tokens."""
        indices, tokens, heldout_tokens, position = [], 0, 0, 0
        while tokens < num_tokens:
            i = self.index(start, position)
            count = self.token_count(i)
            indices.append(i)
            tokens += count
            heldout_tokens += count if i < self.heldout else 0
            position += 1
        return HaystackSpan(tuple(indices), tokens, heldout_tokens, position > len(self.pieces))

    def texts(self, span, count=None):
        """The texts of the span's first `count` pieces (all by default)."""
        return [self.pieces[i] for i in span.indices[:count]]


def language_texts(corpus, lang):
    """(training texts, held-out texts) of the corpus's sources in `lang`, in SOURCES order."""
    parts = [split_text(text) for name, text in corpus.items() if SOURCES[name] == lang]
    return [train for train, _ in parts], [heldout for _, heldout in parts]


def heldout_stream(corpus, lang, tokenizer):
    """The language's held-out sentences, then its training sentences (for haystacks longer than
    the held-out text)."""
    train_texts, heldout_texts = language_texts(corpus, lang)
    heldout = [piece for text in heldout_texts for piece in sentences(text)]
    train = [piece for text in train_texts for piece in sentences(text)]
    return PieceStream(heldout + train, len(heldout), tokenizer)


def training_stream(corpus, lang, tokenizer):
    """The language's training sentences only."""
    train_texts, _ = language_texts(corpus, lang)
    return PieceStream([piece for text in train_texts for piece in sentences(text)], 0, tokenizer)


def corpus_languages(corpus):
    """The languages the corpus's sources cover, in LANGS order."""
    present = {SOURCES[name] for name in corpus}
    return [lang for lang in LANGS if lang in present]


def prose_chunks(stream, chunk_tokens):
    """The stream's pieces in order, cut into consecutive documents of whole pieces holding at most
    chunk_tokens tokens each (a longer piece is a document of its own): {"text", "tokens"}."""
    texts, tokens = [], 0
    for i, piece in enumerate(stream.pieces):
        count = stream.token_count(i)
        if texts and tokens + count > chunk_tokens:
            yield {"text": "".join(texts), "tokens": tokens}
            texts, tokens = [], 0
        texts.append(piece)
        tokens += count
    if texts:
        yield {"text": "".join(texts), "tokens": tokens}


COPY_PASSAGE_WORDS = (4, 48)  # words of a copy document's passage (Chinese: characters)


def copy_documents(rng, streams, tokenizer, count, min_tokens, max_tokens):
    """`count` copy documents {"text", "lang", "tokens"}: a passage of words drawn at random from a
    random stretch of training prose (streams: {lang: PieceStream}), in random order, repeated until
    the document holds min_tokens..max_tokens tokens. Its first reading cannot be predicted and every
    later one is a copy from one passage back: the loss is all copying (induction warm-up)."""
    langs = sorted(streams)
    for _ in range(count):
        lang = rng.choice(langs)
        stream = streams[lang]
        span = stream.take(rng.randrange(stream.rotate), 256)
        text = "".join(stream.texts(span))
        words = text.split() if lang == "en" else [char for char in text if not char.isspace() and char != "。"]
        passage = [rng.choice(words) for _ in range(rng.randint(*COPY_PASSAGE_WORDS))]
        passage = (" " if lang == "en" else "").join(passage) + ("\n" if lang == "en" else "。")
        target = rng.randint(min_tokens, max_tokens)
        passage_tokens = len(tokenizer(passage, add_special_tokens=False).input_ids)
        document = passage * max(2, round(target / passage_tokens))
        yield {"text": document, "lang": lang, "tokens": len(tokenizer(document, add_special_tokens=False).input_ids)}
