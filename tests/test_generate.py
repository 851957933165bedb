"""Greedy generation under eviction, and the divergence from the full cache's continuation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from evictlab.cache import POLICIES, make_policy
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, naive_stream, stream
from evictlab.eval.engine import DecodeClock, generate
from evictlab.eval.evaluate import greedy_divergence
from evictlab.models.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(
        GPTConfig(name="t", vocab_size=30, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, init_std=0.3)
    ).eval()


def naive_greedy(model, prompt, n_new, window=None):
    """Greedy decoding by re-running the model on the (windowed) sequence for every token."""
    seq = prompt
    for _ in range(n_new):
        ctx = seq if window is None else seq[:, -window:]
        seq = torch.cat([seq, model(ctx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.shape[1] :]


def test_full_cache_generation_equals_naive_greedy(model):
    prompt = torch.randint(0, 30, (3, 12))
    torch.testing.assert_close(
        generate(model, prompt, make_policy("full"), 8, 10), naive_greedy(model, prompt, 10)
    )


def test_recompute_window_generation_equals_a_fresh_forward_per_token(model):
    prompt = torch.randint(0, 30, (2, 20))
    got = generate(model, prompt, make_policy("recompute_window"), 6, 8, StreamSpec(position_mode="cache"))
    torch.testing.assert_close(got, naive_greedy(model, prompt, 8, window=7))


@pytest.mark.parametrize("name", [n for n in sorted(POLICIES) if POLICIES[n].can_generate()])
def test_budget_covering_the_sequence_generates_like_the_full_cache(model, name):
    prompt = torch.randint(0, 30, (2, 10))
    full = generate(model, prompt, make_policy("full"), 8, 6)
    torch.testing.assert_close(generate(model, prompt, make_policy(name), 20, 6), full)


@pytest.mark.parametrize("name", ["full", "streaming_llm", "window", "h2o"])
def test_the_clock_times_prefill_and_decode_and_the_fused_kernel_writes_the_same_tokens(model, name):
    """generate(clock=DecodeClock(fused=True)): the decode's token-steps, and for a policy that reads no
    attention weights the same steps again through SDPA from a fork of the prefilled caches, which writes
    the same tokens (and leaves the explicit continuation as it was without the fork)."""
    prompt = torch.randint(0, 30, (3, 40))
    clock = DecodeClock(fused=True)
    out = generate(model, prompt, make_policy(name), 8, 6, StreamSpec(block=16), clock=clock)
    assert torch.equal(out, generate(model, prompt, make_policy(name), 8, 6, StreamSpec(block=16)))
    assert clock.decode_steps == 18 and clock.decode_s > 0 and clock.prefill_s > 0
    if make_policy(name).needs_attention:
        assert clock.fused_rows == 0 and clock.fused_rate() != clock.fused_rate()  # NaN: not measured
    else:
        assert clock.fused_steps == 18 and clock.fused_rows == 3 and clock.fused_same_rows == 3


@pytest.mark.parametrize("name", ["full", "h2o", "tova", "streaming_llm", "random"])
def test_one_prefill_writes_the_generated_tokens_again_and_again(model, name):
    """`make speed` times every round from one prefill: each write forks the prefilled caches, so every
    write is `generate`'s continuation token for token (random's state included), and the fused twin's
    too; a write in place uses the prefill up, and a second write says so."""
    from evictlab.eval.engine import prefilled

    params = {"seed": 3} if name == "random" else {}
    prompt = torch.randint(0, 30, (3, 40))
    want = generate(model, prompt, make_policy(name, **params), 8, 6, StreamSpec(block=16))
    pre = prefilled(model, prompt, make_policy(name, **params), 8, 6, StreamSpec(block=16))
    for _ in range(3):
        clock = DecodeClock(fused=True)
        assert torch.equal(pre.write(clock), want)
        assert clock.decode_steps == 18
        assert clock.fused_same_rows == (0 if make_policy(name).needs_attention else 3)
    assert torch.equal(pre.write(in_place=True), want)
    with pytest.raises(RuntimeError, match="written on in place"):
        pre.write()


def test_a_policy_without_a_cache_has_nothing_to_prefill(model):
    from evictlab.eval.engine import prefilled

    prompt = torch.randint(0, 30, (2, 20))
    spec = StreamSpec(position_mode="cache")
    assert prefilled(model, prompt, make_policy("recompute_window"), 6, 8, spec) is None


@torch.no_grad()  # as every engine path runs
def test_a_fork_goes_on_apart_and_policies_that_read_weights_have_no_fused_kernel(model):
    from evictlab.eval.engine import plan
    from evictlab.eval.loop import TokenLoop
    from evictlab.eval.spec import PositionMode

    policy = make_policy("h2o")
    p = plan(policy, 8, StreamSpec(force_loop=True), model.cfg.n_layer, 20)
    loop = TokenLoop(model, policy, list(p.budgets), PositionMode.original, 2, 19, torch.arange(2))
    tokens = torch.randint(0, 30, (2, 20))
    for t in range(10):
        loop.decode_one_token(tokens[:, t : t + 1], t)
    twin = loop.fork()
    assert twin.model is loop.model and twin.caches[0].k is not loop.caches[0].k
    a = [loop.decode_one_token(tokens[:, t : t + 1], t) for t in range(10, 19)]
    b = [twin.decode_one_token(tokens[:, t : t + 1], t) for t in range(10, 19)]
    torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="reads attention weights"):
        loop.fork(fused=True)


def test_policies_that_cannot_generate_say_why(model):
    prompt = torch.randint(0, 30, (2, 10))
    assert {n for n in POLICIES if not POLICIES[n].can_generate()} == {"oracle", "bos_ablation"}
    with pytest.raises(ConfigError, match="bos_ablation' cannot generate: it ablates the full cache"):
        generate(model, prompt, make_policy("bos_ablation"), 20, 6)
    with pytest.raises(ConfigError, match="oracle' cannot generate: it needs the full-cache run's future"):
        generate(model, prompt, make_policy("oracle"), 20, 6)


def test_divergence_summary(model):
    tokens = torch.randint(0, 30, (3, 40))
    g = greedy_divergence(model, tokens, make_policy("window"), 4, 12, StreamSpec(batch_size=2))
    assert g["policy_tokens"].shape == g["full_tokens"].shape == (3, 12)
    for s in range(3):
        same = g["policy_tokens"][s] == g["full_tokens"][s]
        assert g["first_divergence"][s] == (12 if same.all() else int(same.argmin()))
        assert g["agreement"][s] == pytest.approx(same.mean())
    assert (greedy_divergence(model, tokens, make_policy("full"), 4, 12)["agreement"] == 1).all()
    with pytest.raises(ConfigError, match="cannot generate"):
        generate(model, tokens[:, :5], make_policy("oracle"), 4, 3)


def test_the_full_caches_continuation_is_computed_once_per_sweep(model, tmp_path: Path, monkeypatch):
    """With a SharedReferences store the first run writes the full cache's continuations and the next
    reads them (the same tokens), computing only its own policy's."""
    from evictlab.eval import evaluate as E
    from evictlab.eval.shared import SharedReferences

    tokens, spec = torch.randint(0, 30, (3, 40)), StreamSpec(batch_size=2)
    first = SharedReferences(tmp_path, "ck:abc")
    a = greedy_divergence(model, tokens, make_policy("window"), 4, 12, spec, first)
    assert (first.computed, first.read) == (2, 0)  # two batches
    calls = []
    real = E.generate
    monkeypatch.setattr(
        E, "generate", lambda m, p, pol, *a, **k: calls.append(pol.name) or real(m, p, pol, *a, **k)
    )
    second = SharedReferences(tmp_path, "ck:abc")
    b = greedy_divergence(model, tokens, make_policy("h2o"), 4, 12, spec, second)
    assert (second.computed, second.read) == (0, 2) and calls == ["h2o", "h2o"]
    assert np.array_equal(a["full_tokens"], b["full_tokens"])
    assert np.array_equal(
        b["full_tokens"], greedy_divergence(model, tokens, make_policy("h2o"), 4, 12, spec)["full_tokens"]
    )
    other = SharedReferences(tmp_path, "ck:other")  # another checkpoint: its own entries
    greedy_divergence(model, tokens, make_policy("h2o"), 4, 12, spec, other)
    assert other.computed == 2


@pytest.mark.parametrize("name", ["window", "h2o"])
def test_continuations_written_on_the_answer_path_are_generates(model, name):
    """eval.generate_tokens: the evaluation's pass writes each stream's continuation (Answers(T - n, n))
    and greedy_divergence takes it instead of decoding again: the same tokens, the same summary."""
    from evictlab.eval.engine import Answers
    from evictlab.eval.evaluate import evaluate

    tokens, spec = torch.randint(0, 30, (3, 40)), StreamSpec(batch_size=2, block=16)
    res = evaluate(model, tokens, make_policy(name), 8, spec, answers=Answers(28, 12))
    one = greedy_divergence(model, tokens, make_policy(name), 8, 12, spec, written=res.written)
    two = greedy_divergence(model, tokens, make_policy(name), 8, 12, spec)
    for key in ("policy_tokens", "full_tokens", "first_divergence", "agreement"):
        assert np.array_equal(one[key], two[key]), key


def test_run_records_generations(tmp_path: Path):
    from evictlab import run as run_mod
    from tests.test_pipeline import cfg_for
    from tests.wandb_reader import read_run

    cfg = cfg_for(tmp_path / "outputs", "strategy=window", "budget=b16", "eval.generate_tokens=8")
    m = run_mod.run(cfg)
    wb = read_run(next((tmp_path / "outputs" / "wandb").glob(f"offline-run-*-{m['run_key']}/*.wandb")))
    assert any(k.startswith("generations") for h in wb["history"] for k in h)  # the W&B table
    assert wb["summary"]["gen_agreement"] == pytest.approx(m["gen_agreement"])
    g = pd.read_parquet(run_mod.run_dir(cfg) / "generations.parquet")
    assert len(g) == 2 and {"first_divergence", "agreement", "rouge_l", "text_full", "text_policy"} <= set(g)
    assert m["gen_rouge_l"] == pytest.approx(g["rouge_l"].mean())
    same = g["text_full"] == g["text_policy"]
    assert (g.loc[same, "rouge_l"] == 1).all() and g["rouge_l"].between(0, 1).all()
    assert m["gen_agreement"] == pytest.approx(g["agreement"].mean()) and m["generate_tokens"] == 8
    assert m["path"] == "answer" and m["decode_token_steps_per_s"] > 0  # written in the evaluation's pass
    assert m["fused_same_tokens"] == 1.0  # the window reads no weights: SDPA wrote the same continuations
    stored = json.loads((run_mod.run_dir(cfg) / "metrics.json").read_text())
    assert stored["gen_first_divergence_mean"] == pytest.approx(g["first_divergence"].mean())
    oracle = cfg_for(
        tmp_path / "outputs", "strategy=oracle", "budget=b16", "logger=none", "eval.generate_tokens=8"
    )
    assert "gen_agreement" not in run_mod.run(oracle)  # non-causal: no generation


def test_rouge_l_is_the_longest_common_subsequence_f1_over_words():
    from evictlab.run import rouge_l

    got = rouge_l(
        ["the cat sat on the mat", "a b", "", "-- ::"], ["the cat lay on a mat", "c d", "", "-- ::"]
    )
    assert got == [pytest.approx(2 / 3), 0.0, 1.0, 1.0]  # LCS "the cat on mat": 4 of 6 words each side


def test_recompute_window_re_encodes_from_position_zero_in_both_modes():
    """One definition: every window at positions 0 .. budget, so a model with a learned position table
    of 16 streams 40 tokens and the engine equals a window-by-window computation; with RoPE both
    position modes agree."""
    torch.manual_seed(0)
    policy, budget = make_policy("recompute_window"), 8
    tokens = torch.randint(0, 30, (2, 40))
    rope = GPT(GPTConfig(name="t", vocab_size=30, n_layer=2, n_head=2, n_embd=16)).double().eval()
    a = stream(rope, tokens, policy, budget, StreamSpec(position_mode="original", block=7))
    b = stream(rope, tokens, policy, budget, StreamSpec(position_mode="cache"))
    torch.testing.assert_close(a.nll, b.nll, rtol=0, atol=1e-12)
    cfg = GPTConfig(name="t", vocab_size=30, n_layer=2, n_head=2, n_embd=16, pos_emb="learned", block_size=16)
    model = GPT(cfg).double().eval()
    a = stream(model, tokens, policy, budget, StreamSpec(position_mode="original", block=7))
    t = 30  # the window of step 30 is tokens 22 .. 30 at positions 0 .. 8
    logits = model.forward_with(tokens[:, t - budget : t + 1], torch.arange(budget + 1))[:, -1]
    expected = -torch.log_softmax(logits, -1).gather(-1, tokens[:, t + 1 : t + 2])[:, 0]
    torch.testing.assert_close(a.nll[:, t], expected, rtol=0, atol=1e-12)
    nll, _, _ = naive_stream(model, tokens[0], policy, budget, StreamSpec(position_mode="original"))
    torch.testing.assert_close(nll, a.nll[0], rtol=0, atol=1e-10)
    assert generate(model, tokens[:, :20], policy, budget, 25).shape == (2, 25)  # past the table too


def test_a_generation_sweep_aggregates_tabulates_and_draws_its_continuations(tmp_path: Path):
    """eval.generate_tokens runs aggregate into a generations table (one row per run and stream); make
    tables prints each evicting policy's ROUGE-L, tokens to the first divergence and identical share per
    budget, computed from those rows; the generation_agreement figure draws one panel per budget."""
    from evictlab import run as run_mod
    from evictlab.analysis import figures as F
    from evictlab.analysis.aggregate import aggregate
    from evictlab.analysis.report import generation_table, load_tables
    from evictlab.paper import _tables_text
    from tests.test_pipeline import cfg_for

    out = tmp_path / "outputs"
    dirs = []
    for strategy, budget in (("full", "b16"), ("window", "b16"), ("h2o", "b16"), ("h2o", "b32")):
        over = [f"strategy={strategy}", f"budget={budget}", "eval.generate_tokens=8", "logger=none"]
        cfg = cfg_for(out, "group=gen", *over)
        run_mod.run(cfg)
        dirs.append(run_mod.run_dir(cfg))
    aggregate([dirs[0].parent], dirs[0].parent)
    tables = load_tables(dirs[0].parent)
    g = tables["generations"]
    assert len(g) == 4 * 2 and {"first_divergence", "rouge_l", "text_policy", "strategy", "budget"} <= set(g)
    grid = generation_table(tables)
    assert list(grid.columns) == ["b16", "b32"] and "full" not in grid.index  # evicting policies only
    h2o = g[(g["strategy"] == "h2o") & (g["budget"] == 16)]
    same = int((h2o["first_divergence"] == 8).sum())
    assert grid.loc["h2o", "b16"].startswith(f"{h2o['rouge_l'].mean():.2f} [")
    assert grid.loc["h2o", "b16"].endswith(f"; {same}/2") and grid.loc["window", "b32"] == "-"
    assert "greedy continuations against the full cache's" in _tables_text("gen", tables, {})
    assert F.FIGURES["generation_agreement"].applies(tables)
    fig = F.generation_agreement(g)
    assert len(fig.axes) == 2 and [a.get_title() for a in fig.axes] == ["budget 16", "budget 32"]
    trade = F.tradeoff(tables["runs"])  # quality on its y axis: the continuations' ROUGE-L
    assert trade.axes[0].get_ylabel().startswith("continuations: ROUGE-L")
    full = trade.axes[0].get_lines()[0]  # the full cache, starred: its continuation is its own
    assert full.get_marker() == "*" and list(full.get_ydata()) == [1.0]
