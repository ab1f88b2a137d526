"""`forerun train {medusa,hydra,eagle,eagle3}`: heads distilled from the target itself.

Owns: the training corpus, the data collection (the target's features and its top-K next-token
distribution at every position, written as resumable shards) and the training loop. The
features come from `--runtime`, the one the heads will draft on: torch, or llama.cpp (final
layer only, so not for EAGLE-3), whose numerics differ from torch's by a few percent. Data:
- code: the Python standard library's own sources on this machine, teacher-forced in windows;
- chat: the target's own replies (greedy; on llama.cpp 16 decoding in one batch) to the
  questions of `chat_prompts()`, written or generated for this file (none is a benchmark row),
  and optionally to questions the target wrote itself (`self_questions`, Magpie; `self_tasks`)
  and to the user's own (`--questions`: prompts of their traffic, in the bench's JSONL
  shapes), then teacher-forced like the code;
- text (`--text`, optional): the user's own plain-text files (prose, docs), teacher-forced,
  their windows alternating with the code's after the chat replies.
Loss: cross-entropy against the target's distribution (its top-K, renormalised over the head's
reduced vocabulary): KL to the target up to a constant, as GKD-style distillation does, not only
the sampled token; EAGLE-1 adds its feature regression. Reported: per-head (per-step for EAGLE)
top-1/top-5 agreement with the target's argmax on held-out windows.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from forerun.heads import HeadConfig, Heads, TargetIO, save_heads
from forerun.propose.heads import causal
from forerun.runtime.base import Runtime

TEACHER_TOP = 32  # the target's most likely tokens kept per position

CHAT_PROMPTS = (
    "Explain the difference between a process and a thread.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are three ways to reduce memory use in a pandas DataFrame?",
    "Give me a short packing list for a three-day hiking trip.",
    "How does HTTPS keep a connection private?",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "What is the time complexity of binary search, and why?",
    "Translate 'The weather is lovely today' into Spanish and German.",
    "Write a bash one-liner that counts lines in all .py files under a folder.",
    "Explain what a Python decorator is, with an example.",
    "How do I undo the last git commit but keep the changes?",
    "What is the difference between TCP and UDP?",
    "Write a haiku about compilers.",
    "Explain gradient descent to a high-school student.",
    "Write a JavaScript function that debounces another function.",
    "What should I check before deploying a web service to production?",
    "Describe how a hash map handles collisions.",
    "Write a Rust function that reverses a vector in place.",
    "If a train travels 120 km in 1.5 hours, what is its average speed? Show the steps.",
    "Suggest five names for a coffee shop run by programmers.",
    "Explain the CAP theorem in simple terms.",
    "Write a Python class for a stack with push, pop and peek.",
    "What is the difference between a list and a tuple in Python?",
    "How can I make a slow SQL query faster?",
    "Write unit tests with pytest for a function add(a, b).",
    "Explain what Docker containers are and why people use them.",
    "Give a recipe for a simple tomato pasta sauce.",
    "Refactor this code to use a list comprehension: result = []\nfor x in xs:\n"
    "    if x > 0:\n        result.append(x * 2)",
    "What does the `yield` keyword do in Python?",
    "Write a regular expression that matches an email address, and explain it.",
    "Explain the difference between supervised and unsupervised learning.",
)


EXPLAIN = ("recursion", "closures", "virtual memory", "garbage collection",
           "public-key cryptography", "how DNS resolves a name", "load balancing",
           "database indexes", "the JavaScript event loop", "REST versus GraphQL", "overfitting",
           "attention in transformers", "photosynthesis", "inflation", "compound interest",
           "the water cycle", "black holes", "how vaccines work", "big-O notation", "mutexes",
           "consistent hashing", "Bloom filters", "unit versus integration tests", "git rebase")
TASKS = (("Python", "merges two sorted lists"), ("Python", "parses a CSV line with quotes"),
         ("Python", "returns the n-th prime"), ("Python", "flattens a nested list"),
         ("Python", "validates an IPv4 address"), ("Python", "computes a moving average"),
         ("Python", "groups words by their anagram"), ("Python", "retries a call with backoff"),
         ("JavaScript", "deep-clones an object"), ("JavaScript", "formats a date as YYYY-MM-DD"),
         ("TypeScript", "narrows a union type with a type guard"), ("Go", "reads a file line by "
         "line"), ("Rust", "counts word frequencies"), ("C", "reverses a string in place"),
         ("Java", "checks balanced parentheses"), ("SQL", "finds duplicate emails in a table"),
         ("Python", "implements an LRU cache"), ("Python", "converts Roman numerals to integers"),
         ("bash", "renames all .txt files to .md"), ("Python", "downloads a URL with a timeout"))
SENTENCES = ("Where is the nearest train station?", "The meeting has been moved to Thursday.",
             "Please keep the door closed.", "I would like a cup of coffee with milk.",
             "Our team released a new version of the library yesterday.")
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese", "Chinese")
EDITS = ("add type hints and a docstring", "make it easier to read",
         "rename the variables to be more descriptive", "add input validation",
         "rewrite it without changing its behaviour, in modern Python")

# the second set (after the first 138): writing, role play, reasoning, science and humanities,
# factual questions, translation from German and French, word problems, summaries and questions
# on a passage (the standard library's docstrings), more code; written for this file
FORMS = ("a short blog post", "a professional email", "a product description",
         "a persuasive paragraph", "the opening of a short story", "a two-minute speech",
         "a limerick", "a short news report", "a motivational message", "a LinkedIn post")
SUBJECTS = ("a weekend trip to Lisbon", "switching to a four-day work week",
            "a new reusable water bottle", "learning to play the piano as an adult",
            "a robot that wants to become a chef", "the opening of a community garden",
            "why teams should write design documents", "a city banning cars from its centre",
            "the first day at a new job", "a bakery that only opens at night",
            "saving money on groceries", "a lost dog finding its way home",
            "the benefits of regular code reviews", "a solar-powered bicycle")
ROLES = ("a pirate captain", "a medieval knight", "a friendly librarian", "a sports coach",
         "Sherlock Holmes", "a time traveller from the year 2300", "a grumpy chef",
         "a tour guide in Rome", "a retired astronaut", "a kindergarten teacher")
ROLE_QUESTIONS = ("What do you think of smartphones?", "How should I spend my weekend?",
                  "What is the secret to a happy life?", "Why should I learn mathematics?",
                  "What would you eat for breakfast?", "How do you deal with stress?")
CONCEPTS = ("entropy", "natural selection", "the greenhouse effect", "plate tectonics",
            "Newton's third law", "the Doppler effect", "quantum entanglement",
            "supply and demand", "opportunity cost", "the Renaissance", "the Industrial "
            "Revolution", "the Cold War", "the separation of powers", "utilitarianism",
            "cognitive dissonance", "the placebo effect", "herd immunity", "DNA replication",
            "the speed of light", "electric current", "monetary policy", "the Silk Road",
            "the scientific method", "Impressionism in painting", "the printing press",
            "climate versus weather", "antibiotic resistance", "the Pythagorean theorem",
            "compound words in German", "the stock market")
FACTS = ("Who painted the Mona Lisa?", "What is the capital of Australia?",
         "When did the Berlin Wall fall?", "Who wrote Pride and Prejudice?",
         "How many planets are in the solar system?", "What is the largest ocean on Earth?",
         "Who discovered penicillin?", "What language is spoken in Brazil?",
         "Which element has the chemical symbol Fe?", "Who was the first person on the Moon?",
         "What is the tallest mountain in Africa?", "When was the first iPhone released?",
         "Who composed the Four Seasons?", "What is the longest river in Europe?",
         "Which country hosted the 2016 Summer Olympics?", "What is the boiling point of "
         "water in Fahrenheit?", "Who invented the telephone?", "What is the currency of "
         "Japan?", "How many bones does an adult human have?", "Who wrote the Odyssey?",
         "What is the smallest prime number?", "Which planet is known as the Red Planet?",
         "What year did the Titanic sink?", "Who developed the theory of general relativity?")
GERMAN = ("Der Zug nach München hat heute zwanzig Minuten Verspätung .",
          "Die Stadt plant , im nächsten Jahr drei neue Schulen zu bauen .",
          "Viele Menschen arbeiten inzwischen mindestens einen Tag pro Woche von zu Hause .",
          "Das Museum zeigt eine Ausstellung über die Geschichte der Fotografie .",
          "Nach dem starken Regen waren mehrere Straßen in der Innenstadt gesperrt .",
          "Die Firma hat im letzten Quartal mehr Gewinn gemacht als erwartet .",
          "Wissenschaftler haben eine neue Art von Frosch im Regenwald entdeckt .",
          "Der Bürgermeister versprach , die Preise für Busfahrkarten nicht zu erhöhen .",
          "Im Sommer kommen jedes Jahr Tausende Touristen an den See .",
          "Die Mannschaft gewann das Spiel in der letzten Minute mit zwei zu eins .",
          "Der neue Flughafen soll im Herbst endlich eröffnet werden .",
          "Eltern sollten mit ihren Kindern über die Gefahren im Internet sprechen .")
FRENCH = ("Le marché ouvre tous les samedis matin sur la place du village.",
          "Les chercheurs ont publié leurs résultats dans une revue scientifique.",
          "Il faut réserver une table, car le restaurant est souvent complet.",
          "La bibliothèque sera fermée pendant les vacances de Noël.")
PROBLEMS = ("{a} friends share {b} pizzas equally, and each pizza has 8 slices. How many "
            "slices does each friend get?",
            "A car uses {a} litres of fuel per 100 km. How much fuel does it need for {b}0 km?",
            "Tom is {a} years old. His sister is {b} years older. How old will she be in 5 years?",
            "A garden is {a} metres long and {b} metres wide. What is its area and perimeter?",
            "A book costs ${a} and is on sale for {b}0% off. What is the sale price?",
            "A worker earns ${a}0 a day and works {b} days. After paying $25 for lunch each "
            "week, how much is left if the work took one week?")
PASSAGE_ASKS = ("What is the main purpose of what this passage describes?",
                "List the key points of this passage as bullet points.",
                "Based only on this passage, what would a beginner need to know first?")
MORE_TASKS = (("Python", "removes duplicates from a list while keeping the order"),
              ("Python", "finds the longest common prefix of a list of strings"),
              ("Python", "checks whether two strings are anagrams"),
              ("Python", "reads a JSON file and prints its keys"),
              ("Python", "counts the vowels in a sentence"),
              ("Python", "returns the Fibonacci numbers below n"),
              ("Python", "sorts a list of dictionaries by a key"),
              ("JavaScript", "fetches JSON from a URL and handles errors"),
              ("JavaScript", "shuffles an array"), ("C++", "finds the maximum in a vector"),
              ("Go", "starts an HTTP server that returns hello"),
              ("Java", "reverses a linked list"), ("SQL", "returns monthly sales totals"),
              ("Python", "implements binary search on a sorted list"),
              ("Python", "converts a temperature from Celsius to Fahrenheit"),
              ("Rust", "parses an integer from a string with error handling"))


# the third set (after the first 390): the same families in other combinations (explanations for
# beginners and children, code in other languages and its tests, every writing form and role
# question not yet paired, translation into other languages, more word problems, questions on
# the standard library's docstrings and functions) and the facts below; written for this file
MORE_FACTS = ("Who wrote One Hundred Years of Solitude?", "What is the capital of Canada?",
              "How many continents are there?", "Who painted The Starry Night?",
              "What gas do plants absorb from the air?", "Who was the first emperor of Rome?",
              "What is the hardest natural substance?", "In which country are the pyramids of "
              "Giza?", "Who wrote the play Hamlet?", "What is the freezing point of water in "
              "Celsius?", "Which organ pumps blood through the body?", "Who proposed the "
              "theory of evolution by natural selection?", "What is the largest desert in the "
              "world?", "How many strings does a standard guitar have?", "Which ocean lies "
              "between Africa and Australia?", "Who was the first woman to win a Nobel Prize?",
              "What is the main ingredient of guacamole?", "Which language has the most native "
              "speakers?", "What does a thermometer measure?", "Who built the first practical "
              "light bulb?", "What is the capital of Kenya?", "How many minutes are in a day?",
              "Which metal is liquid at room temperature?", "Who wrote The Little Prince?")
OTHER_LANGUAGES = ("JavaScript", "Go", "Rust", "Java", "C++", "TypeScript", "Python", "C#")


@functools.cache
def chat_prompts() -> tuple[str, ...]:
    """CHAT_PROMPTS, then generated ones in a fixed order: explanations, code, translations,
    arithmetic, summaries of the standard library's module docstrings and edits of its short
    functions (as a user would paste them). Parses the standard library (seconds): cached."""
    import ast

    out = list(CHAT_PROMPTS)
    out += [f"Explain {topic} in a few sentences." for topic in EXPLAIN]
    out += [f"Write a {lang} function that {task}." for lang, task in TASKS]
    out += [f"Translate into {LANGUAGES[i % len(LANGUAGES)]}: {s}"
            for i, s in enumerate(SENTENCES * 2)]
    out += [f"A shop sells {a} pens for ${b}. How much do {c} pens cost? Show the steps."
            for a, b, c in ((3, 4, 9), (5, 12, 7), (4, 10, 22), (6, 15, 10))]
    docs, functions = [], []
    for text in code_corpus():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        if doc and 200 <= len(doc) <= 1200:
            docs.append(doc)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 14:
                functions.append(ast.get_source_segment(text, node))
    out += [f"Summarize this documentation in two sentences:\n\n{d}" for d in docs[::3][:16]]
    out += [f"Please {EDITS[i % len(EDITS)]} for this function:\n\n```python\n{f}\n```"
            for i, f in enumerate(functions[::17][:32])]
    # the second set: appended, so that the first prompts (and collected replies) keep their place
    out += [f"Write {FORMS[i % len(FORMS)]} about {SUBJECTS[(i * 3) % len(SUBJECTS)]}."
            for i in range(40)]
    out += [f"Pretend to be {ROLES[i % len(ROLES)]} in this conversation and answer as they "
            f"would: {ROLE_QUESTIONS[(i * 5) % len(ROLE_QUESTIONS)]}" for i in range(20)]
    out += [f"In a few paragraphs, what is {c}, and why does it matter?" for c in CONCEPTS]
    out += list(FACTS)
    out += [f"Translate German to English: {g}" for g in GERMAN]
    out += [f"Translate French to English: {f}" for f in FRENCH]
    out += [PROBLEMS[i % len(PROBLEMS)].format(a=3 + (i * 7) % 11, b=2 + (i * 5) % 9)
            for i in range(36)]
    out += [f"Write a {lang} function that {task}." for lang, task in MORE_TASKS]
    out += [f"Summarize: {d}" for d in docs[1::3][:40]]
    out += [f"{d}\n\n{PASSAGE_ASKS[i % len(PASSAGE_ASKS)]}" for i, d in enumerate(docs[2::3][:40])]
    out += [f"Please {EDITS[i % len(EDITS)]} for this function:\n\n```python\n{f}\n```"
            for i, f in enumerate(functions[5::17][:40])]
    # the third set, appended for the same reason
    out += [f"Explain {topic} to a beginner, with one concrete example." for topic in EXPLAIN]
    out += [f"Explain {c} to a ten-year-old." for c in CONCEPTS]
    out += [f"Give three real-world examples of {c}, one sentence each." for c in CONCEPTS]
    tasks = TASKS + MORE_TASKS
    out += [f"Write a {lang} function that {task}."
            for i, (first, task) in enumerate(tasks)
            for lang in [other_language(i, first)]]
    out += [f"Write pytest unit tests for a Python function that {task}."
            for lang, task in tasks if lang == "Python"]
    paired = {(i % len(FORMS), (i * 3) % len(SUBJECTS)) for i in range(40)}
    out += [f"Write {FORMS[f]} about {SUBJECTS[t]}." for t in range(len(SUBJECTS))
            for f in range(len(FORMS)) if (f, t) not in paired][:60]
    paired = {(i % len(ROLES), (i * 5) % len(ROLE_QUESTIONS)) for i in range(20)}
    out += [f"Pretend to be {ROLES[r]} in this conversation and answer as they would: "
            f"{ROLE_QUESTIONS[q]}" for q in range(len(ROLE_QUESTIONS))
            for r in range(len(ROLES)) if (r, q) not in paired][:40]
    out += list(MORE_FACTS)
    paired = {(i % len(LANGUAGES), i % len(SENTENCES)) for i in range(2 * len(SENTENCES))}
    out += [f"Translate into {LANGUAGES[g]}: {SENTENCES[t]}" for t in range(len(SENTENCES))
            for g in range(len(LANGUAGES)) if (g, t) not in paired]
    out += [PROBLEMS[i % len(PROBLEMS)].format(a=3 + (i * 7) % 11, b=2 + (i * 5) % 9)
            for i in range(36, 96)]
    out += [f"Explain what this module does, for a new contributor:\n\n{d}"
            for d in docs[::3][16:56]]
    out += [f"Explain what this function does, step by step:\n\n```python\n{f}\n```"
            for f in functions[9::17][:40]]
    out += [f"Write unit tests for this function:\n\n```python\n{f}\n```"
            for f in functions[13::17][:30]]
    return tuple(out)


# Magpie (Xu et al., 2024): an aligned model handed its chat template opened at the user's turn
# writes a user's message itself. Left free, Qwen2.5-Coder wrote exam questions ("Q: ... A. B.
# C.") and Chinese half the time (8 tried); each question here starts with an opener, in turn,
# that steers toward kinds of request the written templates cover thinly.
SELF_OPENERS = ("Write", "Explain", "Imagine you are", "Summarize", "What", "How", "Can you",
                "Solve", "Compare", "Give me", "Please", "Why", "Describe", "Tell me", "I",
                "If", "Suppose", "Create", "Help me", "Draft", "List", "Who", "Which",
                "Rewrite", "Is it", "Translate", "Read", "Plan", "Should I", "Outline")
SELF_MARK = "\x00forerun-question\x00"
SELF_MIN_ASCII = 0.95  # the benchmarks' chat is English; Qwen drifts into Chinese


def self_questions(replier, n: int, seed: int = 0, max_tokens: int = 128, rows: int = 16,
                   progress: bool = True, openers: tuple[str, ...] = SELF_OPENERS) -> list[str]:
    """`n` user questions written by the target itself (Magpie): its chat template rendered up
    to the user's message (default system prompt included) and an opener, then sampled at
    temperature 1 until the turn ends, seeded (the same model gives the same questions),
    batched on llama.cpp. Candidates that run past `max_tokens`, are shorter than 16
    characters, are not English-like (under SELF_MIN_ASCII of ASCII) or repeat an earlier one
    are dropped; rounds continue until `n` are kept. `openers`: how the questions start, in
    turn."""
    from forerun.sampling import SamplingConfig

    tok = replier.tokenizer
    head = tok.apply_chat_template([{"role": "user", "content": SELF_MARK}])
    head = head[:head.index(SELF_MARK)]
    kept: list[str] = []
    seen: set[str] = set()
    start = 0
    bar = tqdm(desc="the target writes questions", unit="question", leave=False,
               disable=not progress)
    while len(kept) < n:
        count = (n - len(kept)) * 5 // 4 + 4
        bar.reset(total=count)  # each round's candidates; some are dropped after
        starts = [openers[i % len(openers)] for i in range(start, start + count)]
        prompts = [tok.encode(head + o, add_special=False) for o in starts]
        if hasattr(replier.target, "greedy_many"):
            replies = replier.target.greedy_many(prompts, max_tokens, tok.stop_ids, rows,
                                                 temperature=1.0, seed=seed)
        else:
            replies = ((j, replier.generate(ids, max_tokens=max_tokens, sampling=SamplingConfig(
                temperature=1.0, seed=seed * 1_000_003 + start + j)).token_ids)
                for j, ids in enumerate(prompts))
        got = {}
        for j, reply in replies:
            got[j] = reply
            bar.update()
        for j in range(count):
            text = (starts[j] + tok.decode(got[j])).strip()
            ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
            if (len(got[j]) < max_tokens and len(text) >= 16 and ascii_share >= SELF_MIN_ASCII
                    and text not in seen):
                seen.add(text)
                kept.append(text)
        start += count
        seed += 1  # greedy_many seeds by prompt index: a new round, new generators
    bar.close()
    return kept[:n]


# --self-tasks: the benchmarks' kinds of work on a passage (summaries, questions on a text,
# rewrites), on passages the target writes itself, never on a benchmark's rows
PASSAGE_OPENERS = ("Write a short news report about", "Write a short encyclopedia entry on",
                   "Write a paragraph of a textbook about", "Write a short blog post about",
                   "Write a short story about", "Write a product description for",
                   "Write an email to", "Write a short opinion piece on")
TASK_TEMPLATES = (
    "Summarize the following text in two or three sentences.\n\n{passage}",
    "{passage}\n\nWhat is the main point of the text above?",
    "Read the passage below and list its key facts.\n\n{passage}",
    "{passage}\n\nWrite a one-line headline for this text.",
    "Using only the passage below, answer: who or what is it about, and what happens?"
    "\n\n{passage}",
    "Rewrite the following text in simpler words.\n\n{passage}",
)


def self_tasks(replier, n: int, seed: int = 0, request_tokens: int = 64,
               passage_tokens: int = 120, rows: int = 16, progress: bool = True) -> list[str]:
    """`n` questions on passages the target writes itself: a request for a text written by
    the target (`self_questions` from PASSAGE_OPENERS), its greedy answer of up to
    `passage_tokens` (the passage), and question i is TASK_TEMPLATES[i % 6] around it."""
    requests = self_questions(replier, n, seed, request_tokens, rows, progress,
                              openers=PASSAGE_OPENERS)
    passages = dict(chat_replies(replier, requests, passage_tokens, rows))
    return [TASK_TEMPLATES[i % len(TASK_TEMPLATES)].format(
        passage=replier.tokenizer.decode(passages[i]).strip()) for i in range(n)]


def user_questions(paths: tuple[str, ...]) -> tuple[str, ...]:
    """--questions files -> their prompts (first user turns), in file order: any JSONL shape
    `forerun bench --workload` reads. The bench's own prompt sets are refused: a head trained on
    them would flatter every figure `forerun bench` prints."""
    from forerun.bench.workloads import BUILTIN, read_workload

    bundled = {path.resolve() for path in BUILTIN.values()}
    out: list[str] = []
    for name in paths:
        path = Path(name).expanduser()
        if name in BUILTIN or (path.is_file() and path.resolve() in bundled):
            raise ValueError(f"--questions {name}: that is one of `forerun bench`'s own prompt "
                             "sets; a head trained on it would flatter the bench. Give prompts "
                             "of your own traffic.")
        out += [p.text for p in read_workload(str(path))]
    return tuple(out)


def other_language(i: int, first: str) -> str:
    """OTHER_LANGUAGES[i], cyclically, or the next one where that is `first`."""
    n = len(OTHER_LANGUAGES)
    return OTHER_LANGUAGES[(i + (OTHER_LANGUAGES[i % n] == first)) % n]


@dataclass(frozen=True)
class TrainConfig:
    kind: str
    max_tokens: int = 20000  # data budget: target tokens collected
    seq_len: int = 256  # teacher-forced window
    chat: int = 16  # chat_prompts() answered by the target (self-distillation)
    chat_tokens: int = 96  # reply length per chat prompt
    replies: str = "torch"  # the runtime generating the chat replies (the fastest: llama.cpp)
    steps: int = 600
    lr: float = 1e-3
    held_out: float = 0.1  # fraction of windows kept for agreement
    ttt: int = 3  # eagle, eagle3: rolled-out steps (training-time test)
    seed: int = 0
    bf16: bool = False  # training matmuls in bfloat16 (autocast; weights and Adam stay fp32)
    text: tuple[str, ...] = ()  # plain-text files/folders (TEXT_SUFFIXES), alternating with code
    self_chat: int = 0  # questions the target writes itself (Magpie), answered after chat's
    epochs: float = 0.0  # > 0: this many passes over the training windows, in place of steps
    self_tasks: int = 0  # questions on passages the target writes itself, after self_chat's
    questions: tuple[str, ...] = ()  # JSONL files of the user's own prompts, answered last

    def total_steps(self, windows: int) -> int:
        """Training steps (one window each): `steps`, or `epochs` passes over `windows`."""
        return max(1, math.ceil(self.epochs * windows)) if self.epochs > 0 else self.steps


# --- data ---------------------------------------------------------------------------------

def read_texts(paths: list[Path]) -> Iterator[str]:
    """The files' UTF-8 texts, in order; unreadable or non-UTF-8 files are skipped."""
    for path in paths:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def code_corpus() -> Iterator[str]:
    """The standard library's top-level sources, in a fixed order."""
    return read_texts(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


TEXT_SUFFIXES = (".txt", ".md", ".rst")  # what a --text folder contributes (".rst.txt" too)


def text_files(paths: tuple[str, ...]) -> list[Path]:
    """--text paths -> the files they name, in a fixed order: a file as given, a folder's files
    with TEXT_SUFFIXES (recursively, sorted). A missing path or an empty folder is an error."""
    files: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise ValueError(f"--text {name}: no {'/'.join(TEXT_SUFFIXES)} files in it")
            files += found
        else:
            raise ValueError(f"--text {name}: no such file or folder")
    return files


def chunked(tok, texts: Iterator[str], n: int) -> Iterator[list[int]]:
    """Texts tokenized back to back, cut into windows of n tokens (a short tail is dropped)."""
    buffer: list[int] = []
    for text in texts:
        buffer += tok.encode(text, add_special=False)
        while len(buffer) >= n:
            yield buffer[:n]
            buffer = buffer[n:]


def windows(engine, cfg: TrainConfig, skip=lambda i: False, replier=None,
            known=lambda i: None, own: tuple[str, ...] = ()) -> Iterator[list[int] | None]:
    """Token windows of cfg.seq_len: the target's chat replies first (greedy, generated by
    `replier`, default `engine`) to cfg.chat written questions and then to `own` (the
    target's own, `self_questions` then `self_tasks`, then the user's `--questions`), then
    code (alternating with cfg.text's windows while they last); None for a chat window
    `skip(i)` says is already collected (its reply is not generated again); `known(i)`, where
    not None, is written question i's window from an earlier collection (the same reply, not
    generated again)."""
    tok, replier = engine.tokenizer, replier or engine
    questions = chat_prompts()[:cfg.chat] + tuple(own)
    skipped = [skip(i) for i in range(len(questions))]
    plan = [None if s or i >= cfg.chat else known(i) for i, s in enumerate(skipped)]
    todo = [i for i, ids in enumerate(plan) if ids is None and not skipped[i]]
    replies = chat_replies(replier, [questions[i] for i in todo], cfg.chat_tokens)
    done: dict[int, list[int]] = {}
    for i, question in enumerate(questions):
        if skipped[i]:
            yield None
            continue
        if plan[i] is not None:
            yield plan[i]
            continue
        while i not in done:  # a batched replier finishes them out of order
            j, reply = next(replies)
            done[todo[j]] = reply
        yield (tok.encode_prompt(question) + done.pop(i))[-cfg.seq_len:]
    streams = [chunked(tok, read_texts(text_files(cfg.text)), cfg.seq_len)] if cfg.text else []
    streams.append(chunked(tok, code_corpus(), cfg.seq_len))
    while streams:  # round robin: a text window, a code window, ...
        for stream in list(streams):
            if (ids := next(stream, None)) is None:
                streams.remove(stream)
            else:
                yield ids


def chat_replies(replier, questions: list[str], max_tokens: int, rows: int = 16
                 ) -> Iterator[tuple[int, list[int]]]:
    """(index, greedy reply) for each question: batched, `rows` at a time, where the replier's
    runtime can (llama.cpp: ~2.5x the tokens a second here), else one after another."""
    tok = replier.tokenizer
    if hasattr(replier.target, "greedy_many"):
        yield from replier.target.greedy_many([tok.encode_prompt(q) for q in questions],
                                              max_tokens, tok.stop_ids, rows)
        return
    for j, question in enumerate(questions):
        yield j, replier.generate(question, max_tokens=max_tokens).token_ids


def teacher(runtime: Runtime, ids: list[int], layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """One window through the target: its features and its top-K next-token log-probs."""
    runtime.truncate(0)
    out = runtime.forward(torch.tensor(ids), hidden_layers=layers)
    top_lp, top_ids = out.logits.float().log_softmax(-1).topk(TEACHER_TOP, dim=-1)  # [T, K]
    runtime.truncate(0)
    shard = {"tokens": torch.tensor(ids, dtype=torch.int32), "top_ids": top_ids.int(),
             "top_lp": top_lp.half()}
    for layer in layers:
        shard[f"h{layer}"] = out.hidden[layer].to(torch.bfloat16).contiguous()  # [T, D]
    return shard


def collect(engine, cfg: TrainConfig, layers: tuple[int, ...], data_dir: Path,
            replier=None, siblings: tuple[tuple[Path, int, bool], ...] = ()) -> list[Path]:
    """Shards data_dir/window-NNNNN.safetensors, one per window, up to cfg.max_tokens tokens;
    windows already there are kept (resumable): the corpus order is fixed. `siblings`: data
    folders of the same kind of corpus (`sibling_collections`), whose chat replies are reused
    (the slow part of a collection), and whose windows, where their features are the same
    (runtime and layers), are copied rather than teacher-forced again."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    def known(i: int) -> list[int] | None:
        for sibling, chats, _ in siblings:  # its first `chats` windows are chat replies
            if i < chats and (path := sibling / f"window-{i:05d}.safetensors").exists():
                with safe_open(str(path), "pt") as f:
                    return f.get_tensor("tokens").tolist()
        return None

    @functools.cache
    def done_before() -> dict[bytes, Path]:  # tokens -> a shard with these features
        found = {}
        for sibling, _, same in siblings:
            for path in sorted(sibling.glob("window-*.safetensors")) if same else ():
                with safe_open(str(path), "pt") as f:
                    found.setdefault(f.get_tensor("tokens").numpy().tobytes(), path)
        return found

    data_dir.mkdir(parents=True, exist_ok=True)
    total = max(1, cfg.max_tokens // cfg.seq_len)
    paths = [data_dir / f"window-{i:05d}.safetensors" for i in range(total)]
    missing = [p for p in paths if not p.exists()]
    with tqdm(total=total, initial=total - len(missing), desc="collect", unit="window") as bar:
        if not missing:
            return paths
        def kept(name: str, write) -> tuple[str, ...]:
            """Questions written once and kept: a resumed collection answers the same ones."""
            saved = data_dir / name
            if not saved.exists():
                saved.write_text(json.dumps(write(), indent=1) + "\n")
            return tuple(json.loads(saved.read_text()))

        writer, context = replier or engine, engine.target.config.context_length
        own = ()
        if cfg.self_chat:
            own += kept("self-questions.json", lambda: self_questions(
                writer, cfg.self_chat, cfg.seed, min(128, context // 4)))
        if cfg.self_tasks:
            own += kept("self-tasks.json", lambda: self_tasks(
                writer, cfg.self_tasks, cfg.seed, min(64, context // 8), min(120, context // 4)))
        own += user_questions(cfg.questions)
        chunks = windows(engine, cfg, skip=lambda i: paths[i].exists(), replier=replier,
                         known=known, own=own)
        for i, ids in enumerate(chunks):
            if i >= total:
                break
            if ids is not None and not paths[i].exists():
                key = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
                if (twin := done_before().get(key)) is not None:
                    shutil.copyfile(twin, paths[i])
                else:
                    save_file(teacher(engine.target, ids, layers), str(paths[i]))
                bar.update()
    return [p for p in paths if p.exists()]


def sibling_collections(data: Path, name: str, cfg: TrainConfig
                        ) -> tuple[tuple[Path, int, bool], ...]:
    """The folders beside `data` holding the same target's windows of the same length and reply
    length, collected for other layers, by another runtime, with --text or with more or fewer
    chat questions: (folder, its chat question count, whether its features are data's own,
    the same runtime and layers). See `collect` for what is reused."""
    pattern = re.compile(rf"({re.escape(name)}-.+-L[-_0-9]+)-T{cfg.seq_len}-C(\d+)"
                         rf"x{cfg.chat_tokens}(-S\d+)?(-P\d+)?(-Q[0-9a-f]+)?(-X[0-9a-f]+)?")
    ours = pattern.fullmatch(data.name)
    return tuple((d, int(m[2]), ours is not None and m[1] == ours[1])
                 for d in sorted(data.parent.glob(f"{name}-*"))
                 if d != data and (m := pattern.fullmatch(d.name)))


def corpus_vocab(shards: list[dict], size: int, fallback: list[int], special: list[int],
                 ) -> torch.Tensor:
    """The heads' reduced vocabulary (FR-Spec / EAGLE-3): the `size` ids most frequent in the
    training data (its tokens and the target's argmax at every position), then, where the data
    has fewer distinct ids, `fallback`'s order; `special` ids always. Sorted."""
    counts = torch.bincount(torch.cat([torch.zeros(0, dtype=torch.long), *(
        ids for w in shards for ids in (w["tokens"].long(), w["top_ids"][:, 0].long()))]))
    seen = [int(i) for i in counts.argsort(descending=True, stable=True) if counts[i] > 0]
    chosen = dict.fromkeys(special)
    for i in [*seen, *fallback]:
        if len(chosen) >= max(size, len(special)):
            break
        chosen.setdefault(i)
    return torch.tensor(sorted(chosen))


def load_shards(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(str(p)) for p in paths]


# --- losses -------------------------------------------------------------------------------

def teacher_probs(w: dict, rows: slice, lookup: torch.Tensor, n: int) -> torch.Tensor:
    """[R, N] the target's top-K distribution over the reduced vocabulary (renormalised)."""
    ids, lp = w["top_ids"][rows].long(), w["top_lp"][rows].float()  # [R, K]
    idx = lookup[ids]  # [R, K]; -1 = outside the reduced vocabulary
    p = lp.exp() * (idx >= 0)
    out = torch.zeros(ids.shape[0], n).scatter_add_(1, idx.clamp_min(0), p)
    return out / out.sum(-1, keepdim=True).clamp_min(1e-9)


def predictions(heads: Heads, w: dict, cfg: TrainConfig
                ) -> tuple[list[tuple[torch.Tensor, slice]], torch.Tensor]:
    """[(logits [R, N], teacher rows)] per head (medusa/hydra) or per rolled-out step (eagle):
    logits at row t predict the token that the target's distribution at row t + 1 + i is
    over; and an extra loss (EAGLE-1's feature regression, else 0)."""
    hc, x = heads.cfg, w["tokens"].long()
    T = x.shape[0]
    if hc.kind == "medusa":
        z = heads.medusa(w["h-1"].float())  # [K, T, D]
        return [(heads.logits(z[i, :T - 1 - i]), slice(1 + i, T))
                for i in range(hc.num_heads)], torch.zeros(())
    if hc.kind == "hydra":
        z, out = w["h-1"].float(), []
        for i in range(hc.num_heads):
            z = heads.hydra_step(i, z[:T - 1 - i], x[1 + i:])  # [T-1-i, D]
            out.append((heads.logits(z), slice(1 + i, T)))
        return out, torch.zeros(())
    feature = heads.feature({k: w[f"h{k}"] for k in hc.layers})  # [T, D]
    # both EAGLEs roll out cfg.ttt steps on their own outputs: drafting past the first token
    # feeds the head's output back in, and a head never trained on that input drafts nothing
    out, steps, extra = [], cfg.ttt, torch.zeros(())
    # Training-time test (EAGLE-3): step i's row t is the i-th draft from origin t, at position
    # t + i; it attends, as at draft time, to the true-feature entries of positions 0..t (step
    # 0's rows 0..t), to its own earlier drafts from t (steps 1..i-1, row t), and to itself.
    offsets: list[int] = []
    k_prev = v_prev = None
    for i in range(steps):
        n, start = T - 1 - i, sum(T - 1 - j for j in range(i))
        # a new cache per step, the earlier steps' entries copied in: autograd needs the
        # tensors an earlier step attended to unchanged
        k_cache, v_cache = heads.new_cache(start + n)
        if k_prev is not None:
            k_cache[:, :start], v_cache[:, :start] = k_prev[:, :start], v_prev[:, :start]
        if i == 0:
            mask = causal(0, n)
        else:
            mask = torch.zeros(n, start + n, dtype=torch.bool)
            mask[:, :T - 1] = torch.ones(n, T - 1, dtype=torch.bool).tril()
            rows = torch.arange(n)
            for offset in [*offsets[1:], start]:
                mask[rows, offset + rows] = True
        offsets.append(start)
        o = heads.eagle_step(feature[:n], x[1 + i:], torch.arange(i, i + n), k_cache, v_cache,
                             start, mask)  # [n, D]
        k_prev, v_prev = k_cache, v_cache
        out.append((heads.logits(o), slice(1 + i, T)))
        if hc.kind == "eagle" and i == 0:  # EAGLE-1 also regresses the next feature
            extra = 0.1 * F.smooth_l1_loss(o, w["h-1"][1:].float())
        feature = o[:-1]
    return out, extra


def window_loss(heads: Heads, w: dict, cfg: TrainConfig, lookup: torch.Tensor,
                ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Mean cross-entropy to the target over heads/steps, and (top1, top5, count) per head."""
    n, losses, agree = heads.vocab_ids.shape[0], [], []
    preds, extra = predictions(heads, w, cfg)
    for logits, rows in preds:
        target = teacher_probs(w, rows, lookup, n)  # [R, N]
        logq = logits.log_softmax(-1)
        losses.append(-(target * logq).sum(-1).mean())
        best = lookup[w["top_ids"][rows, 0].long()]  # [R] the target's argmax, -1 if outside
        top5 = logits.topk(min(5, n), dim=-1).indices  # [R, 5]
        agree.append((int((top5[:, 0] == best).sum()), int((top5 == best[:, None]).any(-1).sum()),
                      best.shape[0]))
    return torch.stack(losses).mean() + extra, agree


def agreement(heads: Heads, shards: list[dict], cfg: TrainConfig, lookup) -> dict:
    sums: list[list[int]] = []
    losses = []
    with torch.no_grad():
        for w in shards:
            loss, agree = window_loss(heads, w, cfg, lookup)
            losses.append(float(loss))
            for i, a in enumerate(agree):
                if i == len(sums):
                    sums.append([0, 0, 0])
                sums[i] = [s + v for s, v in zip(sums[i], a, strict=True)]
    return {"loss": sum(losses) / max(1, len(losses)),
            "top1": [round(s[0] / max(1, s[2]), 4) for s in sums],
            "top5": [round(s[1] / max(1, s[2]), 4) for s in sums]}


# --- the loop -----------------------------------------------------------------------------

def vocab_lookup(heads: Heads) -> torch.Tensor:
    """[V] each full-vocabulary id's index in the heads' reduced vocabulary, -1 outside it."""
    lookup = torch.full((heads.cfg.vocab_size,), -1, dtype=torch.long)
    lookup[heads.vocab_ids] = torch.arange(heads.vocab_ids.shape[0])
    return lookup


def train(heads: Heads, shards: list[dict], cfg: TrainConfig, checkpoint: Path | None = None,
          progress: bool = True) -> dict:
    """AdamW with a cosine schedule over cfg.total_steps() windows; resumes from `checkpoint`."""
    torch.manual_seed(cfg.seed)
    # held_out = 0: agreement on the training windows themselves (a capacity check); else
    # every (1/held_out)-th window, so held-out text mixes chat and code as training does
    every = round(1 / cfg.held_out) if cfg.held_out > 0 and len(shards) > 1 else 0
    held = [w for i, w in enumerate(shards) if every and i % every == every - 1] or shards
    train_set = [w for i, w in enumerate(shards) if not every or i % every != every - 1] or shards
    lookup = vocab_lookup(heads)
    params = [p for p in heads.parameters() if p.requires_grad]
    steps = cfg.total_steps(len(train_set))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    step = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
    before = agreement(heads.eval(), held, cfg, lookup)
    heads.train()
    start = time.perf_counter()
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
    bar = tqdm(total=steps, initial=step, desc=f"train {heads.cfg.kind}", unit="step",
               disable=not progress)
    while step < steps:
        w = train_set[int(order[step % len(train_set)])]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss, _ = window_loss(heads, w, cfg, lookup)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        bar.update()
        if checkpoint is not None and (step % 100 == 0 or step == steps):
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step}, checkpoint)
    bar.close()
    after = agreement(heads.eval(), held, cfg, lookup)
    return {"before": before, "after": after, "train_s": round(time.perf_counter() - start, 1),
            "steps": steps, "windows": len(train_set), "held_out_windows": len(held)}


def new_heads(kind: str, io: TargetIO, vocab_ids: torch.Tensor, target_name: str,
              n_layers: int, **overrides) -> Heads:
    D = io.embed.shape[1]
    layers = head_layers(kind, n_layers)
    cfg = HeadConfig(kind, D, io.embed.shape[0], target_name, layers=layers,
                     draft_vocab=vocab_ids.shape[0], **overrides)
    torch.manual_seed(0)
    heads = Heads(cfg, vocab_ids, io)
    for name, p in heads.named_parameters():  # EAGLE's fc/layer: small random; Medusa: identity
        if p.dim() == 2 and not name.startswith("blocks"):
            torch.nn.init.normal_(p, 0, 0.02)
    return heads


def head_layers(kind: str, n_layers: int) -> tuple[int, ...]:
    """The target layers a kind reads: EAGLE-3 fuses low, middle and final features."""
    return (n_layers // 4, n_layers // 2, -1) if kind == "eagle3" else (-1,)


def run(engine, target_name: str, cfg: TrainConfig, out: Path, data_dir: Path,
        draft_vocab: int, replier=None, siblings: tuple[tuple[Path, int, bool], ...] = (),
        io: TargetIO | None = None, **head_overrides) -> dict:
    """Collect (or reuse) the data, train, save; returns the report. `io`: the target's
    embeddings and LM head (default: the torch runtime's own)."""
    io = io or TargetIO(*(t.detach() for t in (engine.target.model.embed.weight,
                                                engine.target.model.lm_weight())))
    V = io.embed.shape[0]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layers = head_layers(cfg.kind, engine.target.config.n_layers)
    paths = collect(engine, cfg, layers, data_dir, replier, siblings)
    collect_s = time.perf_counter() - t0
    shards = load_shards(paths)
    tok = engine.tokenizer
    ids = (corpus_vocab(shards, draft_vocab, tok.frequent_ids(draft_vocab), tok.frequent_ids(1))
           if draft_vocab else torch.arange(V))
    heads = new_heads(cfg.kind, io, ids[ids < V], target_name, engine.target.config.n_layers,
                      **head_overrides)
    report = train(heads, shards, cfg, checkpoint=out / "checkpoint.pt")
    report |= {"collect_s": round(collect_s, 1), "data_tokens": sum(
        int(s["tokens"].shape[0]) for s in shards), "config": asdict(cfg)}
    heads.cfg = replace(heads.cfg, training=report)
    save_heads(heads, out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
