"""Engine inputs, budget allocation, evaluation streams and the per-run summary."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evictlab.cache import make_policy
from evictlab.cache.budget import allocate
from evictlab.data import load_corpus
from evictlab.data.streams import eval_streams
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, full_reference, stream
from evictlab.eval.caches import BandCache, LayerCache, SlotCache
from evictlab.eval.engine import BLOCK_STEPS, plan
from evictlab.eval.evaluate import evaluate, kv_bytes
from evictlab.eval.naive import _NaiveCache
from evictlab.models.gpt import GPT, GPTConfig
from tests.conftest import make_cfg

DEFAULT_SPEC = StreamSpec()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig(name="t", vocab_size=40, n_layer=4, n_head=4, n_embd=32, init_std=0.5)).eval()


@pytest.fixture(scope="module")
def tokens():
    torch.manual_seed(1)
    return torch.randint(0, 40, (2, 33))


@pytest.mark.parametrize(
    "name, params, budget, match",
    [
        ("window", {}, 0, "budget=0 must be >= 1"),
        ("window", {}, -3, "budget=-3 must be >= 1"),
        ("streaming_llm", {"n_sink": 4}, 4, "larger than strategy.params.n_sink=4"),
        ("streaming_llm", {"n_sink": 4}, 2, "larger than strategy.params.n_sink=4"),
        ("h2o", {"recent_fraction": 0.5}, 1, "h2o split does not fit"),
        ("h2o", {"recent_fraction": 0.9}, 4, "h2o split does not fit"),
        ("scissorhands", {"n_recent": 8}, 8, "needs at least 9"),
        ("l2norm", {"n_sink": 2, "n_recent": 2}, 4, "needs at least 5"),
    ],
)
def test_bad_budgets_fail_before_work(model, tokens, name, params, budget, match):
    with pytest.raises(ConfigError, match=match):
        stream(model, tokens, make_policy(name, **params), budget)


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("belady", {}, "unknown strategy 'belady'; known: bos_ablation, full, h2o"),
        ("h2o", {"recent_fraction": 1.5}, "recent_fraction=1.5 must be in"),
        ("h2o", {"heavy": 3}, "has no parameter heavy; its parameters: strategy.params.recent_fraction"),
        ("streaming_llm", {"n_sink": -1}, "n_sink=-1"),
        ("random", {"seed": 1.5}, "must be an integer"),
        ("scissorhands", {"history_window": 0}, "history_window=0"),
    ],
)
def test_bad_policy_parameters(name, params, match):
    with pytest.raises(ConfigError, match=match):
        make_policy(name, **params)


def test_cache_mode_needs_rope(tokens):
    learned = GPT(
        GPTConfig(name="t", vocab_size=40, n_layer=1, n_head=2, n_embd=16, pos_emb="learned")
    ).eval()
    with pytest.raises(ConfigError, match="position_mode=cache needs RoPE"):
        stream(learned, tokens, make_policy("window"), 8, StreamSpec(position_mode="cache"))
    stream(learned, tokens, make_policy("window"), 8, StreamSpec(position_mode="original"))  # fine


def test_oracle_needs_the_future(model, tokens):
    with pytest.raises(ConfigError, match="attention=True"):
        stream(model, tokens, make_policy("oracle"), 8)
    no_rows = full_reference(model, tokens, attention=True, rows=False)  # summaries only
    with pytest.raises(ConfigError, match="attention=True"):
        stream(model, tokens, make_policy("oracle"), 8, reference=no_rows)
    assert "non-causal" in make_policy("oracle").label


def test_a_run_keeps_of_each_streamed_batch_the_attention_summaries_not_its_rows(model, tokens):
    """After a batch is streamed a run keeps the full cache's NLL and attention summaries, which its sink
    metrics read at the end; the oracle's reference also holds every layer's queries and keys and the
    future rows computed from them, which must go with the batch (smollm2_tasks' oracle run held about
    1.3 GB per batch until it ended: 22.8 GiB of RSS over 10 batches)."""
    from evictlab.eval.evaluate import KeptReference, run_batches

    ref = full_reference(model, tokens, attention=True)
    ref.attention.future(0, 2)  # the oracle's chunk rows and later chunks, cached on the way
    kept = KeptReference.of(ref, tokens).attention
    assert ref.attention.has_rows and not kept.has_rows and kept._rows == {} and kept._after == {}
    for summary in ("first_position_mass", "attention_by_key"):
        torch.testing.assert_close(
            getattr(kept, summary)(), getattr(ref.attention, summary)(), rtol=0, atol=0
        )
    spec = StreamSpec(batch_size=1)
    b = run_batches(model, tokens[:2], make_policy("oracle"), 8, spec)
    assert len(b.refs) == 2 and not any(r.attention.has_rows for r in b.refs)


def test_pyramid_allocation_keeps_the_total_and_tilts_down():
    assert allocate(64, 4, "uniform") == [64] * 4
    p = allocate(64, 4, "pyramid")
    assert sum(p) == 256 and p == sorted(p, reverse=True) and p[0] > 64 > p[-1]
    assert sum(allocate(7, 5, "pyramid")) == 35
    assert allocate(1, 3, "pyramid") == [1, 1, 1]


def test_pyramid_runs_and_reports_layer_budgets(model, tokens):
    out = stream(model, tokens, make_policy("h2o"), 8, StreamSpec(allocation="pyramid"))
    assert out.budgets == allocate(8, 4, "pyramid")
    assert out.occupancy.max(0).values.tolist() == out.budgets
    with pytest.raises(ConfigError, match="layer 3 of the pyramid allocation"):
        stream(model, tokens, make_policy("streaming_llm"), 6, StreamSpec(allocation="pyramid"))


def test_stream_longer_than_the_documents(session_outputs):
    cfg = make_cfg(session_outputs)
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)
    tokens = eval_streams(corpus, 3, 256, sink_token=False, source="documents")
    assert tokens.shape == (3, 256) and (tokens[:, 0] == corpus.tokenizer.bos_id).all()
    with pytest.raises(ConfigError, match="longer than the documents"):
        eval_streams(corpus, 3, 100_000, sink_token=False, source="documents")
    with pytest.raises(ConfigError, match="longer than the test documents"):
        eval_streams(corpus, 1000, 1024, sink_token=False, source="concat")
    cat = eval_streams(corpus, 4, 512, sink_token=True, source="concat")
    assert (cat[:, 0] == corpus.tokenizer.sink_id).all() and (cat[:, 1] == corpus.tokenizer.bos_id).all()
    # consecutive chunks of one text
    body = corpus.splits["test"].stream(corpus.tokenizer.bos_id)
    np.testing.assert_array_equal(cat[1, 2:].numpy(), body[510:1020])


def test_evaluate_summary_is_consistent(model, tokens):
    res = evaluate(model, tokens, make_policy("h2o"), 8, StreamSpec(batch_size=1))
    s, pt = res.summary, res.per_token
    assert (
        pt["nll"].shape == (2, 32)
        and pt["lost"].shape == (2, 32, 4)
        and pt["first4_mass"].shape == (2, 32, 4)
    )
    assert s["ppl"] == pytest.approx(math.exp(pt["nll"].mean()), rel=1e-6)
    assert set(np.unique(pt["correct"])) <= {0.0, 1.0} and s["top1_accuracy"] == pytest.approx(
        pt["correct"].mean()
    )
    assert s["ppl_second_half"] == pytest.approx(math.exp(pt["nll"][:, 16:].mean()), rel=1e-6)
    assert s["delta_nll"] == pytest.approx((pt["nll"] - pt["nll_full"]).mean(), abs=1e-6)
    assert all(not isinstance(v, list | dict) for k, v in s.items() if k != "strategy_params")  # scalars only
    assert s["kl_mean"] > 0 and 0 < s["agreement"] < 1 and s["path"] == "blocked" and s["occupancy_max"] == 8
    assert 0 < s["policy_time_share"] < 1 and s["token_steps_per_s"] > 0 and s["peak_rss_bytes"] > 0
    assert s["strategy_label"] == "h2o" and s["evicts"] and not s["non_causal"]
    held = res.layers[res.layers["metric"] == "held_p0"]
    assert (
        len(held) == 4
        and s["position0_held"] == pytest.approx(held["value"].mean())
        and 0 < s["position0_held"] <= 1
    )


def test_layer_table_is_tidy_and_matches_the_full_cache_attention(model, tokens):
    res = evaluate(model, tokens, make_policy("h2o"), 8, StreamSpec(batch_size=1))
    layers = res.layers
    assert list(layers.columns) == ["layer", "head", "metric", "value"]
    by = {m: g for m, g in layers.groupby("metric")}
    assert by["budget"]["value"].tolist() == [8.0] * 4 and by["budget"]["head"].isna().all()
    lost = by["attention_lost"].sort_values("layer")["value"].to_numpy()
    np.testing.assert_allclose(lost, res.per_token["lost"].mean(axis=(0, 1)), rtol=1e-6)
    assert ((by["first4_mass"]["value"] >= 0) & (by["first4_mass"]["value"] <= 1)).all()
    # first_position_mass per (layer, head) = mean over both streams of the full cache's attention on pos 0
    per_head = by["first_position_mass"].pivot(index="layer", columns="head", values="value").to_numpy()
    refs = [full_reference(model, tokens[i : i + 1]) for i in range(2)]
    expected = [
        np.stack([r.attention.rows(l, 0, 32)[0, :, :, 0].mean(-1).numpy() for l in range(4)]) for r in refs
    ]
    np.testing.assert_allclose(per_head, (expected[0] + expected[1]) / 2, rtol=1e-5)


def test_full_cache_against_itself(model, tokens):
    full = evaluate(model, tokens, make_policy("full"), 8)
    assert full.summary["kl_mean"] == pytest.approx(0, abs=1e-6) and full.summary["agreement"] == 1.0
    assert full.summary["ppl"] == pytest.approx(full.summary["ppl_full"], rel=1e-6)
    assert not full.summary["evicts"] and full.summary["budget"] == 32


def test_kv_bytes_are_bounded_for_evicting_policies(model):
    per_entry = 2 * 4 * 8 * 4  # k and v, 4 kv heads x head_dim 8, float32
    for name in ("window", "streaming_llm", "h2o", "oracle", "recompute_window"):
        p = make_policy(name)
        assert kv_bytes(model, p, 64, 1024) == kv_bytes(model, p, 64, 8192) == 4 * 64 * per_entry
    full = make_policy("full")
    assert kv_bytes(model, full, 64, 8192) == 8 * kv_bytes(model, full, 64, 1024) + 7 * 4 * per_entry


def test_full_reference_attention_rows_sum_to_one(model, tokens):
    ref = full_reference(model, tokens, attention=True)
    att = ref.attention
    att.chunk = 5  # rows a few queries at a time: chunk edges inside the stream
    n, Hkv, G = 32, model.cfg.kv_heads, model.cfg.n_head // model.cfg.kv_heads
    for l in range(model.cfg.n_layer):
        a = att.rows(l, 0, n)  # [B, H, n, n]
        torch.testing.assert_close(a.sum(-1), torch.ones(a.shape[:-1]))
        assert (a.triu(1) == 0).all()  # causal
        for i in (0, 4, 5, 13, 31):
            # future attention on key j at step i = attention from steps > i, summed over the group's heads
            expected = a[:, :, i + 1 :].sum(2).view(2, Hkv, G, n).sum(2)
            torch.testing.assert_close(att.future(l, i), expected)
        # the attention on a held set or a static window, from those keys alone, is the rows' sum over them
        pos = torch.tensor([[0, 3, 7, -1], [1, 2, -1, 9], [0, 1, 2, 3], [9, 8, -1, -1]])[None].expand(2, 4, 4)
        pos = pos[:, :Hkv].contiguous()
        held = a[:, :, 9].gather(-1, pos.clamp(min=0).repeat_interleave(G, 1))
        expected = held.masked_fill(pos.repeat_interleave(G, 1) < 0, 0).sum(-1)
        torch.testing.assert_close(att.held_mass(l, 9, pos), expected)
        for window, s, e in (((2, 5), 3, 20), ((0, 4), 10, 32), ((1, None), 0, 32)):
            keep = BandCache(*window).visible(torch.arange(s, e), torch.arange(e))
            torch.testing.assert_close(att.window_mass(l, s, e, window), (a[:, :, s:e, :e] * keep).sum(-1))
        # the summaries the forward computed are those of the rows
        torch.testing.assert_close(att.first[l], a[..., 0])
        torch.testing.assert_close(att.first4[..., l], a[..., :4].sum(-1).mean(1))
        torch.testing.assert_close(att.by_key_sum[l], a.sum(dim=(0, 1, 2)))


def test_steady_state_starts_once_every_cache_is_full(model):
    """From step max(budget) + 1 every layer enters a step with all its slots written: the same shapes
    each step. Never for the full cache, a budget that covers the stream, or a policy reading the future."""
    from evictlab.eval.loop import TokenLoop
    from evictlab.eval.spec import PositionMode

    def steady(name, budgets, n=64):
        doc = torch.arange(2)
        return TokenLoop(model, make_policy(name), budgets, PositionMode.original, 2, n, doc).steady_from()

    assert steady("h2o", [8, 8, 8, 8]) == 9
    assert steady("window", [4, 6, 8, 16]) == 17
    assert steady("h2o", [64] * 4) is None  # 64 slots hold every step of a 64-step stream
    assert steady("full", [8] * 4) is None


def test_tracked_ranks_equal_sorting_the_positions():
    """Cache mode re-indexes each document's and head's held keys by rank: the ranks a SlotCache updates on
    every write and eviction equal `ranks(pos)` on the held slots, through random evictions."""
    from evictlab.eval.caches import SlotCache, ranks

    gen = torch.Generator().manual_seed(0)
    B, Hkv, S = 3, 2, 6
    cache = SlotCache(B, Hkv, S, 4, torch.empty(0), {})
    cache.track_ranks()
    for t in range(40):
        cache.update(torch.randn(B, Hkv, 1, 4), torch.randn(B, Hkv, 1, 4), t, {})
        held = cache.pos[:, :, : cache.used] >= 0
        assert torch.equal(cache.rank[:, :, : cache.used][held], ranks(cache.pos[:, :, : cache.used])[held])
        if cache.count == S:  # evict a random held slot of each document and head
            cache.evict(torch.randint(0, S, (B, Hkv), generator=gen))
        else:
            cache.evict(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [0, 8])
def test_pair_order_rotation_equals_rotate_half(dtype, rotary_dim):
    """Cache mode holds keys in pair order and rotates them by rank with one complex multiply: the same
    values as `rotate` in rotate-half order (partial rotary and half types included), permuted."""
    from evictlab.models.rope import Rope, rotate

    cfg = GPTConfig(name="t", vocab_size=40, n_layer=1, n_head=2, n_embd=32, rotary_dim=rotary_dim)
    like = torch.empty(0, dtype=dtype)
    table = Rope(cfg, like, slots=7)
    x = torch.randn(2, 2, 7, cfg.head_dim).to(dtype)
    r = torch.stack([torch.randperm(7) for _ in range(4)]).view(2, 2, 7)
    want = table.to_pairs(rotate(x, *table.ranks(r)))
    got = table.rotate_ranks(table.to_pairs(x), r)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 if dtype != torch.bfloat16 else 1e-2)
    # the engine's call: into the table's scratch buffer, the same bits; the buffer is reused
    assert torch.equal(table.rotate_ranks(table.to_pairs(x), r, scratch=True), got)
    y = torch.randn(2, 2, 5, cfg.head_dim).to(dtype)
    r5 = torch.stack([torch.randperm(5) for _ in range(4)]).view(2, 2, 5)
    assert torch.equal(table.rotate_ranks(y, r5, scratch=True), table.rotate_ranks(y, r5))
    assert torch.equal(table.to_pairs(x).index_select(-1, table.half_order), x)


@pytest.mark.parametrize(
    "name, mode, smear",
    [
        # (torch.compile costs 20-75 s a case on 2 cores: two run in make test, all four in make test-all)
        pytest.param("scissorhands", "original", 0, marks=pytest.mark.slow),
        ("tova", "cache", 0),
        ("h2o", "original", 1),
        pytest.param("random", "original", 0, marks=pytest.mark.slow),
    ],
)
def test_compiled_steady_step_equals_the_eager_loop(model, tokens, name, mode, smear):
    """eval.compile runs the steady-state step through torch.compile: the same per-token numbers up to
    float rounding, the same entries kept, and the compilation is timed apart (smear: a model with smeared
    keys, whose step also carries each layer's previous raw key; random: its int32 hash, whose wrapping
    multiplies the generated code must keep)."""
    if smear:
        torch.manual_seed(0)
        cfg = GPTConfig(
            name="t", vocab_size=40, n_layer=2, n_head=4, n_embd=32, init_std=0.5, smear_keys=True
        )
        model = GPT(cfg).eval()
    spec = StreamSpec(position_mode=mode, diagnostics=False, force_loop=True)
    eager = stream(model, tokens, make_policy(name), 12, spec)
    compiled = stream(model, tokens, make_policy(name), 12, StreamSpec(**{**vars(spec), "compile": True}))
    np.testing.assert_allclose(compiled.nll, eager.nll, rtol=1e-5, atol=1e-5)
    assert compiled.compile_seconds > 0 and eager.compile_seconds == 0
    for a, b in zip(compiled.kept, eager.kept, strict=True):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)


def test_shared_reference_is_computed_once_and_read_by_later_runs(model, tokens, tmp_path):
    """Runs on the same checkpoint and streams share the full cache's log-probs (diagnostics off): the
    first computes and stores them, the next reads them and gets exactly what it would have computed;
    a damaged file is recomputed; other tokens get another entry."""
    from evictlab.eval.shared import SharedReferences

    spec = StreamSpec(diagnostics=False)
    first, second = SharedReferences(tmp_path, "ck-1"), SharedReferences(tmp_path, "ck-1")
    a = evaluate(model, tokens, make_policy("h2o"), 8, spec, first)
    b = evaluate(model, tokens, make_policy("window"), 8, spec, second)
    alone = evaluate(model, tokens, make_policy("window"), 8, spec)
    assert (first.computed, first.read, second.computed, second.read) == (1, 0, 0, 1)
    np.testing.assert_array_equal(b.per_token["nll_full"], a.per_token["nll_full"])
    for name in ("nll_full", "kl", "agree"):
        np.testing.assert_array_equal(b.per_token[name], alone.per_token[name])
    (stored,) = tmp_path.glob("*.safetensors")
    stored.write_bytes(b"not a safetensors file")
    third = SharedReferences(tmp_path, "ck-1")
    c = evaluate(model, tokens, make_policy("window"), 8, spec, third)
    assert third.computed == 1 and third.read == 0
    np.testing.assert_array_equal(c.per_token["kl"], alone.per_token["kl"])
    evaluate(model, tokens.flip(1), make_policy("window"), 8, spec, third)
    other = SharedReferences(tmp_path, "ck-2")  # another checkpoint: its own entry
    evaluate(model, tokens, make_policy("window"), 8, spec, other)
    assert third.computed == 2 and other.computed == 1 and len(list(tmp_path.glob("*.safetensors"))) == 3
    # a store that keeps no attention (a noise pass's): the oracle's reference is computed, never written
    scratch = SharedReferences(tmp_path / "scratch", "ck-1", keep_attention=False)
    oracle = evaluate(model, tokens, make_policy("oracle"), 8, StreamSpec(), scratch)
    evaluate(model, tokens, make_policy("window"), 8, spec, scratch)
    assert len(list((tmp_path / "scratch").glob("*.safetensors"))) == 1  # the log-probs only
    with_store = evaluate(
        model, tokens, make_policy("oracle"), 8, StreamSpec(), SharedReferences(tmp_path, "x")
    )
    np.testing.assert_array_equal(oracle.per_token["nll"], with_store.per_token["nll"])


def test_a_run_first_streams_the_batches_whose_reference_no_other_process_is_computing(
    model, tokens, tmp_path, monkeypatch
):
    """The first two runs of a cold sweep compute different batches' references side by side: while
    another process holds batch 1's entry lock (computing it), a run streams batch 2 first, then batch 1
    once the lock is free, and its numbers are those of a run in row order."""
    import threading

    from evictlab.eval import evaluate as E
    from evictlab.eval.shared import SharedReferences
    from evictlab.store import file_lock

    spec, policy = StreamSpec(diagnostics=False, batch_size=1), make_policy("h2o")
    shared = SharedReferences(tmp_path, "ck")
    first, second = (shared.path(model, tokens[i : i + 1], spec, False) for i in (0, 1))
    locked, seen, compute = threading.Event(), [], E.reference_for

    def computing_batch_1() -> None:  # "another process": the lock is flock's, per open file
        with file_lock(first):
            locked.set()
            for _ in range(500):  # until batch 2's entry is stored (5 s at most: a run in row order waits)
                if second.exists():
                    break
                threading.Event().wait(0.01)

    def recorded(m, batch, *args, **kwargs):
        seen.append(next(i for i in (0, 1) if torch.equal(batch, tokens[i : i + 1])))
        return compute(m, batch, *args, **kwargs)

    thread = threading.Thread(target=computing_batch_1, daemon=True)
    thread.start()
    assert locked.wait(10) and shared.busy(model, tokens[:1], spec, False)
    assert not shared.busy(model, tokens[1:2], spec, False)
    monkeypatch.setattr(E, "reference_for", recorded)
    got = E.run_batches(model, tokens, policy, 8, spec, shared)
    thread.join(10)
    assert seen == [1, 0] and got.starts == [0, 1]
    assert shared.computed == 2 and not shared.busy(model, tokens[:1], spec, False) and first.exists()
    alone = E.run_batches(model, tokens, policy, 8, spec)
    for name, value in E.collect_per_token(alone).items():
        np.testing.assert_array_equal(E.collect_per_token(got)[name], value)


def test_a_batch_reference_log_probs_are_released_once_the_batch_is_streamed(model, tokens, monkeypatch):
    """A run keeps each batch's full-cache NLL, never its [B, n, vocab] log-probs past that batch (on
    SmolLM2, 4.8 GB per batch): every batch's log-probs are gone by the end, and the full cache's NLL and
    the per-token numbers equal a run in one batch."""
    import gc
    import weakref

    from evictlab.eval import evaluate as E

    held, compute = [], E.reference_for

    def tracked(*args, **kwargs):
        ref = compute(*args, **kwargs)
        held.append(weakref.ref(ref.logp))
        return ref

    monkeypatch.setattr(E, "reference_for", tracked)
    spec = StreamSpec(diagnostics=False, batch_size=1)
    one_by_one = E.run_batches(model, tokens, make_policy("h2o"), 8, spec)
    gc.collect()
    assert len(held) == 2 and all(r() is None for r in held)
    together = evaluate(model, tokens, make_policy("h2o"), 8, StreamSpec(diagnostics=False, batch_size=2))
    per_token = E.collect_per_token(one_by_one)
    np.testing.assert_allclose(per_token["nll_full"], together.per_token["nll_full"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(per_token["nll"], together.per_token["nll"], rtol=1e-5, atol=1e-6)


def test_shared_reference_with_attention_rows(model, tokens, tmp_path, monkeypatch):
    """With diagnostics on the shared entry holds the attention rows too: a later run's attention-lost
    diagnostic and the oracle (its future attention derived on load) equal what they compute alone."""
    from evictlab.eval.shared import SharedReferences

    shared = SharedReferences(tmp_path, "ck")
    evaluate(model, tokens, make_policy("h2o"), 8, DEFAULT_SPEC, shared)
    for name in ("tova", "oracle"):
        got = evaluate(model, tokens, make_policy(name), 8, DEFAULT_SPEC, shared)
        alone = evaluate(model, tokens, make_policy(name), 8, DEFAULT_SPEC)
        for key in ("nll", "kl", "lost", "first4_mass"):
            np.testing.assert_array_equal(got.per_token[key], alone.per_token[key])
        np.testing.assert_array_equal(got.attention_by_key, alone.attention_by_key)
    assert (shared.computed, shared.read) == (1, 2)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # the chunked (diagnostics off) kind is another
    monkeypatch.setattr("evictlab.eval.shared.MAX_BYTES", 1000)  # too big to store: computed each time
    evaluate(model, tokens.flip(1), make_policy("tova"), 8, DEFAULT_SPEC, shared)
    evaluate(model, tokens.flip(1), make_policy("tova"), 8, DEFAULT_SPEC, shared)
    assert shared.computed == 3 and len(list(tmp_path.glob("*.safetensors"))) == 1


def test_compile_failure_falls_back_to_the_eager_loop(model, tokens, monkeypatch):
    """A machine where torch.compile cannot build the step (no C++ compiler) warns once and streams eager."""
    import evictlab.eval.loop as loop_mod

    def broken(fn, **kwargs):
        def step(*args):
            raise RuntimeError("InductorError: no working C++ compiler found")

        return step

    monkeypatch.setattr(loop_mod.torch, "compile", broken)
    spec = StreamSpec(diagnostics=False, force_loop=True)
    eager = stream(model, tokens, make_policy("h2o"), 12, spec)
    with pytest.warns(UserWarning, match="torch.compile failed .*runs eager"):
        compiled = StreamSpec(**{**vars(spec), "compile": True})
        fallback = stream(model, tokens, make_policy("h2o"), 12, compiled)
    np.testing.assert_array_equal(fallback.nll, eager.nll)


# the engine's one decision, as a table: (policy, stream settings, T) -> (path, block)
PLANS = [
    ("full", {}, 512, "parallel", 128),
    ("full", {}, 65536, "parallel", 2048),  # the full cache's block grows with the stream (T / 16)
    ("full", {"block": 256}, 65536, "parallel", 256),
    ("window", {}, 65536, "parallel", 128),
    ("streaming_llm", {"position_mode": "cache"}, 512, "parallel", 128),
    ("streaming_llm", {"compile": True}, 512, "parallel", 128),  # compile applies to the loop only
    ("streaming_llm", {"force_loop": True}, 512, "loop", 1),
    ("h2o", {}, 512, "blocked", 128),
    ("tova", {"position_mode": "cache"}, 512, "blocked", 128),
    ("oracle", {}, 512, "blocked", 128),
    ("h2o", {"block": 32}, 512, "blocked", 32),
    ("h2o", {"compile": True}, 512, "loop", 1),
    ("scissorhands", {"force_loop": True}, 512, "loop", 1),
    ("recompute_window", {}, 512, "recompute", 2048),
    ("recompute_window", {"block": 64}, 512, "recompute", 64),
]


@pytest.mark.parametrize("name, settings, T, path, block", PLANS, ids=[str(p[:3]) for p in PLANS])
def test_the_plan_table(name, settings, T, path, block):
    from evictlab.eval.spec import PositionMode

    settings = {k: PositionMode(v) if k == "position_mode" else v for k, v in settings.items()}
    p = plan(make_policy(name), 64, StreamSpec(**settings), 4, T)
    assert (p.path, p.block) == (path, block)
    held = T - 1 if name == "full" else 64  # the full cache holds every scored position
    assert p.budgets == (held,) * 4 and p.compiled == (path == "loop" and settings.get("compile", False))
    assert BLOCK_STEPS == 128


def test_the_plan_is_what_ran_and_what_metrics_record():
    model = GPT(GPTConfig(name="t", vocab_size=40, n_layer=2, n_head=2, n_embd=16)).eval()
    tokens = torch.randint(0, 40, (2, 65), generator=torch.Generator().manual_seed(0))
    for name, path in (("window", "parallel"), ("h2o", "blocked"), ("recompute_window", "recompute")):
        policy = make_policy(name)
        expected = plan(policy, 8, StreamSpec(), 2, 65)
        out = stream(model, tokens, policy, 8, StreamSpec())
        assert (out.path, out.block, tuple(out.budgets)) == (path, expected.block, expected.budgets)
    res = evaluate(model, tokens, make_policy("h2o"), 8, StreamSpec(diagnostics=False))
    assert res.summary["path"] == "blocked" and res.summary["block"] == 128


def test_a_recompute_plan_needs_one_window_for_every_layer():
    from evictlab.cache.budget import Allocation

    with pytest.raises(ConfigError, match="allocation=uniform"):
        plan(make_policy("recompute_window"), 64, StreamSpec(allocation=Allocation.pyramid), 4, 512)


def test_a_wider_model_gets_larger_window_blocks_on_the_parallel_path_only():
    """Bounded windows run in blocks that double while the model's width is at least 4x the block (the
    matmuls' share grows with the width); the full cache, the blocked path and a narrow model keep theirs,
    and a block never exceeds eval.block."""
    from evictlab.eval.engine import window_block

    assert [window_block(w) for w in (0, 40, 128, 511, 512, 576, 1023, 1024, 4096)] == [
        128, 128, 128, 128, 256, 256, 256, 512, 2048]  # fmt: skip
    wide = {"n_layer": 4, "T": 2048, "width": 576}
    assert plan(make_policy("streaming_llm"), 64, StreamSpec(), **wide).block == 256
    assert plan(make_policy("streaming_llm"), 64, StreamSpec(block=200), **wide).block == 200
    assert plan(make_policy("h2o"), 64, StreamSpec(), **wide).block == BLOCK_STEPS
    assert plan(make_policy("full"), 64, StreamSpec(), **wide).block == 2048 // 16
    model = GPT(GPTConfig(name="w", vocab_size=40, n_layer=1, n_head=2, n_embd=512)).eval()
    tokens = torch.randint(0, 40, (1, 300), generator=torch.Generator().manual_seed(0))
    out = stream(model, tokens, make_policy("window"), 16, StreamSpec())
    ref = stream(model, tokens, make_policy("window"), 16, StreamSpec(block=128))
    assert (out.block, ref.block) == (256, 128)
    torch.testing.assert_close(out.nll, ref.nll, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "name, settings, path",
    [
        ("window", {"block": 8}, "parallel"),
        ("h2o", {"block": 8}, "blocked"),
        ("h2o", {"force_loop": True}, "loop"),
        ("recompute_window", {"block": 8}, "recompute"),
    ],
)
def test_every_path_ticks_each_token_step_once(model, tokens, name, settings, path):
    """A progress bar's count: each path reports every (stream, step) exactly once, block by block."""
    ticks: list[int] = []
    out = stream(model, tokens, make_policy(name), 6, StreamSpec(**settings), tick=ticks.append)
    assert out.path == path
    B, T = tokens.shape
    assert sum(ticks) == B * (T - 1)
    n, W = T - 1, 6 + 1  # recompute: steps 0 .. W-1 in one forward, then blocks of 8
    # blocked: the 6 steps before any eviction in one block (fill), then the wavefront's blocks of 8
    blocks = {"loop": n, "recompute": 1 + math.ceil((n - W) / 8), "blocked": 1 + math.ceil((n - 6) / 8)}
    blocks = blocks.get(path, math.ceil(n / 8))
    assert len(ticks) == blocks


def test_a_run_logs_its_progress_and_time_left(model, tokens, caplog, monkeypatch):
    """Every batch logs its reference and its streaming time; while streaming, a line with the count, the
    rate and the time left (every LOG_EVERY_S seconds: here every tick)."""
    import logging

    from evictlab.eval import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="evictlab"):
        evaluate(model, tokens, make_policy("h2o"), 6, StreamSpec(batch_size=1, block=8, diagnostics=False))
    lines = [r.getMessage() for r in caplog.records]
    n = tokens.shape[1] - 1
    assert sum("full-cache reference ready" in x for x in lines) == 2
    assert any(x.startswith("h2o b=6, batch 2/2 (1 x 33 tokens): streamed in") for x in lines)
    counts = [x for x in lines if "token-steps (" in x]
    assert counts[0].startswith(f"h2o b=6: 6/{2 * n:,} token-steps (9%), ")  # the 6 steps before evicting
    assert counts[-1].startswith(f"h2o b=6: {2 * n}/{2 * n} token-steps (100%), ")
    assert counts[-1].endswith("streaming ~0 s left")


def test_progress_time_left_counts_streaming_time_only():
    from evictlab.eval.progress import StreamProgress, duration

    p = StreamProgress(total=100, desc="x", log_every_s=1e9)
    p.streaming_s, p.since, p.done = 10.0, None, 25  # 25 steps in 10 s of streaming, paused since
    assert p.line() == "x: 25/100 token-steps (25%), 2.5/s, streaming ~30 s left"
    assert [duration(s) for s in (42, 750, 11_520)] == ["42 s", "12.5 min", "3.2 h"]
    p.close()


def test_sampled_steps_draw_one_step_in_each_equal_stratum():
    from evictlab.eval.spec import sampled_steps

    assert sampled_steps(10, 0) == list(range(10)) == sampled_steps(10, 10) == sampled_steps(10, 40)
    steps = sampled_steps(1000, 8)
    assert len(steps) == 8 and steps == sorted(steps) and sampled_steps(1000, 8) == steps  # seeded
    assert all(125 * i <= t < 125 * (i + 1) for i, t in enumerate(steps))
    assert len({t % 125 for t in steps}) > 1  # drawn, not the strata's starts
    with pytest.raises(ConfigError, match="eval.recompute_sample=-1 must be >= 0"):
        StreamSpec(recompute_sample=-1)


@pytest.mark.parametrize("n_sink", [0, 1])
def test_a_sampled_recompute_run_scores_the_sampled_steps_as_the_whole_run_does(model, tokens, n_sink):
    """eval.recompute_sample=k: the k sampled steps (some before the window fills, some after) carry the
    values of the unsampled run, every other step is NaN on both sides (the full cache's NLL too), and the
    summary's means are over the scored steps."""
    from evictlab.eval.spec import sampled_steps

    policy = make_policy("recompute_window", n_sink=n_sink)
    ref = full_reference(model, tokens)
    whole = stream(model, tokens, policy, 6, StreamSpec(block=8), reference=ref)
    ticks: list[int] = []
    some = stream(
        model, tokens, policy, 6, StreamSpec(block=8, recompute_sample=9), reference=ref, tick=ticks.append
    )
    steps = sampled_steps(tokens.shape[1] - 1, 9)
    assert min(steps) < 7 <= max(steps) and sum(ticks) == 2 * 9
    for name in ("nll", "correct", "kl", "agree"):
        a, b = getattr(whole, name), getattr(some, name)
        torch.testing.assert_close(b[:, steps], a[:, steps], rtol=0, atol=1e-5)
        rest = torch.ones(a.shape[1], dtype=torch.bool)
        rest[steps] = False
        assert b[:, rest].isnan().all()
    res = evaluate(model, tokens, policy, 6, StreamSpec(block=8, recompute_sample=9))
    nll, full = res.per_token["nll"], res.per_token["nll_full"]
    assert np.array_equal(np.isnan(nll), np.isnan(full)) and res.summary["scored_tokens"] == 2 * 9
    assert res.summary["ppl"] == pytest.approx(math.exp(np.nanmean(nll)))
    assert res.summary["full_reference_len"] == tokens.shape[1] - 1


@pytest.mark.parametrize("layout", ["band", "slot", "naive"])
def test_every_cache_layout_is_one_layer_cache_type_and_holds_what_its_evictions_leave(layout):
    """Each layout through the same LayerCache calls: entries stored one step at a time, and evicted as a
    sink of 1 plus a window of 2 (BandCache by the next query's position, the others by a victim index):
    after every step each holds positions {0, t-1, t}, with the keys stored at them."""
    torch.manual_seed(0)
    Hkv, D, steps = 2, 4, 7
    cache = {
        "band": lambda: BandCache(n_sink=1, lookback=2),
        "slot": lambda: SlotCache(1, Hkv, 4, D, like=torch.zeros(1), state={}),
        "naive": _NaiveCache,
    }[layout]()
    assert isinstance(cache, LayerCache)
    keys = torch.randn(steps, 1, Hkv, 1, D)
    for t in range(steps):
        pos = torch.tensor([t]) if layout == "band" else t
        K, V, P = cache.update(keys[t], keys[t] + 1, pos)
        P = P.expand(1, Hkv, -1) if P.dim() == 1 else P
        if layout == "band":
            cache.evict(t + 1)
            K, V, P = cache.k, cache.v, cache.pos.expand(1, Hkv, -1)
        else:
            held = (P >= 0).sum(-1)
            if int(held.max()) > 3:  # the oldest position after the sink goes
                victim = P.masked_fill(P < 1, steps).argmin(-1)
                cache.evict(victim)
            else:
                cache.evict(None)
            K, V, P = cache.k, cache.v, cache.pos
        want = sorted({0, max(t - 1, 0), t})
        for h in range(Hkv):
            rows = [i for i in range(P.shape[-1]) if P[0, h, i] >= 0]
            assert sorted(int(P[0, h, i]) for i in rows) == want
            for i in rows:
                assert torch.equal(K[0, h, i], keys[int(P[0, h, i]), 0, h, 0])
                assert torch.equal(V[0, h, i], keys[int(P[0, h, i]), 0, h, 0] + 1)


@pytest.mark.parametrize(
    "name, spec, path",
    [
        ("window", StreamSpec(), "parallel"),
        ("recompute_window", StreamSpec(), "recompute"),
        ("h2o", StreamSpec(), "blocked"),
        ("tova", StreamSpec(force_loop=True), "loop"),
        ("streaming_llm", StreamSpec(), "answer"),
    ],
)
def test_each_path_is_one_object_built_from_model_policy_plan_and_spec(model, tokens, name, spec, path):
    """engine.PATHS holds one `Path` per plan.path; built from (model, policy, plan, spec) and run on the
    tokens it is the stream (`stream` adds only its timings and the reference's first-4 mass)."""
    from evictlab.eval.engine import PATHS, Answers, build_path
    from evictlab.eval.paths import Path

    assert set(PATHS) == {"parallel", "recompute", "blocked", "loop", "answer"}
    assert all(issubclass(cls, Path) and cls.name == key for key, cls in PATHS.items())
    policy, T = make_policy(name), tokens.shape[1]
    answers = Answers(T - 4, 3) if path == "answer" else None
    p = plan(policy, 8, spec, model.cfg.n_layer, T, model.cfg.n_embd, answers)
    assert p.path == path
    ref = full_reference(model, tokens)
    built = build_path(model, make_policy(name), p, spec, answers)
    assert isinstance(built, PATHS[path])
    out = built.run(tokens, ref, torch.arange(tokens.shape[0]))
    via = stream(model, tokens, make_policy(name), 8, spec, reference=ref, answers=answers)
    assert out.path == via.path == path and torch.equal(out.nll, via.nll) and torch.equal(out.kl, via.kl)
    assert torch.equal(out.occupancy, via.occupancy)


def test_paper_verify_and_noise_log_progress_to_stderr_tagged_by_pass(capsys):
    """`paper verify` / `paper noise` have no Hydra to configure logging: the runs' progress lines go to
    stderr with the time and, in a noise pass, its name (two passes' lines interleave); one handler."""
    import logging

    from evictlab.eval.progress import log_to_stderr

    out = logging.getLogger("evictlab")
    handler = log_to_stderr("plain")
    try:
        logging.getLogger("evictlab.eval.progress").info("h2o b=6: 6/64 token-steps")
        assert log_to_stderr("perturbed(seed=1)") is handler and out.handlers.count(handler) == 1
        logging.getLogger("evictlab.eval.progress").info("tova b=6: 1/64 token-steps")
        err = capsys.readouterr().err.splitlines()
        assert err[0].endswith(" [plain] h2o b=6: 6/64 token-steps")
        assert err[1].endswith(" [perturbed(seed=1)] tova b=6: 1/64 token-steps")
    finally:
        out.removeHandler(handler)
