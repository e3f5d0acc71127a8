"""Prompt datasets, the sampler and the built-in digits task."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter

import pytest
import torch

from textrl.envs.prompts import PromptDataset, PromptSampler, encode_prompts, load_prompts
from textrl.envs.tasks import (
    DATA_DIR,
    digits_answer,
    format_completion,
    make_digits_task,
    warmup_examples,
    write_jsonl,
)
from textrl.models import build_tiny_tokenizer

FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def digits():
    return load_prompts("builtin:digits")


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _sampler(dataset, tokenizer, **kw):
    kw.setdefault("prompts_per_batch", 4)
    return PromptSampler(dataset, tokenizer, **kw)


# -- datasets ---------------------------------------------------------------------------------------


def test_jsonl_minimind_conversations(tmp_path):
    path = _write(
        tmp_path / "rlaif.jsonl",
        [
            json.dumps(
                {
                    "conversations": [
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4"},
                    ]
                }
            ),
            "",  # blank lines are skipped
            json.dumps(
                {
                    "conversations": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Name a colour."},
                    ],
                    "id": 7,
                }
            ),
        ],
    )
    ds = PromptDataset.from_jsonl(path)
    assert len(ds) == 2
    assert ds[0]["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    assert ds[0]["reference"] == "4"
    assert "conversations" not in ds[0]
    assert "reference" not in ds[1] and ds[1]["id"] == 7
    assert ds.messages(1)[0] == {"role": "system", "content": "Be brief."}


def test_jsonl_plain_prompt_rows_keep_fields(tmp_path):
    path = _write(
        tmp_path / "plain.jsonl",
        [json.dumps({"prompt": "2+2?", "answer": "4"}), json.dumps({"prompt": "x", "k": [1]})],
    )
    ds = PromptDataset.from_jsonl(path)
    assert ds[0] == {"prompt": "2+2?", "answer": "4"}
    assert ds[1]["k"] == [1]
    assert ds.messages(0) == [{"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "no prompt"}', "no prompt"),
        ('{"prompt": "   "}', "empty prompt"),
        ('{"prompt": 3}', "'prompt' must be a string"),
        ('{"conversations": [{"role": "user"}]}', "string 'role' and 'content'"),
        ('{"conversations": [{"role": "assistant", "content": "a"}]}', "no 'user' turn"),
        ('{"conversations": []}', "non-empty list"),
    ],
)
def test_jsonl_malformed_row_names_file_and_line(tmp_path, line, what):
    path = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "fine"}), line])
    with pytest.raises(ValueError, match=re.escape("bad.jsonl:2: ")) as info:
        PromptDataset.from_jsonl(path)
    assert what in str(info.value)


def test_a_non_utf8_line_names_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\); save the file as UTF-8"):
        PromptDataset.from_jsonl(path)


def test_empty_sources_raise(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        PromptDataset.from_jsonl(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ValueError, match="empty"):
        PromptDataset.from_list([])
    with pytest.raises(ValueError, match="does not exist"):
        PromptDataset.from_jsonl(tmp_path / "missing.jsonl")


def test_from_list_and_immutability():
    ds = PromptDataset.from_list(["a", {"prompt": "b", "answer": "1"}])
    row = ds[1]
    row["answer"] = "changed"
    assert ds[1]["answer"] == "1"
    with pytest.raises(ValueError, match="row 1: empty prompt"):
        PromptDataset.from_list(["a", " \n"])


def test_from_hf_dataset():
    datasets = pytest.importorskip("datasets")
    hf = datasets.Dataset.from_list(
        [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]
    )
    ds = PromptDataset.from_hf_dataset(hf, prompt_field="question")
    assert [r["prompt"] for r in ds] == ["2+2?", "3+3?"]
    assert ds[1]["answer"] == "6" and "question" not in ds[1]
    with pytest.raises(ValueError, match="no column 'prompt'"):
        PromptDataset.from_hf_dataset(hf)
    conv = datasets.Dataset.from_list(
        [
            {
                "conversations": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ]
            }
        ]
    )
    ds = PromptDataset.from_hf_dataset(conv, prompt_field="conversations")
    assert ds[0]["messages"] == [{"role": "user", "content": "q"}] and ds[0]["reference"] == "a"
    assert load_prompts(datasets.Dataset.from_list([{"prompt": "p"}]))[0] == {"prompt": "p"}


def test_load_prompts_specs(tmp_path, digits):
    assert len(digits) == 512 and digits[0].keys() == {"prompt", "answer"}
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "x"})])
    assert load_prompts(str(path))[0]["prompt"] == "x"
    assert load_prompts(["y"])[0]["prompt"] == "y"
    with pytest.raises(ValueError, match="builtin:digits"):
        load_prompts("builtin:nope")


def test_split_disjoint_and_deterministic(digits):
    train, evals = digits.split(32, seed=0)
    assert len(evals) == 32 and len(train) == 480
    train_p = {r["prompt"] for r in train}
    eval_p = {r["prompt"] for r in evals}
    assert not train_p & eval_p and len(train_p | eval_p) == 512
    again_train, again_eval = digits.split(32, seed=0)
    assert list(again_eval) == list(evals) and list(again_train) == list(train)
    assert {r["prompt"] for r in digits.split(32, seed=1)[1]} != eval_p
    for bad in (0, 512, 600):
        with pytest.raises(ValueError, match="eval_size"):
            digits.split(bad)


# -- sampler ----------------------------------------------------------------------------------------


def test_left_padding_and_chat_template(tokenizer):
    ds = PromptDataset.from_list(["short", "a much longer prompt with many more words in it"])
    batch = _sampler(ds, tokenizer, prompts_per_batch=2, shuffle=False).next_batch()
    assert batch.input_ids.dtype == torch.int64 and batch.attention_mask.dtype == torch.bool
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, batch.input_ids.shape[1])
    short, long = batch.attention_mask
    assert long.all() and not short[0] and short[-1]
    # The mask is a suffix: False* True*, and pads sit exactly where it is False.
    assert torch.equal(short, short.cummax(0).values)
    assert (batch.input_ids[0][~short] == tokenizer.pad_token_id).all()
    assert all(t.startswith("<|im_start|>") for t in batch.prompt_texts)
    assert batch.prompt_texts[0].endswith("<|im_start|>assistant\n")
    ids = batch.input_ids[0][short].tolist()
    assert ids == tokenizer(batch.prompt_texts[0], add_special_tokens=False)["input_ids"]


def test_no_template_falls_back_to_raw_prompt(tokenizer):
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    batch = _sampler(["hello there"], plain, prompts_per_batch=1).next_batch()
    assert batch.prompt_texts == ["hello there"]


def test_n_samples_grouping(tokenizer, digits):
    n = 3
    batch = _sampler(digits, tokenizer, prompts_per_batch=5, n_samples_per_prompt=n).next_batch()
    assert batch.input_ids.shape[0] == len(batch.rows) == 15
    for g in range(5):
        rows = range(g * n, g * n + n)
        assert len({batch.prompt_index[i] for i in rows}) == 1
        assert len({batch.prompt_texts[i] for i in rows}) == 1
        assert all(torch.equal(batch.input_ids[i], batch.input_ids[g * n]) for i in rows)
        assert batch.rows[g * n]["answer"] == digits[batch.prompt_index[g * n]]["answer"]


def test_seeded_determinism_and_private_rng(tokenizer, digits):
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first = _sampler(digits, tokenizer, seed=3).next_batch().prompt_index
    assert torch.equal(torch.random.get_rng_state(), before)
    s1, s2 = _sampler(digits, tokenizer, seed=3), _sampler(digits, tokenizer, seed=3)
    seq1 = [s1.next_batch().prompt_index for _ in range(5)]
    assert seq1 == [s2.next_batch().prompt_index for _ in range(5)]
    assert seq1[0] == first
    s3 = _sampler(digits, tokenizer, seed=4)
    assert seq1 != [s3.next_batch().prompt_index for _ in range(5)]


def test_epoch_covers_every_prompt_once(tokenizer):
    ds = PromptDataset.from_list([f"prompt {i}" for i in range(12)])
    sampler = _sampler(ds, tokenizer, prompts_per_batch=4, n_samples_per_prompt=2)
    for epoch in range(2):
        seen = [i for _ in range(3) for i in sampler.next_batch().prompt_index[::2]]
        assert sorted(seen) == list(range(12)), epoch
    # A batch size that does not divide the dataset runs on into the next epoch.
    odd = _sampler(ds, tokenizer, prompts_per_batch=5, seed=1)
    stream = [i for _ in range(12) for i in odd.next_batch().prompt_index]  # 60 = 5 epochs
    for e in range(5):
        assert sorted(stream[12 * e : 12 * e + 12]) == list(range(12))
    assert stream[:12] != stream[12:24]  # a new order each epoch


def test_shuffle_false_keeps_order(tokenizer):
    ds = PromptDataset.from_list([f"p{i}" for i in range(5)])
    sampler = _sampler(ds, tokenizer, prompts_per_batch=3, shuffle=False)
    stream = [i for _ in range(3) for i in sampler.next_batch().prompt_index]
    assert stream == [0, 1, 2, 3, 4, 0, 1, 2, 3]


def test_resume_from_state_dict(tokenizer, digits):
    ref = _sampler(digits, tokenizer, prompts_per_batch=100, n_samples_per_prompt=2, seed=7)
    for _ in range(7):  # past an epoch boundary (512 prompts)
        ref.next_batch()
    state = json.loads(json.dumps(ref.state_dict()))  # survives a JSON checkpoint
    expected = [ref.next_batch() for _ in range(4)]
    resumed = _sampler(digits, tokenizer, prompts_per_batch=100, n_samples_per_prompt=2, seed=99)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert got.prompt_index == want.prompt_index
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.attention_mask, want.attention_mask)
    other = _sampler(["a", "b"], tokenizer, prompts_per_batch=1)
    with pytest.raises(ValueError, match="taken on 512 training prompts and list now gives 2: rows were removed"):
        other.load_state_dict(state)


def test_truncation_error_and_left(tokenizer):
    ds = PromptDataset.from_list(["ok", "this prompt is far too long " * 5])
    with pytest.raises(
        ValueError, match=r"^list\[1\]: the prompt is \d+ tokens long.*max_prompt_length=30.*truncate"
    ):
        _sampler(ds, tokenizer, max_prompt_length=30).next_batch()  # refused when first drawn
    sampler = _sampler(ds, tokenizer, max_prompt_length=30, truncate="left", shuffle=False)
    with pytest.warns(UserWarning, match="left-truncated"):
        batch = sampler.next_batch()
    assert batch.input_ids.shape[1] == 30
    full = tokenizer(batch.prompt_texts[1], add_special_tokens=False)["input_ids"]
    assert batch.input_ids[1].tolist() == full[-30:]  # the end (generation prompt) is kept
    with pytest.raises(ValueError, match="truncate must be one of"):
        _sampler(ds, tokenizer, truncate="right")


def test_a_long_prompt_is_named_by_its_file_line_even_inside_a_split(tmp_path, tokenizer):
    """The train split re-indexes the rows; the message still names the line of the file
    (blank lines counted), not the row's position in the split."""
    lines = [json.dumps({"prompt": f"short {i}"}) for i in range(10)]
    lines[3] = ""
    lines[7] = json.dumps({"prompt": "this prompt is far too long " * 5})
    path = _write(tmp_path / "p.jsonl", lines)
    train, held_out = PromptDataset.from_jsonl(path).split(2, seed=0)
    part = train if any("far too long" in row["prompt"] for row in train) else held_out
    assert [part.where(i) for i in range(len(part))][-1].startswith(f"{path}:")
    with pytest.raises(ValueError, match=f"^{path}:8: the prompt is \\d+ tokens long.*max_prompt_length=30"):
        _sampler(part, tokenizer, max_prompt_length=30, prompts_per_batch=len(part)).next_batch()
    assert PromptDataset.from_list(["a", "b", "c"]).select([2, 0]).where(0) == "list[2]"


def test_no_truncation_warning_when_short(tokenizer, digits):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sampler(digits, tokenizer, max_prompt_length=64)  # the default config's limit


def test_empty_prompt_names_index(tokenizer):
    with pytest.raises(ValueError, match="row 2: empty prompt"):
        _sampler(["a", "b", "   "], tokenizer)


def test_encode_eval_in_order(tokenizer, digits):
    _, evals = digits.split(10, seed=0)
    sampler = _sampler(digits, tokenizer)
    batches = sampler.encode_eval(evals, batch_size=4)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [i for b in batches for i in b.prompt_index] == list(range(10))
    assert [r["prompt"] for b in batches for r in b.rows] == [r["prompt"] for r in evals]
    (whole,) = encode_prompts(evals, tokenizer)
    assert len(whole) == 10


def test_tokenizes_each_prompt_once_when_first_drawn(tokenizer, monkeypatch, digits):
    texts = []
    original = type(tokenizer).__call__

    def counting(self, text, *args, **kwargs):
        texts.extend(text)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    sampler = _sampler(digits, tokenizer)
    assert texts == []  # building the sampler tokenizes nothing
    for _ in range(len(digits) // 4 + 5):  # an epoch, and five batches into the next
        sampler.next_batch()
    assert len(texts) == len(set(texts)) == len(digits)


# -- digits task ------------------------------------------------------------------------------------


def test_digits_task_deterministic_and_correct():
    rows = make_digits_task(200, seed=3)
    assert rows == make_digits_task(200, seed=3)
    assert rows != make_digits_task(200, seed=4)
    assert len({r["prompt"] for r in rows}) == 200
    for r in rows:
        assert r["prompt"].startswith("Repeat the last digit: ")
        assert r["answer"] == digits_answer(r["prompt"]) == r["prompt"][-1]
        assert 3 <= len(r["prompt"].split()) - 4 <= 6
    assert Counter(r["answer"] for r in rows) == {str(d): 20 for d in range(10)}


def test_shipped_digits_file_regenerates(tmp_path):
    shipped = DATA_DIR / "digits.jsonl"
    regenerated = tmp_path / "digits.jsonl"
    write_jsonl(make_digits_task(512, seed=0), regenerated)
    assert shipped.read_bytes() == regenerated.read_bytes()


def test_digits_prompts_fit_default_length(tokenizer, digits):
    (batch,) = encode_prompts(digits, tokenizer)
    assert batch.attention_mask.sum(1).max() <= 64


def test_warmup_examples_teach_format_not_answers(tokenizer):
    rows = make_digits_task(512, seed=0)
    pairs = warmup_examples(rows, seed=0)
    assert pairs == warmup_examples(rows, seed=0)
    assert [p for p, _ in pairs] == [r["prompt"] for r in rows]
    assert all(FORMAT.match(c) for _, c in pairs)
    answers = [re.search(r"<answer>\n(.*?)\n</answer>", c).group(1) for _, c in pairs]
    correct = sum(a == r["answer"] for a, r in zip(answers, rows)) / len(rows)
    assert correct < 0.2  # chance is 0.1; the correct answer is not taught
    assert set(answers) == {str(d) for d in range(10)}
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) + 1 for _, c in pairs]
    assert max(lengths) <= 24  # completion + EOS fits the default max_new_tokens


def test_format_completion_matches_rule():
    assert FORMAT.match(format_completion("step one\nstep two", "7"))
    assert format_completion("t", "a").endswith("<answer>\na\n</answer>")


@pytest.mark.parametrize(("accuracy", "low", "high"), [(0.0, 0.05, 0.15), (0.3, 0.30, 0.44), (1.0, 1.0, 1.0)])
def test_warmup_answer_accuracy_sets_the_share_of_correct_answers(accuracy, low, high):
    rows = make_digits_task(512, seed=0)
    pairs = warmup_examples(rows, seed=0, answer_accuracy=accuracy)
    correct = sum(c.endswith(f"<answer>\n{r['answer']}\n</answer>") for (_, c), r in zip(pairs, rows))
    # expected share: accuracy + (1 - accuracy) / 10 (a random digit is right one time in ten)
    assert low <= correct / len(rows) <= high


def test_warmup_answer_accuracy_zero_keeps_the_random_answers():
    rows = make_digits_task(64, seed=0)
    assert warmup_examples(rows, seed=1) == warmup_examples(rows, seed=1, answer_accuracy=0.0)
    with pytest.raises(ValueError, match="answer_accuracy"):
        warmup_examples(rows, answer_accuracy=1.5)


# -- data faults named: one-row data, duplicates across the split, conversations flattened ----------


def test_a_one_row_dataset_says_it_needs_two_rows():
    with pytest.raises(ValueError, match=r"list: the dataset has 1 row, .* needs at least 2 rows; add prompts"):
        load_prompts(["only one"]).split(32)
    with pytest.raises(ValueError, match=r"eval_size=32 \(--eval-size\): must be in \[1, 2\] for the 3 rows of list"):
        load_prompts(["a", "b", "c"]).split(32)


def test_held_out_duplicates_of_training_rows_are_named(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a", "a", "b", "a", "a", "a"]))
    # five copies of one row in six: any held-out pair holds a copy that the training part holds too
    with pytest.warns(UserWarning, match=r"of 2 held-out rows are duplicates of training rows \(.*data.jsonl:[12456] = "
                                         r".*data.jsonl:[12456].*remove the duplicate rows"):
        load_prompts(str(data)).split(2, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_prompts(["a", "b", "c", "d"]).split(2)  # no duplicates: no warning


def test_conversations_on_a_tokenizer_without_a_chat_template_warn_once():
    from textrl.envs.prompts import encoding as prompt_encoding

    tok = build_tiny_tokenizer()
    tok.chat_template = None
    tok.name_or_path = "no-template-tokenizer"
    prompt_encoding._FLATTENED_WARNED.discard("no-template-tokenizer")
    rows = [{"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]}] * 2
    with pytest.warns(UserWarning, match=r"tokenizer 'no-template-tokenizer' has no chat template.*the system "
                                         r"prompt and the roles are dropped"):
        encode_prompts(rows, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encode_prompts(rows, tok)  # once per tokenizer


# -- a resume after rows were edited (no run is lost to a data fault) ----------------------------------


def _rows_file(path, answers):
    return _write(path, [json.dumps({"prompt": f"What is {i} + {i}?", "answer": a}) for i, a in enumerate(answers)])


def _answers(n=20):
    return [str(2 * i) for i in range(n)]


def _stream(sampler, batches=6):
    return [i for _ in range(batches) for i in sampler.next_batch().prompt_index]


def test_a_resume_accepts_edited_rows_names_them_and_draws_the_same_batches(tmp_path, tokenizer):
    path = _rows_file(tmp_path / "rows.jsonl", [*_answers()[:4], "bad", *_answers()[5:]])
    train, held_out = load_prompts(path).split(4, seed=1)
    first = _sampler(train, tokenizer, seed=3, held_out=held_out)
    first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    expected = _stream(first)
    _rows_file(path, _answers())  # line 5 fixed: 'bad' -> '8'
    train, held_out = load_prompts(path).split(4, seed=1)
    resumed = _sampler(train, tokenizer, seed=3, held_out=held_out)
    resumed.load_state_dict(state)
    assert [change["row"] for change in resumed.edited] == [f"{path}:5"]
    assert resumed.edited[0]["sha256"]["from"] != resumed.edited[0]["sha256"]["to"]
    assert _stream(resumed) == expected  # the order is the rows' number's and the seed's, not their contents'
    resumed.load_state_dict(resumed.state_dict())  # nothing changed since: nothing named
    assert resumed.edited == []


def test_an_edited_held_out_row_is_named_too(tmp_path, tokenizer):
    path = _rows_file(tmp_path / "rows.jsonl", _answers())
    train, held_out = load_prompts(path).split(4, seed=1)
    state = _sampler(train, tokenizer, held_out=held_out).state_dict()
    line = int(held_out.where(0).rsplit(":", 1)[1])
    answers = _answers()
    answers[line - 1] = "a fixed answer"
    _rows_file(path, answers)
    train, held_out = load_prompts(path).split(4, seed=1)
    resumed = _sampler(train, tokenizer, held_out=held_out)
    resumed.load_state_dict(state)
    assert [change["row"] for change in resumed.edited] == [f"{path}:{line}"]


@pytest.mark.parametrize(("edit", "refusal"), [
    (lambda rows: [rows[1], rows[0], *rows[2:]], r"rows.jsonl:\d+ now holds the row that was at \S+rows.jsonl:\d+ "
                                                  r"\(2 rows moved: the rows were reordered\)"),
    (lambda rows: [*rows[:2], rows[3], rows[2], *rows[4:]],  # two training rows: a move, not 'another dataset'
     r"rows.jsonl:3 now holds the row that was at \S+rows.jsonl:4 \(2 rows moved: the rows were reordered\)"),
    (lambda rows: [*rows, rows[0].replace("0 + 0", "20 + 20")], r"taken on 16 training prompts and \S+ now gives 17: "
                                                                 "rows were added"),
    (lambda rows: rows[1:], r"taken on 16 training prompts and \S+ now gives 15: rows were removed"),
    (lambda rows: [row.replace("?", "?!") for row in rows[:3]] + rows[3:],
     r"2 of the 16 training prompts changed since the checkpoint \(\S+:1, \S+:3\): more than one "
     "in 10, so this is another dataset"),
])
def test_rows_added_removed_reordered_or_mostly_changed_are_refused(tmp_path, tokenizer, edit, refusal):
    path = _rows_file(tmp_path / "rows.jsonl", _answers())
    train, held_out = load_prompts(path).split(4, seed=1)
    sampler = _sampler(train, tokenizer, held_out=held_out)
    sampler.next_batch()
    state = sampler.state_dict()
    lines = path.read_text().splitlines()
    _write(path, edit(lines))
    train, held_out = load_prompts(path).split(4, seed=1)
    resumed = _sampler(train, tokenizer, held_out=held_out)
    with pytest.raises(ValueError, match=refusal) as err:
        resumed.load_state_dict(state)
    assert "a resume may change what rows hold, not how many there are or their order" in str(err.value)
    assert "start a new run in another --output-dir" in str(err.value)
    assert (resumed.epoch, resumed.position, resumed.edited) == (0, 0, [])  # left as it was


def test_a_state_without_row_digests_still_needs_the_same_rows(tmp_path, tokenizer):
    """A checkpoint written before per-row digests: any edit is refused, as it was then."""
    path = _rows_file(tmp_path / "rows.jsonl", _answers())
    state = _sampler(load_prompts(path), tokenizer).state_dict()
    old = {k: v for k, v in state.items() if k not in ("row_digests", "held_out")}
    _sampler(load_prompts(path), tokenizer).load_state_dict(old)  # the same rows: accepted
    answers = _answers()
    answers[4] = "8!"
    _rows_file(path, answers)
    with pytest.raises(ValueError, match="sampler state was saved on a different prompt dataset"):
        _sampler(load_prompts(path), tokenizer).load_state_dict(old)
    _sampler(load_prompts(path), tokenizer).load_state_dict(state)  # with digests: accepted


def test_a_reward_error_is_placed_in_the_data_by_file_line(tmp_path, tokenizer):
    from textrl.envs.prompts import TrackedBatches, placing_rows
    from textrl.rewards import RewardError

    path = _rows_file(tmp_path / "rows.jsonl", _answers())
    sampler = _sampler(load_prompts(path), tokenizer, prompts_per_batch=2, n_samples_per_prompt=2, shuffle=False)
    batch = sampler.next_batch()
    assert sampler.batch_rows(batch) == f"0-1 = {path}:1, 2-3 = {path}:2"
    with pytest.raises(RewardError, match=rf"^reward 'r' raised ValueError: x; in iteration 3, batch rows 0-1 = "
                                          rf"{path}:1, 2-3 = {path}:2$"):
        with placing_rows("iteration 3", lambda: sampler.batch_rows(batch)):
            raise RewardError("reward 'r' raised ValueError: x")
    tracked = TrackedBatches(encode_prompts(load_prompts(path), tokenizer, batch_size=8), load_prompts(path))
    assert tracked.rows() == "unknown" and len(tracked) == 3
    for _ in tracked:
        pass
    assert tracked.rows() == ", ".join(f"{b} = {path}:{17 + b}" for b in range(4))
    with pytest.raises(ValueError, match="not a reward's"):  # other errors pass through unchanged
        with placing_rows("iteration 3", tracked.rows):
            raise ValueError("not a reward's")
