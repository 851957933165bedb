"""The GPT itself: shapes, causality, RoPE relativity, the engine-facing attention steps, learning."""

from __future__ import annotations

import pytest
import torch

from evictlab.config import compose, to_objects
from evictlab.errors import ConfigError
from evictlab.models.gpt import GPT, GPTConfig, PosEmb, apply_rope


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(name="t", vocab_size=50, n_layer=2, n_head=4, n_embd=32, **kw)
    return GPT(cfg).double().eval()


@pytest.mark.parametrize(
    "kw",
    [{}, {"n_kv_head": 2}, {"n_kv_head": 1}, {"pos_emb": "learned", "block_size": 64}, {"smear_keys": True}],
)
def test_shapes_and_causality(kw):
    model = tiny(**kw)
    idx = torch.randint(0, 50, (3, 20))
    logits = model(idx)
    assert logits.shape == (3, 20, 50)
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 50  # alter the future
    after = model(changed)
    torch.testing.assert_close(after[:, :12], logits[:, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(after[:, 12:], logits[:, 12:])


def test_gqa_stores_kv_heads_only():
    model = tiny(n_kv_head=2)
    attn = model.blocks[0].attn
    q, k, v = attn.project(torch.randn(2, 5, 32, dtype=torch.float64))
    assert q.shape == (2, 4, 5, 8) and k.shape == (2, 2, 5, 8) and v.shape == (2, 2, 5, 8)


def test_smeared_keys_mix_in_the_previous_key_and_stream_in_pieces():
    """k'_j = s k_j + (1 - s) k_(j-1) per KV head (k_(-1) = 0); a sequence smeared in two pieces, the second
    given the first's last raw key, equals it smeared at once; without the switch there is no parameter."""
    assert tiny().blocks[0].attn.smear_logit is None
    assert not any("smear" in name for name in tiny().state_dict())  # old checkpoints load unchanged
    attn = tiny(smear_keys=True, n_kv_head=2).blocks[0].attn
    assert attn.smear_logit.shape == (2,) and attn.smear_logit.dim() < 2  # 1-D: never weight-decayed
    with torch.no_grad():
        attn.smear_logit.copy_(torch.tensor([0.0, 2.0]))
    k = torch.randn(3, 2, 6, 8, dtype=torch.float64)
    s = torch.sigmoid(torch.tensor([0.0, 2.0], dtype=torch.float64))[:, None, None]
    before = torch.cat([torch.zeros_like(k[:, :, :1]), k[:, :, :-1]], dim=2)
    torch.testing.assert_close(attn.smear(k), s * k + (1 - s) * before, rtol=0, atol=1e-15)
    pieces = torch.cat([attn.smear(k[:, :, :4]), attn.smear(k[:, :, 4:], prev=k[:, :, 3:4])], dim=2)
    torch.testing.assert_close(pieces, attn.smear(k), rtol=0, atol=1e-15)
    assert not torch.allclose(tiny(smear_keys=True)(torch.arange(9)[None]), tiny()(torch.arange(9)[None]))


def test_rope_scores_depend_only_on_position_difference():
    torch.manual_seed(0)
    q, k = torch.randn(2, 16, dtype=torch.float64).unbind(0)

    def score(pq: int, pk: int) -> float:
        rq = apply_rope(q[None], torch.tensor([pq]), 10000.0)
        rk = apply_rope(k[None], torch.tensor([pk]), 10000.0)
        return float((rq * rk).sum())

    for delta in (0, 1, 5, 37):
        ref = score(delta, 0)
        for shift in (1, 100, 4000):
            assert score(shift + delta, shift) == pytest.approx(ref, abs=1e-9)
    assert score(5, 0) != pytest.approx(score(6, 0), abs=1e-6)


def test_rope_preserves_norm_and_position_zero_is_identity():
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    pos = torch.arange(7)
    torch.testing.assert_close(apply_rope(x, pos, 500.0).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(apply_rope(x[:, :1], pos[:1], 500.0), x[:, :1])


def test_forward_with_external_attention_equals_plain_forward():
    """Driving each block's attention from outside (as the KV engine does) reproduces forward()."""
    model = tiny(n_kv_head=2)
    idx = torch.randint(0, 50, (2, 11))
    pos = torch.arange(11)
    seen = []

    def attend(l, a, h):
        seen.append(l)
        q, k, v = a.project(h)
        return a.out(a.attend(a.rotate(q, pos), a.rotate(k, pos), v, mask=torch.ones(11, 11).tril().bool()))

    torch.testing.assert_close(model.forward_with(idx, pos, attend), model(idx), rtol=0, atol=1e-12)
    assert seen == list(range(model.cfg.n_layer))


def test_per_row_positions_equal_shared_positions():
    """forward_with at positions [B, T] (each row its own offset) equals each row alone at its offset."""
    model = tiny()
    idx = torch.randint(0, 50, (2, 7))
    pos = torch.stack([torch.arange(7) + 3, torch.arange(7) + 20])
    both = model.forward_with(idx, pos)
    for b in range(2):
        torch.testing.assert_close(both[b], model.forward_with(idx[b : b + 1], pos[b])[0], rtol=0, atol=1e-12)


def test_learned_positions_differ_from_rope_and_check_table_size():
    model = tiny(pos_emb="learned", block_size=16)
    assert model.wpe is not None and model.cfg.pos_emb is PosEmb.learned
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_head_is_tied_and_size_registry():
    small = to_objects(compose(["model=gpt_small"])).model
    tiny_cfg = to_objects(compose(["model=gpt_tiny"])).model
    small.vocab_size = tiny_cfg.vocab_size = 258
    m_small, m_tiny = GPT(small), GPT(tiny_cfg)
    assert m_small.lm_head.weight is m_small.wte.weight
    assert (small.n_layer, small.n_embd, small.n_head) == (4, 128, 4)
    assert 0.7e6 < m_small.num_params() < 1.3e6
    assert 35e3 < m_tiny.num_params() < 70e3


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"n_embd": 30, "n_head": 4}, "not divisible by model.n_head"),
        ({"n_head": 4, "n_kv_head": 3}, "not divisible by model.n_kv_head"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_embd": 36, "n_head": 4}, "even head_dim"),
    ],
)
def test_bad_model_config(kw, match):
    with pytest.raises(ConfigError, match=match):
        GPTConfig(vocab_size=10, **kw)


def test_loss_falls_in_a_few_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, n_layer=2, n_head=2, n_embd=32))
    data = torch.arange(64).remainder(7).view(4, 16)  # a repeating pattern
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        _, loss = model(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 2}, {"bias": True}])
def test_keys_projected_alone_equal_the_fused_projections_keys_bit_for_bit(kw):
    """The blocked path projects a key-scoring policy's keys one token at a time with `project_keys`,
    the token loop with `project`: their ties break alike only if the two agree bit for bit, on this
    machine's matmul kernels, at every batch size, and with SmolLM2's width (576 -> 960 fused)."""
    torch.manual_seed(0)
    models = [tiny(**kw).float()]  # (tiny is float64; the engine runs float32)
    models.append(GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=9, n_kv_head=3, n_embd=576)).eval())
    for model in models:
        a = model.blocks[0].attn
        with torch.no_grad():
            for B in (1, 2, 8, 64):
                x = torch.randn(B, 1, model.cfg.n_embd)
                assert torch.equal(a.project_keys(x), a.project(x)[1])
            x = torch.randn(2, 16, model.cfg.n_embd)  # and a block of positions, up to rounding
            torch.testing.assert_close(a.project_keys(x), a.project(x)[1])
