"""A checkpoint as each consumer loads it: the config that consumer reads, the weights linked (never
copied), and the exact command that serves or loads it; a refusal, naming the reason, for whatever
that consumer would load and then serve wrongly without an error.

    python export.py out/RUN/ckpt-0003504 --for vllm|sglang|specforge|zlab OUT [--target TARGET]

Kinds of checkpoint: plain DFlash, DSpark (a Markov head), DSpark with a confidence head, Domino
aligned (prefix 0, train.py --domino_layout=aligned) and Domino shifted (prefix 1, SGLang's; the
default). save_drafter's own directory stays
what vLLM and SGLang load directly; an export only adds a directory beside it. This is its own
file, not part of checkpoint.py: that file is the run directory a training run writes, this is a
command a user runs afterwards, one table of facts about other projects' loaders.

Test: python -m pytest -q tests/test_export.py
"""

import argparse
import json
import os
import shlex
import sys

from model import DrafterConfig

CONSUMERS = ("vllm", "sglang", "specforge", "zlab")
KINDS = ("plain", "dspark", "dspark+confidence", "domino-prefix0", "domino-prefix1")

# ------------------------------------------------------------------ Domino's two block layouts
# A block is [anchor, mask, ..., mask] (K slots) at positions anchor+0..anchor+K-1; it attends to
# the target's context features strictly before the anchor and to its whole block (SpecForge
# a6b6b02 specforge/algorithms/common/dflash_family_model.py:110 the mask, :212-243 positions and
# block tokens). The drafter's normed hidden h_j at slot j gives base logits lm_head(h_j); Domino
# adds embed_proj([h_j ; g_j]) with g_j the state of a bias-free GRU over the target's embeddings
# of the block's true tokens (training) or drafted ones (drafting).
#
# shift_label false, pure_draft_prefix_len 0 (--domino_layout=aligned; DominoDraftModel):
#   slot k predicts token anchor+k (slot 0 is the anchor: no label, dflash_family_model.py:628,
#   :654-656); the GRU reads tokens anchor+0..anchor+K-2 and g_k = its state after anchor+k-1;
#   every slot 1..K-1 is corrected (specforge/modeling/draft/domino.py:56-62 suffix_start = 1,
#   :126-131 prefix_states = gru_out[:, :, 0:]). Decay weight exp(-(k-1)/gamma) (:669-673).
# shift_label true, pure_draft_prefix_len 1 (--domino_layout=shifted, loss.block_labels' shift;
#   SpecForge configs/qwen3-8b-domino.json and
#   qwen3.5-4b-domino.json at a6b6b02; SGLang's DFlashDraftModel with projector_type domino):
#   slot j predicts token anchor+j+1, every slot j = 0..K-1 carries a label (label_start = 1,
#   dflash_family_model.py:628-640, no slot masked at :654), and an anchor needs loss_mask at
#   anchor and anchor+1 (:185) while labels past the sequence end are masked (:633, :652).
#   The GRU reads the K tokens anchor+0..anchor+K-1 (prev_ids, :504-517; head_token_ids, :527);
#   g_j = its state after anchor+j, i.e. after every token before slot j's label. suffix_start
#   = pure_draft_prefix_len = 1 (domino.py:56-62): slot 0 keeps its base logits (no correction),
#   slots 1..K-1 get embed_proj([h_j ; gru_out_j]) (domino.py:120-124, :133-139). Decay weight
#   exp(-j/gamma) from slot 0 (:669-673). Loss per position (1 - b) CE(final) + b CE(base),
#   normalized by the weight sum (:699); at slot 0 final = base, so it is CE(base).
# Drafting in that layout proposes K-1 tokens from slots 0..K-2 (slot K-1's prediction is
#   trained, never used; the verify window stays K): SpecForge domino.py:94-105 (head position
#   t-1 for token t, GRU over the whole block, causal so later mask slots do not matter);
#   SGLang python/sglang/srt/speculative/domino_utils.py domino_greedy_rollout (commit 04d4c1ae):
#   p_0 = argmax lm_head(h_0) uncorrected, state = GRU(emb[anchor, p_0]); for i = 1..K-2,
#   p_i = argmax(lm_head(h_i) + embed_proj([h_i ; state])) then state = GRUcell(emb p_i, state).
#   Its argmax for i >= 1 runs over a candidate pool (the 2048 largest of max_i lm_head(h_i)
#   over slots 1..K-2) when the vocabulary is larger: drafted tokens equal a full-vocabulary
#   argmax only when the winner is in that pool. That rollout has no prefix parameter: its first
#   proposal is always uncorrected (prefix 1); SGLang's Domino tests expect pure_draft_prefix_len
#   2 refused, and its runtime checks want CUDA and bf16 projector weights. With shift_label
#   false it reads slots 1..K-1 instead, which is SpecForge's (false, 1), not our (false, 0).


class ExportRefused(ValueError):
    """This consumer would load the checkpoint and serve it wrongly; the message says why."""


def checkpoint_kind(cfg):
    if cfg.domino_gru_dim:
        return f"domino-prefix{cfg.domino_prefix_len}"
    if cfg.markov_rank:
        return "dspark+confidence" if cfg.confidence_head else "dspark"
    return "plain"


def refusal(consumer, kind):
    """Why `consumer` must not get a `kind` checkpoint, or None. Sources: module docstrings of
    tests/test_export.py name each file and commit."""
    if consumer == "zlab" and kind != "plain":
        return ("z-lab/dflash's DFlashDraftModel (dflash/model.py) builds no Markov, confidence or "
                "Domino head: from_pretrained drops those weights with a warning and drafts with "
                "the backbone alone")
    if consumer == "vllm" and kind.startswith("domino"):
        return ("vLLM has no Domino speculative method (vllm/config/speculative.py lists dflash "
                "and dspark); nothing there reads prefix_gru/embed_proj")
    if consumer == "sglang" and kind == "domino-prefix0":
        return ("SGLang serves Domino only with pure_draft_prefix_len 1: its first drafted token "
                "is uncorrected and each GRU state one token longer than this head was trained "
                "with; train with --domino_layout=shifted (the default)")
    return None


def consumer_config(src, consumer):
    """The config.json `consumer` reads, from save_drafter's `src` dict."""
    cfg = json.loads(json.dumps(src))  # a deep copy
    arch = cfg["architectures"][0]
    if consumer == "specforge" and arch == "Qwen3DSparkModel":
        # SpecForge's registry knows DSparkDraftModel only; vLLM sends that name with model_type
        # qwen3 to its DeepSeek-V4 DSpark class in builds before vllm-project/vllm#52197
        cfg["architectures"] = ["DSparkDraftModel"]
    if consumer == "sglang" and cfg["dflash_config"].get("projector_type") == "domino":
        cfg["architectures"] = ["DFlashDraftModel"]  # SGLang's Domino is its DFlash model
    if consumer == "vllm" and cfg["architectures"] == ["DSparkDraftModel"]:
        raise ExportRefused("a config naming DSparkDraftModel must never reach vLLM")
    return cfg


def serve_command(consumer, cfg, out, target):
    """The shell command (or Python line) that serves or loads `out` for `consumer`."""
    K, kind = cfg.block_size, checkpoint_kind(cfg)
    out_q, target = shlex.quote(out), shlex.quote(target)
    if consumer == "vllm":
        # K - 1 drafted tokens: offset 0 holds the anchor (sample_from_anchor false); K would add
        # a row the drafter never trained
        spec = {"method": "dspark" if cfg.markov_rank else "dflash", "model": out,
                "num_speculative_tokens": K - 1}
        if cfg.confidence_head:  # vLLM builds the confidence head only for adaptive verification
            spec["enable_adaptive_verification"] = True
        v2 = "VLLM_USE_V2_MODEL_RUNNER=1 " if "sliding_attention" in cfg.layer_types else ""
        return f"{v2}vllm serve {target} --speculative-config {shlex.quote(json.dumps(spec))}"
    if consumer == "sglang":
        # DSPARK reads the block size as gamma (drafted tokens) and verifies gamma + 1; the flag
        # sets gamma = K - 1. static ragged verify: other modes build a confidence head always
        algo = "DSPARK" if cfg.markov_rank else "DFLASH"
        env = "SGLANG_RAGGED_VERIFY_MODE=static " if kind == "dspark" else ""
        return (f"{env}python -m sglang.launch_server --model-path {target} "
                f"--speculative-algorithm {algo} --speculative-draft-model-path {out_q} "
                f"--speculative-num-draft-tokens {K}")
    module, name = "dflash.model", "DFlashDraftModel"  # z-lab/dflash
    if consumer == "specforge":
        module, name = "specforge.modeling.draft", {
            "plain": "DFlashDraftModel", "dspark": "DSparkDraftModel",
            "dspark+confidence": "DSparkDraftModel"}.get(kind, "DominoDraftModel")
    code = f"from {module} import {name}; print({name}.from_pretrained({json.dumps(out)}))"
    return f"python -c {shlex.quote(code)}"


def notes(consumer, kind):
    """What the command cannot check: the engine build, the layout a consumer trains in."""
    n = {("sglang", "dspark"): "needs an SGLang build with PR #36186 (merged 2026-08-25): older "
                               "ones ignore sample_from_anchor false and draft one slot early",
         ("sglang", "domino-prefix1"): "needs an SGLang build with PR #36899 (merged 2026-08-28), "
                                       "CUDA and bf16 weights",
         ("specforge", "dspark"): "SpecForge a6b6b02 drafts with slots 1..K-1 as this checkpoint "
                                  "was trained, but its DSpark trainer labels slot j with token "
                                  "anchor+j+1: training on from here shifts the head"}
    n[("sglang", "dspark+confidence")] = n[("sglang", "dspark")]
    n[("specforge", "dspark+confidence")] = n[("specforge", "dspark")]
    return n.get((consumer, kind))


def link_weights(src, dst):
    """A hard link (same bytes, no copy); a symlink across filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(os.path.abspath(src), dst)


def export(ckpt, consumer, out, target="TARGET"):
    """Write `out` for `consumer` from checkpoint directory `ckpt` -> (the serve/load command, a
    note or None). Raises ExportRefused (nothing written) when the consumer would mis-serve it."""
    if consumer not in CONSUMERS:
        raise ValueError(f"--for {consumer!r}: one of {', '.join(CONSUMERS)}")
    path, weights = os.path.join(ckpt, "config.json"), os.path.join(ckpt, "model.safetensors")
    with open(path) as f:
        src = json.load(f)
    cfg = DrafterConfig.from_json_dict(src, where=path)  # a config we cannot read is an error here
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"{weights}: the checkpoint has no weights")
    kind = checkpoint_kind(cfg)
    why = refusal(consumer, kind)
    if why:
        raise ExportRefused(f"{ckpt}: a {kind} checkpoint is not exported for {consumer}: {why}")
    out_cfg = consumer_config(src, consumer)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out}: exists and is not empty; export writes a fresh directory")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(out_cfg, f, indent=2)
    link_weights(weights, os.path.join(out, "model.safetensors"))
    return serve_command(consumer, cfg, out, target), notes(consumer, kind)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", help="a checkpoint directory (config.json + model.safetensors)")
    p.add_argument("--for", dest="consumer", required=True, choices=CONSUMERS)
    p.add_argument("out", help="the directory to write (new or empty)")
    p.add_argument("--target", default="TARGET", help="the target model, for the printed command")
    a = p.parse_args(argv)
    try:
        command, note = export(a.ckpt, a.consumer, a.out, a.target)
    except ExportRefused as e:
        sys.exit(f"refused: {e}")
    print(command)
    if note:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
