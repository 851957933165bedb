"""The streaming engine: teacher-forced decoding of a batch of documents through a fixed-budget KV cache.

`plan(policy, budget, spec, n_layer, T)` decides, in one place and from nothing but the policy's flags and
the settings, how a stream runs: its path, the per-layer budgets, the block size and the windows (`Plan`).
`stream` then builds that path (an `eval/paths.py: Path`, from the model, the policy, the plan and the
spec) and runs it; every path returns a `StreamOutput`. The paths, all exact (tests/test_policies.py
holds each equal to the naive loop):

* **parallel** - position-static policies (`static_window`) in both position modes (in ``cache`` mode a
  contiguous run keeps its distances and only the sinks move): blocks of queries, each over the keys
  its window reaches (eval/static.py).
* **blocked** - every other cache policy: the token loop layer by layer over a block of steps, so only
  the cache's write, attention and eviction run per step and the rest as block matmuls (eval/blocked.py).
* **loop** - one token per step over preallocated slot buffers (eval/loop.py): ``spec.force_loop``,
  ``spec.compile`` (its steady step compiled), and generation.
* **recompute** - policies that keep no cache (`recompute`): every prediction is a fresh forward over the
  last budget+1 tokens, run as batched forwards over the windows of a block of steps.
* **answer** - a stream that also writes answers (`Answers`, the long-context tasks), for every policy that
  can generate: the prompt on the blocked path, then a fork of its caches decodes the answer while the
  stream goes on teacher-forced through the token loop; the prompt runs once for both.

Step t processes the token at position t and predicts token t+1 (t = 0 .. T-2). The query attends to
the entries kept after step t-1 (at most `budget`) plus itself; then the cache is evicted to budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from evictlab.cache.budget import budgets_for
from evictlab.cache.policies import Policy
from evictlab.errors import ConfigError
from evictlab.eval import blocked
from evictlab.eval.blocked import BlockedPath, prefill
from evictlab.eval.full import FullReference, Recorder, Tick
from evictlab.eval.loop import LoopPath, TokenLoop
from evictlab.eval.paths import Path, Plan, StreamOutput
from evictlab.eval.spec import DEFAULT, StreamSpec, check_positions
from evictlab.eval.static import ParallelPath, RecomputePath
from evictlab.models.gpt import GPT

# At most this many steps per block on the blocked path and on the static path of bounded windows (whose
# attention is block x (block + budget)); the full cache's static path takes T / 16 when larger (at most
# spec.block). Measured with make bench's workload (2026-12-01): 64-128 best for all three; a block of
# 2,048 ran a window at half the rate of 128, the full cache at 0.72x.
BLOCK_STEPS = 128


def window_block(width: int) -> int:
    """Queries per block of a bounded window on the parallel path, for a model of hidden size `width`:
    BLOCK_STEPS, doubled while the width is at least 4x the block. A block's attention is block x (block
    + budget) per head, its matmuls block x width x width: the wider the model, the larger their share and
    the more rows they need to run near the machine's matmul rate. Measured at batch 1, 512 tokens, budget
    64, 1 thread (2026-12-03, two other processes on the 2 cores): SmolLM2-135M (width 576) ran StreamingLLM
    at 101-117 token-steps/s with blocks of 256 against 82-98 with 128 and 90-107 with 512; gpt_small
    (width 128) keeps 128."""
    block = BLOCK_STEPS
    while width >= 4 * block:
        block *= 2
    return block


@dataclass
class Answers:
    """Answers to write while streaming (the long-context tasks): every row's prompt ends at `prompt_end`
    (tokens[:, :prompt_end]) and `n_new` tokens are decoded greedily from it under the policy. On the answer
    path the prompt then runs once for both the teacher-forced stream and the written answers."""

    prompt_end: int
    n_new: int
    clock: DecodeClock | None = None  # where the writing's time goes (DecodeClock, below)


def plan(
    policy: Policy,
    budget: int,
    spec: StreamSpec,
    n_layer: int,
    T: int,
    width: int = 0,
    answers: Answers | None = None,
) -> Plan:
    """The path, per-layer budgets and block size of a stream of T tokens through a model of `n_layer`
    layers and hidden size `width` (and `answers` to write on the way): the engine's one decision."""
    if (
        answers is not None
        and policy.can_generate()
        and not (policy.recompute or spec.force_loop or spec.compile)
    ):
        T = max(T, answers.prompt_end + answers.n_new)  # the caches hold the written tokens too
        budgets = tuple(budgets_for(n_layer, policy, budget, spec.allocation, T - 1))
        return Plan("answer", budgets, min(spec.block, BLOCK_STEPS))
    budgets = tuple(budgets_for(n_layer, policy, budget, spec.allocation, T - 1))
    if policy.recompute:
        if len(set(budgets)) != 1:
            raise ConfigError(f"{policy.name} re-encodes one window for all layers: use allocation=uniform")
        return Plan("recompute", budgets, spec.block, windows=tuple(policy.static_window(b) for b in budgets))
    windows = tuple(policy.static_window(b) for b in budgets)
    if policy.ablation:
        policy.ablated(n_layer)  # a layer the model has
        if spec.force_loop or spec.compile:
            raise ConfigError(
                f"{policy.name} runs on the parallel path only: unset eval.force_loop/eval.compile"
            )
    if windows[0] is not None and not spec.force_loop:
        bounded = all(lookback is not None for _, lookback in windows)
        # the full cache's blocks grow with the stream: each block re-reads every earlier key
        block = window_block(width) if bounded else max(BLOCK_STEPS, T // 16)
        return Plan("parallel", budgets, min(spec.block, block), windows=windows)
    if not (spec.force_loop or spec.compile):
        return Plan("blocked", budgets, min(spec.block, BLOCK_STEPS))
    return Plan("loop", budgets, 1, compiled=spec.compile)


@dataclass
class AnswerPath(Path):
    """The blocked path that writes answers on the way: the prompt's steps (0 .. P-2) on the blocked path,
    then a fork of its caches decodes `answers.n_new` tokens greedily while the stream goes on teacher-
    forced through the token loop (steps P-1 .. T-2). Each part equals its own pass (the blocked path and
    `generate`, tests/test_tasks.py), but the prompt, nearly all of a task stream, runs once."""

    name: ClassVar[str] = "answer"
    answers: Answers | None = None

    @torch.no_grad()
    def run(self, tokens, reference, doc, tick=None) -> StreamOutput:
        P, n_new, clock = self.answers.prompt_end, self.answers.n_new, self.answers.clock
        B, T = tokens.shape
        n = T - 1
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        start = time.perf_counter()
        rec = Recorder(tgt, None, reference, tick)
        budgets, mode = list(self.plan.budgets), self.spec.position_mode
        loop = TokenLoop(self.model, self.policy, budgets, mode, B, max(n, P - 1 + n_new), doc, reference)
        blocked.run_blocked(self.model, inp[:, : P - 1], loop, self.plan.block, rec)
        answer = Prefilled(loop.fork(), tokens[:, :P], n_new, time.perf_counter() - start)  # (its own caches)
        for t in range(P - 1, n):  # the rest of the stream, teacher-forced
            rec.add(t, loop.decode_one_token(inp[:, t : t + 1], t)[:, None])
        written = answer.write(clock, in_place=True)
        out = rec.out
        if loop.lost is not None:
            out["lost"] = loop.lost.values[:, :n]
        loop.held = loop.held[:n]  # (sized for the written tokens too)
        return replace(self.cache_output(out, loop), written=written)


# Plan.path -> the path that runs it
PATHS: dict[str, type[Path]] = {
    cls.name: cls for cls in (ParallelPath, BlockedPath, LoopPath, RecomputePath, AnswerPath)
}


def build_path(model: GPT, policy: Policy, p: Plan, spec: StreamSpec, answers: Answers | None = None) -> Path:
    """The path object `p` names, built from everything decided before the stream."""
    if p.path == "answer":
        return AnswerPath(model, policy, p, spec, answers)
    return PATHS[p.path](model, policy, p, spec)


def stream(
    model: GPT,
    tokens: torch.Tensor,
    policy: Policy,
    budget: int,
    spec: StreamSpec = DEFAULT,
    *,
    reference: FullReference | None = None,
    doc: torch.Tensor | None = None,
    tick: Tick | None = None,
    answers: Answers | None = None,
) -> StreamOutput:
    """Stream tokens [B, T] (each row a document starting with its prefix) under `policy` at `budget`.

    `reference` (from `full_reference`) enables KL / agreement / attention diagnostics; a policy that
    `needs_future` needs one with its attention rows. `doc`: the rows' global document indices. `tick`
    is told the token-steps of each block as it is recorded (a progress bar's update). `answers`: write
    them on the way where the policy can generate (the answer path; `written` in the output), else the
    stream runs as without them (and `written` is None).
    """
    check_positions(model.cfg, spec.position_mode)
    B, T = tokens.shape
    if T < 2:
        raise ConfigError(f"a stream needs at least 2 tokens, got {T}")
    p = plan(policy, budget, spec, model.cfg.n_layer, T, model.cfg.n_embd, answers)
    if policy.needs_future and (
        reference is None or not (reference.attention and reference.attention.has_rows)
    ):
        raise ConfigError(f"strategy {policy.name!r} needs reference=full_reference(..., attention=True)")
    doc = doc if doc is not None else torch.arange(B, device=tokens.device)
    model.eval()
    start = time.perf_counter()
    out = build_path(model, policy, p, spec, answers).run(tokens, reference, doc, tick)
    seconds = time.perf_counter() - start
    first4_mass = None
    if reference is not None and reference.attention is not None:  # NaN past the steps the reference covers
        first4 = reference.attention.first4
        first4_mass = first4.new_full((B, T - 1, first4.shape[-1]), float("nan"))
        first4_mass[:, : first4.shape[1]] = first4
    return replace(out, block=p.block, seconds=seconds, first4_mass=first4_mass)


@dataclass
class DecodeClock:
    """Where generation's time goes, summed over `generate` calls: the prompt (its blocked-path prefill)
    and the new tokens, one step at a time through the token loop (the rate a deployment decodes at)."""

    fused: bool = False  # also decode through the fused kernel (TokenLoop.fork), where the policy can
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # token-steps decoded: rows x new tokens
    fused_s: float = 0.0  # the same steps from the same prefilled caches through the fused kernel
    fused_steps: int = 0
    fused_rows: int = 0
    fused_same_rows: int = 0  # of them, those whose fused continuation is the explicit one's, token for token

    def rate(self) -> float:
        """Decode token-steps per second (NaN before any)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    def fused_rate(self) -> float:
        return self.fused_steps / self.fused_s if self.fused_s > 0 else float("nan")


@torch.no_grad()
def _generate_recompute(model: GPT, prompt: torch.Tensor, W: int, n_new: int, n_sink: int = 0):
    """Greedy continuation without a cache: a fresh forward over the first n_sink and the last W - n_sink
    tokens (at positions 0 ..) for each new token."""
    seq = prompt
    for _ in range(n_new):
        window = (
            seq if seq.shape[1] <= W else torch.cat([seq[:, :n_sink], seq[:, seq.shape[1] - W + n_sink :]], 1)
        )
        pos = torch.arange(window.shape[1], device=seq.device)
        logits = model.forward_with(window, pos, last_only=True)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1] :]


@dataclass
class Prefilled:
    """A prompt [B, P] run through the blocked path under a policy: the token loop holding its caches and
    policy state after the prompt's last token, ready to write `n_new` tokens. `write` decodes on a fork,
    so one prefill serves any number of timed decodes (`make speed`)."""

    loop: TokenLoop
    prompt: torch.Tensor  # [B, P]
    n_new: int
    prefill_s: float  # seconds the prefill took
    spent: bool = False  # an in-place write moved the caches on

    @torch.no_grad()
    def write(self, clock: DecodeClock | None = None, *, in_place: bool = False) -> torch.Tensor:
        """Greedy continuation [B, n_new] from a fork of the prefilled caches, this object unchanged
        (`in_place`: on its own caches, which it uses up); `clock` adds the prefill's seconds, the
        decode's and, where it asks and the policy reads no weights, the same steps through the fused
        kernel from another fork."""
        if self.spent:
            raise RuntimeError("this prefill was written on in place: its caches are past the prompt")
        self.spent = in_place
        B, P = self.prompt.shape
        tokens = torch.cat([self.prompt, self.prompt.new_zeros(B, self.n_new)], dim=1)
        twin = _fused_twin(self.loop, clock)  # (before a decode moves the caches on)
        loop = self.loop if in_place else self.loop.fork()
        _write(loop, twin, tokens, P, clock, self.prefill_s)
        return tokens[:, P:]


def _generation_plan(
    model: GPT, prompt: torch.Tensor, policy: Policy, budget: int, n_new: int, spec: StreamSpec
) -> Plan:
    """The plan of `n_new` greedy tokens after prompt [B, P] (checked: the policy can generate, the
    positions fit the model, a prompt and a token to write); the model put in eval mode."""
    check_positions(model.cfg, spec.position_mode)
    if not policy.can_generate():
        why = "it needs the full-cache run's future" if policy.needs_future else "it ablates the full cache"
        raise ConfigError(f"strategy {policy.name!r} cannot generate: {why}")
    P = prompt.shape[1]
    if P < 1 or n_new < 1:
        raise ConfigError(f"generation needs a prompt and n_new >= 1 (got P={P}, n_new={n_new})")
    model.eval()
    return plan(policy, budget, replace(spec, compile=False), model.cfg.n_layer, P + n_new)


def _prefill(
    model: GPT, prompt: torch.Tensor, policy: Policy, p: Plan, spec: StreamSpec, n_new: int, doc
) -> Prefilled:
    """The prompt on the blocked path (every policy that can generate runs on it) into a token loop sized
    for `n_new` more tokens."""
    B, P = prompt.shape
    start = time.perf_counter()
    doc = doc if doc is not None else torch.arange(B, device=prompt.device)
    loop = TokenLoop(model, policy, list(p.budgets), spec.position_mode, B, P + n_new - 1, doc)
    prefill(model, prompt, loop, min(spec.block, BLOCK_STEPS))
    return Prefilled(loop, prompt, n_new, time.perf_counter() - start)


@torch.no_grad()
def prefilled(
    model: GPT,
    prompt: torch.Tensor,
    policy: Policy,
    budget: int,
    n_new: int,
    spec: StreamSpec = DEFAULT,
    *,
    doc: torch.Tensor | None = None,
) -> Prefilled | None:
    """The prompt [B, P] prefilled on the blocked path for `n_new` tokens of greedy generation, or None
    where the plan keeps no cache to prefill (the window with re-computation encodes every step afresh)."""
    p = _generation_plan(model, prompt, policy, budget, n_new, spec)
    return None if p.path == "recompute" else _prefill(model, prompt, policy, p, spec, n_new, doc)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    policy: Policy,
    budget: int,
    n_new: int,
    spec: StreamSpec = DEFAULT,
    *,
    doc: torch.Tensor | None = None,
    clock: DecodeClock | None = None,
) -> torch.Tensor:
    """Greedy continuation [B, n_new] of prompt [B, P] with the cache evicted to `budget` every step
    (the prompt runs on the blocked path, whose caches and policy state are then the token loop's, as
    tests/test_policies.py holds; spec.force_loop streams it token by token instead; then each new token
    through the token loop). `clock` adds this call's prefill and decode seconds (not on force_loop's
    reference; window + recompute's re-encoding counts as decode)."""
    p = _generation_plan(model, prompt, policy, budget, n_new, spec)
    B, P = prompt.shape
    if p.path == "recompute":  # no cache: every new token a fresh forward over the window
        start = time.perf_counter()
        out = _generate_recompute(model, prompt, p.budgets[0] + 1, n_new, policy.n_sink)
        if clock is not None:
            clock.decode_s += time.perf_counter() - start
            clock.decode_steps += B * n_new
        return out
    if spec.force_loop:  # the reference: the prompt token by token too
        tokens = torch.cat([prompt, prompt.new_zeros(B, n_new)], dim=1)
        doc = doc if doc is not None else torch.arange(B, device=prompt.device)
        _, _, filled = LoopPath(model, policy, p, spec).stream(tokens, None, doc, generate_from=P)
        return filled[:, P:]
    return _prefill(model, prompt, policy, p, spec, n_new, doc).write(clock, in_place=True)


def _fused_twin(loop: TokenLoop, clock: DecodeClock | None) -> TokenLoop | None:
    """A fork of the loop attending through the fused kernel, where the clock asks for its rate and the
    policy reads no attention weights; else None."""
    if clock is None or not clock.fused or loop.policy.needs_attention:
        return None
    return loop.fork(fused=True)


def _write(loop: TokenLoop, twin, tokens: torch.Tensor, P: int, clock: DecodeClock | None, prefill_s: float):
    """Greedy steps P-1 .. T-2 of tokens [B, T] in place on `loop`, and on the fused `twin` (if any) into
    a copy; the clock gets the prefill seconds, both decodes' seconds and steps, and rows written alike."""
    B, T = tokens.shape
    t0 = time.perf_counter()
    _decode(loop, tokens, P - 1, T - 1)
    if clock is None:
        return
    steps = B * (T - P)
    clock.prefill_s += prefill_s
    clock.decode_s += time.perf_counter() - t0
    clock.decode_steps += steps
    if twin is not None:
        again, t0 = tokens.clone(), time.perf_counter()
        _decode(twin, again, P - 1, T - 1)
        clock.fused_s += time.perf_counter() - t0
        clock.fused_steps, clock.fused_rows = clock.fused_steps + steps, clock.fused_rows + B
        clock.fused_same_rows += int((again[:, P:] == tokens[:, P:]).all(1).sum())


def _decode(loop: TokenLoop, tokens: torch.Tensor, first: int, n: int) -> None:
    """Greedy steps first .. n-1 in place: each writes its argmax as the next token."""
    for t in range(first, n):
        tokens[:, t + 1] = loop.decode_one_token(tokens[:, t : t + 1], t).argmax(-1)
