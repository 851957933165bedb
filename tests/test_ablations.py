"""Issue 27's ablations as run options: BOS's key masked or value zeroed in the full cache (all layers or
one), window + recompute with the first tokens at the head of each window, StreamingLLM whose sink is a
text token. tests/test_policies.py holds each equal to the naive loop; these test what each means."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch

from evictlab.analysis import stats as S
from evictlab.cache import make_policy
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec, full_reference, generate, stream
from evictlab.eval.engine import plan
from evictlab.models.gpt import GPT, GPTConfig

T = 48


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=40, n_layer=3, n_head=4, n_embd=32, n_kv_head=2)
    model = GPT(cfg).double().eval()
    with torch.no_grad():  # sharper attention than at init, so that ablating one key shows
        for block in model.blocks:
            block.attn.c_attn.weight.mul_(6)
    tokens = torch.randint(0, 39, (2, T))
    tokens[:, 0] = 39  # BOS
    return model, tokens, full_reference(model, tokens, attention=True)


@pytest.mark.parametrize("mode", ["original", "cache"])
def test_bos_key_masked_in_every_layer_is_the_stream_without_bos(setup, mode):
    """With BOS's key hidden from every later query in every layer, nothing after it reads BOS, and RoPE
    scores depend on distances only: steps 1.. are the full cache of the stream without its BOS."""
    model, tokens, ref = setup
    out = stream(
        model, tokens, make_policy("bos_ablation"), 16, StreamSpec(position_mode=mode), reference=ref
    )
    without = full_reference(model, tokens[:, 1:])
    nll = -without.logp.gather(-1, tokens[:, 2:, None])[..., 0]
    torch.testing.assert_close(out.nll[:, 1:], nll, rtol=0, atol=1e-9)
    assert out.path == "parallel" and out.kl[:, 1:].mean() > 1e-3  # BOS mattered to this model
    torch.testing.assert_close(
        out.nll[:, 0], ref_nll(ref, tokens)[:, 0], rtol=0, atol=1e-12
    )  # BOS's own step


def ref_nll(ref, tokens):
    return -ref.logp.gather(-1, tokens[:, 1 : ref.logp.shape[1] + 1, None])[..., 0]


def test_the_ablations_differ_and_one_layer_differs_from_all(setup):
    model, tokens, ref = setup
    runs = {
        (part, layer): stream(
            model, tokens, make_policy("bos_ablation", part=part, layer=layer), 16, reference=ref
        )
        for part in ("key", "value")
        for layer in (-1, 0, 2)
    }
    full = ref_nll(ref, tokens)
    nlls = {k: o.nll for k, o in runs.items()}
    for k, nll in nlls.items():
        torch.testing.assert_close(nll[:, 0], full[:, 0], rtol=0, atol=1e-12)  # step 0: only BOS itself
        assert (nll[:, 1:] - full[:, 1:]).abs().max() > 1e-4, k
    assert len({tuple(n.flatten().tolist()) for n in nlls.values()}) == len(nlls)


def test_value_zeroed_keeps_the_attention_bos_draws(setup):
    """part=value: each later query still gives BOS its attention weight and reads nothing from it, so
    layer 0's attention output is the full cache's minus (weight on BOS) x BOS's value, computed here with
    an explicit softmax; query 0 reads its own value."""
    from evictlab.eval.static import _BandAttention
    from evictlab.models.rope import Rope

    model, tokens, _ = setup
    a, n = model.blocks[0].attn, T - 1
    pos = torch.arange(n)
    q, k, v = a.project(model.blocks[0].ln_1(model.embed(tokens[:, :-1], pos)))
    qr, kr = a.rotate(q, pos), a.rotate(a.smear(k), pos)
    rep = a.n_head // a.n_kv_head
    kh, vh = kr.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    w = torch.softmax((qr @ kh.transpose(-1, -2) * a.head_dim**-0.5).masked_fill(~causal, float("-inf")), -1)
    want = w @ vh
    want[:, :, 1:] -= w[:, :, 1:, :1] * vh[:, :, :1]
    attend = _BandAttention([], Rope(model.cfg, torch.empty(0)), ablate=("value", [True]))
    attend.pos = pos
    got = attend.ablated(a, qr, kr, v, pos, causal, "value")  # [B, n, C]
    B = tokens.shape[0]
    torch.testing.assert_close(got.view(B, n, a.n_head, a.head_dim).transpose(1, 2), want, rtol=0, atol=1e-12)


def test_bos_ablation_errors_name_the_parameter(setup):
    model, tokens, _ = setup
    with pytest.raises(ConfigError, match="strategy.params.part"):
        make_policy("bos_ablation", part="query")
    with pytest.raises(ConfigError, match="layers 0 .. 2"):
        stream(model, tokens, make_policy("bos_ablation", layer=3), 16)
    with pytest.raises(ConfigError, match="parallel path only"):
        plan(make_policy("bos_ablation"), 16, StreamSpec(force_loop=True), 3, T)


def test_recompute_with_a_sink_re_encodes_the_first_token_at_the_head_of_every_window(setup):
    """window + recompute with n_sink=1 (BOS prepended): each prediction is one fresh forward over
    [BOS] + the last budget - 1 tokens + the token itself, at positions 0 .. budget."""
    model, tokens, _ = setup
    budget = 8
    out = stream(model, tokens, make_policy("recompute_window", n_sink=1), budget, StreamSpec(block=5))
    for t in (3, budget, budget + 1, T - 2):
        win = (
            tokens[:, : t + 1]
            if t <= budget
            else torch.cat([tokens[:, :1], tokens[:, t - budget + 1 : t + 1]], 1)
        )
        assert win.shape[1] == min(t + 1, budget + 1)
        logp = torch.log_softmax(model(win)[:, -1], -1)
        torch.testing.assert_close(
            out.nll[:, t], -logp.gather(-1, tokens[:, t + 1, None])[:, 0], rtol=0, atol=1e-9
        )
    plain = stream(model, tokens, make_policy("recompute_window"), budget)
    assert (plain.nll[:, budget + 1 :] - out.nll[:, budget + 1 :]).abs().min() > 0


def test_recompute_with_a_sink_generates_from_the_same_windows(setup):
    model, tokens, _ = setup
    prompt, budget, n_new = tokens[:, :12], 6, 5
    got = generate(model, prompt, make_policy("recompute_window", n_sink=1), budget, n_new)
    seq = prompt
    for _ in range(n_new):
        win = torch.cat([seq[:, :1], seq[:, -(budget):]], 1)
        seq = torch.cat([seq, model(win)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, seq[:, prompt.shape[1] :])


@pytest.mark.parametrize("mode", ["original", "cache"])
def test_streaming_llm_with_a_text_token_sink_keeps_position_one_not_bos(setup, mode):
    model, tokens, ref = setup
    policy = make_policy("streaming_llm", n_sink=1, first_sink=1)
    out = stream(model, tokens, policy, 8, StreamSpec(position_mode=mode), reference=ref)
    assert out.path == "blocked"
    for pos in out.kept:
        for row in pos.flatten(0, 1):
            assert sorted(row[row >= 0].tolist()) == [1, *range(T - 8, T - 1)]
    bos_sink = stream(
        model, tokens, make_policy("streaming_llm", n_sink=1), 8, StreamSpec(position_mode=mode)
    )
    assert (bos_sink.nll[:, 9:] - out.nll[:, 9:]).abs().max() > 1e-4
    with pytest.raises(ConfigError, match="first_sink"):
        make_policy("streaming_llm", first_sink=-1)


def test_an_ablation_is_never_taken_for_the_full_cache_reference():
    frame = pd.DataFrame(
        {
            "strategy": ["full", "bos_ablation", "window"],
            "strategy_order": [0, 20, 1],
            "evicts": [False, False, True],
            "ablation": [False, True, False],
        }
    )
    assert list(S.reference(frame)["strategy"]) == ["full"]
    assert list(S.ablations(frame)["strategy"]) == ["bos_ablation"]
    assert list(S.evicting(frame)["strategy"]) == ["window"]
    assert S.PolicyOrder(frame).references == {"full"}
    old = frame.drop(columns="ablation").iloc[[0, 2]]  # a table from before the column: full is the reference
    assert list(S.reference(old)["strategy"]) == ["full"]


def _arm_tables():
    """Synthetic aggregated tables of an ablation sweep: 3 checkpoints x 4 streams per arm, each arm's NLL
    the full cache's plus a known shift (growing with the checkpoint), and bos_key one layer at a time."""
    rng = np.random.default_rng(0)
    shift = {"window": 0.4, "sink_bos": 0.05, "sink_text": 0.3, "bos_key": 0.2, "bos_value": 0.1}
    strategy = {"none": "full", "window": "window", "sink_bos": "streaming_llm", "sink_text": "streaming_llm"}
    streams, results = [], []
    arms = [("none", -1), *((a, -1) for a in shift), *(("bos_key", layer) for layer in range(2))]
    for arm, layer in arms:
        name = strategy.get(arm, "bos_ablation")
        sinks = {"n_sink": 1, "first_sink": int(arm == "sink_text")} if name == "streaming_llm" else {}
        for c in range(3):
            key = f"{arm}-{layer}-{c}"
            row = {"run_key": key, "strategy": name, "cfg.arm": arm, "cfg.strategy.params.layer": layer,
                   "checkpoint": f"gpt_small-{c}", "cfg.train.seed": c, "cfg.train.steps": 4000}  # fmt: skip
            results.append(row | {f"cfg.strategy.params.{k}": v for k, v in sinks.items()})
            evicts = name not in ("full", "bos_ablation")
            d = 0.0 if arm == "none" else shift[arm] * (1 + 0.1 * c) / (1 if layer < 0 else 2 + layer)
            for j in range(4):
                full = 2.0 + 0.1 * j + 0.05 * c
                streams.append(
                    {"run_key": key, "strategy": name, "strategy_order": 0, "evicts": evicts,
                     "ablation": name == "bos_ablation", "budget": 64 if evicts else 511,
                     "position_mode": "original", "seed": 0, "stream": j, "checkpoint": f"gpt_small-{c}",
                     "model": "gpt_small", "dataset": "man_pages", "nll": full + d + rng.normal(0, 1e-3),
                     "nll_full": full}
                )  # fmt: skip
    return pd.DataFrame(streams), pd.DataFrame(results)


def test_the_ablations_figure_draws_every_arm_with_hierarchical_cis():
    from evictlab.analysis import figures as F

    streams, results = _arm_tables()
    tables = {"streams": streams, "results": results}
    assert F.FIGURES["ablations"].applies(tables)
    assert not F.FIGURES["ablations"].applies(
        {"streams": streams, "results": results.drop(columns="cfg.arm")}
    )
    fig = F.ablations(streams, results)
    ax, layer_ax = fig.axes
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [F.ARMS[a] for a in ("window", "sink_text", "sink_bos", "bos_key", "bos_value")]
    points = dict(map(tuple, ax.containers[0].lines[0].get_xydata()[:, ::-1]))  # row -> mean ratio
    for arm, shift in [("window", 0.4), ("bos_value", 0.1)]:
        want = np.exp(np.mean([shift * (1 + 0.1 * c) for c in range(3)]))  # mean over trainings
        np.testing.assert_allclose(points[labels.index(F.ARMS[arm])], want, rtol=2e-3)
    assert len(layer_ax.get_lines()) >= 2  # bos_key per layer, and its all-layers level
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"training seed=0", "training seed=1", "training seed=2"} <= set(legend)  # one marker each
    plt.close(fig)


def test_hierarchical_ci_is_wider_than_the_pooled_one_when_trainings_differ():
    rng = np.random.default_rng(1)
    clusters = np.repeat([0, 1, 2], 30)
    values = np.array([0.1, 0.5, 0.9])[clusters] + rng.normal(0, 0.05, 90)
    point, lo, hi = S.nested_bootstrap_ci(values, clusters)
    _, plo, phi = S.bootstrap_ci(values)
    assert abs(point - 0.5) < 0.02 and hi - lo > 3 * (phi - plo)
    assert S.nested_bootstrap_ci(values, np.zeros(90)) == S.bootstrap_ci(values)  # one cluster: plain
    frame = pd.DataFrame(
        {"strategy": "w", "budget": 1, "position_mode": "o", "checkpoint": clusters, "x": values}
    )
    row = S.summarize_streams(frame, "x").iloc[0]
    assert (row["n"], row["clusters"]) == (90, 3) and (row["low"], row["high"]) == (lo, hi)


def test_the_headline_table_keeps_arms_of_one_strategy_apart():
    from evictlab.analysis.report import headline_table

    streams, results = _arm_tables()
    runs = streams.drop_duplicates("run_key")[["run_key", "strategy", "budget", "position_mode"]]
    t = headline_table({"streams": streams, "results": results, "runs": runs.assign(kv_bytes=1024.0)})
    settings = set(t["setting"])
    assert {"sink_bos", "sink_text", "bos_value"} <= settings
    # one arm ablated in every layer (-1) and in one layer at a time: three rows, not one pooled "bos_key"
    assert {"bos_key, layer=-1", "bos_key, layer=0", "bos_key, layer=1"} <= settings
    assert "bos_key" not in settings
    assert (t["training runs"] == 3).all()
