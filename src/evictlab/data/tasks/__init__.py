"""Long-context tasks generated locally, RULER-style (Hsieh et al. 2024): needles planted in a haystack of
held-out text, a question after it, an answer scored by what the model writes.

Every task is one small file in this package: a dataclass with a `name`, registered with `@register`, that
draws a `Problem` (the sentences to plant, the question, the start of the reply and the reference answer,
the items a correct answer names) from a seeded generator. `task_streams` turns problems into token
streams of exactly `length` tokens each:

    prompt = head + instruction + haystack with the needles at seeded depths + question + reply start
    stream = prompt + reference answer (+ more haystack text, so every prompt of a batch ends at one place)

so the engine scores the answer teacher-forced like any other stream (its tokens' NLL, exact match), and
greedy decoding from the prompt under a policy gives the written answer that `Task.score` grades: exact
(the items named are exactly the expected ones) and partial credit (the share named, less any extras).
Segments are tokenized separately, so answer positions are exact for every tokenizer.

Templates: `chatml` wraps the prompt in SmolLM2's chat template (system, user, assistant turns); `plain`
is "instruction, context, question, Answer:" for the models trained here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import numpy as np
import torch

from evictlab.data.dataset import Corpus
from evictlab.errors import ConfigError


class Template(str, Enum):
    plain = "plain"  # instruction, context, question, "Answer:" (the models trained here)
    chatml = "chatml"  # SmolLM2's chat template: system, user and assistant turns


SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's default
CHAT_HEAD = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
CHAT_TURN = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Problem:
    needles: list[str]  # sentences planted in the haystack, in this order (first shallowest)
    question: str  # asked after the context
    reply: str  # the start of the answer, given in the prompt ("The special magic number for X is:")
    answer: str  # the reference continuation (teacher-forced)
    expected: tuple[str, ...]  # the items a correct answer names


@dataclass
class Task:
    """A task: `problem(rng)` draws one, `score(problem, text)` grades a written answer."""

    name: ClassVar[str] = ""
    instruction: ClassVar[str] = ""  # before the context
    item: ClassVar[str] = r"\d{7}"  # what counts as one named item in an answer (regex)
    partial: ClassVar[bool] = True  # whether partial credit means anything (several expected items)

    def problem(self, rng: np.random.Generator) -> Problem:
        raise NotImplementedError

    def named(self, text: str) -> list[str]:
        """The items an answer names, in order, duplicates dropped. The answer is the text before the end
        of the turn (<|im_end|>), from its first word to its first blank line: a list over several lines
        counts, text the model runs on into after a blank line does not."""
        body = text.split("<|im_end|>")[0].lstrip(" \t\n:.,-")
        first = body.split("\n\n")[0]
        return list(dict.fromkeys(re.findall(rf"(?<![\w]){self.item}(?![\w])", first)))

    def score(self, problem: Problem, text: str) -> tuple[bool, float]:
        """(exact, partial): exact when the answer names exactly the expected items (any order); partial:
        expected items named / max(expected, named), so listing extras does not earn credit."""
        named = self.named(text)
        hit = len(set(named) & set(problem.expected))
        exact = set(named) == set(problem.expected)
        return exact, hit / max(len(problem.expected), len(named), 1)


TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a `name`")
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise TypeError(f"task name {cls.name!r} registered twice")
    TASKS[cls.name] = cls
    return cls


def make_task(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
    return TASKS[name]()


def digits(rng: np.random.Generator, n: int = 7) -> str:
    """A number of n digits without a leading zero."""
    return str(int(rng.integers(10 ** (n - 1), 10**n)))


def distinct(draw, n: int) -> list[str]:
    """n distinct values from a zero-argument `draw`."""
    out: dict[str, None] = {}
    while len(out) < n:
        out[draw()] = None
    return list(out)


@dataclass
class TaskBatch:
    tokens: torch.Tensor  # [N, T]
    answer: torch.Tensor  # [N, T-1] bool: steps whose target is an answer token
    answer_start: np.ndarray  # [N] position of the first answer token (the prompt is tokens[:, :start])
    answer_len: np.ndarray  # [N]
    needle_pos: list[list[int]]  # [N] positions of each needle's first token
    problems: list[Problem]
    documents: list[str]  # [N] the documents each haystack comes from (TokenSplit.documents_in)
    task: Task = field(repr=False, default_factory=Task)

    def head(self, k: int) -> TaskBatch:
        """The first k problems (make verify --streams k: the same problems the whole batch starts with)."""
        return TaskBatch(
            self.tokens[:k],
            self.answer[:k],
            self.answer_start[:k],
            self.answer_len[:k],
            self.needle_pos[:k],
            self.problems[:k],
            self.documents[:k],
            self.task,
        )


def _segments(tok, problem: Problem, task: Task, template: Template, prefix: np.ndarray):
    """The tokenized pieces around the haystack: (head, needles, tail, answer)."""
    enc = lambda s: np.asarray(tok.encode(s), dtype=np.int64)  # noqa: E731
    question = f"\n\n{problem.question}"
    if template is Template.chatml:
        head = enc(CHAT_HEAD + task.instruction + "\n\n")
        if len(head) == 0 or head[0] != tok.bos_id or enc("<|im_end|>").size != 1:
            raise ConfigError(
                "eval.task_template=chatml needs a tokenizer whose <|im_start|> is its BOS and "
                "<|im_end|> one token (SmolLM2's); use eval.task_template=plain"
            )
        tail = enc(question + CHAT_TURN + problem.reply)
    else:
        head = np.concatenate((prefix, enc(task.instruction + "\n\n")))
        tail = enc(question + "\nAnswer: " + problem.reply)
    return head, [enc(n) for n in problem.needles], tail, enc(problem.answer)


def layout(segments, filler: np.ndarray, length: int, slot: int, rng, name: str):
    """One stream of exactly `length` tokens from a problem's tokenized `segments`: (ids, needle
    positions, (first, stop) of the filler tokens it holds). The prompt ends at length - slot whatever the
    answer (so a batch's prompts end at one position and decode together); filler text after the answer
    fills the rest of the slot."""
    head, needles, tail, answer = segments
    body = length - len(head) - sum(len(n) for n in needles) - len(tail) - slot
    pad = slot - len(answer)
    if body < 1 or body + pad > len(filler):
        raise ConfigError(
            f"task {name}: a stream of {length} tokens leaves {body} haystack tokens; need 1 .. "
            f"{len(filler) - pad} (eval.stream_len)"
        )
    start = int(rng.integers(0, len(filler) - body - pad + 1))
    fill = filler[start : start + body]
    cuts = np.sort(rng.integers(0, body + 1, size=len(needles)))  # depths, first needle shallowest
    parts, pos, at = [head], [], len(head)
    for a, b, needle in zip([0, *cuts[:-1]], cuts, needles, strict=True):
        parts.append(fill[a:b])
        at += b - a
        pos.append(at)
        parts.append(needle)
        at += len(needle)
    parts += [
        fill[cuts[-1] :] if len(cuts) else fill,
        tail,
        answer,
        filler[start + body : start + body + pad],
    ]
    return np.concatenate(parts).astype(np.int64), pos, (start, start + body + pad)


def task_streams(
    corpus: Corpus,
    name: str,
    n: int,
    length: int,
    sink_token: bool,
    template: Template | str = Template.plain,
    seed: int = 0,
    split: str = "test",
) -> TaskBatch:
    """n streams of `length` tokens of task `name`, haystacks from the split's text (seeded: the same
    problems and haystacks for every policy). Every prompt ends at one position (the longest answer's
    slot before the end), so the answers are written in batches."""
    task, template = make_task(name), Template(template)
    if n < 1:
        raise ConfigError(f"eval.n_streams={n} must be >= 1")
    prefix = np.asarray(corpus.prefix(sink_token), dtype=np.int64)
    draw = np.random.default_rng([seed, 7])
    problems = [task.problem(draw) for _ in range(n)]
    segments = [_segments(corpus.tokenizer, p, task, template, prefix) for p in problems]
    slot = max(len(seg[3]) for seg in segments)  # the longest answer
    rng, sp = np.random.default_rng([seed, 8]), corpus.splits[split]
    rows, needles, docs = [], [], []
    for seg in segments:
        seq, pos, span = layout(seg, sp.ids, length, slot, rng, task.name)
        rows.append(seq)
        needles.append(pos)
        docs.append(sp.documents_in(*span))
    starts = [length - slot] * n
    lens = [len(seg[3]) for seg in segments]
    tokens = torch.from_numpy(np.stack(rows))
    answer = torch.zeros(n, length - 1, dtype=torch.bool)
    for i, (s, k) in enumerate(zip(starts, lens, strict=True)):
        answer[i, s - 1 : s - 1 + k] = True  # step t predicts token t + 1
    return TaskBatch(tokens, answer, np.array(starts), np.array(lens), needles, problems, docs, task)


for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
