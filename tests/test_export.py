"""What each consumer's loader reads, pinned per checkpoint kind, and export.py's table.

The loaders, read at these commits (2026-12):
- vLLM (vllm-project/vllm): vllm/config/speculative.py @ 002e77c1f0ef (method detection: the
  architecture Qwen3DSparkModel is method "dspark"; DSparkDraftModel is renamed to it only with
  model_type qwen3 after vllm-project/vllm#52197, otherwise sent to the DeepSeek-V4 DSpark class;
  no Domino method), vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d0 (the DFlash
  layers: layer_types, sliding_window, rope_parameters, head_dim, attention_bias, hidden_act;
  mixed sliding/full layers need VLLM_USE_V2_MODEL_RUNNER=1), qwen3_dspark.py @ 47bd6d7cc66f
  (markov_rank, confidence_head_with_markov; markov_head.markov_w1/w2; a confidence head with a
  bias, built only under adaptive verification).
- SGLang (sgl-project/sglang): python/sglang/srt/models/dflash.py @ 003b23d7388e (plain DFlash),
  speculative/dspark_components/dspark_config.py @ 01f476234ab4 (gamma = the config's block
  size, verify window gamma + 1, --speculative-num-draft-tokens N sets gamma = N - 1),
  speculative/domino_utils.py @ 04d4c1ae50fc (Domino drafting, prefix 1, shift_label either).
- SpecForge (sgl-project/SpecForge) @ a6b6b02: specforge/modeling/draft/registry.py (the
  architecture name picks the class), dflash.py, dspark.py (head fields from dflash_config only),
  domino.py (projector_type domino, emb_dim, gru_hidden_dim, shift_label, pure_draft_prefix_len).
- z-lab/dflash @ 44947fbf: dflash/model.py (DFlashDraftModel: block_size, num_target_layers,
  dflash_config.target_layer_ids and mask_token_id; no head beyond the backbone).
- vllm-project/speculators @ c05b95b: src/speculators/models/dflash/core.py:209-212 (drafted
  tokens = K - 1 when offset 0 is the anchor, sample_from_anchor false, as ours).

Test: python -m pytest -q tests/test_export.py
"""

import json
import os
import shlex

import pytest
import torch

import export
from model import DFlashDrafter, DrafterConfig, load_drafter, save_drafter

V, D, K = 96, 64, 8
HEADS = {"plain": {}, "dspark": dict(markov_rank=8),
         "dspark+confidence": dict(markov_rank=8, confidence_head=True),
         "domino-prefix0": dict(domino_gru_dim=12, domino_emb_dim=20),
         "domino-prefix1": dict(domino_gru_dim=12, domino_emb_dim=20, domino_shift_label=True,
                                domino_prefix_len=1)}


def drafter_cfg(kind, **kw):
    base = dict(hidden_size=D, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=V, block_size=K, rope_theta=5e5,
                target_layer_ids=[1, 3, 5], num_target_layers=8, mask_token_id=7,
                layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    return DrafterConfig(**(base | HEADS[kind] | kw))


def saved(tmp_path, kind, **kw):
    """A checkpoint directory of this kind as training writes it -> (its path, the drafter)."""
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_cfg(kind, **kw))
    path = str(tmp_path / f"ckpt-{kind}")
    save_drafter(drafter, path, dtype=None)
    return path, drafter


def exported(tmp_path, kind, consumer, **kw):
    """-> (the exported config dict, the command, the note, the source drafter, the out dir)."""
    ckpt, drafter = saved(tmp_path, kind, **kw)
    out = str(tmp_path / f"{consumer}-{kind}")
    command, note = export.export(ckpt, consumer, out, target="Qwen/Qwen3-8B")
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f), command, note, drafter, out


def value(c, name):
    """c's value at a dotted name; a missing key fails naming it."""
    for part in name.split("."):
        assert part in c, f"the loader reads {name}"
        c = c[part]
    return c


def weight_shapes(out, prefixes):
    from safetensors import safe_open
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith(prefixes)}


# ---------------------------------------------------------------- the table: consumer x kind
REFUSED = "refused"
WRITES = {  # (consumer, kind) -> the architecture the export writes, or (REFUSED, the reason)
    ("vllm", "plain"): "DFlashDraftModel", ("vllm", "dspark"): "Qwen3DSparkModel",
    ("vllm", "dspark+confidence"): "Qwen3DSparkModel",
    ("vllm", "domino-prefix0"): (REFUSED, "no Domino speculative method"),
    ("vllm", "domino-prefix1"): (REFUSED, "no Domino speculative method"),
    ("sglang", "plain"): "DFlashDraftModel", ("sglang", "dspark"): "Qwen3DSparkModel",
    ("sglang", "dspark+confidence"): "Qwen3DSparkModel",
    ("sglang", "domino-prefix0"): (REFUSED, "only with pure_draft_prefix_len 1"),
    ("sglang", "domino-prefix1"): "DFlashDraftModel",
    ("specforge", "plain"): "DFlashDraftModel", ("specforge", "dspark"): "DSparkDraftModel",
    ("specforge", "dspark+confidence"): "DSparkDraftModel",
    ("specforge", "domino-prefix0"): "DominoDraftModel",
    ("specforge", "domino-prefix1"): "DominoDraftModel",
    ("zlab", "plain"): "DFlashDraftModel",
    **{("zlab", k): (REFUSED, "drops those weights") for k in HEADS if k != "plain"},
}


@pytest.mark.parametrize("consumer,kind", sorted(WRITES))
def test_each_consumer_and_kind_is_written_or_refused(tmp_path, consumer, kind):
    """The table: an export writes save_drafter's config with only the architecture changed (the
    name that consumer's loader dispatches on) and the weights as a link to the same bytes, which
    load back as the same drafter; a refusal names its reason and writes nothing."""
    ckpt, drafter = saved(tmp_path, kind)
    out = str(tmp_path / "out")
    want = WRITES[(consumer, kind)]
    if isinstance(want, tuple):
        with pytest.raises(export.ExportRefused, match=want[1]):
            export.export(ckpt, consumer, out)
        assert not os.path.exists(out)
        return
    export.export(ckpt, consumer, out)
    with open(os.path.join(ckpt, "config.json")) as f:
        src = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == [want]
    assert {k: v for k, v in c.items() if k != "architectures"} == {
        k: v for k, v in src.items() if k != "architectures"}
    a, b = os.path.join(ckpt, "model.safetensors"), os.path.join(out, "model.safetensors")
    assert os.path.samefile(a, b)  # linked, not copied
    back = load_drafter(out)
    assert back.cfg == drafter.cfg
    assert all(torch.equal(x, y) for x, y in zip(back.state_dict().values(),
                                                 drafter.state_dict().values()))


# ---------------------------------------------------------------- vLLM
VLLM_FIELDS = ["architectures", "hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps",
               "attention_bias", "max_position_embeddings", "rope_parameters", "layer_types",
               "sliding_window", "dflash_config.mask_token_id", "dflash_config.target_layer_ids"]
LAYER_WEIGHTS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def vllm_spec(command):
    """The --speculative-config JSON of a printed vllm serve command."""
    words = shlex.split(command)
    return json.loads(words[words.index("--speculative-config") + 1])


@pytest.mark.parametrize("kind", ["plain", "dspark", "dspark+confidence"])
def test_vllm_reads_these_fields_and_drafts_k_minus_1(tmp_path, kind):
    """vLLM (module docstring: speculative.py @ 002e77c1f0ef, qwen3_dflash.py @ 036a00d1f5d0,
    qwen3_dspark.py @ 47bd6d7cc66f): the DFlash fields, the DSpark head as Qwen3DSparkModel
    reads it (top level: markov_rank, markov_head_type vanilla, sample_from_anchor false, the
    confidence head's flags; markov_head.markov_w1 [V, r] and markov_w2 [V, r], the confidence
    head's proj [1, D + r] with a bias [1]), and the command: method dflash/dspark,
    num_speculative_tokens K - 1 (offset 0 is the anchor: speculators core.py:209-212), adaptive
    verification for a confidence head, the V2 runner for mixed sliding/full layers."""
    c, command, note, drafter, out = exported(tmp_path, kind, "vllm")
    for name in VLLM_FIELDS:
        assert value(c, name) is not None, name
    assert c["hidden_act"] == "silu" and c["rope_parameters"]["rope_theta"] == 5e5
    assert set(weight_shapes(out, ("fc", "hidden_norm", "norm", "layers"))) == {
        "fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{w}.weight" for i in range(2) for w in LAYER_WEIGHTS}
    spec = vllm_spec(command)
    assert command.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Qwen/Qwen3-8B ")
    assert spec["model"] == out and spec["num_speculative_tokens"] == K - 1
    assert note is None
    if kind == "plain":
        assert c["architectures"] == ["DFlashDraftModel"] and spec["method"] == "dflash"
        assert weight_shapes(out, ("markov", "confidence")) == {}
        return
    conf = kind == "dspark+confidence"
    assert c["architectures"] == ["Qwen3DSparkModel"] and spec["method"] == "dspark"
    assert [c["markov_rank"], c["markov_head_type"], c["sample_from_anchor"]] == [8, "vanilla", False]
    assert c["enable_confidence_head"] is conf and c["confidence_head_with_markov"] is conf
    assert spec.get("enable_adaptive_verification", False) is conf
    assert weight_shapes(out, ("markov", "confidence")) == {
        "markov_head.markov_w1.weight": [V, 8], "markov_head.markov_w2.weight": [V, 8],
        **({"confidence_head.proj.weight": [1, D + 8], "confidence_head.proj.bias": [1]}
           if conf else {})}


def test_a_renamed_dspark_config_never_reaches_vllm(tmp_path):
    """SpecForge's name DSparkDraftModel sends a drafter to vLLM's DeepSeek-V4 DSpark class in
    builds before vllm-project/vllm#52197: exporting a SpecForge export again for vLLM is
    refused, and a Qwen3 layer config without a sliding layer drops the V2 runner flag."""
    c, _, _, _, out = exported(tmp_path, "dspark", "specforge")
    assert c["architectures"] == ["DSparkDraftModel"]
    with pytest.raises(export.ExportRefused, match="DSparkDraftModel must never reach vLLM"):
        export.export(out, "vllm", str(tmp_path / "again"))
    assert not os.path.exists(tmp_path / "again")
    _, command, _, _, _ = exported(tmp_path, "dspark", "vllm", layer_types=None, sliding_window=None)
    assert command.startswith("vllm serve ")


# ---------------------------------------------------------------- SGLang
SGLANG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "rms_norm_eps", "attention_bias",
                 "max_position_embeddings", "hidden_act", "layer_types", "sliding_window",
                 "rope_parameters", "rope_theta", "dflash_config.block_size",
                 "dflash_config.target_layer_ids", "dflash_config.mask_token_id", "num_target_layers"]


def sglang_flag(command, flag):
    words = shlex.split(command)
    return words[words.index(flag) + 1]


@pytest.mark.parametrize("kind", ["plain", "dspark", "dspark+confidence", "domino-prefix1"])
def test_sglang_reads_these_fields_and_verifies_k(tmp_path, kind):
    """SGLang (module docstring: models/dflash.py @ 003b23d7388e, dspark_config.py @ 01f476234ab4,
    domino_utils.py @ 04d4c1ae50fc): the DFlash fields (block size nested first); a DSpark head
    (markov_rank, markov_head_type, mask_token_id top level) served by DSPARK, whose gamma is the
    config's block size unless --speculative-num-draft-tokens K sets it to K - 1 (the verify
    window K, as trained); SGLANG_RAGGED_VERIFY_MODE=static for a Markov-only head (other modes
    build a confidence head it has no weights for); a Domino head as its DFlashDraftModel reads
    one: projector_type domino, shift_label true (a bool), pure_draft_prefix_len 1, the two
    widths (emb_dim also top level, equal), prefix_gru.weight_ih_l0 [3G, D], weight_hh_l0 [3G, G],
    embed_proj.0 [E, D + G], embed_proj.2 [V, E]."""
    c, command, note, drafter, out = exported(tmp_path, kind, "sglang")
    for name in SGLANG_FIELDS:
        assert value(c, name) is not None, name
    assert c["dflash_config"]["block_size"] == c["block_size"] == K
    assert sglang_flag(command, "--speculative-num-draft-tokens") == str(K)
    assert sglang_flag(command, "--speculative-draft-model-path") == out
    assert sglang_flag(command, "--model-path") == "Qwen/Qwen3-8B"
    algo = sglang_flag(command, "--speculative-algorithm")
    assert command.startswith("SGLANG_RAGGED_VERIFY_MODE=static ") == (kind == "dspark")
    if kind.startswith("dspark"):
        assert algo == "DSPARK" and c["architectures"] == ["Qwen3DSparkModel"]
        assert [c["markov_rank"], c["markov_head_type"], c["mask_token_id"]] == [8, "vanilla", 7]
        assert "#36186" in note
        return
    assert algo == "DFLASH" and c["architectures"] == ["DFlashDraftModel"]
    if kind == "plain":
        assert note is None and "projector_type" not in c["dflash_config"]
        return
    dc = c["dflash_config"]
    assert {k: dc[k] for k in ("projector_type", "shift_label", "pure_draft_prefix_len",
                               "gru_hidden_dim", "emb_dim")} == {
        "projector_type": "domino", "shift_label": True, "pure_draft_prefix_len": 1,
        "gru_hidden_dim": 12, "emb_dim": 20}
    assert c["emb_dim"] == dc["emb_dim"] and "#36899" in note
    assert weight_shapes(out, ("prefix_gru", "embed_proj")) == {
        "prefix_gru.weight_ih_l0": [36, D], "prefix_gru.weight_hh_l0": [36, 12],
        "embed_proj.0.weight": [20, D + 12], "embed_proj.2.weight": [V, 20]}


# ---------------------------------------------------------------- SpecForge
SPECFORGE_DSPARK = ["dflash_config.markov_rank", "dflash_config.markov_head_type",
                    "dflash_config.enable_confidence_head", "dflash_config.confidence_head_with_markov",
                    "dflash_config.projector_type", "dflash_config.attention_mode",
                    "dflash_config.target_layer_ids", "dflash_config.mask_token_id", "block_size",
                    "model_type"]


@pytest.mark.parametrize("kind,kv_heads", [("plain", 2), ("dspark", 2), ("dspark", 4),
                                           ("dspark+confidence", 2), ("domino-prefix0", 2),
                                           ("domino-prefix1", 2)])
def test_specforge_reads_these_fields(tmp_path, kind, kv_heads):
    """SpecForge a6b6b02 (module docstring): the registry picks the class by architecture
    (DSparkDraftModel, not Qwen3DSparkModel, which it does not know); DSparkDraftModel reads its
    head from dflash_config only (markov_rank, markov_head_type vanilla, enable_confidence_head,
    confidence_head_with_markov, projector_type dspark, attention_mode gqa with fewer KV heads or
    mha with equal ones) and block_size top level; its AcceptRatePredictor is proj [1, D + r]
    with a bias. A config with the head fields nested only, as SpecForge writes one, loads back
    the same drafter here. DominoDraftModel reads projector_type domino, emb_dim, gru_hidden_dim,
    shift_label, pure_draft_prefix_len (both layouts are its own)."""
    c, command, note, drafter, out = exported(tmp_path, kind, "specforge", num_key_value_heads=kv_heads)
    dc = c["dflash_config"]
    name = c["architectures"][0]
    assert shlex.split(command) == ["python", "-c", f"from specforge.modeling.draft import {name}; "
                                    f"print({name}.from_pretrained({json.dumps(out)}))"]
    if kind == "plain":
        assert name == "DFlashDraftModel" and note is None
        return
    if kind.startswith("domino"):
        shift = kind == "domino-prefix1"
        assert name == "DominoDraftModel" and note is None
        assert [dc[k] for k in ("projector_type", "emb_dim", "gru_hidden_dim", "shift_label",
                                "pure_draft_prefix_len")] == ["domino", 20, 12, shift, int(shift)]
        return
    conf = kind == "dspark+confidence"
    assert name == "DSparkDraftModel" and "anchor+j+1" in note
    for field in SPECFORGE_DSPARK:
        value(c, field)
    assert [dc["markov_rank"], dc["markov_head_type"], dc["projector_type"]] == [8, "vanilla", "dspark"]
    assert dc["attention_mode"] == ("gqa" if kv_heads < 4 else "mha")
    assert dc["enable_confidence_head"] is conf and dc["confidence_head_with_markov"] is conf
    if conf:
        assert weight_shapes(out, ("confidence",)) == {"confidence_head.proj.weight": [1, D + 8],
                                                       "confidence_head.proj.bias": [1]}
    nested_only = {k: v for k, v in c.items() if k not in (
        "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
        "sample_from_anchor")}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(nested_only, f)
    back = load_drafter(out)
    assert back.cfg == drafter.cfg and all(torch.equal(x, y) for x, y in zip(
        back.state_dict().values(), drafter.state_dict().values()))


# ---------------------------------------------------------------- z-lab/dflash
ZLAB_FIELDS = ["block_size", "num_target_layers", "dflash_config.target_layer_ids",
               "dflash_config.mask_token_id", "layer_types", "sliding_window", "rope_theta",
               "rope_scaling", "hidden_size", "num_hidden_layers", "torch_dtype"]


def test_zlab_reads_these_fields(tmp_path):
    """z-lab/dflash @ 44947fbf dflash/model.py: DFlashDraftModel (a Qwen3PreTrainedModel, loaded
    with transformers 4.57.1, which reads rope_theta beside rope_scaling and torch_dtype) takes
    block_size and num_target_layers top level, target_layer_ids and mask_token_id from
    dflash_config, the sliding window per layer_types."""
    c, command, note, _, out = exported(tmp_path, "plain", "zlab")
    for name in ZLAB_FIELDS:
        value(c, name)
    assert c["block_size"] == K and c["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert shlex.split(command) == ["python", "-c", "from dflash.model import DFlashDraftModel; "
                                    f"print(DFlashDraftModel.from_pretrained({json.dumps(out)}))"]
    assert note is None


# ---------------------------------------------------------------- the layout fields, the CLI
def test_domino_layouts_round_trip_and_other_forms_are_refused(tmp_path):
    """The two layouts save and load back (SpecForge's dflash_config spelling); every other pair
    of shift_label and pure_draft_prefix_len, or a layout without a Domino head, is an error
    naming the file it came from."""
    for kind in ("domino-prefix0", "domino-prefix1"):
        ckpt, drafter = saved(tmp_path, kind)
        assert load_drafter(ckpt).cfg == drafter.cfg
        assert drafter.cfg.num_params() == sum(p.numel() for p in drafter.parameters())
    with pytest.raises(ValueError, match="shift_label true and pure_draft_prefix_len 0"):
        drafter_cfg("domino-prefix0", domino_shift_label=True)
    with pytest.raises(ValueError, match="shift_label false and pure_draft_prefix_len 1"):
        drafter_cfg("domino-prefix0", domino_prefix_len=1)
    with pytest.raises(ValueError, match="needs domino_gru_dim"):
        drafter_cfg("plain", domino_shift_label=True, domino_prefix_len=1)
    c = drafter_cfg("domino-prefix1").to_json_dict()
    c["dflash_config"]["pure_draft_prefix_len"] = 2
    with pytest.raises(ValueError, match=r"^x/config.json: .*pure_draft_prefix_len 2"):
        DrafterConfig.from_json_dict(c, where="x/config.json")


def test_confidence_head_forms_the_engines_do_not_serve_are_refused(tmp_path):
    """Both engines serve a confidence head only inside a DSpark drafter, on [h ; markov_w1[prev]]
    (confidence_head_with_markov true): without a Markov head, or on h alone, it is an error."""
    with pytest.raises(ValueError, match="confidence_head needs markov_rank"):
        drafter_cfg("plain", confidence_head=True)
    ckpt, _ = saved(tmp_path, "dspark+confidence")
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        c = json.load(f)
    c["confidence_head_with_markov"] = False
    with open(path, "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        load_drafter(ckpt)


def test_cli_prints_the_command_or_the_refusal(tmp_path, capsys):
    """`python export.py CKPT --for C OUT`: the command and a note on stdout; a refusal exits
    non-zero with its reason; an existing non-empty OUT is an error, not a merge."""
    ckpt, _ = saved(tmp_path, "dspark")
    out = str(tmp_path / "sg")
    export.main([ckpt, "--for", "sglang", out, "--target", "T"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("SGLANG_RAGGED_VERIFY_MODE=static python -m sglang.launch_server "
                               "--model-path T --speculative-algorithm DSPARK")
    assert lines[1].startswith("note: needs an SGLang build with PR #36186")
    with pytest.raises(SystemExit, match="refused: .*z-lab/dflash"):
        export.main([ckpt, "--for", "zlab", str(tmp_path / "z")])
    with pytest.raises(FileExistsError, match="not empty"):
        export.export(ckpt, "sglang", out)
