"""Train the byte-level BPE tokenizer (vocab 6400, minimind-style) and save it for AutoTokenizer.

Reads JSONL files ({"text": ...} or {"conversations": [{"role", "content"}, ...]}) and plain .txt files.
The shipped model/tokenizer/ was trained on the sample pretrain + SFT data and, when present, on
/work/shared/data/tinyshakespeare.txt and sanguo.txt, so that real English and Chinese text used in
quality benchmarks also tokenizes compactly:

  python scripts/make_sample_data.py --out_dir dataset/sample
  python scripts/train_tokenizer.py --data dataset/sample/pretrain_hq.jsonl dataset/sample/sft_mini_512.jsonl \\
      /work/shared/data/tinyshakespeare.txt /work/shared/data/sanguo.txt --out model/tokenizer

The prose tokenizer (model/tokenizer_prose/, docs/LONG_CONTEXT.md) is trained on the training split
of the real prose only, with every digit a token of its own and a space before a digit joined to it
(--digits space_joined), so a number is copied one digit per token after a space, after Chinese
text or at a line start, and an English answer begins with its first digit; --measure compares it
with another tokenizer on held-out prose:

  python scripts/make_prose_data.py --split_only --out_dir dataset/prose
  python scripts/train_tokenizer.py --data dataset/prose/prose_train_*.txt --digits space_joined \
      --vocab_size 6400 --model_max_length 1048576 --out model/tokenizer_prose --measure dataset/prose/prose_heldout_*.txt

Special tokens: <|endoftext|>=0 (also pad and unk), <|im_start|>=1 (bos), <|im_end|>=2 (eos).
Encoding never adds special tokens by itself; the chat template (dataset/chat_messages.py) writes them explicitly.
"""
import argparse
import json
import random
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from dataset.chat_messages import CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def read_texts(path):
    """Yield training texts from a .jsonl (text or conversations) or a plain text file (by paragraph)."""
    path = Path(path)
    with open(path, encoding="utf-8-sig") as f:
        if path.suffix != ".jsonl":
            # Paragraph-sized chunks keep the iterator's items small without splitting words.
            yield from (chunk for chunk in f.read().split("\n\n") if chunk.strip())
            return
        for line in f:
            record = json.loads(line)
            if "text" in record:
                yield record["text"]
            else:
                yield "\n".join(message.get("content") or "" for message in record["conversations"])


SENTENCE_END = re.compile(r"(?<=[.?!。？！\n])")


def distinct_sentences(texts):
    """Each sentence once: the sample data repeats a few hundred template sentences thousands of
    times, and counted at face value they would fill the vocabulary with whole-sentence tokens."""
    seen = set()
    for text in texts:
        for sentence in SENTENCE_END.split(text):
            if sentence.strip() and sentence not in seen:
                seen.add(sentence)
                yield sentence


DIGIT_STYLES = ("bytes", "individual", "space_joined")
SPACE = "\u0120"  # byte-level BPE's spelling of a space
SPACE_DIGITS = tuple(SPACE + digit for digit in "0123456789")  # the tokens space_joined reserves


def digit_pre_tokenizer(digit_style):
    """How digits are split before byte-level BPE (`DIGIT_STYLES`):
    bytes         no special treatment: merges may join digits to each other and to a space;
    individual    every digit a piece of its own ("is 42" -> "is", " ", "4", "2");
    space_joined  every digit a piece of its own, a space right before it joined to it
                  ("is 42" -> "is", " 4", "2"), so a number after a space has no token of its own
                  before its first digit."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if digit_style == "bytes":
        return byte_level
    if digit_style == "individual":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if digit_style == "space_joined":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r" ?\p{N}"), behavior="isolated"), byte_level])
    raise ValueError(f"unknown digit style {digit_style!r}; choose from {', '.join(DIGIT_STYLES)}")


def with_space_digits(tokenizer):
    """The tokenizer with SPACE_DIGITS as tokens (ids after the trained vocabulary): the training
    text may hold too few numbers after a space for BPE to learn those merges itself."""
    spec = json.loads(tokenizer.to_str())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    pairs_as_lists = bool(merges) and isinstance(merges[0], list)
    for token in SPACE_DIGITS:
        if token not in vocab:
            vocab[token] = len(vocab)
            merges.append([SPACE, token[1]] if pairs_as_lists else f"{SPACE} {token[1]}")
    return Tokenizer.from_str(json.dumps(spec))


def train(data_paths, vocab_size, digit_style="bytes"):
    """A byte-level BPE of `vocab_size` tokens whose digits are split as `digit_style` says
    (digit_pre_tokenizer); space_joined reserves len(SPACE_DIGITS) of them for " 0" .. " 9"."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = digit_pre_tokenizer(digit_style)
    tokenizer.decoder = decoders.ByteLevel()
    reserved = len(SPACE_DIGITS) if digit_style == "space_joined" else 0
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - reserved,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (text for path in data_paths for text in read_texts(path))
    tokenizer.train_from_iterator(distinct_sentences(texts), trainer=trainer)
    if digit_style == "space_joined":
        tokenizer = with_space_digits(tokenizer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id, f"{token} must have id {expected_id}"
    return tokenizer


def save(tokenizer, out_dir, model_max_length):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        # Cleanup would rewrite " ." to "." and break exact decode(encode(x)) == x.
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")


def check_round_trip(out_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    for text in ["The capital of Zorvia is Talen.", "佐维亚的首都是塔伦。", "Mixed 中英文 text, 3 + 5 = 8 ! 🙂\n"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text, f"round trip failed for {text!r}"
        print(f"{len(ids):3d} tokens: {text!r}")


# ----------------------------------------------------------------------------- measurement

# Where a number may stand in a document: after an English word and a space, right after Chinese
# text, at the start of a line.
NUMBER_CONTEXTS = {"after a space": "The number is {n}.", "after Chinese": "魔法数字是{n}。", "line start": "\n{n}\n"}


def tokens_per_char(tokenizer, texts):
    """Tokens per character over the texts (lower is more compact)."""
    tokens = sum(len(tokenizer(text, add_special_tokens=False, verbose=False).input_ids) for text in texts)
    return tokens / max(sum(len(text) for text in texts), 1)


def number_pieces(tokenizer, template, number):
    """The tokens of template.format(n=number) that overlap `number`, as (token id, its text, whether
    it holds a character around the number too: a space, a Chinese character, the newline)."""
    text = template.format(n=number)
    start = text.index(str(number))
    end = start + len(str(number))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (token, text[low:high], low < start or high > end)
        for token, (low, high) in zip(encoding.input_ids, encoding.offset_mapping)
        if high > start and low < end
    ]


def number_tokens(tokenizer, template, number):
    """The tokens that spell `number` inside template.format(n=number), or None when a token also
    holds a character around the number."""
    pieces = number_pieces(tokenizer, template, number)
    return None if any(spills for _, _, spills in pieces) else tuple(token for token, _, _ in pieces)


def consistent_numbers(tokenizer, numbers):
    """The fraction of numbers spelled by the same tokens, none of them shared with a neighbour,
    in every context of NUMBER_CONTEXTS."""
    same = 0
    for number in numbers:
        spellings = {number_tokens(tokenizer, template, number) for template in NUMBER_CONTEXTS.values()}
        same += len(spellings) == 1 and None not in spellings
    return same / len(numbers)


def one_digit_per_token(tokenizer, template, number):
    """True when each token of `number` inside template.format(n=number) holds one of its digits, the
    first token possibly with the space before it (--digits space_joined), and nothing else."""
    texts = [text for _, text, _ in number_pieces(tokenizer, template, number)]
    return [texts[0].removeprefix(" "), *texts[1:]] == list(str(number))


def digit_numbers(tokenizer, numbers):
    """The fraction of numbers spelled one digit per token (one_digit_per_token) in every context of
    NUMBER_CONTEXTS: copying a number is copying its digits, wherever it stands."""
    return sum(all(one_digit_per_token(tokenizer, template, number) for template in NUMBER_CONTEXTS.values())
               for number in numbers) / len(numbers)


def measure(tokenizers, heldout_paths, num_numbers=200, seed=0):
    """Prints, per tokenizer ({name: tokenizer}): tokens per character of each held-out file and the
    shares of 5-7 digit numbers spelled the same way in every context and one digit per token in every
    context."""
    rng = random.Random(seed)
    numbers = [rng.randint(10 ** (digits - 1), 10**digits - 1) for digits in (rng.randint(5, 7) for _ in range(num_numbers))]
    texts = {Path(path).stem: Path(path).read_text(encoding="utf-8") for path in heldout_paths}
    print(f"{'tokenizer':<28} {'vocab':>6} " + " ".join(f"{name[:22]:>22}" for name in texts) + f" {'same number':>12} {'digit/token':>12}")
    for name, tokenizer in tokenizers.items():
        rates = [tokens_per_char(tokenizer, [text]) for text in texts.values()]
        print(f"{name:<28} {len(tokenizer):>6} " + " ".join(f"{rate:>16.3f} tok/ch" for rate in rates)
              + f" {consistent_numbers(tokenizer, numbers):>12.2f} {digit_numbers(tokenizer, numbers):>12.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help=".jsonl or .txt files to train on")
    parser.add_argument("--out", default="model/tokenizer")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--model_max_length", type=int, default=32768)
    parser.add_argument("--digits", choices=DIGIT_STYLES, default="bytes",
                        help="how digits are split into tokens (digit_pre_tokenizer)")
    parser.add_argument("--measure", nargs="+", default=None, metavar="HELDOUT",
                        help="after training, compare with --compare on these held-out text files")
    parser.add_argument("--compare", default="model/tokenizer", help="the tokenizer --measure compares with")
    args = parser.parse_args(argv)

    missing = [path for path in args.data + (args.measure or []) if not Path(path).exists()]
    if missing:
        parser.error(f"data files not found: {missing}")
    tokenizer = train(args.data, args.vocab_size, args.digits)
    save(tokenizer, args.out, args.model_max_length)
    print(f"saved {tokenizer.get_vocab_size()}-token tokenizer to {args.out}")
    check_round_trip(args.out)
    if args.measure:
        from transformers import AutoTokenizer

        measure({args.compare: AutoTokenizer.from_pretrained(args.compare),
                 args.out: AutoTokenizer.from_pretrained(args.out)}, args.measure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
