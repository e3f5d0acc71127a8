"""Prompt sources at scale: compact file rows, tokenisation when batched, bounded caches, and the
same batches, splits and resume states as the eager implementation they replace."""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from textrl.envs.prompts import (
    PromptDataset,
    PromptSampler,
    check_prompts_fit,
    encode_prompts,
    load_prompts,
    template_prompt,
)
from textrl.envs.prompts import encoding as prompt_encoding
from textrl.envs.prompts import stores as row_stores
from textrl.envs.prompts.table import PromptTable
from textrl.models import build_tiny_tokenizer

# A small file: blank line 2, every row shape (plain, MiniMind conversation, messages, TRL prompt
# list), extra fields, non-ASCII text.
LINES = [
    {"prompt": "What is 2+2?", "answer": "4"},
    None,
    {"conversations": [{"role": "user", "content": "Name a colour."},
                       {"role": "assistant", "content": "Blue."}]},
    {"prompt": "Say hello in French.", "answer": "Bonjour", "meta": {"k": [1, 2]}},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Capital of Italy?"}]},
    {"prompt": [{"role": "user", "content": "\u00dcn\u00efcode \u2014 ok?"}], "answer": "yes"},
    {"prompt": "Count to three."},
    {"prompt": "The last one.", "answer": "x"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(("" if row is None else json.dumps(row, ensure_ascii=False)) + "\n"
                            for row in LINES), encoding="utf-8")
    return path


class CharTokenizer:
    """One token per character, no chat template; a text holding 'VANISH' tokenizes to nothing.
    Records the texts of each call."""

    pad_token_id = 0
    chat_template = None

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, texts, add_special_tokens=True):
        self.calls.append(list(texts))
        return {"input_ids": [[] if "VANISH" in t else [ord(c) for c in t] for t in texts]}


def _write_rows(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


def _reference_stream(seed: int, n: int, draws: int) -> list[int]:
    """The prompt indices an eager sampler draws: epoch e is default_rng([seed, e]).permutation(n)."""
    order: list[int] = []
    epoch = 0
    while len(order) < draws:
        order += np.random.default_rng([seed, epoch]).permutation(n).tolist()
        epoch += 1
    return order[:draws]


def _reference_batch(dataset, tokenizer, indices):
    """(input_ids, attention_mask, texts) of ``indices``, each row templated and tokenized alone."""
    texts = [template_prompt(tokenizer, dataset.messages(i)) for i in indices]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for b, row in enumerate(ids):
        input_ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = True
    return input_ids, mask, texts


# -- the same batches as before ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 3, 11])
def test_batches_match_an_eager_reference_across_epochs(small, tokenizer, seed):
    ds = load_prompts(small)
    sampler = PromptSampler(ds, tokenizer, prompts_per_batch=3, n_samples_per_prompt=2, seed=seed)
    stream = _reference_stream(seed, len(ds), 3 * 6)
    for b in range(6):  # 18 draws of 7 prompts: three epochs
        batch = sampler.next_batch()
        want = [i for i in stream[3 * b: 3 * b + 3] for _ in range(2)]
        input_ids, mask, texts = _reference_batch(ds, tokenizer, want)
        assert batch.prompt_index == want
        assert torch.equal(batch.input_ids, input_ids) and torch.equal(batch.attention_mask, mask)
        assert batch.prompt_texts == texts
        assert batch.rows == [ds[i] for i in want]
    assert ds[2]["meta"] == {"k": [1, 2]} and ds[1]["reference"] == "Blue."
    assert ds.messages(4) == [{"role": "user", "content": "\u00dcn\u00efcode \u2014 ok?"}]


def test_order_split_and_state_recorded_from_the_eager_implementation(small, tokenizer):
    """Figures the implementation that parsed and tokenized every row up front gave (main at
    300193f) for this file: the draw order, the split and the sampler state."""
    ds = load_prompts(small)
    sampler = PromptSampler(ds, tokenizer, prompts_per_batch=3, n_samples_per_prompt=2, seed=3)
    assert [sampler.next_batch().prompt_index for _ in range(5)] == [
        [5, 5, 6, 6, 2, 2], [1, 1, 4, 4, 3, 3], [0, 0, 2, 2, 1, 1], [4, 4, 0, 0, 5, 5],
        [6, 6, 3, 3, 4, 4]]
    train, held_out = ds.split(2, seed=1)
    assert [train.where(i).rsplit(":", 1)[1] for i in range(len(train))] == ["3", "4", "5", "6", "8"]
    assert [held_out.where(i).rsplit(":", 1)[1] for i in range(len(held_out))] == ["1", "7"]
    first = PromptSampler(train, tokenizer, prompts_per_batch=4, seed=11).next_batch()
    assert first.prompt_index == [1, 4, 2, 3] and list(first.input_ids.shape) == [4, 34]


def test_a_state_saved_before_files_were_hashed_by_bytes_still_resumes(small, tokenizer):
    train, _ = load_prompts(small).split(2, seed=1)
    # state_dict() of the eager implementation after one batch (its fingerprint: the rows' JSON)
    old = {"seed": 11, "epoch": 0, "position": 4, "shuffle": True, "num_prompts": 5,
           "fingerprint": "c1956d1805d8590a"}
    straight = PromptSampler(train, tokenizer, prompts_per_batch=4, seed=11)
    straight.next_batch()
    want = straight.next_batch()
    resumed = PromptSampler(train, tokenizer, prompts_per_batch=4, seed=0)
    resumed.load_state_dict(old)
    assert resumed.next_batch().prompt_index == want.prompt_index
    state = resumed.state_dict()
    assert state["fingerprint"] != old["fingerprint"]  # now the file's bytes: no parse to check
    again = PromptSampler(train, tokenizer, prompts_per_batch=4)
    again.load_state_dict(state)
    assert again.position == resumed.position and again.epoch == resumed.epoch
    small.write_text(small.read_text().replace("Count to three.", "Count to four."))  # held out
    same_train, _ = load_prompts(small).split(2, seed=1)
    for saved in (old, state):  # the sampler's rows are unchanged: it resumes
        PromptSampler(same_train, tokenizer, prompts_per_batch=4).load_state_dict(saved)
    small.write_text(small.read_text().replace("hello in French", "hello in Italian"))  # trained on
    changed, _ = load_prompts(small).split(2, seed=1)
    with pytest.raises(ValueError, match="different prompt dataset"):  # no per-row digests: the same rows only
        PromptSampler(changed, tokenizer, prompts_per_batch=4).load_state_dict(old)
    edited = PromptSampler(changed, tokenizer, prompts_per_batch=4)  # per-row digests: an edited row is named
    edited.load_state_dict(state)
    assert len(edited.edited) == 1 and edited.edited[0]["row"].startswith(str(small))


def test_fingerprints(small, tmp_path):
    ds = load_prompts(small)
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(small.read_bytes())
    assert load_prompts(moved).fingerprint() == ds.fingerprint()  # the bytes, not the path
    moved.write_bytes(b"\n\n" + small.read_bytes().replace(b"\n\n", b"\n"))
    assert load_prompts(moved).fingerprint() == ds.fingerprint()  # nor the blank lines
    assert ds.select(range(len(ds))).fingerprint() == ds.fingerprint()
    train, held_out = ds.split(2, seed=1)
    assert train.fingerprint() == ds.select([1, 2, 3, 4, 6]).fingerprint() != held_out.fingerprint()
    # rows held as dicts: the hash of their JSON, as before (figure recorded from main)
    rows = PromptDataset.from_list(["a", {"prompt": "b", "answer": 1}])
    blob = json.dumps([{"prompt": "a"}, {"prompt": "b", "answer": 1}], sort_keys=True).encode()
    assert rows.fingerprint() == hashlib.sha256(blob).hexdigest()[:16] == "970c2f3ad202c430"
    assert row_stores._content_hash(ds) == "cb7ca64c70e2e321"  # main's fingerprint of the file


_TEXT = st.text(st.one_of(st.characters(blacklist_categories=("Cs",)), st.sampled_from("\u2028\x85\r\n\t ")),
                min_size=1, max_size=12).filter(str.strip)


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(_TEXT, min_size=2, max_size=12), blank_every=st.integers(2, 5), data=st.data())
def test_file_rows_select_and_split_like_the_same_rows_in_a_list(prompts, blank_every, data):
    """Peer check: rows read from a file (blank lines between, any text, raw U+2028 / U+0085)
    behave as the same rows given as a list, through select (negative indices too) and split."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        lines = []
        for i, text in enumerate(prompts):
            lines += [""] * (i % blank_every == 1) + [json.dumps({"prompt": text, "i": i}, ensure_ascii=False)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        from_file = load_prompts(path)
        from_list = PromptDataset.from_list([{"prompt": text, "i": i} for i, text in enumerate(prompts)])
        n = len(prompts)
        first = data.draw(st.lists(st.integers(-n, n - 1), min_size=1, max_size=2 * n))
        second = data.draw(st.lists(st.integers(0, len(first) - 1), min_size=1, max_size=n))
        for ds in (from_file, from_list):
            assert list(ds) == [{"prompt": text, "i": i} for i, text in enumerate(prompts)]
        a, b = from_file.select(first).select(second), from_list.select(first).select(second)
        assert list(a) == list(b) and len(a) == len(second)
        assert [a.where(k) for k in range(len(a))] == [
            f"{path}:{lines.index(json.dumps(row, ensure_ascii=False)) + 1}" for row in b]
        seed = data.draw(st.integers(0, 3))
        for part_a, part_b in zip(from_file.split(1, seed=seed), from_list.split(1, seed=seed)):
            assert list(part_a) == list(part_b)
            assert [part_a.messages(k) for k in range(len(part_a))] == [
                part_b.messages(k) for k in range(len(part_b))]


# -- errors name FILE:LINE ---------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "byte", "column"), [
    (b'{"prompt": "\xff"}', 0xFF, 13),  # never valid in UTF-8
    (b'{"prompt": "ok \xc3("}', 0xC3, 16),  # a lead byte without its continuation
    (b'{"prompt": "ok"} \xe2\x82', 0xE2, 18),  # truncated at the end of the line
])
def test_a_non_utf8_row_is_named_by_file_and_line(tmp_path, data, byte, column):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n  \r\n{"prompt": "b"}\r\n' + data + b'\n{"prompt": "c"}\n')
    message = f"{path}:5: not UTF-8 text (byte 0x{byte:02x} at column {column}); save the file as UTF-8"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_prompts(path)


def test_a_json_error_names_file_and_line_after_blank_and_crlf_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r\n\r\n{"prompt": "b"}\n{"prompt": "c",}\n')
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:4: not valid JSON"):
        load_prompts(path)
    path.write_bytes(b'{"prompt": "a"}\r\n\r\n{"prompt": "b"}\r\n')
    ds = load_prompts(path)
    assert [ds.where(i) for i in range(2)] == [f"{path}:1", f"{path}:3"]
    assert [row["prompt"] for row in ds] == ["a", "b"]


# -- compact and lazy --------------------------------------------------------------------------------


def test_a_file_costs_its_bytes_plus_a_few_bytes_a_row(tmp_path):
    n = 20_000
    path = _write_rows(tmp_path / "many.jsonl", [f"prompt number {i}, with some words" for i in range(n)])
    size = path.stat().st_size
    tracemalloc.start()
    try:
        ds = load_prompts(path)
        held, peak = tracemalloc.get_traced_memory()
        train, held_out = ds.split(100, seed=0)
        after_split, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held - size < 20 * n  # 16 bytes a row: offset and line number
    assert peak - size < 40 * n  # nothing parsed is kept while loading
    assert after_split - held < 12 * n  # a split keeps int64 indices, no rows
    assert train[0] == {"prompt": "prompt number 0, with some words"} == ds[0]
    assert len(train) + len(held_out) == n


def _counting(monkeypatch, tokenizer) -> list[list[str]]:
    """The texts of every call of ``tokenizer`` from now on, one list a call."""
    calls: list[list[str]] = []
    original = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        calls.append([text] if isinstance(text, str) else list(text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    return calls


def test_the_sampler_tokenizes_what_it_draws_and_a_small_dataset_once(tokenizer, monkeypatch):
    digits = load_prompts("builtin:digits")
    calls = _counting(monkeypatch, tokenizer)
    sampler = PromptSampler(digits, tokenizer, prompts_per_batch=32, n_samples_per_prompt=2)
    assert calls == []  # nothing tokenized to build it
    sampler.next_batch()
    assert len(calls) == 1 and len(calls[0]) == 32  # the batch's distinct prompts, in one call
    for _ in range(2 * len(digits) // 32):  # two more epochs
        sampler.next_batch()
    texts = [text for call in calls for text in call]
    assert len(texts) == len(set(texts)) == len(digits)  # each tokenized once: the cache holds all


def test_a_large_dataset_keeps_a_bounded_cache_and_the_same_batches(small, tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_encoding, "_CACHE_ROWS", 3)
    ds = load_prompts(small)
    sampler = PromptSampler(ds, tokenizer, prompts_per_batch=2, seed=5)
    stream = _reference_stream(5, len(ds), 2 * 9)
    for b in range(9):
        batch = sampler.next_batch()
        assert len(sampler._encoder._cache) <= 3
        input_ids, mask, _ = _reference_batch(ds, tokenizer, stream[2 * b: 2 * b + 2])
        assert torch.equal(batch.input_ids, input_ids) and torch.equal(batch.attention_mask, mask)


def test_a_too_long_row_is_refused_when_first_drawn_and_the_stream_stays(tmp_path, tokenizer):
    prompts = [f"short {i}" for i in range(6)]
    prompts[4] = "this prompt is far too long " * 5
    path = _write_rows(tmp_path / "p.jsonl", prompts)
    sampler = PromptSampler(path, tokenizer, prompts_per_batch=2, seed=0, max_prompt_length=30)
    message = rf"^{re.escape(str(path))}:5: the prompt is \d+ tokens long \(chat template included\), more than max_prompt_length=30"
    stream = _reference_stream(0, 6, 6)
    refused_at = stream.index(4) // 2
    for _ in range(refused_at):
        sampler.next_batch()
    before = sampler.state_dict()
    for _ in range(2):  # refused again: the failed call did not move the stream
        with pytest.raises(ValueError, match=message):
            sampler.next_batch()
        assert sampler.state_dict() == before
    with pytest.raises(ValueError, match=message):  # check_prompts_fit names it before training
        check_prompts_fit(path, tokenizer, context=512, max_new_tokens=8, max_prompt_length=30)


def test_left_truncation_warns_once_naming_the_rows(tmp_path, tokenizer):
    prompts = ["a", "this prompt is far too long " * 5, "b", "and this one is too long too " * 5]
    path = _write_rows(tmp_path / "p.jsonl", prompts)
    sampler = PromptSampler(path, tokenizer, prompts_per_batch=4, shuffle=False, max_prompt_length=30,
                            truncate="left")
    with pytest.warns(UserWarning, match=rf"2 prompt\(s\) of .* in this batch .*left-truncated .*"
                                         rf"{re.escape(str(path))}:2 \(\d+ tokens\), .*:4 .*later batches"):
        batch = sampler.next_batch()
    assert batch.input_ids.shape[1] == 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.next_batch()  # the next epoch truncates again, silently


def test_a_row_that_tokenizes_to_nothing_is_named(tmp_path):
    path = _write_rows(tmp_path / "p.jsonl", ["fine", "fine too", "VANISH", "ok"])
    message = f"^{re.escape(str(path))}:3: the prompt tokenizes to no tokens: 'VANISH'"
    with pytest.raises(ValueError, match=message):
        PromptSampler(path, CharTokenizer(), prompts_per_batch=4).next_batch()
    with pytest.raises(ValueError, match=message):
        check_prompts_fit(path, CharTokenizer(), context=64, max_new_tokens=8)
    with pytest.raises(ValueError, match=message):
        encode_prompts(path, CharTokenizer(), batch_size=1)


def test_encode_prompts_matches_the_reference_in_chunks(small, tokenizer, monkeypatch):
    monkeypatch.setattr(prompt_encoding, "_CHUNK_ROWS", 2)
    ds = load_prompts(small)
    calls = _counting(monkeypatch, tokenizer)
    batches = encode_prompts(ds, tokenizer, batch_size=5)
    assert [len(b) for b in batches] == [5, 2]
    assert [len(call) for call in calls] == [2, 2, 1, 2]  # batches of 5 and 2, in chunks of 2
    for start, batch in zip((0, 5), batches):
        input_ids, mask, want = _reference_batch(ds, tokenizer, range(start, start + len(batch)))
        assert torch.equal(batch.input_ids, input_ids) and batch.prompt_texts == want


# -- check_prompts_fit, streamed ---------------------------------------------------------------------


def _reference_verdict(lengths, context, max_new, max_len, truncate):
    """What the eager check refuses first: ('empty', row), ('long', row, n), ('over', first, n,
    count, longest, its n) or None. A length of 0 is a row that tokenizes to nothing."""
    if 0 in lengths:
        return ("empty", lengths.index(0))
    counted = []
    for i, n in enumerate(lengths):
        if max_len is not None and n > max_len:
            if truncate == "error":
                return ("long", i, n)
            n = max_len
        counted.append(n)
    over = [i for i, n in enumerate(counted) if n + max_new > context]
    if not over:
        return None
    longest = max(over, key=lambda i: counted[i])
    return ("over", over[0], counted[over[0]], len(over), longest, counted[longest])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=14),
    context=st.integers(8, 40),
    max_new=st.integers(1, 7),
    max_len=st.one_of(st.none(), st.integers(1, 30)),
    truncate=st.sampled_from(["error", "left"]),
    chunk=st.integers(1, 5),
)
def test_check_prompts_fit_streams_to_the_eager_verdict(lengths, context, max_new, max_len, truncate, chunk):
    rows = ["VANISH" if n == 0 else "x" * n for n in lengths]
    tokenizer = CharTokenizer()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prompt_encoding, "_CHUNK_ROWS", chunk)
        verdict = _reference_verdict(lengths, context, max_new, max_len, truncate)
        call = lambda: check_prompts_fit(rows, tokenizer, context=context, max_new_tokens=max_new,  # noqa: E731
                                         max_prompt_length=max_len, truncate=truncate, model="m")
        if verdict is None:
            call()
        else:
            with pytest.raises(ValueError) as info:
                call()
            message = str(info.value)
            if verdict[0] == "empty":
                assert message.startswith(f"list[{verdict[1]}]: the prompt tokenizes to no tokens")
            elif verdict[0] == "long":
                assert message.startswith(f"list[{verdict[1]}]: the prompt is {verdict[2]} tokens "
                                          f"long, more than max_prompt_length={max_len}")
            else:
                _, first, n, count, longest, longest_n = verdict
                assert message.startswith(f"list[{first}]: the prompt is {n} tokens long; with "
                                          f"max_new_tokens={max_new} its sequence reaches {n + max_new}")
                others = f"; {count - 1} more row(s) do not fit either, the longest list[{longest}] ({longest_n} tokens)"
                assert (others in message) == (count > 1)
    assert all(len(texts) <= chunk for texts in tokenizer.calls)
    assert sum(len(texts) for texts in tokenizer.calls) <= len(rows)


# -- PromptTable -------------------------------------------------------------------------------------


def test_prompt_table_reads_a_file_lazily_with_a_bounded_cache(small, tokenizer, monkeypatch):
    from textrl.envs.prompts import table as prompt_table

    monkeypatch.setattr(prompt_table, "_CACHE_ROWS", 2)
    table = PromptTable(str(small), tokenizer, max_prompt_length=64)
    for i in [0, 1, 2, 3, 0, 4, 5, 6]:
        want = tokenizer(template_prompt(tokenizer, load_prompts(small).messages(i)),
                         add_special_tokens=False)["input_ids"]
        assert table.ids(i).tolist() == want
        assert len(table._cache) <= 2
    assert table.fields(2) == {"answer": "Bonjour", "meta": {"k": [1, 2]}}
