"""What eval.py's decodes amount to: tau and the engines' counts, the confidence head's
calibration, bootstrap intervals, the macro mean over sets, paired comparison of runs
(`eval.py --compare`), the printed summaries and the eval.json / eval.png / tau.png files.
Nothing here decodes or loads a model."""
import json
import os
import statistics

import torch

TIME_KEYS = ("prefill", "draft", "verify", "other", "plain_prefill", "plain_step")


def calibration_sums(confs, lengths):
    """A prompt's cycles -> per offset j = 1..K-1 the sums of the predicted prefix acceptance (the
    confidence head's probabilities multiplied up to j, what the engines plan with) and of its
    squared error against the realized one (1 if the cycle accepted offset j, so the whole prefix
    up to it; DeepSpec's calibration); {} without a confidence head."""
    if not confs or confs[0] is None:
        return {}
    pred, sq = [0.0] * len(confs[0]), [0.0] * len(confs[0])
    for conf, n in zip(confs, lengths):
        run = 1.0
        for j, c in enumerate(conf):
            run *= c
            pred[j] += run
            sq[j] += (run - (n > j + 1)) ** 2
    return dict(conf_pred=pred, conf_sq_err=sq)


def calibration(per_prompt, pos_accept, cycles):
    """Predicted vs realized acceptance of each offset's prefix over all cycles, with the Brier
    score; None without a confidence head."""
    if not per_prompt or "conf_pred" not in per_prompt[0]:
        return None
    def mean(key):  # over all cycles, per offset
        return [sum(x) / max(cycles, 1) for x in zip(*(r[key] for r in per_prompt))]
    return dict(predicted=mean("conf_pred"), realized=pos_accept, brier=mean("conf_sq_err"))


def merge(parts):
    """Results (or evaluate()'s counts) of N workers, worker k having decoded prompts k, k+N, ... -> one results dict,
    in prompt order. evaluate() builds its own here too, so N workers' figures are exactly one process's."""
    n, total = len(parts), sum(len(r["per_prompt"]) for r in parts)
    per_prompt = [parts[i % n]["per_prompt"][i // n] for i in range(total)]
    divergences = sorted((d for r in parts for d in r["divergences"]), key=lambda d: d["prompt"])
    K, lengths = parts[0]["config"]["block_size"], [n for r in per_prompt for n in r["lengths"]]  # per verify cycle
    # accept_hist[L-1]: cycles that accepted L-1 drafts; offset j is accepted iff all drafts up to j matched
    c = dict(accept_hist=[lengths.count(L) for L in range(1, K + 1)],
             pos_accept_counts=[sum(n > j for n in lengths) for j in range(1, K)],
             pos_seen_counts=[len(lengths)] * (K - 1))
    c.update({k: sum(r[k] for r in parts) for k in ("new_tokens", "spec_s", "plain_tokens", "plain_s")})
    c["time_s"] = {k: sum(r["time_s"][k] for r in parts) for k in TIME_KEYS}
    pos_accept = [a / max(s, 1)  # offsets 1..K-1
                  for a, s in zip(c["pos_accept_counts"], c["pos_seen_counts"])]
    spec_tps = c["new_tokens"] / c["spec_s"]
    plain_tps = c["plain_tokens"] / c["plain_s"] if c["plain_s"] else None  # no baseline: no time spent on it
    return dict(  # tau: the authors' "Average Acceptance length" (the papers' figure), then the other counts
        tau_figures(per_prompt), **engine_figures(per_prompt, K), cycles=sum(c["accept_hist"]),
        pos_accept=pos_accept, confidence=calibration(per_prompt, pos_accept, len(lengths)),
        spec_tok_s=spec_tps, plain_tok_s=plain_tps, speedup=spec_tps / plain_tps if plain_tps else None, **c,
        lossless=(not divergences) if parts[0]["lossless"] is not None else None, divergences=divergences,
        variants=merge_variants(parts, K, len(lengths), plain_tps),
        config=dict(parts[0]["config"], prompts=total, workers=n), per_prompt=per_prompt)


def merge_variants(parts, K, fixed_cycles, plain_tps):
    """Each variant's counts (eval.variants: another verification rule, or an adaptive verify
    length) of N workers -> its figures beside the main ones: tau with its interval, cycles,
    per-offset acceptance, speed; with an adaptive length, the target tokens its verify forwards
    took against the fixed length's (fixed_cycles of the main decode x K)."""
    out = {}
    for name in parts[0].get("variants", {}):
        vs = [r["variants"][name] for r in parts]
        n, total = len(vs), sum(len(v["per_prompt"]) for v in vs)
        per_prompt = [vs[i % n]["per_prompt"][i // n] for i in range(total)]
        lengths = [x for r in per_prompt for x in r["lengths"]]
        new_tokens, spec_s = (sum(v[k] for v in vs) for k in ("new_tokens", "spec_s"))
        f = dict(tau_figures(per_prompt), rule=vs[0]["rule"], adaptive=vs[0].get("adaptive"),
                 cycles=len(lengths), new_tokens=new_tokens, spec_s=spec_s,
                 pos_accept=[sum(x > j for x in lengths) / max(len(lengths), 1) for j in range(1, K)],
                 spec_tok_s=new_tokens / spec_s if spec_s else None,
                 divergences=sorted((d for v in vs for d in v["divergences"]), key=lambda d: d["prompt"]))
        f["speedup"] = f["spec_tok_s"] / plain_tps if plain_tps and f["spec_tok_s"] else None
        if f["adaptive"] is not None:
            verified = sum(x for r in per_prompt for x in r["verified"])
            f.update(verified_per_cycle=verified / max(len(lengths), 1), target_tokens_verified=verified,
                     fixed_target_tokens_verified=fixed_cycles * K,
                     target_tokens_saved=fixed_cycles * K - verified)
        out[name] = dict(f, per_prompt=per_prompt)
    return out


def tau_figures(per_prompt, suffix=""):
    """tau: the authors' count (accepted + 1 every cycle), the mean of per-prompt means, with a bootstrap 95% interval
    over prompts (2,000 resamples, seeded); tau_committed: only the tokens that end up in the output, over the cycles
    that gave any (no credit past EOS or max_new). _pooled: over all cycles of all prompts instead of per prompt."""
    n, pooled = max(len(per_prompt), 1), lambda xs: sum(map(sum, xs)) / max(sum(map(len, xs)), 1)
    boot = bootstrap_means([r["tau"] for r in per_prompt], torch.Generator().manual_seed(0))
    return {f"tau{suffix}": sum(r["tau"] for r in per_prompt) / n, f"tau_ci95{suffix}": ci95(boot),
            f"tau_pooled{suffix}": pooled([r["lengths"] for r in per_prompt]),
            f"tau_committed{suffix}": sum(r["tau_committed"] for r in per_prompt) / n,
            f"tau_committed_pooled{suffix}": pooled([[x for x in r["committed"] if x] for r in per_prompt])}


def bootstrap_means(values, generator, n=2000):
    """n means of len(values) draws with replacement, a float64 tensor [n] (no values: as [0.0])."""
    x = torch.tensor([float(v) for v in values] or [0.0], dtype=torch.float64)
    return x[torch.randint(len(x), (n, len(x)), generator=generator)].mean(1)


def ci95(boot):
    return boot.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()


def engine_figures(per_prompt, K):
    """What SGLang and vLLM would print for the same decode (the same drafts, the same verify).
    Both stop a request once its output holds an EOS or max_new tokens, so they run exactly the
    cycles that committed a token here (the authors' loop runs one more after a first token that is
    EOS, or with exactly max_new tokens out), and both count a cycle's drafts as its verify accepted
    them, before the output is cut at EOS / max_new.
    tau_sglang: SGLang's per-request meta_info["spec_accept_length"], completion_tokens /
      spec_verify_ct (the cut output, the prefill's first token included), averaged over requests
      as z-lab/dflash dflash/benchmark.py (44947fb, --backend sglang) averages it; a request with no
      verify cycle has no such field and is left out. Read in sglang 0.5.23 (the PyPI wheel):
      srt/managers/tokenizer_manager.py _calculate_spec_decoding_metrics and
      srt/managers/scheduler_components/batch_result_processor.py _resolve_spec_v2_tokens.
    tau_vllm: vLLM's "Mean acceptance length", 1 + accepted / drafts pooled over every cycle of
      every request: vllm-project/vllm vllm/v1/spec_decode/metrics.py at ee4ceaa
      (SpecDecodingLogging.log), the counts from vllm/v1/core/sched/scheduler.py at b4622cf
      (update_from_output: accepted = len(sampled) - 1, before the stop check). SGLang's server log
      "accept len" and its sglang:spec_accept_length gauge count the same way over their window,
      (correct drafts + 1) per verify (sglang 0.5.23 scheduler_components/metrics_reporter.py).
    vllm_pos_accept: vLLM's per-position acceptance rate, cycles that accepted offset j / drafts,
    j = 1..K-1; vllm_draft_accept_rate: accepted / drafted tokens, K-1 drafted a cycle (DFlash's
    num_speculative_tokens)."""
    runs = [[n for n, c in zip(r["lengths"], r["committed"]) if c] for r in per_prompt]
    cycles = [n for run in runs for n in run]  # the cycles the engines run, accepted + 1 each
    if not cycles or K < 2:  # nothing drafted: neither engine prints a figure
        return dict.fromkeys(["tau_sglang", "tau_vllm", "vllm_pos_accept",
                              "vllm_draft_accept_rate"])
    sglang = [r["new_tokens"] / len(run) for r, run in zip(per_prompt, runs) if run]
    accepted = sum(n - 1 for n in cycles)
    return dict(tau_sglang=sum(sglang) / len(sglang), tau_vllm=1 + accepted / len(cycles),
                vllm_pos_accept=[sum(n > j for n in cycles) / len(cycles) for j in range(1, K)],
                vllm_draft_accept_rate=accepted / (len(cycles) * (K - 1)))


def summary(res):
    c, t, ms = res["config"], res["time_s"], lambda x, n: f"{1e3 * x / max(n, 1):.2f}"
    lo, hi = res["tau_ci95"]
    s = (f"eval: tau={res['tau']:.3f} [95% CI {lo:.3f}-{hi:.3f}] (pooled {res['tau_pooled']:.3f}; committed tokens "
         f"only: {res['tau_committed']:.3f}, pooled {res['tau_committed_pooled']:.3f}) K={c['block_size']} "
         f"prompts={c['prompts']} cycles={res['cycles']} spec={res['spec_tok_s']:.1f} tok/s")
    if res["speedup"] is not None:
        s += f" greedy={res['plain_tok_s']:.1f} tok/s speedup={res['speedup']:.2f}x"
    s += f" lossless={res['lossless']} divergences={len(res['divergences'])} dtype={c['dtype']}"
    if c.get("workers", 1) > 1:
        s += f" workers={c['workers']} (aggregate spec {res['aggregate_spec_tok_s']:.1f} tok/s)"
    if res.get("tau_vllm") is not None:  # this decode as the engines would log it (engine_figures)
        s += (f"\n  as engines print it: SGLang spec_accept_length {res['tau_sglang']:.3f}, "
              f"vLLM mean acceptance length {res['tau_vllm']:.3f} "
              f"(draft acceptance rate {res['vllm_draft_accept_rate']:.3f})")
    if res.get("confidence"):  # the confidence head: predicted vs realized prefix acceptance
        cal = res["confidence"]
        pairs = enumerate(zip(cal["predicted"], cal["realized"]), 1)
        s += "\n  confidence head, predicted/realized prefix acceptance by offset: " + ", ".join(
            f"{j}: {p:.2f}/{r:.2f}" for j, (p, r) in pairs)
    s += "\n  per verify cycle: " + ", ".join(f"{k} {ms(t[k], res['cycles'])} ms" for k in ("draft", "verify", "other"))
    if res["plain_tokens"]:  # the first token of each prompt comes from the prefill
        s += f"; plain decoding: {ms(t['plain_step'], res['plain_tokens'] - len(res['per_prompt']))} ms per token"
    if res.get("seen_in_training"):
        s += (f"\n  WARNING: {res['seen_in_training']} of {c['prompts']} prompts are, as text, training prompts; "
              + (f"on the other {c['prompts'] - res['seen_in_training']}: tau={res['tau_unseen']:.3f} "
                 f"(pooled {res['tau_pooled_unseen']:.3f})" if "tau_unseen" in res else "no unseen prompt"))
    s += "".join(f"\n  {line}" for line in variant_lines(res, c.get("verify")))
    return s + "".join(f"\n  {line}" for line in verdict(res))


RULE_WORDS = {
    "greedy": "greedy",
    "match": "token matching (the authors' loop: sampled drafts, an independent target sample compared)",
    "ratio": "ratio test as vLLM and SGLang verify (greedy drafts, q one-hot)",
    "ratio_sampled": "ratio test with sampled drafts (q the drafter's distribution)"}


def variant_lines(res, main_rule=None):
    """One line per other decode of the same prompts (eval.variants): its verification rule's tau,
    or the adaptive verify length's tau and the target tokens it saved."""
    rules = [v for v in (res.get("variants") or {}).values() if v.get("adaptive") is None]
    lines = [f"verified by {RULE_WORDS[main_rule]}: tau above"] if rules and main_rule else []
    for name, v in (res.get("variants") or {}).items():
        lo, hi = v["tau_ci95"]
        speed = f", speedup {v['speedup']:.2f}x" if v.get("speedup") is not None else ""
        if v.get("adaptive") is None:
            lines.append(f"verified by {RULE_WORDS[v['rule']]}: tau={v['tau']:.3f} [95% CI {lo:.3f}-{hi:.3f}]{speed}")
            continue
        K = res["config"]["block_size"]
        lines.append(
            f"adaptive verify length (confidence head's prefix acceptance >= {v['adaptive']}): tau={v['tau']:.3f} "
            f"[95% CI {lo:.3f}-{hi:.3f}] against {res['tau']:.3f} at the fixed length {K}; "
            f"{v['verified_per_cycle']:.2f} tokens verified per cycle against {K}; target tokens verified "
            f"{v['target_tokens_verified']} against {v['fixed_target_tokens_verified']} "
            f"(saved {v['target_tokens_saved']}, {v['target_tokens_saved'] / max(v['fixed_target_tokens_verified'], 1):.0%})"
            f"{speed}")
    return lines


def verdict(res):
    """What `lossless` and `speedup` mean for this run, in words a user can act on."""
    c, lines = res["config"], []
    K, dtype = c["block_size"], c["dtype"]
    if res["lossless"] is False:
        first = {}  # prompt -> its first diverging new token
        for d in res["divergences"]:
            first[d["prompt"]] = min(d["position"], first.get(d["prompt"], d["position"]))
        lines.append(
            f"lossless False: {len(first)} of {c['prompts']} prompts diverged from plain greedy decoding, after a "
            f"median of {statistics.median(first.values()):g} identical new tokens. In {dtype} a {K}-token verify "
            "forward rounds differently from one-token steps, so a near-tie of the target's top two can flip; "
            "in float32 the output is checked equal and a divergence is an error.")
    elif res["lossless"] is None and c.get("temperature", 0) > 0:
        lines.append("lossless: not checked token by token at temperature > 0; each rule keeps the target's "
                     "sampling distribution (tests/test_eval.py: the distribution test)")
    if res.get("speedup") is not None and res["speedup"] < 1:
        t, cycles = res["time_s"], max(res["cycles"], 1)
        d, v, o = (1e3 * t[k] / cycles for k in ("draft", "verify", "other"))
        plain = 1e3 * t["plain_step"] / max(res["plain_tokens"] - len(res["per_prompt"]), 1)
        lines.append(
            f"speedup {res['speedup']:.2f}x: the drafter is slower than plain decoding here. A verify cycle takes "
            f"{d + v + o:.2f} ms (draft {d:.2f}, verify {v:.2f}, other {o:.2f}) for {res['tau_pooled']:.2f} tokens, "
            f"plain decoding {plain:.2f} ms a token: at these costs it pays from tau {(d + v + o) / plain:.2f} on.")
    return lines


def write_results(res, out_dir):
    """out_dir/eval.json + eval.png (histogram of tokens per cycle | per-offset acceptance)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders headless (Agg)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
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
    fig.savefig(os.path.join(out_dir, "eval.png"), dpi=120)


def plot_tau(rows, path):
    from matplotlib.figure import Figure
    fig, rows = Figure(figsize=(6, 3.8)), sorted(rows, key=lambda r: r["step"])
    ax = fig.subplots()
    for key in ("tau", "tau_pooled"):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label=key)
    ax.set(xlabel="training step", ylabel="acceptance length", title="held-out tau by checkpoint")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def macro_figures(results, resamples=2000):
    """results: set name -> results. The mean over sets of each set's figure (each set weighs the
    same, whatever its size). tau's 95% interval: each round resamples every set's prompts on their
    own, with replacement, and takes the mean of the sets' means (2,000 rounds, seeded)."""
    gen = torch.Generator().manual_seed(0)
    boot = torch.stack([bootstrap_means([r["tau"] for r in res["per_prompt"]], gen, resamples)
                        for res in results.values()]).mean(0)
    figures = ("tau", "tau_pooled", "tau_committed", "tau_sglang", "tau_vllm", "speedup")
    mean = {k: None if any(r[k] is None for r in results.values())
            else sum(r[k] for r in results.values()) / len(results) for k in figures}
    variants = {}  # every set's other verification rules / adaptive length, the same way
    for name in set.intersection(*(set(r.get("variants") or {}) for r in results.values())):
        vs = [r["variants"][name] for r in results.values()]
        vboot = torch.stack([bootstrap_means([p["tau"] for p in v["per_prompt"]], gen, resamples)
                             for v in vs]).mean(0)
        variants[name] = dict(tau=sum(v["tau"] for v in vs) / len(vs), tau_ci95=ci95(vboot))
    return dict(mean, sets=len(results), tau_ci95=ci95(boot), resamples=resamples,
                variants=dict(sorted(variants.items())))


def compare(base_path, *new_paths, resamples=5000, rule=None):
    """eval.json files of the same prompts (eval.py --compare BASE NEW [NEW ...]; an arm trained
    under several seeds: its files joined by commas) -> for each NEW against BASE (compare_two);
    one NEW: its result, several: {NEW: result}, and a race table (one row per arm: each set's
    tau, the macro mean, its gain over BASE with the interval). rule: judge by that decode of the
    prompts (read_arm), not the main one."""
    outs = {p: compare_two(base_path, p, resamples, rule) for p in new_paths}
    if len(new_paths) == 1:
        return outs[new_paths[0]]
    sets = [k for k in outs[new_paths[0]] if k != "macro mean"]

    def name(spec):  # a run's eval.json: its folder; another file: its own name; seeds: +N
        path = os.path.abspath(spec.split(",")[0])
        stem = os.path.splitext(os.path.basename(path))[0]
        first = os.path.basename(os.path.dirname(path)) if stem == "eval" else stem
        return first + (f" +{spec.count(',')}" if "," in spec else "")
    print(f"\n{'run':<16}" + "".join(f"{k[:12]:>13}" for k in sets) + f"{'macro':>9}  gain over {name(base_path)}")
    first = outs[new_paths[0]]
    print(f"{name(base_path):<16}" + "".join(f"{first[k]['base']:>13.3f}" for k in sets)
          + (f"{first['macro mean']['base']:>9.3f}" if "macro mean" in first else ""))
    for p, o in outs.items():
        m = o.get("macro mean", o[sets[0]])
        print(f"{name(p):<16}" + "".join(f"{o[k]['new']:>13.3f}" for k in sets)
              + (f"{o['macro mean']['new']:>9.3f}" if "macro mean" in o else "")
              + f"  {m['gain']:+.1%} [{m['gain_ci95'][0]:+.1%}, {m['gain_ci95'][1]:+.1%}]")
    return outs


def read_arm(spec, rule=None):
    """An arm of --compare: "A.json", or "A1.json,A2.json" (one eval.json per training seed) ->
    [(path, {set name: results}), ...], the sets alike in every file. rule: each set's decode
    under that verification rule (the main one, or a variant: eval.py --verify's others,
    "adaptive"), e.g. ratio to judge as engines verify at T > 0."""
    runs = []
    for path in spec.split(","):
        with open(path) as f:
            res = json.load(f)
        sets = res["sets"] if "sets" in res else {"prompts": res}
        runs.append((path, sets if rule is None else {n: decode_of(r, rule, path) for n, r in sets.items()}))
        if runs[-1][1].keys() != runs[0][1].keys():
            raise SystemExit(f"--compare: {runs[0][0]} has sets {sorted(runs[0][1])}, {path} {sorted(runs[-1][1])}")
    return runs


def decode_of(res, rule, path):
    """One set's results under `rule`: its main decode's (config.verify) or a variant's."""
    if res.get("config", {}).get("verify") == rule:
        return res
    if rule in (res.get("variants") or {}):
        return res["variants"][rule]
    have = [res.get("config", {}).get("verify"), *(res.get("variants") or {})]
    raise SystemExit(f"--compare --rule {rule}: {path} has no such decode (it has {have})")


def seed_prompt_means(t_SP, seeds_RS, prompts_RP):
    """Per resampling round, the mean over the round's seeds (rows of t) of the mean over its
    prompts; seeds_RS None: the one seed, as a plain prompt bootstrap."""
    if seeds_RS is None:
        return t_SP[0][prompts_RP].mean(1)
    x_RSP = t_SP[seeds_RS]
    return x_RSP.gather(2, prompts_RP[:, None, :].expand(-1, x_RSP.shape[1], -1)).mean((1, 2))


def compare_two(base_spec, new_spec, resamples=5000, rule=None):
    """Two arms of the same prompts (read_arm: one eval.json per training seed) -> per set and for
    the macro mean: tau of each (the mean over seeds and prompts), the paired difference NEW - BASE
    and the relative gain, each with a 95% interval from a hierarchical bootstrap: each round draws
    each arm's seeds with replacement (once for every set: a seed is one training) and then the
    prompts (the same draw for both arms: paired by prompt hash; every set on its own for the
    macro mean; seeded), so the spread between trainings of one recipe is in the interval; and
    the prompts each arm is ahead on (its seeds' mean)."""
    print(f"{new_spec} against {base_spec}" + (f", verified by {rule}:" if rule else ":"))
    arms, gen = (read_arm(base_spec, rule), read_arm(new_spec, rule)), torch.Generator().manual_seed(0)
    (pa, a), (pb, b) = arms[0][0], arms[1][0]
    if a.keys() != b.keys():
        raise SystemExit(f"--compare: {pa} has sets {sorted(a)}, {pb} {sorted(b)}")
    seeds = [torch.randint(len(arm), (resamples, len(arm)), generator=gen) if len(arm) > 1 else None
             for arm in arms]
    out, draws = {}, {}
    for name in a:
        keys = [r.get("prompt_sha", r["prompt_tokens"]) for r in a[name]["per_prompt"]]
        for path, run in arms[0] + arms[1]:
            pp = run[name]["per_prompt"]
            if [r.get("prompt_sha", r["prompt_tokens"]) for r in pp] != keys:
                raise SystemExit(f"--compare: set {name!r}: not the same prompts in the same order "
                                 f"({len(keys)} in {pa}, {len(pp)} in {path})")
        ta, tb = (torch.tensor([[r["tau"] for r in run[name]["per_prompt"]] for _, run in arm],
                               dtype=torch.float64) for arm in arms)  # [seeds, prompts]
        idx = torch.randint(len(keys), (resamples, len(keys)), generator=gen)
        draws[name] = seed_prompt_means(ta, seeds[0], idx), seed_prompt_means(tb, seeds[1], idx)
        ma, mb = ta.mean(0), tb.mean(0)
        out[name] = _paired(ma.mean(), mb.mean(), *draws[name], prompts=len(keys),
                            ahead=int((mb > ma).sum()), behind=int((mb < ma).sum()),
                            **({"seeds": [len(arms[0]), len(arms[1])]} if seeds != [None, None] else {}))
    if len(a) > 1:
        ma, mb = (torch.stack([d[i] for d in draws.values()]).mean(0) for i in (0, 1))
        out["macro mean"] = _paired(sum(o["base"] for o in out.values()) / len(a),
                                    sum(o["new"] for o in out.values()) / len(a), ma, mb)
    for name, o in out.items():
        print(f"{name:<12} {o['base']:.3f} -> {o['new']:.3f}  {o['diff']:+.3f} "
              f"[{o['diff_ci95'][0]:+.3f}, {o['diff_ci95'][1]:+.3f}]  {o['gain']:+.1%} "
              f"[{o['gain_ci95'][0]:+.1%}, {o['gain_ci95'][1]:+.1%}]"
              + (f"  ahead on {o['ahead']}, behind on {o['behind']} of {o['prompts']}"
                 if "prompts" in o else "")
              + (f"  (seeds {o['seeds'][0]} vs {o['seeds'][1]})" if "seeds" in o else ""))
    return out


def _paired(base, new, base_draws, new_draws, **counts):
    base, new = float(base), float(new)
    return dict(base=base, new=new, diff=new - base, diff_ci95=ci95(new_draws - base_draws),
                gain=new / base - 1, gain_ci95=ci95(new_draws / base_draws - 1), **counts)


def sets_summary(res):
    """The per-set table, then the macro mean: one line each."""
    f = lambda x, digits=3: "-" if x is None else f"{x:.{digits}f}"

    def row(name, prompts, r, lossless=""):
        return (f"{name:<14}{prompts:>8}{f(r['tau']):>8}  {'-'.join(map(f, r['tau_ci95'])):<14}"
                f"{f(r['tau_sglang']):>8}{f(r['tau_vllm']):>8}{f(r['tau_committed']):>10}"
                f"{f(r['speedup'], 2):>9}  {lossless}")
    head = (f"{'set':<14}{'prompts':>8}{'tau':>8}  {'95% CI':<14}{'SGLang':>8}{'vLLM':>8}"
            f"{'committed':>10}{'speedup':>9}  lossless")
    lines = [row(n, r["config"]["prompts"], r, r["lossless"]) for n, r in res["sets"].items()]
    lines.append(row("macro mean", "", res["macro"]))
    for name, v in (res["macro"].get("variants") or {}).items():  # other rules / adaptive length
        first = next(iter(res["sets"].values()))["variants"][name]
        what = (RULE_WORDS[first["rule"]] if first.get("adaptive") is None
                else f"adaptive verify length (>= {first['adaptive']})")
        lines.append(f"{what}: tau " + ", ".join(
            f"{n} {r['variants'][name]['tau']:.3f}" for n, r in res["sets"].items())
            + f", macro {v['tau']:.3f} [95% CI {v['tau_ci95'][0]:.3f}-{v['tau_ci95'][1]:.3f}]")
    lines += [f"{n}: {line}" for n, r in res["sets"].items() for line in verdict(r)]
    return "\n".join([head, *lines])


def write_sets(res, out_dir):
    """out_dir/eval.json (every set's results, the macro mean) + eval.png (tau per set with its
    interval and the engines' counts | per-offset acceptance per set)."""
    from matplotlib.figure import Figure
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "eval.json"), "w") as f:
        json.dump(res, f, indent=1)
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    rows = [*res["sets"].items(), ("macro mean", res["macro"])]
    x, tau = list(range(len(rows))), [r["tau"] for _, r in rows]
    err = [[r["tau"] - r["tau_ci95"][0] for _, r in rows],
           [r["tau_ci95"][1] - r["tau"] for _, r in rows]]
    ax1.bar(x, tau, yerr=err, capsize=4, color=["C0"] * len(res["sets"]) + ["C7"],
            label="tau, 95% CI")
    for key, marker, color in (("tau_sglang", "_", "C3"), ("tau_vllm", "x", "k")):
        nan = float("nan")  # an engine with no figure (no draft)
        ax1.scatter(x, [nan if r[key] is None else r[key] for _, r in rows], marker=marker, s=90,
                    color=color, zorder=3, label=key)
    ax1.set_xticks(x, [n for n, _ in rows], rotation=20)
    ax1.set(ylabel="acceptance length", title="tau per set (the authors' count)")
    ax1.legend(fontsize=8)
    for name, r in res["sets"].items():
        ax2.plot(range(1, len(r["pos_accept"]) + 1), r["pos_accept"], marker="o", label=name)
    K = max(len(r["pos_accept"]) for r in res["sets"].values()) + 1
    ax2.set(xlabel="block offset", ylabel="P(draft accepted)", ylim=(0, 1.02), xticks=range(1, K),
            title="per-position acceptance")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "eval.png"), dpi=120)
