"""Build the real-model demo's English corpus and its last-word task from the Python documentation.

Source: the reStructuredText sources of the Python 3.11 documentation, as Debian ships them in
``python3.11-doc`` (``/usr/share/doc/python3.11/html/_sources``), under the PSF License Agreement
(its text is copied beside the outputs). Prose paragraphs only: directives, code, literal blocks,
tables and titles are dropped and inline markup is reduced to its text.

- the corpus: ``tutorial/`` and ``faq/``;
- the task: ``howto/`` (other text than the corpus), cut LAMBADA-style: a passage that ends just
  before a sentence's last word (four letters or more), which the model must write.

    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb doc
    python training/make_english_assets.py doc/usr/share/doc/python3.11/html/_sources
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "pytest_fp8gate" / "assets"
CORPUS_DIRS = ("tutorial", "faq")
TASK_DIRS = ("howto",)
QUESTIONS = 500
CONTEXT_CHARS = 250  # about 75 tokens of passage before the missing word
SEED = 0

_ROLE = re.compile(r":[\w:.+-]+:`(?:[^`<]*<)?([^`>]*)>?`")  # :func:`x`, :ref:`text <target>`
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")  # `text <url>`_
_LITERAL = re.compile(r"``([^`]*)``")
_EMPHASIS = re.compile(r"\*\*?([^*]+)\*\*?")
_REFERENCE = re.compile(r"`([^`]+)`_+|\|([^|]+)\|")
_SENTENCE_END = re.compile(r"(?<=[a-z])\s([A-Za-z]{4,})([.!?])(?=\s|$)")


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one reStructuredText file, each on one line with its markup reduced."""
    kept, literal_next = [], False
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        indented = lines[0].startswith((" ", "\t"))
        literal, literal_next = literal_next and indented, lines[-1].rstrip().endswith("::")
        first = lines[0].strip()
        if literal or first.startswith(("..", ">>>", "$", "+", "|", "=", "*" * 3, ":")) or indented and \
                first.startswith(("...", ":")):
            continue
        if len(lines) > 1 and re.fullmatch(r"([=\-~^*#\"'+`])\1{2,}", lines[-1].strip()):
            continue  # a title with its underline
        joined = " ".join(line.strip() for line in lines).removesuffix("::") + ("." if literal_next else "")
        joined = joined.replace(":.", ".")
        for pattern in (_LINK, _ROLE, _LITERAL, _EMPHASIS):
            joined = pattern.sub(r"\1", joined)
        joined = _REFERENCE.sub(lambda m: m.group(1) or m.group(2), joined).replace("\\", "")
        joined = re.sub(r"\s*\[#\w*\]_", "", joined).replace("~", "")  # footnote marks, shortened targets
        letters = sum(c.isalpha() or c == " " for c in joined)
        if len(joined) >= 80 and letters >= 0.85 * len(joined) and re.search(r"[a-z]\.", joined):
            kept.append(re.sub(r"^[-*#0-9.]+\s+", "", joined))
    return kept


def prose(sources: Path, directories: tuple[str, ...]) -> list[str]:
    return [p for d in directories for f in sorted((sources / d).rglob("*.rst.txt"))
            for p in paragraphs(f.read_text(encoding="utf-8"))]


def last_word_questions(passages: list[str], count: int, rng: random.Random) -> list[dict]:
    """LAMBADA-style questions: each passage ends before a sentence's last word, the target."""
    text = "\n".join(passages)
    ends = [m for m in _SENTENCE_END.finditer(text) if m.start(1) >= CONTEXT_CHARS]
    questions = []
    for match in rng.sample(ends, len(ends)):
        word = match.group(1)
        start = text.rfind("\n", 0, match.start(1) - CONTEXT_CHARS) + 1
        if start == 0:
            start = max(text.find(" ", match.start(1) - CONTEXT_CHARS) + 1, 0)
        context = text[start:match.start(1)].rstrip().replace("\n", " ")
        questions.append({"context": context, "target": word})
        if len(questions) == count:
            break
    return questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", type=Path, help="the documentation's _sources directory")
    args = parser.parse_args()
    corpus = "\n\n".join(prose(args.sources, CORPUS_DIRS)) + "\n"
    (ASSETS / "english").mkdir(exist_ok=True)
    (ASSETS / "english" / "corpus.txt").write_text(corpus, encoding="utf-8")
    license_text = (args.sources / "license.rst.txt").read_text(encoding="utf-8")
    (ASSETS / "english" / "LICENSE-PSF.txt").write_text(license_text, encoding="utf-8")
    questions = last_word_questions(prose(args.sources, TASK_DIRS), QUESTIONS, random.Random(SEED))
    task = ASSETS / "tasks" / "docs_last_word" / "test.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    for path in (ASSETS / "english" / "corpus.txt", task):
        print(path.relative_to(ASSETS), hashlib.sha256(path.read_bytes()).hexdigest(), len(path.read_text()))


if __name__ == "__main__":
    main()
