"""The long-context tasks (data/tasks): stream construction, the graders, the written answers of a run."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
import torch

from evictlab.cache import make_policy
from evictlab.config import EvalTask
from evictlab.data import load_corpus
from evictlab.data.tasks import TASKS, make_task, task_streams
from evictlab.errors import ConfigError
from evictlab.eval import StreamSpec
from evictlab.eval.engine import DecodeClock, generate
from evictlab.eval.evaluate import task_accuracy, task_decode_len
from evictlab.eval.shared import SharedReferences
from tests.conftest import make_cfg


@pytest.fixture(scope="module")
def corpus(session_outputs):
    cfg = make_cfg(session_outputs)
    return load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs)


def test_every_task_is_an_eval_task_and_has_one_file():
    assert set(TASKS) == {t.value for t in EvalTask} - {"lm", "recall"}
    assert len(TASKS) >= 3
    with pytest.raises(ConfigError, match="unknown task 'nope'; known: niah_multikey"):
        make_task("nope")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_streams_plant_every_needle_in_order_and_end_with_the_reference_answer(corpus, name):
    tok = corpus.tokenizer
    b = task_streams(corpus, name, 4, 1000, sink_token=False, seed=3)
    assert b.tokens.shape == (4, 1000) and (b.tokens[:, 0] == tok.bos_id).all()
    for i, p in enumerate(b.problems):
        row = b.tokens[i].tolist()
        s, n = int(b.answer_start[i]), int(b.answer_len[i])
        assert s == b.answer_start[0] and tok.decode(row[s : s + n]) == p.answer  # one prompt length
        assert tok.decode(row[:s]).endswith(f"{p.question}\nAnswer: {p.reply}")
        assert b.answer[i].sum() == n and b.answer[i, s - 1 : s - 1 + n].all()
        assert b.needle_pos[i] == sorted(b.needle_pos[i]) and len(b.needle_pos[i]) == len(p.needles)
        for at, needle in zip(b.needle_pos[i], p.needles, strict=True):
            assert tok.decode(row[at : at + len(tok.encode(needle))]) == needle
        assert b.task.score(p, p.answer) == (True, 1.0)  # the reference answer is graded correct
    again = task_streams(corpus, name, 4, 1000, sink_token=False, seed=3)
    assert torch.equal(again.tokens, b.tokens) and again.problems == b.problems
    other = task_streams(corpus, name, 4, 1000, sink_token=False, seed=4)
    assert other.problems != b.problems
    with pytest.raises(ConfigError, match="haystack tokens"):
        task_streams(corpus, name, 1, 80, sink_token=False)


def _wrong(item: str) -> str:
    """The item with its last character changed (a digit or a capital letter)."""
    last = item[-1]
    return item[:-1] + ("0" if last == "9" else "A" if last == "Z" else chr(ord(last) + 1))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_grader_accepts_a_correct_answer_and_rejects_wrong_missing_or_extra_items(name):
    task = make_task(name)
    p = task.problem(np.random.default_rng(0))
    items = list(p.expected)
    sep = " " if task.item.startswith("[A-Z]") else ", "
    assert task.score(p, " " + sep.join(reversed(items)) + ".<|im_end|>\nmore 1234567") == (True, 1.0)
    assert task.score(p, ":\n\n" + "\n".join(f"- {i}" for i in items)) == (True, 1.0)  # a list counts
    assert task.score(p, " Let me see.\n\n" + sep.join(items)) == (False, 0.0)  # up to a blank line
    wrong = task.score(p, " " + sep.join([_wrong(items[0]), *items[1:]]))
    assert wrong == (False, (len(items) - 1) / len(items))
    if len(items) > 1:
        assert task.score(p, " " + sep.join(items[1:])) == (False, (len(items) - 1) / len(items))
    assert task.score(p, " " + sep.join([*items, _wrong(items[0])])) == (False, len(items) / (len(items) + 1))
    assert task.score(p, " I do not know.") == (False, 0.0)


def test_a_variable_tracking_answer_names_only_the_asked_chain():
    task = make_task("variable_tracking")
    p = task.problem(np.random.default_rng(1))
    chain = [n.split()[1] for n in p.needles]
    other = [v for v in dict.fromkeys(chain) if v not in p.expected]
    assert len(other) == len(p.expected)  # the distractor chain: as long, another value
    assert task.score(p, " " + " ".join(other))[0] is False


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_written_answers_are_graded_and_match_the_teacher_forced_answer(tiny_checkpoint, corpus, policy):
    """A causal policy writes the reference's tokens exactly when it predicts each of them teacher-forced
    (until its first wrong token greedy decoding sees the true prefix); the grade is the grader's."""
    model, tok = tiny_checkpoint.model, corpus.tokenizer
    b = task_streams(corpus, "niah_multikey", 2, 700, sink_token=False, seed=0)
    for i in (0,):  # make one answer the model's own continuation, so both outcomes occur
        s, n = int(b.answer_start[i]), int(b.answer_len[i])
        b.tokens[i, s : s + n] = generate(model, b.tokens[i : i + 1, :s], make_policy(policy), 32, n)[0]
    clock = DecodeClock()
    f = task_accuracy(
        model, b, make_policy(policy), 32, StreamSpec(batch_size=4), decode=tok.decode, clock=clock
    )
    n_new = task_decode_len(b.answer_len).max()  # both rows decode together, as many as the longer needs
    assert clock.decode_steps == 2 * n_new and clock.decode_s > 0 and clock.prefill_s > 0
    assert list(f["task"].unique()) == ["niah_multikey"] and len(f) == 2
    ref = [tok.decode(b.tokens[i, b.answer_start[i] :][: b.answer_len[i]].tolist()) for i in range(2)]
    starts = [w.startswith(r) for w, r in zip(f["written"], ref, strict=True)]
    assert starts == list(f["exact_teacher_forced"]) and all(starts[::2])
    graded = [b.task.score(p, w) for p, w in zip(b.problems, f["written"], strict=True)]
    assert list(f["exact"]) == [e for e, _ in graded] and list(f["partial"]) == [c for _, c in graded]
    no_text = task_accuracy(model, b, make_policy("oracle"), 32, decode=tok.decode)
    assert "written" not in no_text and np.isfinite(no_text["answer_nll"]).all()


@pytest.mark.parametrize("policy", ["full", "window", "streaming_llm", "h2o", "tova", "random"])
def test_the_answer_path_writes_the_answers_generate_writes_and_streams_as_the_plain_pass(
    tiny_checkpoint, corpus, policy
):
    """One pass for a task run (the prompt on the blocked path, then a fork writes the answers while the
    stream goes on teacher-forced) gives the plain evaluation's per-token metrics, held shares and
    occupancy, and the tokens `generate` writes from the same prompts."""
    from evictlab.eval.evaluate import evaluate, greedy_answers, task_answers

    model = tiny_checkpoint.model
    b = task_streams(corpus, "niah_multiquery", 3, 800, sink_token=False, seed=1)
    pol, spec = make_policy(policy), StreamSpec(batch_size=2, block=64)
    plain = evaluate(model, b.tokens, pol, 48, spec)
    clock = DecodeClock(fused=True)
    one = evaluate(model, b.tokens, pol, 48, spec, answers=task_answers(b, clock))
    assert one.summary["path"] == "answer" and plain.written is None
    for name in ("nll", "correct", "kl", "agree"):
        np.testing.assert_allclose(
            one.per_token[name], plain.per_token[name], rtol=0, atol=2e-5, err_msg=name
        )
    assert one.summary["occupancy_max"] == plain.summary["occupancy_max"]
    held = lambda r: r.layers[r.layers["metric"].str.startswith("held_p")]["value"].to_numpy()  # noqa: E731
    np.testing.assert_allclose(held(one), held(plain), atol=1e-9)
    want = greedy_answers(model, b, pol, 48, spec, task_decode_len)
    n_new = task_decode_len(b.answer_len).max()
    assert one.written.shape == (3, n_new)
    for row, w in zip(one.written, want, strict=True):
        assert row[: len(w)].tolist() == w.tolist()
    assert clock.decode_steps == 3 * n_new and clock.prefill_s > 0
    assert clock.fused_rows == (0 if pol.needs_attention else 3)
    graded = task_accuracy(model, b, pol, 48, spec, one, tok_decode := corpus.tokenizer.decode)
    assert graded["written"].tolist() == [tok_decode(w.tolist()) for w in want]


def test_chatml_needs_a_tokenizer_with_the_chat_tokens(corpus, tmp_path):
    with pytest.raises(ConfigError, match="task_template=chatml needs a tokenizer"):
        task_streams(corpus, "niah_multikey", 1, 1000, sink_token=False, template="chatml")
    with pytest.raises(ConfigError, match="task_template='json' must be plain or chatml"):
        make_cfg(tmp_path, "eval.task_template=json")


@pytest.mark.slow
def test_chatml_prompts_are_smollm2_chat_turns(smollm2_outputs):
    """With SmolLM2's tokenizer the prompt is its chat template: system, user, then the assistant's reply."""
    cfg = make_cfg(smollm2_outputs, "model=smollm2_135m", "dataset=man_pinned")
    corpus = load_corpus(cfg.dataset, cfg.tokenizer, cfg.outputs, min_tokens=cfg.corpus_min_tokens)
    b = task_streams(corpus, "niah_multiquery", 2, 700, sink_token=False, template="chatml", seed=0)
    tok = corpus.tokenizer
    for i, p in enumerate(b.problems):
        text = tok.decode(b.tokens[i].tolist())
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert f"{p.question}<|im_end|>\n<|im_start|>assistant\n{p.reply}{p.answer}" in text
        assert text.endswith(p.answer) and b.tokens[i, 0] == tok.bos_id
        assert (b.tokens[i] == tok.encode("<|im_end|>")[0]).sum() == 2  # system and user turns end


def test_a_task_run_records_each_answer_written_and_graded(session_outputs):
    import json

    from evictlab import run as run_mod
    from evictlab.analysis.aggregate import aggregate
    from evictlab.analysis.report import load_tables
    from tests.test_pipeline import cfg_for

    # the session's tiny checkpoint (trained once), this test's own group (so aggregate reads its run only)
    overrides = ["group=task_run", "strategy=streaming_llm", "budget=b32", "logger=none"]
    cfg = cfg_for(session_outputs, *overrides, "eval.task=niah_multivalue", "eval.stream_len=800")
    m = run_mod.run(cfg)
    graded = pd.read_parquet(run_mod.run_dir(cfg) / "tasks.parquet")
    assert len(graded) == 2 and m["n_streams"] == 2 and {"written", "exact", "partial"} <= set(graded)
    assert m["task_partial"] == pytest.approx(graded["partial"].mean())
    assert m["task_exact_teacher_forced"] == pytest.approx(graded["exact_teacher_forced"].mean())
    assert m["decode_token_steps_per_s"] > 0 and m["prefill_s"] > 0  # how fast the answers were written
    assert json.loads((run_mod.run_dir(cfg) / "metrics.json").read_text())["status"] == "ok"
    aggregate([run_mod.run_dir(cfg).parent], run_mod.run_dir(cfg).parent)
    tables = load_tables(run_mod.run_dir(cfg).parent)
    assert len(tables["tasks"]) == 2 and set(tables["tasks"]["strategy"]) == {"streaming_llm"}
    from evictlab.paper import _tables_text

    text = _tables_text("task_run", tables, {})  # what make tables prints for a task sweep
    share = f"{graded['exact'].mean():.2f} ["
    assert (
        "task answers graded exact" in text
        and f"| niah_multivalue, 800 tokens: StreamingLLM | {share}" in text
    )
    plain = cfg_for(session_outputs, *overrides, "eval.stream_len=800")
    assert run_mod.run_dir(plain) != run_mod.run_dir(cfg)  # the task is in the run key


def test_wilson_interval_and_exact_mcnemar_test():
    from evictlab.analysis import stats as S

    assert S.wilson_ci(5, 10) == pytest.approx((0.5, 0.2366, 0.7634), abs=1e-4)
    p, lo, hi = S.wilson_ci(0, 10)
    assert (p, lo) == (0.0, 0.0) and hi == pytest.approx(0.2775, abs=1e-4)  # not collapsed to a point
    ones, zeros = np.ones(6, dtype=bool), np.zeros(6, dtype=bool)
    assert S.mcnemar_p(ones, zeros) == pytest.approx(2 * 0.5**6)  # 6 discordant pairs, all one way
    assert S.mcnemar_p(np.r_[ones, zeros], np.r_[zeros, ones]) == 1.0  # balanced
    assert S.mcnemar_p(ones, ones) == 1.0  # no discordant pair


def test_the_task_table_gives_each_policys_accuracy_and_its_paired_test_against_the_full_cache():
    from evictlab.analysis.report import task_table

    n = 10
    rows = []
    for task, full_ok, h2o_ok in [
        ("niah_multikey", [1] * 8 + [0] * 2, [0] * 8 + [0, 1]),
        ("vt", [1] * n, [1] * n),
    ]:
        for name, budget, ok in [("full", 2047, full_ok), ("h2o", 256, h2o_ok), ("oracle", 256, [1] * n)]:
            rows += [
                {"task": task, "stream_len": 2048, "position_mode": "original", "strategy": name,
                 "evicts": name != "full", "budget": budget, "stream": i, "strategy_label": name,
                 "exact": None if name == "oracle" else bool(ok[i]), "exact_teacher_forced": bool(ok[i])}
                for i in range(n)
            ]  # fmt: skip
    t = task_table({"tasks": pd.DataFrame(rows)})
    assert list(t.columns) == ["all", "b256"] and "oracle" not in " ".join(t.index)  # it writes nothing
    key = next(i for i in t.index if i.startswith("niah_multikey") and "h2o" in i)
    assert t.loc[key, "b256"] == "0.10 [0.02, 0.40] 1/10; p=0.039"  # 8 discordant of 9 pairs: 2 x 10/512
    assert t.loc[next(i for i in t.index if i.startswith("niah") and "full" in i), "all"].startswith("0.80 [")
    assert t.index[0].startswith("niah_multikey, 2,048 tokens")
    forced = task_table({"tasks": pd.DataFrame(rows)}, column="exact_teacher_forced")
    assert any("oracle" in i for i in forced.index)


def test_the_decode_table_gives_each_policys_rate_and_the_fused_kernels_beside_it():
    from evictlab.analysis.report import decode_table

    runs = pd.DataFrame(
        [
            {"strategy": "full", "evicts": False, "budget": 2047, "rate": 50.0, "fused": 80.0, "same": 1.0},
            {"strategy": "h2o", "evicts": True, "budget": 128, "rate": 40.0, "fused": np.nan, "same": np.nan},
            {"strategy": "h2o", "evicts": True, "budget": 128, "rate": 42.0, "fused": np.nan, "same": np.nan},
            {
                "strategy": "streaming_llm",
                "evicts": True,
                "budget": 512,
                "rate": 61.0,
                "fused": 90.5,
                "same": 0.98,
            },
        ]
    ).rename(columns={"rate": "decode_token_steps_per_s", "fused": "decode_token_steps_per_s_fused"})
    runs = runs.rename(columns={"same": "fused_same_tokens"}).assign(position_mode="original")
    runs["strategy_label"] = runs["strategy"]
    t = decode_table({"runs": runs})
    assert list(t.columns) == ["all", "b128", "b512"]
    assert t.loc["full", "all"] == "50.0; SDPA 80.0 (same 100%)"
    assert t.loc["h2o", "b128"] == "41.0" and t.loc["h2o", "b512"] == "-"  # no fused kernel for H2O
    assert t.loc["streaming_llm", "b512"] == "61.0; SDPA 90.5 (same 98%)"
    assert decode_table({"runs": runs.drop(columns=["decode_token_steps_per_s"])}).empty


def test_calibrate_scores_the_full_caches_written_answers_and_resumes(
    session_outputs, tiny_checkpoint, tmp_path, monkeypatch
):
    """`python -m evictlab.calibrate`: one CSV row per task x context (exact share = the graded answers'
    mean, its Wilson interval, the provenance), each answer beside it; a second call keeps finished rows."""
    from evictlab import calibrate
    from tests.conftest import TINY

    out = tmp_path / "cal" / "calibration.csv"
    args = ["--out", str(out), "--tasks", "niah_multikey", "variable_tracking", "--lengths", "700"]
    args += ["--samples", "3", "--batch", "2", *TINY, f"paths.outputs={session_outputs}"]
    assert calibrate.main([*args, "eval.task_template=plain"]) == 0
    summary = pd.read_csv(out)
    answers = pd.read_parquet(out.with_name("calibration_answers.parquet"))
    assert summary[["task", "context", "n"]].values.tolist() == [
        ["niah_multikey", 700, 3],
        ["variable_tracking", 700, 3],
    ]
    for _, row in summary.iterrows():
        mine = answers[answers["task"] == row["task"]]
        assert len(mine) == 3 and row["exact"] == mine["exact"].sum()
        assert row["ci_low"] <= row["exact_share"] <= row["ci_high"]
        assert row["weights_sha256"] == tiny_checkpoint.meta["weights_sha256"] and len(row["commit"]) == 40
    assert answers["written"].map(type).eq(str).all()

    def boom(*a, **k):
        raise AssertionError("a finished row was re-run")

    monkeypatch.setattr(calibrate, "calibrate_one", boom)
    assert calibrate.main([*args, "eval.task_template=plain"]) == 0
    assert len(pd.read_csv(out)) == 2
    with pytest.raises(ConfigError, match="unknown task"):
        calibrate.main([*args[:2], "--tasks", "nope", *TINY, f"paths.outputs={session_outputs}"])


def test_verify_re_runs_a_task_snapshot_answer_by_answer(session_outputs, tmp_path, monkeypatch):
    """make verify on a task sweep: each sampled run's task streams re-run and its answers compared with the
    snapshot's (answer NLL, exact teacher-forced, the written text and its grade); `--streams 1` re-runs
    the snapshot's first problem, not another draw; an answer written differently in the snapshot fails."""
    from evictlab import results as R
    from evictlab import run as run_mod
    from evictlab import verify as V
    from evictlab.analysis.aggregate import aggregate
    from tests.test_pipeline import FAST, cfg_for

    task = ["eval.task=niah_multikey", "eval.stream_len=600", "eval.n_streams=3", "logger=none"]
    sampled = []
    for strategy in ("streaming_llm", "h2o"):
        overrides = ["group=task_verify", f"strategy={strategy}", "budget=b32", *task]
        cfg = cfg_for(session_outputs, *overrides)
        run_mod.run(cfg)
        sampled.append(
            V.Sampled(run_mod.run_key(cfg), f"{strategy} b32 original", [*FAST, *overrides], {}, None)
        )
    folder = tmp_path / "task_verify"
    aggregate([run_mod.run_dir(cfg).parent], folder / "snapshot")
    monkeypatch.setattr(V, "sample_runs", lambda results, experiment, every=False: sampled)

    now, notes = V.rerun(folder, "unused", streams=2, outputs=session_outputs)
    assert not notes and sorted(set(now["stream"])) == [0, 1]  # the first two of the three problems
    tables = R.read_tables(folder / "snapshot")
    snapshot = V.snapshot_answers(tables["streams"], tables["tasks"])
    rows = V.compare(snapshot, now)
    assert rows["ok"].all(), V.report(rows)
    assert {"answer_nll", "exact_teacher_forced", "exact", "written_match"} <= set(rows["metric"])
    assert (now["written_match"] == 1.0).all()

    changed = tables["tasks"].copy()
    changed.loc[changed["stream"] == 1, "written"] = "a different answer"
    monkeypatch.setattr(R, "read_tables", lambda path: tables | {"tasks": changed})
    again, _ = V.rerun(folder, "unused", streams=2, outputs=session_outputs)
    bad = V.compare(snapshot, again)
    assert set(bad.loc[~bad["ok"], "metric"]) == {"written_match"}
    assert set(bad.loc[~bad["ok"], "stream"]) == {1}
    # a slice at a time (verify --strategies): only that policy's sampled run; a policy not in it is an error
    only, _ = V.rerun(folder, "unused", streams=1, outputs=session_outputs, strategies=["h2o"])
    assert list(only["run"]) == ["h2o b32 original"]
    # make noise: the value-deciding run (H2O, not StreamingLLM) plain and perturbed; its passes in two
    # worker processes measure what one process does
    noise = V.decision_noise(folder, "unused", seeds=1, streams=1, outputs=session_outputs)
    assert set(noise["run"]) == {"h2o b32 original"} and set(noise["perturbations"]) == {1}
    assert {"nll", "kl", "agree", "answer_nll"} <= set(noise["metric"]) and (noise["noise"] >= 0).all()
    both = V.decision_noise(folder, "unused", seeds=1, streams=1, outputs=session_outputs, jobs=2)
    pd.testing.assert_frame_equal(noise, both)
    # a perturbed pass computes its model's full-cache log-probs once per batch for all its runs (a store of
    # its own, which the pass removes when it is done; entries with attention, the oracle's, are not kept)
    computed, reference = [], SharedReferences.reference

    def counted(self, model, batch, spec, attention, compute):
        return reference(self, model, batch, spec, attention, lambda: computed.append(attention) or compute())

    monkeypatch.setattr(SharedReferences, "reference", counted)
    refs, moved = tmp_path / "pass_references", functools.partial(V.perturbed, seed=0)
    two, _ = V.rerun(
        folder, "unused", streams=1, outputs=session_outputs, transform=moved, pass_references=refs
    )
    assert two["run"].nunique() == 2 and computed == [False] and any(refs.rglob("*.safetensors"))
    monkeypatch.setattr(SharedReferences, "reference", reference)
    # resumable: each (pass, run) kept as it is measured; a later call reads them back and measures nothing
    # (a call stopped by a crash or a session's end goes on from its finished runs); --fresh drops them
    resumable = {"seeds": 1, "streams": 1, "outputs": session_outputs, "resume": True}
    pd.testing.assert_frame_equal(noise, V.decision_noise(folder, "unused", **resumable, fresh=True))
    kept = sorted((session_outputs / V.RESUME_DIR / folder.name).glob("*.parquet"))
    assert len(kept) == 2  # the plain pass and perturbed(seed=0), one run each
    first = pd.read_parquet(kept[0])  # with its pass, the machine that measured it and the commit
    assert first["noise_pass"].iloc[0] in {"plain", "perturbed(seed=0)"} and first["machine"].notna().all()
    assert {"git_commit", "run_key", "nll", "seconds"} <= set(first)
    assert len(V.pass_machines([first, first])) == 1
    # over all the streams the runs are kept in the experiment folder (committed beside the CSV), by name
    assert V.kept_path(folder, session_outputs, sampled[1], None, "perturbed(seed=1)") == (
        folder / V.NOISE_RUNS / "perturbed-seed-1--h2o-b32-original.parquet"
    )
    assert not any((session_outputs / V.RESUME_DIR / folder.name).glob("references-*"))  # (removed)

    def measured(*args, **kwargs):
        raise RuntimeError("measured again")

    monkeypatch.setattr(V, "measure", measured)
    pd.testing.assert_frame_equal(noise, V.decision_noise(folder, "unused", **resumable))
    first.assign(run_key="another").to_parquet(kept[0])  # a kept file of another run: measured again
    with pytest.raises(RuntimeError, match="measured again"):
        V.decision_noise(folder, "unused", **resumable)
    kept[0].unlink()  # one pass stopped before its run was kept: only that run is measured
    with pytest.raises(RuntimeError, match="measured again"):
        V.decision_noise(folder, "unused", **resumable)
    with pytest.raises(RuntimeError, match="measured again"):
        V.decision_noise(folder, "unused", **resumable, fresh=True)
    assert V.transform_label(functools.partial(V.perturbed, seed=2)) == "perturbed(seed=2)"
    with pytest.raises(ValueError, match="tova"):
        V.rerun(folder, "unused", streams=1, outputs=session_outputs, strategies=["tova"])
