"""The contract between the engine and its paths: what `plan` decides (`Plan`), the object every path is
(`Path`: built from the model, the policy, the plan and the spec; one `run`), and what it returns
(`StreamOutput`). The paths themselves live beside their mechanics: `ParallelPath` and `RecomputePath` in
eval/static.py, `BlockedPath` in eval/blocked.py, `LoopPath` in eval/loop.py, `AnswerPath` in
eval/engine.py, which picks one by `Plan.path` (engine.PATHS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from evictlab.eval.caches import last_attended
from evictlab.eval.spec import StreamSpec

if TYPE_CHECKING:
    from evictlab.cache.policies import Policy
    from evictlab.eval.full import FullReference, Tick
    from evictlab.models.gpt import GPT


@dataclass(frozen=True)
class Plan:
    """How one stream runs, decided before any work (`engine.plan`); metrics.json records `path` and
    `block`."""

    path: str  # parallel | blocked | loop | recompute | answer
    budgets: tuple[int, ...]  # KV entries each layer keeps between steps
    block: int  # steps per block (queries per block on the parallel path); 1 on the token loop
    compiled: bool = False  # the loop's steady step through torch.compile
    # per layer (n_sink, lookback) of a position-static window (parallel and recompute paths), else None
    windows: tuple[tuple[int, int | None], ...] | None = None


@dataclass
class StreamOutput:
    nll: torch.Tensor  # [B, n] per predicted token
    correct: torch.Tensor  # [B, n] 1 where the policy's top-1 prediction is the true token
    occupancy: torch.Tensor  # [n, L] entries held after each step
    path: str  # parallel | blocked | loop | recompute | answer (Plan.path)
    budgets: list[int]  # per layer
    kl: torch.Tensor | None = None  # [B, n] KL(p_full || p_policy)
    agree: torch.Tensor | None = None  # [B, n] top-1 agreement with the full cache
    lost: torch.Tensor | None = None  # [B, n, L] full-cache attention on entries the policy does not hold
    first4_mass: torch.Tensor | None = None  # [B, n, L] full-cache attention on positions 0-3
    # [B, L, Hkv or 1, N_FIRST]: the last step whose query attends to each of positions 0-3 (-1: every step)
    last_attended: torch.Tensor | None = None
    block: int = 0  # Plan.block
    seconds: float = 0.0
    policy_seconds: float = 0.0  # time inside policy scoring and victim selection
    compile_seconds: float = 0.0  # torch.compile of the loop's steady step (spec.compile), part of `seconds`
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer [B, Hkv, S] final positions (loop)
    written: torch.Tensor | None = None  # [B, n_new] greedy answers (the answer path, engine.Answers)


@dataclass
class Path:
    """One way through the model, built from everything decided before the stream: the model, the policy,
    the plan and the spec. `run` streams tokens [B, T] (each row a document starting with its prefix)
    against the full cache's `reference` (None: no KL, agreement or diagnostics); `doc` [B] are the rows'
    global document indices (a seeded policy's draws), `tick(token_steps)` is told each recorded block."""

    name: ClassVar[str] = ""  # Plan.path
    model: GPT
    policy: Policy
    plan: Plan
    spec: StreamSpec

    def run(
        self,
        tokens: torch.Tensor,
        reference: FullReference | None,
        doc: torch.Tensor,
        tick: Tick | None = None,
    ) -> StreamOutput:
        raise NotImplementedError

    def static_output(self, per_token: dict, tokens: torch.Tensor) -> StreamOutput:
        """A position-static path's output: layer l holds min(step, budget_l) entries after each step, and
        its window (n_sink, lookback: Plan.windows) decides which steps attend to the first positions."""
        B, T = tokens.shape
        p = self.plan
        steps = torch.arange(1, T, device=tokens.device)
        occupancy = torch.stack([steps.clamp(max=b) for b in p.budgets], dim=-1)
        last = last_attended(list(p.windows), T - 1).to(tokens.device)[None, :, None].expand(B, -1, 1, -1)
        return StreamOutput(
            **per_token, occupancy=occupancy, path=p.path, budgets=list(p.budgets), last_attended=last
        )

    def cache_output(self, per_token: dict, loop, **extra) -> StreamOutput:
        """A slot-cache path's output (blocked, loop, answer): what its caches held, when they dropped
        positions 0-3."""
        return StreamOutput(
            **per_token,
            occupancy=loop.occupancy,
            path=self.plan.path,
            budgets=list(self.plan.budgets),
            policy_seconds=loop.policy_seconds,
            kept=[c.pos.clone() for c in loop.caches],
            last_attended=torch.stack([c.dropped for c in loop.caches], 1),
            **extra,
        )
