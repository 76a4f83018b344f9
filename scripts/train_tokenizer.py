"""Train the byte-level BPE tokenizer (vocab 6400, minimind-style) and save it for AutoTokenizer.

Reads JSONL files ({"text": ...} or {"conversations": [{"role", "content"}, ...]}) and plain .txt files.
The shipped model/tokenizer/ was trained on the sample pretrain + SFT data and, when present, on
/work/shared/data/tinyshakespeare.txt and sanguo.txt, so that real English and Chinese text used in
quality benchmarks also tokenizes compactly:

  python scripts/make_sample_data.py --out_dir dataset/sample
  python scripts/train_tokenizer.py --data dataset/sample/pretrain_hq.jsonl dataset/sample/sft_mini_512.jsonl \\
      /work/shared/data/tinyshakespeare.txt /work/shared/data/sanguo.txt --out model/tokenizer

Special tokens: <|endoftext|>=0 (also pad and unk), <|im_start|>=1 (bos), <|im_end|>=2 (eos).
Encoding never adds special tokens by itself; the chat template (dataset/chat_messages.py) writes them explicitly.
"""
import argparse
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def train(data_paths, vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (text for path in data_paths for text in read_texts(path))
    tokenizer.train_from_iterator(distinct_sentences(texts), trainer=trainer)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help=".jsonl or .txt files to train on")
    parser.add_argument("--out", default="model/tokenizer")
    parser.add_argument("--vocab_size", type=int, default=6400)
    parser.add_argument("--model_max_length", type=int, default=32768)
    args = parser.parse_args()

    missing = [path for path in args.data if not Path(path).exists()]
    if missing:
        parser.error(f"data files not found: {missing}")
    tokenizer = train(args.data, args.vocab_size)
    save(tokenizer, args.out, args.model_max_length)
    print(f"saved {tokenizer.get_vocab_size()}-token tokenizer to {args.out}")
    check_round_trip(args.out)


if __name__ == "__main__":
    main()
