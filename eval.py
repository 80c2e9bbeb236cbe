"""
Acceptance length under real DFlash speculative decoding, batch 1 (DFLASH_SPEC §7, issue #9).

The authors' `dflash_generate` contract: the target prefills the prompt and picks the first token, the first
anchor. Each cycle the drafter fills a block [anchor, mask x (K-1)] from its cache of target features, the target
verifies all K tokens in one forward, the longest matching draft prefix plus the target's own next token (the bonus)
is committed, and both caches are cropped to the committed length. tau = tokens committed per verify cycle.

Greedy speculative decoding is lossless: its output must equal the target's plain greedy decoding token for token.
In fp32 a mismatch raises LosslessError. In bf16 a K-token verify and 1-token decoding round differently and flip
near-tie argmaxes (issue #9: 238 of 16,368 positions on SmolLM2), so there each divergence is reported with its
fp32 logit gap instead.

  python eval.py --target DIR --drafter CKPT --data prompts.jsonl [--max-new-tokens 256 --temperature 0
                 --block-size 16 --limit 32 --device cuda --dtype bfloat16 --out out/eval --workers 8]
  python eval.py --watch out/RUN --data prompts.jsonl [...]   # every checkpoint of a run, as training writes it
  python eval.py ... --train-data train.jsonl   # flag prompts that are training prompts; tau without them too
  python -m pytest -q tests/test_eval.py

Writes <out>/eval.json (tau, histogram, per-position acceptance, tokens/s, speedup, divergences, config) and
<out>/eval.png, prints one line. From Python (the trainer): evaluate(target, tokenizer, drafter, prompts) -> dict.
--workers N runs N processes on the one device, each loading its own target + drafter and taking every N-th prompt
(evaluate_parallel): the same results, faster, since batch-1 decoding leaves the GPU idle between kernel launches.
"""
import argparse
import copy
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from attention import NO_CUDNN


class LosslessError(RuntimeError):
    """Greedy speculative output differs from greedy target output in fp32: a bug, never a statistic."""


def features(hidden_states, layer_ids):
    """HF hidden_states (index 0 = embeddings) -> [B, T, nK*D]. Id k is the OUTPUT of decoder layer k, i.e.
    hidden_states[k+1] (spec §1.2, §8.1), concatenated in id order along features, as in training."""
    return torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)


def pick(logits, temperature, generator=None):
    """Argmax, or one sample at `temperature` per position (plain softmax: the reference's top_p=1, top_k=0)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def crop(cache, length):
    """Keep positions 0..length-1. Negative counts mean 'remove' in every transformers version; 5.24 rejects a
    positive absolute length and old versions read crop(0) as 'keep nothing', so never call it with 0."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def draft(drafter, target, block_1K, new_hidden_1TC, cache, start, temperature, generator):
    """One drafter call (spec §7.2-3) -> (draft tokens for block offsets 1..K-1 [1, K-1], cache of 0..start-1).
    A seam: tests replace it with an oracle or a saboteur to check the acceptance counting."""
    x_1KD = F.embedding(block_1K, target.get_input_embeddings().weight)  # raw rows, exactly as dflash_loss embeds
    h_1KD, cache = drafter.forward_cached(x_1KD, new_hidden_1TC, cache, start)
    logits = target.get_output_embeddings()(h_1KD[:, 1:])  # offset 0 is the clean anchor: its output is unused
    return pick(logits, temperature, generator), cache


def _stop(gen, eos, max_new):
    return len(gen) >= max_new or gen[-1] in eos


def _lap(times, key, t0, dev):
    """Add the time since t0 to times[key] (device synchronized) -> now. No-op without a times dict."""
    if times is None:
        return t0
    t1 = _clock(dev)
    times[key] = times.get(key, 0.0) + t1 - t0
    return t1


@torch.inference_mode()
@sdpa_kernel(NO_CUDNN)
def spec_decode(target, drafter, prompt_ids, max_new, block_size, eos, temperature=0.0, generator=None, times=None):
    """-> (new token ids, first token included, cut at the first EOS (kept) and at max_new; per cycle: tokens
    committed, drafts accepted before any cut, block size verified). block_size 1 = plain decoding, no drafter.
    times: a dict that gets seconds added under prefill / draft / verify / other (the device is synchronized at
    each phase's end; decoding at batch 1 waits on the host anyway)."""
    dev = target.device
    t = _clock(dev) if times is not None else 0.0
    ids = torch.tensor([prompt_ids], device=dev)
    use_drafter = block_size > 1
    out = target(input_ids=ids, use_cache=True, output_hidden_states=use_drafter, logits_to_keep=1)
    cache_t, cache_d = out.past_key_values, None
    gen = [int(pick(out.logits[:, -1], temperature, generator))]
    if use_drafter:  # the drafter's first context: features of prompt positions 0..n-1
        layer_ids, mask_id = drafter.cfg.target_layer_ids, drafter.cfg.mask_token_id
        new_hidden = features(out.hidden_states, layer_ids)
    t = _lap(times, "prefill", t, dev)
    start = ids.shape[1]  # position of the current anchor, gen[-1]; the target cache holds 0..start-1
    committed, accepted, verified = [], [], []
    while not _stop(gen, eos, max_new):
        K = min(block_size, max_new - len(gen) + 1)  # the reference shrinks the last block the same way
        block = torch.full((1, K), mask_id if use_drafter else 0, dtype=torch.long, device=dev)
        block[0, 0] = gen[-1]
        if K > 1:
            block[:, 1:], cache_d = draft(drafter, target, block, new_hidden, cache_d, start, temperature, generator)
            t = _lap(times, "draft", t, dev)
        out = target(input_ids=block, position_ids=torch.arange(start, start + K, device=dev)[None],
                     past_key_values=cache_t, use_cache=True, output_hidden_states=K > 1)
        # posterior[k] = the target's token after block position k; at temperature > 0 an independent target
        # sample compared by token equality, as the reference does (spec §7), not a probability-ratio test
        blk, post = torch.stack([block[0], pick(out.logits[0], temperature, generator)]).tolist()  # one sync
        t = _lap(times, "verify", t, dev)
        a = 0
        while a < K - 1 and blk[a + 1] == post[a]:
            a += 1
        new = blk[1:a + 1] + [post[a]]  # accepted drafts + bonus
        take = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        take = min(take, max_new - len(gen))
        gen += new[:take]
        committed.append(take)
        accepted.append(a)
        verified.append(K)
        start += take
        crop(cache_t, start)  # block positions 0..a stay (their K/V is exact); the bonus has none yet
        if K > 1:  # new drafter context: target features of block positions 0..a (never the bonus, spec §7.5)
            new_hidden = features(out.hidden_states, layer_ids)[:, :take]
        t = _lap(times, "other", t, dev)  # acceptance, cache crop, the next context
    return gen, committed, accepted, verified


@torch.inference_mode()
@sdpa_kernel(NO_CUDNN)
def plain_decode(target, prompt_ids, max_new, eos, temperature=0.0, generator=None, times=None):
    """The target alone, one token per forward over its KV cache: the baseline for speed and for losslessness.
    times: seconds added under plain_prefill / plain_step (each step ends in a host sync already: int())."""
    t = _clock(target.device) if times is not None else 0.0
    out = target(input_ids=torch.tensor([prompt_ids], device=target.device), use_cache=True, logits_to_keep=1)
    gen = [int(pick(out.logits[:, -1], temperature, generator))]
    t = _lap(times, "plain_prefill", t, target.device)
    while not _stop(gen, eos, max_new):
        out = target(input_ids=torch.tensor([gen[-1:]], device=target.device), past_key_values=out.past_key_values,
                     use_cache=True)
        gen.append(int(pick(out.logits[:, -1], temperature, generator)))
    _lap(times, "plain_step", t, target.device)
    return gen


@torch.inference_mode()
def fp32_gap(ref, seq, spec_tok, plain_tok):
    """fp32 logits after `seq`: top-1 minus each of the two competing tokens (a near-tie shows as a small gap)."""
    logits = ref(input_ids=torch.tensor([seq], device=ref.device)).logits[0, -1].float()
    top = logits.max()
    return dict(fp32_top1=int(logits.argmax()), gap_spec=float(top - logits[spec_tok]),
                gap_plain=float(top - logits[plain_tok]))


def render(tokenizer, messages):
    """Chat messages -> prompt ids, rendered as data.py renders training data (template, no extra specials)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer, target):
    """The tokenizer's EOS plus the generation config's (Qwen3 instruct lists two)."""
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


def _clock(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def evaluate(target, tokenizer, drafter, prompts, max_new_tokens=256, temperature=0.0, block_size=None,
             check_lossless=True, eos_ids=None, seed=0, warmup=True, indices=None):
    """Speculative decoding over `prompts` (chat message lists, or token-id lists) -> results dict.
    check_lossless: also run plain target decoding, for the speedup and, at temperature 0, the token-for-token
    check (fp32: LosslessError; other dtypes: divergences with fp32 logit gaps). block_size: default the drafter's;
    smaller serves well (a b16 drafter at b8), larger is allowed but was not trained for (spec §8.15).
    indices: each prompt's global index (default 0, 1, ...). It seeds the prompt's sampler and names the prompt in
    divergences and errors, so a worker given prompts k::N decodes them exactly as one process would."""
    K = block_size or (drafter.cfg.block_size if drafter is not None else 1)
    eos = set(eos_ids) if eos_ids is not None else stop_ids(tokenizer, target)
    prompts = [p if p and isinstance(p[0], int) else render(tokenizer, p) for p in prompts]
    indices = list(range(len(prompts)) if indices is None else indices)
    dev, dtype = target.device, next(target.parameters()).dtype
    gen = lambda i: torch.Generator(device=dev).manual_seed(seed + i)  # per prompt: order-independent samples
    if warmup:  # first calls pay allocator/kernel set-up; keep them off the clock
        spec_decode(target, drafter, prompts[0], min(max_new_tokens, 2 * K), K, eos, temperature, gen(0))
        plain_decode(target, prompts[0], min(max_new_tokens, 2 * K), eos, temperature, gen(0))
    per_prompt, divergences, ref = [], [], None
    t_spec = t_plain = 0.0
    n_spec = n_plain = 0
    hist, acc_k, seen_k = [0] * K, [0] * K, [0] * K
    times = dict.fromkeys(TIME_KEYS, 0.0)
    for i, p in zip(indices, prompts):
        t0 = _clock(dev)
        out, committed, accepted, verified = spec_decode(target, drafter, p, max_new_tokens, K, eos, temperature,
                                                         gen(i), times)
        t_spec += _clock(dev) - t0
        n_spec += len(out)
        for c, a, k in zip(committed, accepted, verified):
            hist[c - 1] += 1
            for j in range(1, k):  # offset j was verified in this cycle; accepted iff all drafts up to j matched
                seen_k[j] += 1
                acc_k[j] += a >= j
        per_prompt.append(dict(prompt_tokens=len(p), new_tokens=len(out), cycles=len(committed),
                               tau=sum(committed) / max(len(committed), 1), committed=committed))
        if not check_lossless:
            continue
        t0 = _clock(dev)
        base = plain_decode(target, p, max_new_tokens, eos, temperature, gen(i), times)
        t_plain += _clock(dev) - t0
        n_plain += len(base)
        if temperature > 0 or out == base:
            continue
        # only the first divergence of a prompt is meaningful: after it the two texts differ
        j = next((j for j, (s, b) in enumerate(zip(out, base)) if s != b), min(len(out), len(base)))
        if j == min(len(out), len(base)):  # cannot happen: both stop at the same EOS / limit
            raise LosslessError(f"prompt {i}: lengths differ ({len(out)} vs {len(base)}) without a token mismatch")
        if ref is None:
            ref = target if dtype == torch.float32 else copy.deepcopy(target).float()
        d = dict(prompt=i, position=j, spec_token=out[j], plain_token=base[j], **fp32_gap(ref, p + out[:j],
                                                                                          out[j], base[j]))
        if dtype == torch.float32:
            raise LosslessError(f"not lossless: prompt {i}, new token {j}: speculative {out[j]} vs greedy {base[j]}"
                                f" (fp32 top-1 {d['fp32_top1']}, gaps {d['gap_spec']:.3g} / {d['gap_plain']:.3g})")
        divergences.append(d)
    config = dict(block_size=K, drafter_block_size=drafter.cfg.block_size if drafter is not None else None,
                  max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, prompts=len(prompts),
                  dtype=str(dtype).removeprefix("torch."), device=str(dev), eos=sorted(eos),
                  target_layer_ids=drafter.cfg.target_layer_ids if drafter is not None else None,
                  mask_token_id=drafter.cfg.mask_token_id if drafter is not None else None)
    return _results(per_prompt, hist, acc_k[1:], seen_k[1:], n_spec, t_spec, n_plain, t_plain, divergences,
                    check_lossless and temperature == 0, config, times)


TIME_KEYS = ("prefill", "draft", "verify", "other", "plain_prefill", "plain_step")


def _results(per_prompt, hist, acc, seen, n_spec, t_spec, n_plain, t_plain, divergences, checked, config, times):
    """Raw counts -> the results dict. evaluate() and _merge() both build it here, so the figures merged from N
    workers' counts are computed exactly as one process computes them."""
    spec_tps = n_spec / t_spec
    plain_tps = n_plain / t_plain if t_plain else None  # no baseline: no time spent on it
    return dict(
        # tau: the authors' "Average Acceptance length" (per-prompt mean, then mean over prompts);
        # tau_pooled: committed tokens / verify cycles over all prompts (long answers weigh more)
        tau=sum(r["tau"] for r in per_prompt) / len(per_prompt),
        tau_pooled=sum(sum(r["committed"]) for r in per_prompt) / max(sum(hist), 1),
        cycles=sum(hist), new_tokens=n_spec,
        accept_hist=hist,  # accept_hist[L-1] = cycles that committed L tokens (cut at EOS/limit, as the reference)
        pos_accept=[a / max(s, 1) for a, s in zip(acc, seen)],  # P(draft at offset j accepted), j=1..K-1
        pos_accept_counts=acc, pos_seen_counts=seen,  # the raw counts behind pos_accept, for merging
        spec_tok_s=spec_tps, plain_tok_s=plain_tps, speedup=spec_tps / plain_tps if plain_tps else None,
        spec_s=t_spec, plain_s=t_plain, plain_tokens=n_plain,
        time_s=times,  # where the seconds went: spec_s = prefill + draft + verify + other, plain_s = the plain_* two
        lossless=(not divergences) if checked else None, divergences=divergences,
        config=config,
        per_prompt=per_prompt,
    )


def _merge(parts):
    """Results of N workers, worker k having decoded prompts k, k+N, ... -> one results dict, in prompt order."""
    n, total = len(parts), sum(len(r["per_prompt"]) for r in parts)
    add = lambda key: [sum(x) for x in zip(*(r[key] for r in parts))]  # element-wise over workers
    tot = lambda key: sum(r[key] for r in parts)
    return _results([parts[i % n]["per_prompt"][i // n] for i in range(total)], add("accept_hist"),
                    add("pos_accept_counts"), add("pos_seen_counts"), tot("new_tokens"), tot("spec_s"),
                    tot("plain_tokens"), tot("plain_s"),
                    sorted((d for r in parts for d in r["divergences"]), key=lambda d: d["prompt"]),
                    parts[0]["lossless"] is not None, dict(parts[0]["config"], prompts=total, workers=n),
                    {k: sum(r["time_s"][k] for r in parts) for k in TIME_KEYS})


def _worker(k, n, target_path, drafter_path, prompts, device, dtype, kw, out_dir):
    """Worker k of n: load its own target and drafter, decode prompts k::n, write its results to out_dir/k.json."""
    from data import load_target
    from model import load_drafter
    if torch.device(device).type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    target, tok = load_target(target_path, device, dtype)
    drafter = load_drafter(drafter_path, device, next(target.parameters()).dtype) if drafter_path else None
    t0 = time.time()  # wall clock, comparable across processes: the decoding phase spans all workers' intervals
    res = evaluate(target, tok, drafter, prompts[k::n], indices=range(k, len(prompts), n), **kw)
    with open(os.path.join(out_dir, f"{k}.json"), "w") as f:
        json.dump(dict(res=res, t=[t0, time.time()]), f)


def evaluate_parallel(target_path, drafter_path, prompts, workers, device="cpu", dtype=None, **kw):
    """evaluate() split over `workers` processes on one device (batch-1 decoding of a small target is launch-bound:
    one process leaves the GPU mostly idle). Worker k loads its own target and drafter (drafter_path None: block 1
    only) and takes prompts k, k+N, ... (long and short ones spread); kw go to evaluate(). Tau, histograms, per-prompt
    results, divergences and losslessness equal a one-process run's exactly, greedy or sampled (seeds follow the
    global prompt index). Speeds: spec_tok_s / plain_tok_s pool each worker's own tokens and seconds, i.e. the speed
    of one stream, measured under contention (N processes share the GPU and the CPU), so the clean speedup is the
    one-process one; aggregate_spec_tok_s = all speculative tokens / wall time of the decoding phase (the plain
    baseline runs in it too, unless check_lossless=False); wall_s includes process start-up and loading.
    A failing worker (a LosslessError included, which keeps its type) fails the whole call, never a partial result."""
    n, t0 = min(workers, len(prompts)), time.time()
    if str(target_path).endswith(".gguf"):  # convert once, here: N workers converting into one folder would race
        from data import convert_gguf, default_cache_dir
        name = os.path.basename(target_path).split(".")[0].lower()  # the folder load_target would convert into
        target_path = convert_gguf(target_path, default_cache_dir() / name)
    with tempfile.TemporaryDirectory() as tmp:
        try:  # spawn, not fork: CUDA does not survive a fork. join=True raises once a worker fails, ending the rest
            torch.multiprocessing.spawn(_worker, args=(n, target_path, drafter_path, prompts, device, dtype, kw, tmp),
                                        nprocs=n)
        except torch.multiprocessing.ProcessRaisedException as e:  # the worker's exception arrives as its traceback
            raise (LosslessError if "LosslessError: " in str(e) else RuntimeError)(str(e).strip()) from None
        parts = []
        for k in range(n):
            with open(os.path.join(tmp, f"{k}.json")) as f:
                parts.append(json.load(f))
    res = _merge([p["res"] for p in parts])
    phase = max(p["t"][1] for p in parts) - min(p["t"][0] for p in parts)
    res.update(wall_s=time.time() - t0, aggregate_spec_tok_s=res["new_tokens"] / phase)
    return res


def mark_seen(res, prompts, keys):
    """Flag each prompt that is, as text, a prompt of the training data (data.training_prompt_keys), and add tau
    over the unseen ones: a held-out set split by conversation can still repeat training prompts verbatim."""
    from data import prompt_key
    seen = [prompt_key(p) in keys for p in prompts]
    for r, s in zip(res["per_prompt"], seen):
        r["seen_in_training"] = s
    unseen = [r for r, s in zip(res["per_prompt"], seen) if not s]
    res["seen_in_training"] = sum(seen)
    if unseen:
        res["tau_unseen"] = sum(r["tau"] for r in unseen) / len(unseen)
        res["tau_pooled_unseen"] = sum(sum(r["committed"]) for r in unseen) / max(sum(r["cycles"] for r in unseen), 1)
    return res


def summary(res):
    c = res["config"]
    s = (f"eval: tau={res['tau']:.3f} (pooled {res['tau_pooled']:.3f}) K={c['block_size']} prompts={c['prompts']} "
         f"cycles={res['cycles']} spec={res['spec_tok_s']:.1f} tok/s")
    if res["speedup"] is not None:
        s += f" greedy={res['plain_tok_s']:.1f} tok/s speedup={res['speedup']:.2f}x"
    s += f" lossless={res['lossless']} divergences={len(res['divergences'])} dtype={c['dtype']}"
    if c.get("workers", 1) > 1:
        s += f" workers={c['workers']} (aggregate spec {res['aggregate_spec_tok_s']:.1f} tok/s)"
    t, ms = res["time_s"], lambda x, n: f"{1e3 * x / max(n, 1):.2f}"
    s += (f"\n  per verify cycle: draft {ms(t['draft'], res['cycles'])} ms, verify {ms(t['verify'], res['cycles'])} ms,"
          f" other {ms(t['other'], res['cycles'])} ms")
    steps = res["plain_tokens"] - len(res["per_prompt"])  # the first token of each prompt comes from the prefill
    if res["plain_tokens"]:
        s += f"; plain decoding: {ms(t['plain_step'], steps)} ms per token"
    if res.get("seen_in_training"):
        s += (f"\n  WARNING: {res['seen_in_training']} of {c['prompts']} prompts are, as text, training prompts; "
              + (f"on the other {c['prompts'] - res['seen_in_training']}: tau={res['tau_unseen']:.3f} "
                 f"(pooled {res['tau_pooled_unseen']:.3f})" if "tau_unseen" in res else "no unseen prompt"))
    return s


def write_results(res, out_dir):
    """eval.json + eval.png (histogram of tokens per cycle | per-offset acceptance). -> (json path, png path)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders headless (Agg)
    os.makedirs(out_dir, exist_ok=True)
    jpath, ppath = os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "eval.png")
    with open(jpath, "w") as f:
        json.dump(res, f, indent=1)
    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    K, cycles = len(res["accept_hist"]), max(res["cycles"], 1)
    ax1.bar(range(1, K + 1), [h / cycles for h in res["accept_hist"]])
    ax1.set(xlabel="tokens committed per verify cycle", ylabel="fraction of cycles",
            title=f"tau {res['tau']:.2f} (pooled {res['tau_pooled']:.2f}), block {K}")
    ax2.plot(range(1, K), res["pos_accept"], marker="o")
    ax2.set(xlabel="block offset", ylabel="P(draft accepted)", ylim=(0, 1.02), title="per-position acceptance")
    fig.tight_layout()
    fig.savefig(ppath, dpi=120)
    return jpath, ppath


def _step(name):
    return 0 if name == "init" else int(name[5:])


def watch(run_dir, out_dir, evaluate_ckpt, poll=30.0, once=False):
    """Held-out tau every ckpt_every steps, in any topology: evaluate each checkpoint of a training run as it
    appears (`init`, the untrained drafter, as step 0), oldest first, alongside training (another GPU, or the
    same one) or after it, until train.py has written done.json and every checkpoint is done. Resumable: what
    out_dir/tau.jsonl already holds is skipped. A checkpoint pruned (keep_ckpts) before it was read is counted and
    reported. evaluate_ckpt(path) -> results dict. Writes out_dir/<ckpt>/eval.{json,png}, tau.jsonl, tau.png."""
    from train import list_ckpts
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "tau.jsonl")
    rows = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
    done, pruned = {r["ckpt"] for r in rows}, []
    while True:
        finished = os.path.exists(os.path.join(run_dir, "done.json"))  # before listing: its checkpoints are there
        names = (["init"] if os.path.isdir(os.path.join(run_dir, "init")) else []) + list_ckpts(run_dir)
        for name in [n for n in names if n not in done and n not in pruned]:
            path = os.path.join(run_dir, name)
            try:
                res = evaluate_ckpt(path)
            except LosslessError:
                raise
            except (OSError, RuntimeError):
                if os.path.isdir(path):
                    raise
                pruned.append(name)
                print(f"watch: {name} was pruned before it could be evaluated (keep_ckpts)", flush=True)
                continue
            write_results(res, os.path.join(out_dir, name))
            row = dict(ckpt=name, step=_step(name), tau=res["tau"], tau_pooled=res["tau_pooled"],
                       speedup=res["speedup"], lossless=res["lossless"], divergences=len(res["divergences"]),
                       seen_in_training=res.get("seen_in_training"))
            with open(log, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            done.add(name)
            _plot_tau(rows, os.path.join(out_dir, "tau.png"))
            print(f"watch: step {row['step']}: {summary(res)}", flush=True)
        if finished or once:
            break
        time.sleep(poll)
    print(f"watch: {len(rows)} checkpoints evaluated" + (f", {len(pruned)} pruned unread: {pruned}" if pruned else "")
          + f"; {log}", flush=True)
    return rows, pruned


def _plot_tau(rows, path):
    from matplotlib.figure import Figure
    rows = sorted(rows, key=lambda r: r["step"])
    fig = Figure(figsize=(6, 3.8))
    ax = fig.subplots()
    for key in ("tau", "tau_pooled"):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label=key)
    ax.set(xlabel="training step", ylabel="acceptance length", title="held-out tau by checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_prompts(path, limit=None):
    """JSONL/JSON conversations -> message lists without a final assistant turn (that is what we generate)."""
    from data import read_conversations
    convs, _ = read_conversations(path, require_assistant=False)
    convs = [c[:-1] if c[-1]["role"] == "assistant" else c for c in convs]
    return convs[:limit]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="HF folder (or SmolLM2 .gguf) of the target; with --watch: the run's")
    p.add_argument("--drafter", default=None, help="drafter checkpoint dir (ours or released); none: block 1 only")
    p.add_argument("--watch", default=None, help="a train.py run directory: evaluate every checkpoint as it appears")
    p.add_argument("--poll", type=float, default=30.0, help="--watch: seconds between looks for new checkpoints")
    p.add_argument("--once", action="store_true", help="--watch: evaluate what is there now, then stop")
    p.add_argument("--train-data", default=None, help="flag prompts that are, as text, prompts of this training "
                   "file, and report tau without them (default with --watch: the run's data, if it is there)")
    p.add_argument("--data", required=True, help="JSONL of conversations; the final assistant turn is dropped")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu (the exact losslessness check needs float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding (no speedup, no lossless check)")
    p.add_argument("--out", default=None, help="default: out/eval; with --watch: RUN/eval")
    p.add_argument("--workers", type=int, default=1,
                   help="processes sharing the device, worker k taking prompts k, k+N, ... (tok/s then per stream)")
    a = p.parse_args(argv)
    if a.watch:
        cfg_path = os.path.join(a.watch, "config.json")
        if not os.path.exists(cfg_path):
            p.error(f"--watch {a.watch}: no config.json, not a train.py run directory")
        if a.drafter:
            p.error("--watch evaluates the run's checkpoints: drop --drafter")
        run_cfg = json.load(open(cfg_path))["train"]
        a.target = a.target or run_cfg["target"]
        if a.train_data is None and os.path.exists(run_cfg["data"]):
            a.train_data = run_cfg["data"]
    if a.target is None:
        p.error("--target is required")
    if a.drafter is None and (a.block_size or 1) != 1 and not a.watch:
        p.error("--block-size > 1 needs --drafter")
    if a.workers < 1:
        p.error("--workers must be >= 1")
    prompts = read_prompts(a.data, a.limit)
    keys = None
    if a.train_data:
        from data import training_prompt_keys
        keys = training_prompt_keys(a.train_data)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    kw = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, block_size=a.block_size,
              check_lossless=not a.no_baseline, seed=a.seed)
    loaded = {}

    def run(drafter_path):
        if a.workers > 1:
            res = evaluate_parallel(a.target, drafter_path, prompts, a.workers, a.device, dtype, **kw)
        else:
            from data import load_target
            from model import load_drafter
            if not loaded:  # one target for every checkpoint of a watch
                loaded["target"], loaded["tok"] = load_target(a.target, a.device, dtype)
            target = loaded["target"]
            drafter = load_drafter(drafter_path, a.device, next(target.parameters()).dtype) if drafter_path else None
            res = evaluate(target, loaded["tok"], drafter, prompts, **kw)
        res["config"].update(target=str(a.target), drafter=drafter_path, data=a.data, train_data=a.train_data)
        res["config"].setdefault("workers", 1)
        return mark_seen(res, prompts, keys) if keys is not None else res

    if a.watch:
        return watch(a.watch, a.out or os.path.join(a.watch, "eval"), run, a.poll, a.once)
    res = run(a.drafter)
    write_results(res, a.out or "out/eval")
    print(summary(res))
    return res


if __name__ == "__main__":
    main()
