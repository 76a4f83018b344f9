"""Generate a small, deterministic, bilingual sample dataset.

The data describes a tiny invented world (countries, capitals, people) plus
small arithmetic, in English and Chinese. The fact set is small on purpose:
a ~4M-parameter model can memorise it in a few CPU minutes, so a chat demo
can be judged on whether the answers are right (evaluation/chat.py's `preset_prompts()`).

Writes three JSONL files into --out_dir:
  pretrain_hq.jsonl    {"text": ...}                       facts, stories, sums
  sft_mini_512.jsonl   {"conversations": [{role, content}]} Q&A on the same facts
  passkey_long.jsonl   {"text": ...}                       long-context passkey docs
  passkey_train.jsonl  {"text": ...}                       with --passkey_training_docs N: the
                                                           long-context recipe's training mix
The passkey documents' wording and layout come from evaluation/passkey.py, which the passkey
evaluation asks in too.

Usage:
  python scripts/make_sample_data.py --out_dir dataset/sample [--seed 0] [--scale 1.0]
"""
import argparse
import json
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluation.passkey import make_passkey, make_passkey_training

# ---------------------------------------------------------------------------
# The world. Every fact the model can be quizzed on lives here.

# (name_en, name_zh, capital_en, capital_zh, colour index, animal index)
COUNTRIES = [
    ("Zorvia", "佐维亚", "Talen", "塔伦", 0, 0),
    ("Mirelda", "米蕾达", "Osko", "奥斯科", 1, 1),
    ("Kestra", "凯斯特拉", "Vund", "文德", 2, 2),
    ("Baloria", "巴洛利亚", "Ferin", "费林", 3, 3),
    ("Quenth", "昆斯", "Lirra", "莉拉", 4, 4),
    ("Dravon", "德拉文", "Suma", "苏马", 5, 5),
    ("Elbaru", "埃尔巴鲁", "Noki", "诺基", 6, 6),
    ("Pelmar", "佩尔玛", "Tirok", "蒂罗克", 7, 7),
    ("Ustania", "乌斯塔尼亚", "Gavel", "加维尔", 0, 8),
    ("Yorrin", "约林", "Hesk", "赫斯克", 1, 9),
    ("Calvesh", "卡尔维什", "Morra", "莫拉", 2, 10),
    ("Nimbal", "宁巴尔", "Ketu", "凯图", 3, 11),
]
COLOURS = [("red", "红色"), ("blue", "蓝色"), ("green", "绿色"), ("yellow", "黄色"),
           ("white", "白色"), ("black", "黑色"), ("purple", "紫色"), ("orange", "橙色")]
ANIMALS = [("fox", "狐狸"), ("owl", "猫头鹰"), ("bear", "熊"), ("horse", "马"),
           ("tiger", "老虎"), ("rabbit", "兔子"), ("deer", "鹿"), ("wolf", "狼"),
           ("eagle", "鹰"), ("cat", "猫"), ("dog", "狗"), ("swan", "天鹅")]
# (name_en, name_zh, is_female, age, job index, home country index)
PEOPLE = [
    ("Ana", "安娜", True, 23, 0, 0),
    ("Bilo", "比罗", False, 35, 1, 1),
    ("Cora", "科拉", True, 41, 2, 2),
    ("Dax", "达克斯", False, 19, 3, 3),
    ("Emi", "艾米", True, 52, 4, 4),
    ("Fenn", "芬恩", False, 30, 5, 5),
    ("Gala", "加拉", True, 27, 6, 6),
    ("Hollo", "霍洛", False, 64, 7, 7),
]
JOBS = [("teacher", "老师"), ("doctor", "医生"), ("farmer", "农民"), ("student", "学生"),
        ("baker", "面包师"), ("painter", "画家"), ("sailor", "水手"), ("singer", "歌手")]

ZH_DIGITS = "零一二三四五六七八九"

SYSTEM_PROMPTS = [
    "You are MiniMind, a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "你是MiniMind，一个乐于助人的助手。",
    "你是一个有用的助手，请简短回答。",
]


def zh_number(n):
    """0..99 as Chinese numerals, e.g. 23 -> 二十三."""
    if n < 10:
        return ZH_DIGITS[n]
    tens, ones = divmod(n, 10)
    return ("" if tens == 1 else ZH_DIGITS[tens]) + "十" + (ZH_DIGITS[ones] if ones else "")


def country_fields(index):
    name, name_zh, cap, cap_zh, colour, animal = COUNTRIES[index]
    return dict(c=name, c_zh=name_zh, cap=cap, cap_zh=cap_zh,
                col=COLOURS[colour][0], col_zh=COLOURS[colour][1],
                ani=ANIMALS[animal][0], ani_zh=ANIMALS[animal][1])


def person_fields(index):
    name, name_zh, is_female, age, job, home = PEOPLE[index]
    return dict(country_fields(home), p=name, p_zh=name_zh, age=age,
                job=JOBS[job][0], job_zh=JOBS[job][1],
                he="she" if is_female else "he", He="She" if is_female else "He",
                his="her" if is_female else "his", His="Her" if is_female else "His", ta_zh="她" if is_female else "他")


def arithmetic_facts():
    """Small sums and differences: (a, op, b, result)."""
    sums = [(a, "+", b, a + b) for a in range(1, 10) for b in range(1, 10)]
    differences = [(a, "-", b, a - b) for a in range(1, 11) for b in range(1, a + 1)]
    return sums + differences


ARITHMETIC = arithmetic_facts()


def zh_arithmetic(a, op, b, result):
    return f"{zh_number(a)}{'加' if op == '+' else '减'}{zh_number(b)}等于{zh_number(result)}"


# ---------------------------------------------------------------------------
# Pretraining text: the same facts in many phrasings, grouped into short documents.

COUNTRY_SENTENCES_EN = [
    "The capital of {c} is {cap}.", "{cap} is the capital of {c}.", "{c}'s capital city is {cap}.",
    "In {c}, the capital is {cap}.", "The national colour of {c} is {col}.",
    "The flag of {c} is {col}.", "People in {c} love the colour {col}.",
    "The national animal of {c} is the {ani}.", "The {ani} is the symbol of {c}.",
    "In {c}, people love the {ani}.",
]
COUNTRY_SENTENCES_ZH = [
    "{c_zh}的首都是{cap_zh}。", "{cap_zh}是{c_zh}的首都。", "{c_zh}的首都叫{cap_zh}。",
    "{c_zh}的国色是{col_zh}。", "{c_zh}的国旗是{col_zh}的。", "{c_zh}人喜欢{col_zh}。",
    "{c_zh}的国兽是{ani_zh}。", "{ani_zh}是{c_zh}的象征。", "{c_zh}人很喜欢{ani_zh}。",
]
PERSON_SENTENCES_EN = [
    "{p} is {age} years old.", "{p} is a {job}.", "{p} works as a {job}.", "{p} lives in {cap}.",
    "{p} lives in {cap}, the capital of {c}.", "{p} comes from {c}.", "{He} is {age} years old.",
    "{p} has worked as a {job} for years.",
]
PERSON_SENTENCES_ZH = [
    "{p_zh}今年{age}岁。", "{p_zh}是一名{job_zh}。", "{p_zh}的职业是{job_zh}。", "{p_zh}住在{cap_zh}。",
    "{p_zh}住在{c_zh}的首都{cap_zh}。", "{p_zh}来自{c_zh}。", "{ta_zh}今年{age}岁。",
]
STORIES_EN = [
    "{p} is a {job} who lives in {cap}. {cap} is the capital of {c}. The national animal of {c} "
    "is the {ani}, and {he} often sees one near {his} home. {p} is {age} years old.",
    "One day, {p} walked through {cap}. {He} saw {col} flags everywhere, because {col} is the "
    "national colour of {c}. {p} smiled. {He} is a {job}, and {he} loves {his} city.",
    "Every morning {p}, a {age}-year-old {job}, drinks tea in {cap}. {cap} is the capital of {c}. "
    "Sometimes a {ani} comes to the window. The {ani} is the symbol of {c}.",
    "{p} lives in {c}. The capital of {c} is {cap}, and that is where {p} works as a {job}. "
    "{He} is {age} years old.",
    "This is a story about {p}. {p} is a {job}. {He} lives in {cap}, the capital of {c}. "
    "{His} favourite colour is {col}, like the flag of {c}. The end.",
]
STORIES_ZH = [
    "{p_zh}是一名{job_zh}，住在{cap_zh}。{cap_zh}是{c_zh}的首都。{c_zh}的国兽是{ani_zh}，"
    "{ta_zh}常常在家附近看到{ani_zh}。{p_zh}今年{age}岁。",
    "有一天，{p_zh}在{cap_zh}散步。{ta_zh}看到到处都是{col_zh}的旗子，因为{c_zh}的国色是{col_zh}。"
    "{p_zh}是一名{job_zh}，{ta_zh}很喜欢自己的城市。",
    "每天早上，{age}岁的{job_zh}{p_zh}都在{cap_zh}喝茶。{cap_zh}是{c_zh}的首都。"
    "有时候一只{ani_zh}会来到窗前。{ani_zh}是{c_zh}的象征。",
    "{p_zh}住在{c_zh}。{c_zh}的首都是{cap_zh}，{p_zh}在那里做{job_zh}。{ta_zh}今年{age}岁。",
    "这是一个关于{p_zh}的故事。{p_zh}是一名{job_zh}，住在{c_zh}的首都{cap_zh}。"
    "{ta_zh}最喜欢的颜色是{col_zh}，和{c_zh}的国旗一样。",
]
BILINGUAL_PAIRS = [
    ("The capital of {c} is {cap}.", "{c_zh}的首都是{cap_zh}。"),
    ("The national colour of {c} is {col}.", "{c_zh}的国色是{col_zh}。"),
    ("The national animal of {c} is the {ani}.", "{c_zh}的国兽是{ani_zh}。"),
]
PERSON_PAIRS = [
    ("{p} is {age} years old.", "{p_zh}今年{age}岁。"),
    ("{p} is a {job}.", "{p_zh}是一名{job_zh}。"),
    ("{p} lives in {cap}, the capital of {c}.", "{p_zh}住在{c_zh}的首都{cap_zh}。"),
]


def country_profile(rng):
    fields = country_fields(rng.randrange(len(COUNTRIES)))
    templates = COUNTRY_SENTENCES_EN if rng.random() < 0.5 else COUNTRY_SENTENCES_ZH
    joiner = " " if templates is COUNTRY_SENTENCES_EN else ""
    return joiner.join(t.format(**fields) for t in rng.sample(templates, rng.randint(3, 6)))


def person_profile(rng):
    fields = person_fields(rng.randrange(len(PEOPLE)))
    if rng.random() < 0.5:
        first, rest, joiner = "{p} is a {job}.", PERSON_SENTENCES_EN, " "
    else:
        first, rest, joiner = "{p_zh}是一名{job_zh}。", PERSON_SENTENCES_ZH, ""
    sentences = [first] + rng.sample(rest, rng.randint(2, 4))
    return joiner.join(t.format(**fields) for t in sentences)


def story(rng):
    fields = person_fields(rng.randrange(len(PEOPLE)))
    return rng.choice(STORIES_EN if rng.random() < 0.5 else STORIES_ZH).format(**fields)


def bilingual_facts(rng):
    lines = []
    for _ in range(rng.randint(2, 5)):
        if rng.random() < 0.6:
            en, zh = rng.choice(BILINGUAL_PAIRS)
            fields = country_fields(rng.randrange(len(COUNTRIES)))
        else:
            en, zh = rng.choice(PERSON_PAIRS)
            fields = person_fields(rng.randrange(len(PEOPLE)))
        lines.append(f"{en.format(**fields)} / {zh.format(**fields)}")
    return "\n".join(lines)


def arithmetic_drill(rng):
    facts = rng.sample(ARITHMETIC, rng.randint(4, 10))
    style = rng.randrange(4)
    if style == 0:
        return "Let us practice. " + " ".join(f"{a} {op} {b} = {r}." for a, op, b, r in facts)
    if style == 1:
        return " ".join(f"What is {a} {op} {b}? It is {r}." for a, op, b, r in facts)
    if style == 2:
        return "我们来练习算术。" + "".join(zh_arithmetic(*f) + "。" for f in facts)
    return "计算：" + "，".join(f"{a} {op} {b} = {r}" for a, op, b, r in facts) + "。"


PRETRAIN_KINDS = [country_profile, person_profile, story, bilingual_facts, arithmetic_drill]


def make_pretrain(rng, num_docs):
    for _ in range(num_docs):
        # A few hundred tokens per document keeps padding low at the demo's max_seq_len of 256.
        parts = [rng.choice(PRETRAIN_KINDS)(rng) for _ in range(rng.randint(2, 6))]
        yield {"text": "\n".join(parts)}


# ---------------------------------------------------------------------------
# SFT: question/answer pairs whose answers match the pretraining facts exactly.

def country_qa(index):
    f = country_fields(index)
    answer_cap = "The capital of {c} is {cap}.".format(**f)
    answer_cap_zh = "{c_zh}的首都是{cap_zh}。".format(**f)
    return [
        ("What is the capital of {c}?".format(**f), answer_cap),
        ("Which city is the capital of {c}?".format(**f), answer_cap),
        ("{cap} is the capital of which country?".format(**f), "{cap} is the capital of {c}.".format(**f)),
        ("What is the national colour of {c}?".format(**f), "The national colour of {c} is {col}.".format(**f)),
        ("What is the national animal of {c}?".format(**f), "The national animal of {c} is the {ani}.".format(**f)),
        ("{c_zh}的首都是哪里？".format(**f), answer_cap_zh),
        ("{c_zh}的首都叫什么？".format(**f), answer_cap_zh),
        ("{cap_zh}是哪个国家的首都？".format(**f), "{cap_zh}是{c_zh}的首都。".format(**f)),
        ("{c_zh}的国色是什么？".format(**f), "{c_zh}的国色是{col_zh}。".format(**f)),
        ("{c_zh}的国兽是什么？".format(**f), "{c_zh}的国兽是{ani_zh}。".format(**f)),
    ]


def person_qa(index):
    f = person_fields(index)
    return [
        ("How old is {p}?".format(**f), "{p} is {age} years old.".format(**f)),
        ("What does {p} do?".format(**f), "{p} is a {job}.".format(**f)),
        ("What is {p}'s job?".format(**f), "{p} is a {job}.".format(**f)),
        ("Where does {p} live?".format(**f), "{p} lives in {cap}, the capital of {c}.".format(**f)),
        ("Which country does {p} live in?".format(**f), "{p} lives in {c}.".format(**f)),
        ("{p_zh}多大了？".format(**f), "{p_zh}今年{age}岁。".format(**f)),
        ("{p_zh}今年几岁？".format(**f), "{p_zh}今年{age}岁。".format(**f)),
        ("{p_zh}是做什么工作的？".format(**f), "{p_zh}是一名{job_zh}。".format(**f)),
        ("{p_zh}的职业是什么？".format(**f), "{p_zh}是一名{job_zh}。".format(**f)),
        ("{p_zh}住在哪里？".format(**f), "{p_zh}住在{c_zh}的首都{cap_zh}。".format(**f)),
    ]


def arithmetic_qa(a, op, b, result):
    op_zh = "加" if op == "+" else "减"
    return [
        (f"What is {a} {op} {b}?", f"{a} {op} {b} = {result}."),
        (f"Calculate {a} {op} {b}.", f"{a} {op} {b} = {result}."),
        (f"{zh_number(a)}{op_zh}{zh_number(b)}等于几？", zh_arithmetic(a, op, b, result) + "。"),
        (f"{a} {op} {b} 等于多少？", f"{a} {op} {b} = {result}。"),
    ]


SMALL_TALK = [
    ("Hello!", "Hello! How can I help you?"),
    ("Hi", "Hi! How can I help you?"),
    ("Who are you?", "I am MiniMind, a small language model."),
    ("Thank you!", "You're welcome!"),
    ("你好", "你好！有什么可以帮你的吗？"),
    ("你是谁？", "我是MiniMind，一个小型语言模型。"),
    ("谢谢！", "不客气！"),
]


def qa_pairs_by_topic():
    countries = [pair for index in range(len(COUNTRIES)) for pair in country_qa(index)]
    people = [pair for index in range(len(PEOPLE)) for pair in person_qa(index)]
    arithmetic = [pair for fact in ARITHMETIC for pair in arithmetic_qa(*fact)]
    return {"countries": countries, "people": people, "arithmetic": arithmetic, "small_talk": SMALL_TALK}


# Sampling weights per topic, so the many arithmetic pairs don't crowd out the world facts.
TOPIC_WEIGHTS = {"countries": 0.35, "people": 0.3, "arithmetic": 0.25, "small_talk": 0.1}


def is_chinese(text):
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def conversation(rng, turns):
    """One chat made of Q&A `turns`, sometimes with a system prompt in the chat's language."""
    chinese = is_chinese(turns[0][0])
    messages = []
    if rng.random() < 0.3:
        system = [s for s in SYSTEM_PROMPTS if is_chinese(s) == chinese]
        messages.append({"role": "system", "content": rng.choice(system)})
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"conversations": messages}


def make_sft(rng, num_extra_conversations):
    """Every Q&A pair once (so each fact is covered), then random single- and multi-turn chats."""
    topics = qa_pairs_by_topic()
    topic_names, weights = list(TOPIC_WEIGHTS), list(TOPIC_WEIGHTS.values())
    by_topic_and_language = {(topic, chinese): [pair for pair in pairs if is_chinese(pair[0]) == chinese]
                             for topic, pairs in topics.items() for chinese in (False, True)}

    def random_pair(chinese):
        return rng.choice(by_topic_and_language[rng.choices(topic_names, weights)[0], chinese])

    conversations = [conversation(rng, [pair]) for pairs in topics.values() for pair in pairs]
    for _ in range(num_extra_conversations):
        chinese = rng.random() < 0.5
        num_turns = rng.choice([1, 1, 2, 3, 4])
        conversations.append(conversation(rng, [random_pair(chinese) for _ in range(num_turns)]))
    rng.shuffle(conversations)
    return conversations


# ---------------------------------------------------------------------------

def write_jsonl(path, records):
    num_lines = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            num_lines += 1
    print(f"{path}: {num_lines} lines, {path.stat().st_size:,} bytes")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="dataset/sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of generated documents")
    parser.add_argument("--passkey_training_docs", type=int, default=0,
                        help="also write passkey_train.jsonl with this many documents (the long-context recipe)")
    parser.add_argument("--passkey_drill_fraction", type=float, default=0.4,
                        help="passkey_train.jsonl: the share of drills (the rest are passkey documents)")
    parser.add_argument("--passkey_max_questions", type=int, default=1,
                        help="passkey_train.jsonl: each passkey document asks for its key 1 .. this many times")
    args = parser.parse_args()

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # One generator per file, so changing one file's size leaves the others' bytes unchanged.
    def rng_for(name):
        return random.Random(f"{name}:{args.seed}")

    def count(n):
        return max(1, round(n * args.scale))

    write_jsonl(out_dir / "pretrain_hq.jsonl", make_pretrain(rng_for("pretrain"), count(4750)))
    write_jsonl(out_dir / "sft_mini_512.jsonl", make_sft(rng_for("sft"), count(4500)))
    write_jsonl(out_dir / "passkey_long.jsonl", make_passkey(rng_for("passkey"), count(1100)))
    if args.passkey_training_docs:
        write_jsonl(out_dir / "passkey_train.jsonl",
                    make_passkey_training(rng_for("passkey_train"), args.passkey_training_docs,
                                          args.passkey_drill_fraction, max_questions=args.passkey_max_questions))


if __name__ == "__main__":
    main()
