"""Generate the embedded model's data: GSM8K-format word problems and plain text.

Deterministic (fixed seeds). Writes, under OUT_DIR:
  train.txt          training text (problems in 5-shot layout, and stories)
  tasks/test.jsonl   held-out questions (the lm-eval test split)
  tasks/fewshot.jsonl  few-shot examples (a separate split)
  valid.jsonl        questions for checkpoint selection during training
  corpus.txt         plain text for the probability check
Questions in the test, few-shot and validation splits never occur in train.txt.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Callable

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "June",
         "Kai", "Lena", "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tess",
         "Uma", "Vic", "Wren", "Yara", "Zeke", "Liam", "Mia", "Noah", "Ella", "Finn"]
ITEMS = ["apples", "pears", "books", "pens", "stamps", "coins", "shells", "cards",
         "marbles", "cookies", "eggs", "plums", "beads", "stickers", "rocks", "cups",
         "socks", "toys", "nails", "bricks"]
PLACES = ["market", "school", "park", "library", "farm", "shop", "harbor", "garden"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ADJECTIVES = ["red", "small", "old", "shiny", "heavy", "green", "round", "soft", "blue", "new"]


def _who(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    return name, rng.choice(["He", "She"])


def _add(rng: random.Random) -> tuple[str, str, int]:
    name, pron = _who(rng)
    item = rng.choice(ITEMS)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    c = a + b
    q = f"{name} has {a} {item}. {pron} gets {b} more. How many {item} does {name} have now?"
    s = f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {c}."
    return q, s, c


def _sub(rng: random.Random) -> tuple[str, str, int]:
    name, pron = _who(rng)
    item = rng.choice(ITEMS)
    a = rng.randint(30, 99)
    b = rng.randint(10, a - 5)
    c = a - b
    q = f"{name} has {a} {item}. {pron} gives away {b} of them. How many {item} are left?"
    s = f"{name} gives away {b} of {a} {item}, so {a} - {b} = {c}."
    return q, s, c


def _mul(rng: random.Random) -> tuple[str, str, int]:
    name, _ = _who(rng)
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(3, 12)
    c = a * b
    q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
    s = f"There are {a} bags of {b} {item}, so {a} * {b} = {c}."
    return q, s, c


def _two_step(rng: random.Random) -> tuple[str, str, int]:
    name, pron = _who(rng)
    friend = rng.choice([n for n in NAMES if n != name])
    item = rng.choice(ITEMS)
    a, b = rng.randint(10, 60), rng.randint(10, 60)
    c = a + b
    d = rng.randint(5, c - 5)
    e = c - d
    q = (f"{name} has {a} {item}. {pron} finds {b} more and then gives {d} to {friend}. "
         f"How many {item} does {name} have at the end?")
    s = (f"After finding more, {name} has {a} + {b} = {c} {item}. "
         f"After giving {d} away, {name} has {c} - {d} = {e}.")
    return q, s, e


def _big_add(rng: random.Random) -> tuple[str, str, int]:
    place = rng.choice(PLACES)
    item = rng.choice(ITEMS)
    a, b = rng.randint(100, 899), rng.randint(10, 99)
    c = a + b
    q = (f"The {place} had {a} {item} in the morning and {b} more arrived at noon. "
         f"How many {item} does the {place} have?")
    s = f"The {place} has {a} + {b} = {c} {item}."
    return q, s, c


def _four_add(rng: random.Random) -> tuple[str, str, int]:
    name, _ = _who(rng)
    item = rng.choice(ITEMS)
    a, b, c, d = (rng.randint(10, 99) for _ in range(4))
    e = a + b + c + d
    q = f"On four days {name} picked {a}, {b}, {c} and {d} {item}. How many {item} did {name} pick in all?"
    s = f"{name} picked {a} + {b} + {c} + {d} = {e} {item}."
    return q, s, e


def _big_mul(rng: random.Random) -> tuple[str, str, int]:
    place = rng.choice(PLACES)
    item = rng.choice(ITEMS)
    a, b = rng.randint(101, 499), rng.randint(13, 29)
    c = a * b
    q = f"The {place} has {b} shelves with {a} {item} on each shelf. How many {item} are on the shelves?"
    s = f"There are {b} shelves of {a} {item}, so {b} * {a} = {c}."
    return q, s, c


# A model of this size solves the first five kinds almost always; four numbers
# with carries and three-by-two-digit products it only partly learns. The mix keeps
# its accuracy inside the 40-90% band at the end of training, with near ties left
# where answers can flip both ways.
PROBLEM_KINDS: list[Callable[[random.Random], tuple[str, str, int]]] = [
    _add, _sub, _mul, _two_step, _big_add, _four_add, _four_add, _big_mul, _big_mul]


def problem(rng: random.Random) -> dict:
    kind = rng.choice(PROBLEM_KINDS)
    question, steps, answer = kind(rng)
    return {"question": question, "answer": f"{steps}\n#### {answer}", "kind": kind.__name__.lstrip("_")}


def story(rng: random.Random) -> str:
    """A paragraph of plain text: counting, places, days; some tokens certain, many not."""
    name, pron = _who(rng)
    day, place, item = rng.choice(DAYS), rng.choice(PLACES), rng.choice(ITEMS)
    adj = rng.choice(ADJECTIVES)
    a = rng.randint(2, 40)
    b = rng.randint(1, a)
    sentences = [
        f"On {day}, {name} walked to the {place} and saw {a} {adj} {item}.",
        f"{pron} took {b} of them home, so {a - b} {item} stayed at the {place}.",
        rng.choice([
            f"The next day was {DAYS[(DAYS.index(day) + 1) % 7]}.",
            f"{name} counted them again: {b} {item}, no more and no less.",
            f"Everyone at the {place} said the {item} were {rng.choice(ADJECTIVES)}.",
            f"{a} is {'more than' if a > b else 'the same as'} {b}, and {a} plus {b} is {a + b}.",
        ]),
        rng.choice([
            f"Later {name} met {rng.choice(NAMES)} near the {rng.choice(PLACES)}.",
            "It rained a little in the evening.",
            f"{pron} wrote the number {a * 2} in a notebook.",
            "",
        ]),
    ]
    return " ".join(s for s in sentences if s)


def few_shot_block(rows: list[dict]) -> str:
    """The layout lm-eval builds: 'Question: q\\nAnswer: a' joined by blank lines."""
    return "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows)


def _unique_problems(rng: random.Random, count: int, taken: set[str]) -> list[dict]:
    rows: list[dict] = []
    while len(rows) < count:
        row = problem(rng)
        if row["question"] not in taken:
            taken.add(row["question"])
            rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict], keep_kind: bool = False) -> None:
    """lm-eval's splits carry only question and answer; validation rows keep their kind."""
    fields = ("question", "answer", "kind") if keep_kind else ("question", "answer")
    path.write_text("".join(json.dumps({k: r[k] for k in fields}) + "\n" for r in rows))


def main(out_dir: str, train_chars: int = 40_000_000) -> None:
    out = Path(out_dir)
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    held_out: set[str] = set()
    test = _unique_problems(random.Random(1001), 500, held_out)
    fewshot = _unique_problems(random.Random(1002), 50, held_out)
    valid = _unique_problems(random.Random(1003), 200, held_out)
    write_jsonl(out / "tasks" / "test.jsonl", test)
    write_jsonl(out / "tasks" / "fewshot.jsonl", fewshot)
    write_jsonl(out / "valid.jsonl", valid, keep_kind=True)

    corpus_rng = random.Random(2001)
    corpus: list[str] = []
    while sum(len(p) + 2 for p in corpus) < 120_000:
        corpus.append(story(corpus_rng) if corpus_rng.random() < 0.7 else few_shot_block([problem(corpus_rng)]))
    (out / "corpus.txt").write_text("\n\n".join(corpus) + "\n")

    rng = random.Random(3001)
    documents: list[str] = []
    size = 0
    while size < train_chars:
        if rng.random() < 0.8:
            rows = []
            while len(rows) < rng.randint(2, 7):
                row = problem(rng)
                if row["question"] not in held_out:
                    rows.append(row)
            doc = few_shot_block(rows)
        else:
            doc = " ".join(story(rng) for _ in range(rng.randint(2, 6)))
        documents.append(doc)
        size += len(doc)
    (out / "train.txt").write_text("\x00".join(documents))


if __name__ == "__main__":
    main(sys.argv[1])
