"""Build the prose long-context data: real text split into a training part and a held-out part, and
the training mix of prose chunks and needle documents (dataset/prose.py, evaluation/needles.py).

    python scripts/make_prose_data.py --data_dir ../shared/data --out_dir dataset/prose

Reads kjv.txt, tinyshakespeare.txt (English) and sanguo.txt (Chinese) from --data_dir (default
../shared/data beside the repo). The last 10% of each file is held out and never trained on.
Writes into --out_dir:
  prose_train.jsonl            {"text", "kind": "prose" | "needle" | "copy", ...}: the training split cut into
                               chunks of <= --chunk_tokens tokens, shuffled with needle documents
                               (--needle_fraction of all documents) whose haystack is training prose,
                               --drill_fraction of those drills, --repeat_fraction of them with
                               one short passage repeated as haystack (evaluation/needles.py), and
                               --copy_documents documents of random words repeated (kind "copy")
  prose_train_SOURCE.txt       each file's training part (what scripts/train_tokenizer.py trains on)
  prose_heldout_SOURCE.txt     each file's held-out part (scripts/eval_perplexity.py reads these;
                               scripts/eval_needles.py cuts its haystacks from the same split)
  (--split_only writes only the .txt files: a tokenizer is trained on them before the mix is built)
  prose_data.json              the split (characters per part, where held-out starts) and the counts
Exit codes: 0 done, 2 bad arguments or a missing text file.
"""

import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import AutoTokenizer

from common.cli import OneLineParser, UsageError
from dataset.prose import (
    DEFAULT_DATA_DIR, HELDOUT_FRACTION, SOURCES, copy_documents, corpus_languages, heldout_start, prose_chunks,
    read_corpus, split_text, training_stream,
)
from evaluation.needles import NEEDLE_TEXTS, TASKS, shortest_prompt, training_documents

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZER = REPO_ROOT / "model" / "tokenizer_prose"


def parse_args(argv=None):
    p = OneLineParser(description="MiniMind prose long-context data")
    p.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR), help="folder with kjv.txt, tinyshakespeare.txt, sanguo.txt")
    p.add_argument("--sources", nargs="+", choices=sorted(SOURCES), default=list(SOURCES))
    p.add_argument("--out_dir", default="dataset/prose")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="lengths are counted in its tokens")
    p.add_argument("--chunk_tokens", type=int, default=1000, help="most tokens of a prose document")
    p.add_argument("--needle_fraction", type=float, default=0.3, help="share of needle documents in the mix")
    p.add_argument("--drill_fraction", type=float, default=0.0,
                   help="share of the needle documents that are drills (every key asked right after it)")
    p.add_argument("--repeat_fraction", type=float, default=0.0,
                   help="share of the needle documents whose haystack is one short passage repeated")
    p.add_argument("--copy_documents", type=int, default=0,
                   help="copy documents added to the mix: random words repeated (dataset/prose.py copy_documents)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), help=f"needle tasks of the mix ({', '.join(TASKS)})")
    p.add_argument("--needle_min_tokens", type=int, default=320)
    p.add_argument("--needle_max_tokens", type=int, default=960, help="prompt tokens; the answer follows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split_only", action="store_true",
                   help="write only the train / held-out text files (what a new tokenizer trains on)")
    return p.parse_args(argv)


def validate_args(args, tokenizer, langs):
    unknown = [task for task in args.tasks if task not in TASKS]
    if unknown:
        raise UsageError(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(TASKS)}")
    if args.chunk_tokens <= 0:
        raise UsageError(f"--chunk_tokens must be positive, got {args.chunk_tokens}")
    if not 0.0 <= args.needle_fraction < 1.0:
        raise UsageError(f"--needle_fraction must lie in [0, 1), got {args.needle_fraction}")
    for name in ("drill_fraction", "repeat_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise UsageError(f"--{name} must lie in [0, 1], got {getattr(args, name)}")
    if args.copy_documents < 0:
        raise UsageError(f"--copy_documents must be >= 0, got {args.copy_documents}")
    if args.needle_max_tokens < args.needle_min_tokens:
        raise UsageError(f"--needle_max_tokens {args.needle_max_tokens} is below --needle_min_tokens "
                         f"{args.needle_min_tokens}")
    for task in args.tasks:
        for lang in langs:
            least = shortest_prompt(tokenizer, task, lang)
            if args.needle_min_tokens < least:
                raise UsageError(f"--needle_min_tokens {args.needle_min_tokens} is shorter than the {lang} {task} "
                                 f"template with its most keys and values ({least} tokens)")


def load_tokenizer(path):
    if not (Path(path) / "tokenizer.json").is_file():
        raise UsageError(f"--tokenizer {path}: no tokenizer.json in that folder")
    return AutoTokenizer.from_pretrained(path)


def build(args, corpus, tokenizer, langs):
    """The shuffled training mix and the counts prose_data.json records."""
    rng = random.Random(args.seed)
    streams = {lang: training_stream(corpus, lang, tokenizer) for lang in langs}
    prose = [{**chunk, "kind": "prose", "lang": lang}
             for lang, stream in streams.items() for chunk in prose_chunks(stream, args.chunk_tokens)]
    num_needles = round(len(prose) * args.needle_fraction / (1 - args.needle_fraction))
    needles = [{**document, "kind": "needle"} for document in training_documents(
        rng, streams, tokenizer, num_needles, args.tasks, args.needle_min_tokens, args.needle_max_tokens,
        args.drill_fraction, args.repeat_fraction)]
    copies = [{**document, "kind": "copy"} for document in copy_documents(
        rng, streams, tokenizer, args.copy_documents, args.needle_min_tokens, args.needle_max_tokens)]
    documents = prose + needles + copies
    rng.shuffle(documents)
    counts = {"prose_documents": len(prose), "needle_documents": len(needles),
              "needle_documents_by_task": {task: sum(d["task"] == task and not d["drill"] for d in needles)
                                           for task in args.tasks},
              "drill_documents": sum(d["drill"] for d in needles),
              "repeated_haystack_documents": sum(d["repeated"] for d in needles), "copy_documents": len(copies)}
    return documents, counts


def main(argv=None):
    try:
        args = parse_args(argv)
        corpus = read_corpus(args.data_dir, args.sources)
        langs = [lang for lang in corpus_languages(corpus) if lang in NEEDLE_TEXTS]
        if not args.split_only:
            tokenizer = load_tokenizer(args.tokenizer)
            validate_args(args, tokenizer, langs)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    split = {}
    for name, text in corpus.items():
        train, heldout = split_text(text)
        (out_dir / f"prose_train_{name}.txt").write_text(train, encoding="utf-8")
        (out_dir / f"prose_heldout_{name}.txt").write_text(heldout, encoding="utf-8")
        split[name] = {"lang": SOURCES[name], "chars": len(text), "train_chars": len(train),
                       "heldout_chars": len(heldout), "heldout_starts_at_char": heldout_start(text)}
    if args.split_only:
        print(f"wrote prose_train_*.txt and prose_heldout_*.txt for {', '.join(corpus)} to {out_dir}")
        return 0
    documents, counts = build(args, corpus, tokenizer, langs)
    with open(out_dir / "prose_train.jsonl", "w", encoding="utf-8") as f:
        for document in documents:
            f.write(json.dumps(document, ensure_ascii=False) + "\n")
    metadata = {"heldout_fraction": HELDOUT_FRACTION, "split": split, **counts,
                "args": {key: value for key, value in vars(args).items()}}
    (out_dir / "prose_data.json").write_text(json.dumps(metadata, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    copies = f" + {counts['copy_documents']} copy" if counts["copy_documents"] else ""
    print(f"wrote {out_dir}/prose_train.jsonl ({counts['prose_documents']} prose + {counts['needle_documents']} "
          f"needle{copies} documents), prose_train_*.txt and prose_heldout_*.txt for {', '.join(corpus)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
