"""The shared matrix: every registered policy x position mode x budget, against the invariants.

A new policy file under src/evictlab/cache/policies/ is picked up here by name, with no new test.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from evictlab.cache import POLICIES, make_policy
from evictlab.cache.policies import StepContext, choose_victim
from evictlab.eval import PositionMode, StreamSpec, full_reference, naive_stream, stream
from evictlab.eval.caches import held_share
from evictlab.eval.engine import generate, plan
from evictlab.models.gpt import GPT, GPTConfig

T = 40  # stream length (tokens, prefix included): 39 predicted tokens
NAMES = sorted(POLICIES)
MODES = ["original", "cache"]
# Each policy with its defaults, and the parameter settings that change which path or code runs
# (issue 27's ablations: a text-token sink, BOS re-encoded at the head of each window, BOS's value or one
# layer's BOS key ablated). A case is "name" or "name:param=value,...".
EXTRA = {
    "streaming_llm:n_sink=1,first_sink=1": ("streaming_llm", {"n_sink": 1, "first_sink": 1}),
    "recompute_window:n_sink=1": ("recompute_window", {"n_sink": 1}),
    "recompute_window:n_sink=3": ("recompute_window", {"n_sink": 3}),
    "bos_ablation:part=value": ("bos_ablation", {"part": "value"}),
    "bos_ablation:layer=1": ("bos_ablation", {"layer": 1}),
    "bos_ablation:part=value,layer=0": ("bos_ablation", {"part": "value", "layer": 0}),
}
CASES = {**{n: (n, {}) for n in NAMES}, **EXTRA}
ABLATIONS = [c for c, (n, _) in CASES.items() if POLICIES[n].ablation]


def policy_of(case: str):
    name, params = CASES.get(case, (case, {}))
    return make_policy(name, **params)


def small_budget(case: str) -> int:
    return max(10, policy_of(case).min_budget() + 3)


VARIANTS = {
    "mha": {},
    "gqa": {"n_kv_head": 2},
    # every switch the imported families use, at once: RMSNorm, SwiGLU, q/k/v and linear biases,
    # partial rotary, parallel residual, untied head, and our smeared keys (the engine must stay exact
    # under all of them)
    "families": {
        "n_kv_head": 2,
        "norm": "rmsnorm",
        "act": "swiglu",
        "bias": True,
        "rotary_dim": 4,
        "parallel_residual": True,
        "tie_embeddings": False,
        "smear_keys": True,
    },  # fmt: skip
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request):
    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=40, n_layer=2, n_head=4, n_embd=32, **VARIANTS[request.param])
    model = GPT(cfg).double().eval()
    if cfg.bias:  # biases start at zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
                if name.endswith("smear_logit"):  # away from 1/2, a different mix per KV head
                    p.normal_(0, 1.0)
    tokens = torch.randint(0, 40, (3, T))
    tokens[:, 0] = 39  # a <bos>-like first token
    ref = full_reference(model, tokens, attention=True)
    return model, tokens, ref


def run(setup, name, mode, budget, force_loop=False):
    model, tokens, ref = setup
    spec = StreamSpec(position_mode=mode, force_loop=force_loop)
    return stream(model, tokens, policy_of(name), budget, spec, reference=ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", ["small", "covers"])
def test_engine_equals_reference_loop(setup, name, mode, size):
    model, tokens, ref = setup
    budget = small_budget(name) if size == "small" else T
    out = run(setup, name, mode, budget)
    policy = policy_of(name)
    n = tokens.shape[1] - 1
    for b in range(tokens.shape[0]):
        nll, kept, last = naive_stream(
            model, tokens[b], policy, budget, StreamSpec(position_mode=mode), reference=ref, doc=b, row=b
        )
        assert (nll - out.nll[b]).abs().max().item() <= 1e-5, (name, mode, b)
        # the same steps attend to each of positions 0-3, on every path (the parallel one by its window)
        held, engine_held = held_share(last, n), held_share(out.last_attended[b], n)
        assert torch.equal(held, engine_held.expand_as(held)), (name, mode, b, held, engine_held)
        for l, pos in enumerate(kept if out.kept else []):  # loop path: the same entries survive
            for h in range(pos.shape[1]):
                engine_pos = out.kept[l][b, h]
                assert sorted(engine_pos[engine_pos >= 0].tolist()) == pos[0, h].tolist(), (l, h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [c for c in CASES if c not in ABLATIONS])
def test_budget_covering_the_stream_equals_full_cache(setup, name, mode):
    model, tokens, ref = setup
    full = run(setup, "full", mode, T)
    out = run(setup, name, mode, T - 1)  # T-1 predicted tokens: nothing is ever evicted
    torch.testing.assert_close(out.nll, full.nll, rtol=0, atol=1e-10)
    if not name.startswith("recompute_window"):
        assert out.lost is None or out.lost.abs().max() < 1e-12


def test_full_cache_equals_one_teacher_forced_forward(setup):
    model, tokens, ref = setup
    logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
    nll = -logp.gather(-1, tokens[:, 1:, None])[..., 0]
    for force_loop in (False, True):
        out = run(setup, "full", "original", T, force_loop=force_loop)
        torch.testing.assert_close(out.nll, nll, rtol=0, atol=1e-10)
    torch.testing.assert_close(ref.logp, logp, rtol=0, atol=1e-10)
    assert run(setup, "full", "original", T).kl.abs().max() < 1e-10


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", [c for c in CASES if policy_of(c).evicts])
def test_occupancy_never_exceeds_budget(setup, name, mode):
    budget = small_budget(name)
    out = run(setup, name, mode, budget, force_loop=True)
    assert int(out.occupancy.max()) == budget
    assert (out.occupancy <= budget).all()
    for pos in out.kept:
        assert ((pos >= 0).sum(-1) <= budget).all()


@pytest.mark.parametrize("mode", MODES)
def test_streaming_llm_never_evicts_its_sinks(setup, mode):
    out = run(setup, "streaming_llm", mode, 8, force_loop=True)
    n_sink = make_policy("streaming_llm").n_sink
    for pos in out.kept:
        for s in range(n_sink):
            assert ((pos == s).sum(-1) == 1).all()
    assert sorted(out.kept[0][0, 0][out.kept[0][0, 0] >= 0].tolist()) == [0, 1, 2, 3, 35, 36, 37, 38]


def test_window_is_the_same_in_both_position_modes(setup):
    for force_loop in (False, True):
        a = run(setup, "window", "original", 8, force_loop=force_loop)
        b = run(setup, "window", "cache", 8, force_loop=force_loop)
        torch.testing.assert_close(a.nll, b.nll, rtol=0, atol=1e-10)


def assert_same_stream(fast, loop) -> None:
    """A fast path's per-token values, diagnostics, occupancy and the steps attending to positions 0-3
    equal the token loop's."""
    torch.testing.assert_close(fast.nll, loop.nll, rtol=0, atol=1e-10)
    held, loop_held = (held_share(out.last_attended, fast.nll.shape[1]) for out in (fast, loop))
    assert torch.equal(held.expand_as(loop_held), loop_held)  # (the parallel path's: one head for all)
    torch.testing.assert_close(fast.kl, loop.kl, rtol=0, atol=1e-10, equal_nan=True)  # (NaN: no reference)
    assert torch.equal(fast.correct, loop.correct)
    torch.testing.assert_close(fast.lost, loop.lost, rtol=0, atol=1e-10, equal_nan=True)
    assert torch.equal(fast.occupancy, loop.occupancy)


PARALLEL = [
    (n, m)
    for n in CASES
    for m in MODES
    if plan(policy_of(n), 16, StreamSpec(position_mode=PositionMode(m)), 2, 64).path == "parallel"
]
STATIC = {"full", "window", "streaming_llm", *ABLATIONS}


def test_parallel_path_exists_for_the_position_static_policies():
    assert {n for n, _ in PARALLEL} == STATIC  # not streaming_llm with a text-token sink: blocked
    # in cache mode too: a contiguous run keeps its distances, and the sinks are seen from a fixed rank
    assert {n for n, m in PARALLEL if m == "cache"} == STATIC
    assert plan(policy_of("streaming_llm:n_sink=1,first_sink=1"), 16, StreamSpec(), 2, 64).path == "blocked"


@pytest.mark.parametrize("name, mode", [(n, m) for n, m in PARALLEL if n not in ABLATIONS])
def test_parallel_path_equals_token_loop(setup, name, mode):
    budget = small_budget(name)
    fast, loop = run(setup, name, mode, budget), run(setup, name, mode, budget, force_loop=True)
    assert fast.path == "parallel" and loop.path == "loop"
    assert_same_stream(fast, loop)


@pytest.mark.parametrize("block", [3, 7])  # 3: the first block holds fewer tokens than StreamingLLM's 4 sinks
@pytest.mark.parametrize(
    "name, mode", PARALLEL + [(c, m) for c in CASES if c.startswith("recompute_window") for m in MODES]
)
def test_blocked_static_paths_equal_the_token_loop(setup, name, mode, block):
    """Streams several times the block: each block of queries sees only the keys its window reaches."""
    model, tokens, ref = setup
    budget = small_budget(name)
    blocked = stream(
        model, tokens, policy_of(name), budget, StreamSpec(position_mode=mode, block=block), reference=ref
    )
    whole = run(setup, name, mode, budget)  # one block
    torch.testing.assert_close(blocked.nll, whole.nll, rtol=0, atol=1e-10)
    torch.testing.assert_close(blocked.kl, whole.kl, rtol=0, atol=1e-10)
    torch.testing.assert_close(blocked.lost, whole.lost, rtol=0, atol=1e-10)
    if not name.startswith("recompute_window") and name not in ABLATIONS:
        loop = run(setup, name, mode, budget, force_loop=True)
        torch.testing.assert_close(blocked.nll, loop.nll, rtol=0, atol=1e-10)


BLOCKED = [n for n in CASES if not policy_of(n).recompute and policy_of(n).static_window(1) is None]


def test_block_paths_exist_for_every_policy_that_is_not_position_static():
    assert set(BLOCKED) == {
        "h2o", "l2norm", "oracle", "random", "scissorhands", "tova", "streaming_llm:n_sink=1,first_sink=1"
    }  # fmt: skip


@pytest.mark.parametrize("block", [5, 7, 64])  # blocks shorter than the budget, and one block for all
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", BLOCKED)
def test_block_paths_equal_token_loop(setup, name, mode, block):
    """The loop nest turned around (each block layer by layer): the same entries survive every step as in
    the token loop, so the same per-token values, diagnostics and final kept sets."""
    model, tokens, ref = setup
    budget = small_budget(name)
    spec = StreamSpec(position_mode=mode, block=block)
    fast = stream(model, tokens, policy_of(name), budget, spec, reference=ref)
    loop = run(setup, name, mode, budget, force_loop=True)
    assert fast.path == "blocked" and loop.path == "loop"
    assert_same_stream(fast, loop)
    for a, b in zip(fast.kept, loop.kept, strict=True):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


@pytest.fixture(scope="module")
def deep():
    """Five layers (the wavefront fills and drains over four rounds) and grouped KV heads, 3 documents of
    distinct tokens (no exact ties between keys beyond layer 0, where the block matmuls' rounding differs
    from one token at a time: L2Norm would then break a tie differently and keep an equal entry)."""
    torch.manual_seed(1)
    cfg = GPTConfig(name="t", vocab_size=128, n_layer=5, n_head=4, n_kv_head=2, n_embd=32)
    model = GPT(cfg).double().eval()
    tokens = torch.stack([torch.randperm(127)[:70] for _ in range(3)])
    tokens[:, 0] = 127
    short = full_reference(model, tokens[:, :50], attention=True)  # covers 49 of 69 steps
    return model, tokens, short, full_reference(model, tokens, attention=True)


@pytest.mark.parametrize("allocation", ["uniform", "pyramid"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", BLOCKED)
def test_wavefront_equals_token_loop(deep, monkeypatch, name, mode, allocation):
    """With one budget for all layers the blocked path runs its steady steps as a wavefront (rounds with
    every layer a block apart, the last block short, a reference that ends mid-stream); with a budget per
    layer (pyramid) it cannot, and runs them layer by layer. Both equal the token loop."""
    from evictlab.eval import wavefront

    model, tokens, short, whole = deep
    ref = whole if policy_of(name).needs_future else short  # the oracle reads the future of every step
    rounds = []
    monkeypatch.setattr(wavefront.Wavefront, "round", _spy(wavefront.Wavefront.round, rounds))
    policy, budget = policy_of(name), small_budget(name)
    spec = StreamSpec(position_mode=mode, block=6, allocation=allocation)
    fast = stream(model, tokens, policy, budget, spec, reference=ref)
    loop = stream(model, tokens, policy_of(name), budget, replace(spec, force_loop=True), reference=ref)
    # pyramid budgets differ by layer: never stacked. Otherwise the steps from the first eviction (step
    # budget) to 68 in blocks of 6, plus the 4 rounds of fill and drain
    stacked = allocation == "uniform"
    assert len(rounds) == (math.ceil((69 - budget) / 6) + 5 - 1 if stacked else 0)
    assert_same_stream(fast, loop)
    for a, b in zip(fast.kept, loop.kept, strict=True):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name", ["h2o", "tova", "window"])
def test_rotating_the_held_keys_a_few_rows_at_a_time_changes_nothing(deep, monkeypatch, name, rows):
    """Cache mode rotates the held keys at their ranks a few rows per pass (loop.ROTATED_BYTES): passes of
    one or two full rows (the wavefront's 15 rows: the last pass short; fewer slots before the caches
    fill: more rows per pass) give the same stream as one pass, on the token loop and on the wavefront
    (window: one rank layout for all rows, token loop only)."""
    from evictlab.eval import loop as token_loop

    model, tokens, _, whole = deep
    budget = small_budget(name)
    specs = [StreamSpec(position_mode="cache", block=6, force_loop=force) for force in (False, True)]
    if name == "window":
        specs = specs[1:]
    one = [stream(model, tokens, policy_of(name), budget, s, reference=whole) for s in specs]
    row = model.cfg.n_kv_head * (budget + 1) * (model.cfg.n_embd // model.cfg.n_head) * 8  # float64
    monkeypatch.setattr(token_loop, "ROTATED_BYTES", rows * row)
    few = [stream(model, tokens, policy_of(name), budget, s, reference=whole) for s in specs]
    for a, b in zip(few, one, strict=True):
        assert_same_stream(a, b)
        for x, y in zip(a.kept, b.kept, strict=True):
            assert torch.equal(x, y)


def test_the_oracles_future_attention_is_the_sum_of_the_later_rows(deep):
    """FullAttention.future (chunk suffix sums on top of whole later chunks) against the explicit [n, n]
    attention of each layer: the attention key j gets from every query after t, summed over the query
    heads of its KV head; t on both sides of chunk boundaries."""
    from evictlab.eval.full import FullAttention, causal_weights

    *_, whole = deep
    att = FullAttention.from_tensors(whole.attention.tensors())  # fresh: no chunks cached yet
    att.chunk = 8  # several chunks over the 69 queries
    B, Hkv = att.k[0].shape[:2]
    for l in range(len(att.q)):
        w = causal_weights(att.q[l], att.k[l], 0)[0]  # [B, H, n, n]
        for t in (0, 6, 7, 8, 30, 67, 68):
            want = w[:, :, t + 1 :].sum(2).view(B, Hkv, -1, att.n).sum(2)
            torch.testing.assert_close(att.future(l, t), want, rtol=0, atol=1e-12)


def _spy(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(args[1:3])
        return fn(*args, **kwargs)

    return wrapped


def test_chunked_full_reference_equals_the_unchunked_one(setup):
    from evictlab.eval.static import full_logp

    model, tokens, ref = setup
    torch.testing.assert_close(full_logp(model, tokens, block=6), ref.logp, rtol=0, atol=1e-10)


def test_a_reference_shorter_than_the_stream_leaves_nan_after_it(setup):
    model, tokens, _ = setup
    short = full_reference(model, tokens[:, :21], attention=True)  # covers 20 of 39 steps
    for name, force_loop in (("window", False), ("window", True), ("h2o", False)):
        spec = StreamSpec(force_loop=force_loop, block=8)
        out = stream(model, tokens, make_policy(name), 10, spec, reference=short)
        assert not out.nll.isnan().any()
        for x in (out.kl, out.agree, out.lost, out.first4_mass):
            assert not x[:, :20].isnan().any() and x[:, 20:].isnan().all(), name


@pytest.mark.parametrize("name", NAMES)
def test_one_seed_is_bit_identical(setup, name):
    a = run(setup, name, "original", small_budget(name))
    b = run(setup, name, "original", small_budget(name))
    assert torch.equal(a.nll, b.nll) and torch.equal(a.kl, b.kl)


def test_random_depends_on_its_seed(setup):
    model, tokens, ref = setup
    a = stream(model, tokens, make_policy("random", seed=0), 10, reference=ref)
    b = stream(model, tokens, make_policy("random", seed=1), 10, reference=ref)
    assert not torch.equal(a.nll, b.nll)


def test_policies_evict_differently(setup):
    """Guard against a matrix that passes because every policy does the same thing."""
    outs = {n: run(setup, n, "original", 10).nll for n in NAMES if n != "full"}
    distinct = {tuple(v.flatten().tolist()) for v in outs.values()}
    assert len(distinct) == len(outs)


def test_h2o_matches_brute_force_on_a_hand_made_attention_pattern():
    """Drive h2o through the engine's victim choice with a scripted attention pattern and compare the
    kept set with a direct computation: recent window + the largest accumulated attention."""
    budget, steps = 6, 30
    policy = make_policy("h2o", recent_fraction=0.5)  # 3 recent + 3 heavy
    n_recent = policy.n_recent(budget)

    def attention(t: int, j: int) -> float:  # heavy on positions 2, 5 and 11; light elsewhere
        return {2: 50.0, 5: 30.0, 11: 40.0}.get(j, 1.0 + 0.01 * ((7 * j + t) % 5))

    pos = torch.empty(1, 1, 0, dtype=torch.long)
    acc = torch.empty(1, 1, 0, dtype=torch.float64)
    brute_acc: dict[int, float] = {}
    for t in range(steps):
        pos = torch.cat([pos, torch.tensor([[[t]]])], dim=2)
        acc = torch.cat([acc, torch.zeros(1, 1, 1, dtype=torch.float64)], dim=2)
        raw = torch.tensor([attention(t, int(j)) for j in pos[0, 0]], dtype=torch.float64)
        row = (raw / raw.sum()).view(1, 1, -1)
        keys = torch.zeros(1, 1, pos.shape[2], 1, dtype=torch.float64)
        ctx = StepContext(t, 0, budget, pos, keys, row, {"acc": acc}, torch.tensor([0]))
        policy.observe(ctx)
        for j, w in zip(pos[0, 0].tolist(), row[0, 0].tolist(), strict=True):
            brute_acc[j] = brute_acc.get(j, 0.0) + w
        if pos.shape[2] > budget:
            victim = int(choose_victim(policy.scores(ctx), pos)[0, 0])
            keep = [i for i in range(pos.shape[2]) if i != victim]
            pos, acc = pos[:, :, keep], acc[:, :, keep]
            # brute force: among non-recent entries, drop the smallest accumulated attention
            held = sorted(brute_acc)
            candidates = [j for j in held if j <= t - n_recent]
            drop = min(candidates, key=lambda j: (brute_acc[j], j))
            del brute_acc[drop]
        assert sorted(pos[0, 0].tolist()) == sorted(brute_acc), t
    # The early heavy hitters survive; 11 does not: position 0 collected attention over more steps
    # (H2O's known bias toward old entries), and the brute force agrees step by step.
    assert set(pos[0, 0].tolist()) == {0, 2, 5, 27, 28, 29}


@pytest.mark.parametrize("seed", range(5))
def test_choose_victim_knowing_every_slot_is_held_gives_the_same_slot(seed):
    """The engine's shortcut when every slot holds an entry: the same victim, ties (to the oldest) and
    all-protected rows included."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, S = 16, 3, 9
    pos = torch.stack([torch.randperm(40, generator=g)[:S] for _ in range(B * Hkv)]).view(B, Hkv, S)
    scores = torch.randint(0, 4, (B, Hkv, S), generator=g).double()  # many ties
    scores[torch.rand(B, Hkv, S, generator=g) < 0.3] = float("inf")
    scores[0] = float("inf")  # rows where every slot is protected
    victim = choose_victim(scores, pos, all_valid=True)
    assert torch.equal(victim, choose_victim(scores, pos))
    chosen = pos.gather(-1, victim[..., None])[..., 0]
    low = scores.amin(-1)
    oldest_low = pos.masked_fill(scores != low[..., None], 10**6).amin(-1)
    assert torch.equal(chosen, oldest_low)


def _random_draws(seed, doc, layer, t, Hkv, pos, dtype):
    """random's draws as defined: an int64 hash of (seed, document, layer, step, head, position) / 2**32."""
    from evictlab.cache.policies.random import _mix

    h = _mix(_mix(seed + 0x9E3779B) ^ doc.view(-1, 1, 1))
    h = _mix(h ^ (layer * 0x10001 + t * 0x3F1))
    h = _mix(h ^ torch.arange(Hkv).view(1, Hkv, 1))
    return _mix(h ^ pos.clamp(min=0)).to(dtype) / 2**32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_random_draws_equal_their_definition_across_steps_layers_and_documents(dtype):
    """random computes its hash in 32-bit arithmetic from a per-layer table of step keys: the draws equal
    the int64 definition bit for bit, across table chunks, layers, new documents and a tensor step."""
    policy = make_policy("random", seed=3)
    g = torch.Generator().manual_seed(0)
    B, Hkv, S = 5, 3, 11
    for doc in (torch.arange(B), torch.arange(B) + 1000, torch.arange(B) + 1000):
        for layer in (0, 2):
            for t in (0, 1, 255, 256, 257, 1000, 70_000, 3):
                pos = torch.randint(0, t + 1, (B, Hkv, S), generator=g)
                pos[0, 0, :2] = -1  # empty slots
                keys = torch.zeros(B, Hkv, S, 1, dtype=dtype)
                for step in (t, torch.tensor(t)):
                    ctx = StepContext(step, layer, S, pos, keys, None, {}, doc.clone())
                    want = _random_draws(3, doc, layer, t, Hkv, pos, dtype)
                    valid = pos >= 0
                    assert torch.equal(policy.scores(ctx)[valid], want[valid]), (layer, t)


def test_random_draws_in_float16_are_the_float32_draws_rounded():
    """2**32 overflows float16: half-precision draws go through float32 (they were all inf, which made
    random evict the oldest entry)."""
    policy = make_policy("random", seed=1)
    pos = torch.arange(40).view(1, 2, 20)
    draws = {
        dtype: policy.scores(StepContext(50, 0, 20, pos, torch.zeros(1, 2, 20, 1, dtype=dtype), None, {},
                                         torch.tensor([7])))
        for dtype in (torch.float16, torch.float32)
    }  # fmt: skip
    assert draws[torch.float16].dtype == torch.float16
    assert torch.isfinite(draws[torch.float16]).all() and (draws[torch.float16] < 1).all()
    assert torch.equal(draws[torch.float16], draws[torch.float32].half())
    assert len(set(draws[torch.float16].flatten().tolist())) > 30  # a spread, not one value


def test_scissorhands_count_is_its_window_recounted():
    """Scissorhands keeps each slot's count of low-attention verdicts up to date as its ring buffer turns
    over: after every step (slots reset as the engine resets them on a write) the count equals a recount
    of the last history_window steps' verdicts from the attention rows themselves."""
    torch.manual_seed(0)
    policy = make_policy("scissorhands", history_window=3, threshold=1.0, n_recent=0)
    B, Hkv, S, steps = 2, 2, 5, 40
    state = policy.init_state(B, Hkv, S, torch.empty(0, dtype=torch.float64))
    pos = torch.full((B, Hkv, S), -1)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's (verdicts, slot generation)
    generation = torch.zeros(B, Hkv, S, dtype=torch.long)  # bumped when a slot is rewritten
    for t in range(steps):
        slot = t % S if t < S else int(torch.randint(0, S, ()))  # fill in order, then overwrite at random
        pos[:, :, slot] = t
        generation[:, :, slot] += 1
        for st in state.values():
            st[:, :, slot] = 0
        raw = torch.rand(B, Hkv, S, dtype=torch.float64).masked_fill(pos < 0, 0)
        row = raw / raw.sum(-1, keepdim=True)
        ctx = StepContext(t, 0, S, pos, torch.zeros(B, Hkv, S, 1), row, state, torch.arange(B))
        policy.observe(ctx)
        held = (pos >= 0).sum(-1, keepdim=True)
        history.append(((row < 1.0 / held) & (pos >= 0), generation.clone()))
        recount = sum(low & (gen == generation) for low, gen in history[-3:])
        assert torch.equal(state["count"].long(), recount.long()), t
        assert torch.equal(state["count"].long(), state["low"].sum(-1)), t
    scores = policy.scores(ctx)
    assert torch.equal(scores, -recount.to(scores.dtype))


def test_readme_add_a_policy_example_works(setup):
    """The one-file policy in README.md registers and passes the core invariants."""
    import re

    from evictlab.cache import policies as registry
    from evictlab.store import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text()
    code = re.search(r"```python\n(# src/evictlab/cache/policies/keep_first.py.*?)```", readme, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, "README-keep_first", "exec"), namespace)
        assert "keep_first" in POLICIES
        model, tokens, ref = setup
        out = stream(model, tokens, make_policy("keep_first", n_recent=2), 10, reference=ref)
        nll, kept, _ = naive_stream(model, tokens[0], make_policy("keep_first", n_recent=2), 10)
        assert (nll - out.nll[0]).abs().max() <= 1e-10
        assert kept[0][0, 0].tolist() == [*range(8), 37, 38]  # the first entries and the 2 most recent
    finally:
        registry.POLICIES.pop("keep_first", None)


GENERATING = [c for c in CASES if policy_of(c).can_generate() and not policy_of(c).recompute]


@pytest.mark.parametrize("block", [5, 64])  # blocks shorter than the budget, and one block for the prompt
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", GENERATING)
def test_generation_after_a_blocked_prefill_equals_the_token_loop(setup, name, mode, block):
    """generate runs the prompt on the blocked path and hands its caches and policy state to the token
    loop: the same continuation as a prompt streamed token by token, at a budget the prompt overflows."""
    model, tokens, _ = setup
    budget, prompt = small_budget(name), tokens[:, :27]
    spec = StreamSpec(position_mode=mode, block=block)
    fast = generate(model, prompt, policy_of(name), budget, 12, spec)
    loop = generate(model, prompt, policy_of(name), budget, 12, replace(spec, force_loop=True))
    assert torch.equal(fast, loop)


@pytest.mark.parametrize("name", [c for c in CASES if policy_of(c).evicts and not policy_of(c).recompute])
def test_a_policy_reads_values_exactly_when_other_weights_change_what_it_keeps(setup, name):
    """`make noise` and verify's decision tolerance skip the policies whose evictions read no values (the
    position-only ones, random's hashes of positions: `Policy.reads_values`), since rounding cannot reorder
    them: under other weights they keep the very same entries; every policy that reads values keeps others."""
    model, tokens, _ = setup
    other = GPT(model.cfg).double().eval()  # (seeded: another draw of every weight)
    torch.manual_seed(1)
    other.load_state_dict({k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()})
    budget, policy = small_budget(name), policy_of(name)
    a = run(setup, name, "original", budget, force_loop=True)
    b = run((other, tokens, full_reference(other, tokens, attention=True)), name, "original", budget, True)
    same = all(torch.equal(x, y) for x, y in zip(a.kept, b.kept, strict=True))
    assert same == (policy.position_only or not policy.reads_values), (name, same)
