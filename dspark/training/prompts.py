"""Training prompts for the DSpark drafter, in the benchmark's four kinds.

The drafter learns to predict what the TARGET says, so training sequences are these prompts
followed by the target's own answers (self-distillation, dspark.training.data.gather). Text
comes only from what every CPython install carries (dspark.training.corpus, its TRAIN split:
the held-out documents stay unseen) plus the templates below; `heldout_prompts` builds the
evaluation set from the held-out split and from questions no training template produces.
"""
from __future__ import annotations

import random
import re

from dspark.training.corpus import Document, split_documents

SUBJECTS = """photosynthesis|black holes|the water cycle|plate tectonics|vaccines|the immune system|
inflation in economics|compound interest|the French Revolution|the Roman Empire|the printing press|
the industrial revolution|climate change|renewable energy|solar panels|electric cars|batteries|
the internet|DNS|HTTP|TCP/IP|public key cryptography|hash functions|blockchains|machine learning|
neural networks|gradient descent|overfitting|databases|SQL joins|indexes in databases|
garbage collection|recursion|binary search|sorting algorithms|hash tables|linked lists|
version control with git|unit testing|Docker containers|virtual machines|operating systems|
multithreading|memory leaks|compilers|interpreters|regular expressions|JSON|REST APIs|
the Pythagorean theorem|prime numbers|probability|statistics|the mean and the median|
derivatives in calculus|matrices|the speed of light|gravity|magnetism|electricity|atoms|
chemical bonds|acids and bases|evolution|genetics|DNA|cells|bacteria and viruses|sleep|
nutrition|exercise|meditation|stress|time management|public speaking|writing an essay|
learning a language|saving money|budgeting|investing|negotiation|leadership|teamwork|
remote work|job interviews|writing a resume|gardening|composting|baking bread|making coffee|
brewing tea|cooking rice|healthy breakfasts|travelling on a budget|camping|hiking safety|
first aid|recycling|ocean tides|volcanoes|earthquakes|hurricanes|rainbows|the seasons|
the moon's phases|Mars|the solar system|telescopes|satellites|airplanes|bicycles|
music theory|jazz|the piano|painting|photography|chess|poetry|novels|Shakespeare|
the Renaissance|ancient Egypt|the Great Wall of China|democracy|human rights|
""".replace("\n", "").split("|")
SUBJECTS = [s.strip() for s in SUBJECTS if s.strip()]

QUESTION_TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "How does {s} work?",
    "Give me three interesting facts about {s}.", "Why is {s} important?",
    "Explain {s} to a ten-year-old.", "What are the main ideas behind {s}?",
    "Write a short paragraph about {s}.", "What are common misconceptions about {s}?",
    "List the pros and cons of {s}.", "Write a haiku about {s}.",
    "What should a beginner know about {s}?",
]

CODE_TASKS = """reverses a string|checks whether a number is prime|computes the factorial of n|
returns the n-th Fibonacci number|counts the words in a text|removes duplicates from a list while
keeping order|merges two sorted lists|flattens a nested list|finds the maximum in a list without
max()|checks whether a string is a palindrome|converts Celsius to Fahrenheit|reads a CSV file and
returns its rows|computes the average of a list of numbers|sorts a list of dictionaries by a key|
returns the most common element of a list|validates an email address with a regular expression|
computes the greatest common divisor of two numbers|implements binary search|transposes a matrix|
counts the vowels in a string|returns all permutations of a string|parses a date string|
groups words by their first letter|checks whether two strings are anagrams|implements a stack class|
implements a queue with two stacks|computes the sum of the digits of a number|
converts a decimal number to binary|finds all prime numbers below n|capitalizes each word of a sentence
""".replace("\n", " ").split("|")
CODE_TASKS = [t.strip() for t in CODE_TASKS if t.strip()]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript", "C"]


def _paragraphs(doc: Document, lo: int = 200, hi: int = 900) -> list[str]:
    paras = [p.strip() for p in re.split(r"\n\s*\n", doc.text)]
    return [re.sub(r"\s+", " ", p) for p in paras if lo <= len(p) <= hi and p.count(" ") > 20]


def _code_prefixes(doc: Document) -> list[str]:
    """A function's start: its `def` line, docstring and first lines (the model completes it)."""
    out = []
    lines = doc.text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*def \w+\(.*\):\s*$", line):
            body = lines[i:i + 8]
            indent = len(line) - len(line.lstrip())
            if any(len(b) - len(b.lstrip()) <= indent and b.strip() for b in body[1:]):
                continue  # function shorter than the prefix
            out.append("\n".join(b[indent:] for b in body[:5]) + "\n")
    return out


def build(docs: list[Document], count: int, seed: int) -> list[dict]:
    """`count` prompts: {kind, chat (bool), text}. Kinds as in the benchmark: chat, summarize
    (summaries and rewrites of a passage), code (chat requests and raw completion), continue
    (raw continuation of prose)."""
    rng = random.Random(seed)
    paras = [p for d in docs if d.kind == "prose" for p in _paragraphs(d)]
    code = [c for d in docs if d.kind == "code" for c in _code_prefixes(d)]
    rng.shuffle(paras)
    rng.shuffle(code)
    prompts = []
    for i in range(count):
        r = i % 8
        if r in (0, 1, 2):
            s = rng.choice(SUBJECTS)
            prompts.append({"kind": "chat", "chat": True,
                            "text": rng.choice(QUESTION_TEMPLATES).format(s=s)})
        elif r == 3:
            p = paras[i % len(paras)]
            task = rng.choice(["Summarize the following passage in two or three sentences.",
                               "Rewrite the following text in plain, simple English.",
                               "Summarize this text as a short bullet list.",
                               "Explain what this passage says."])
            prompts.append({"kind": "summarize", "chat": True, "text": f"{task}\n\n{p}"})
        elif r == 4:
            prompts.append({"kind": "code", "chat": True, "text":
                            f"Write a {rng.choice(CODE_LANGS)} function that "
                            f"{rng.choice(CODE_TASKS)}."})
        elif r == 5:
            c = code[i % len(code)]
            prompts.append({"kind": "code", "chat": rng.random() < 0.5, "text":
                            c if rng.random() < 0.5 else
                            f"Complete this Python function:\n\n```python\n{c}```"})
        elif r == 6:
            p = paras[(i * 7) % len(paras)]
            cut = p[: max(80, len(p) // 2)].rsplit(" ", 1)[0]
            prompts.append({"kind": "continue", "chat": False, "text": cut})
        else:
            s = rng.choice(SUBJECTS)
            prompts.append({"kind": "chat", "chat": True, "text":
                            rng.choice(["Tell me a short story about {s}.",
                                        "Write an email to a friend about {s}.",
                                        "Describe {s} in one paragraph.",
                                        "Compare {s} with something similar."]).format(s=s)})
    return prompts


def training_prompts(count: int, seed: int = 0) -> list[dict]:
    train, _ = split_documents()
    return build(train, count, seed)


HELDOUT_QUESTIONS = [
    "What causes the northern lights?", "How do noise-cancelling headphones work?",
    "What is the difference between weather and climate?",
    "How can I improve my handwriting?", "Why do cats purr?",
    "What is a good way to start learning to draw?",
    "Write a Python function that checks whether a year is a leap year.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
]


def heldout_prompts(per_kind: int = 6, seed: int = 1) -> list[dict]:
    """Evaluation prompts: held-out corpus documents and questions outside the templates."""
    _, heldout = split_documents()
    rng = random.Random(seed)
    paras = [p for d in heldout if d.kind == "prose" for p in _paragraphs(d)]
    code = [c for d in heldout if d.kind == "code" for c in _code_prefixes(d)]
    rng.shuffle(paras)
    rng.shuffle(code)
    out = [{"kind": "chat", "chat": True, "text": q} for q in HELDOUT_QUESTIONS[:per_kind]]
    out += [{"kind": "summarize", "chat": True, "text":
             f"Summarize the following passage in two or three sentences.\n\n{p}"}
            for p in paras[:per_kind]]
    out += [{"kind": "code", "chat": False, "text": c} for c in code[:per_kind // 2]]
    out += [{"kind": "code", "chat": True, "text": q} for q in HELDOUT_QUESTIONS[6:6 + per_kind - per_kind // 2]]
    out += [{"kind": "continue", "chat": False,
             "text": p[: max(80, len(p) // 2)].rsplit(" ", 1)[0]} for p in paras[per_kind:2 * per_kind]]
    return out
