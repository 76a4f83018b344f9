"""A tiny stand-in for the prose corpus (kjv.txt, tinyshakespeare.txt, sanguo.txt): sentences that
each carry a name of their own, so a test can tell which part of a file any text came from."""

from pathlib import Path

EN_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "so", "na", "vi")
ZH_SYLLABLES = "甲乙丙丁戊己庚辛"
SENTENCES_PER_FILE = 400


def name(index, syllables):
    """A fixed-width name (4 syllables) unique to index < len(syllables) ** 4."""
    return "".join(syllables[index // len(syllables) ** power % len(syllables)] for power in range(3, -1, -1))


def en_sentence(index, source):
    return f"The {name(index, EN_SYLLABLES)} of {source} walked to the river and sang a song."


def zh_sentence(index):
    return f"第{name(index, ZH_SYLLABLES)}号将军领兵入城，百姓出门相迎。"


def write_corpus(folder):
    """Writes the three files into folder; returns it. English lines break every three sentences."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for offset, source in enumerate(("kjv", "tinyshakespeare")):
        sentences = [en_sentence(offset * SENTENCES_PER_FILE + i, source) for i in range(SENTENCES_PER_FILE)]
        lines = [" ".join(sentences[i:i + 3]) for i in range(0, len(sentences), 3)]
        (folder / f"{source}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    lines = ["".join(zh_sentence(i + j) for j in range(4)) for i in range(0, SENTENCES_PER_FILE, 4)]
    (folder / "sanguo.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
