"""SFT data: every format to the same messages, bad rows named by file:line, assistant-only loss masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_smollm2 import GGUF_NAME, _smollm2_dir
from zerotron.components.supervised import RowError, encode_conversation, read_rows, to_messages
from zerotron.models.tokenizer import ByteTokenizer, load_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]
ROWS = {
    "messages": {"messages": CHAT},
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "And of Italy?"},
            {"from": "gpt", "value": "Rome."},
        ]
    },
    "query": {
        "system": "Be brief.",
        "history": [["Capital of France?", "Paris."]],
        "query": "And of Italy?",
        "response": "Rome.",
    },
}


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" if not isinstance(r, str) else r + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_formats_give_the_same_messages(tmp_path: Path, fmt: str) -> None:
    (row,) = read_rows(_write(tmp_path / "d.jsonl", [ROWS[fmt]]))
    assert not isinstance(row, RowError)
    assert to_messages(row) == CHAT
    assert to_messages(row, fmt) == CHAT


def test_alpaca_json_and_csv(tmp_path: Path) -> None:
    alpaca = {"instruction": "Translate", "input": "chat", "output": "cat", "system": "You translate."}
    (tmp_path / "a.json").write_text(json.dumps([alpaca]))
    (tmp_path / "b.csv").write_text("instruction,output\nSay hi,hi\n")
    rows = [r for r in read_rows(tmp_path) if not isinstance(r, RowError)]
    assert [r.where.rsplit("/", 1)[-1] for r in rows] == ["a.json:#0", "b.csv:2"]
    assert to_messages(rows[0]) == [
        {"role": "system", "content": "You translate."},
        {"role": "user", "content": "Translate\n\nchat"},
        {"role": "assistant", "content": "cat"},
    ]
    assert to_messages(rows[1])[-1] == {"role": "assistant", "content": "hi"}


def test_parquet_rows_as_written_by_pandas_or_datasets(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [ROWS["messages"], ROWS["sharegpt"], {"instruction": "Say hi", "output": "hi"}]
    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), tmp_path / "d.parquet")  # absent fields: null
    found = list(read_rows(tmp_path / "d.parquet"))
    assert [r.where.rsplit("/", 1)[-1] for r in found] == ["d.parquet:#0", "d.parquet:#1", "d.parquet:#2"]
    assert all(not isinstance(r, RowError) for r in found)
    assert to_messages(found[0]) == CHAT and to_messages(found[1]) == CHAT  # type: ignore[arg-type]
    assert to_messages(found[2], "alpaca")[-1] == {"role": "assistant", "content": "hi"}  # type: ignore[arg-type]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        list(read_rows(tmp_path / "broken.parquet"))


def test_bad_rows_named_by_file_and_line(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "bad.jsonl",
        [
            ROWS["messages"],
            "{not json",
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
            {"messages": [{"role": "user", "content": "hi"}]},
            {"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]},
            {"something": "else"},
        ],
    )
    found: dict[int, str] = {}
    for row in read_rows(path):
        try:
            if isinstance(row, RowError):
                raise row
            to_messages(row)
        except RowError as e:
            found[int(e.where.rsplit(":", 1)[1])] = str(e)
    assert sorted(found) == [2, 3, 4, 5, 6, 7]
    assert "bad JSON" in found[2] and "role 'wizard'" in found[3] and "empty assistant turn" in found[4]
    assert (
        "no assistant turn" in found[5] and "must be a string" in found[6] and "no known format" in found[7]
    )
    assert all(msg.startswith(f"{path}:{line}: ") for line, msg in found.items())
    with pytest.raises(RowError, match="not a sharegpt row"):
        to_messages(next(r for r in read_rows(path) if not isinstance(r, RowError)), "sharegpt")


def _counted_runs(sample, tokenizer) -> list[str]:  # noqa: ANN001
    runs, current = [], []
    for token, counted in zip(sample.ids, sample.counted):
        if counted:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_assistant_only_mask_by_hand_with_smollm2_template() -> None:
    tokenizer = load_tokenizer(_smollm2_dir() / GGUF_NAME)
    sample = encode_conversation(CHAT, tokenizer, "assistant")
    # Encoding piece by piece gives the tokens of the whole rendered conversation.
    assert sample.ids == tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=False))
    # Exactly each answer and the end of its turn are counted (hand-built from the template's text).
    assert _counted_runs(sample, tokenizer) == ["Paris.<|im_end|>\n", "Rome.<|im_end|>\n"]
    last = encode_conversation(CHAT, tokenizer, "last_turn")
    assert last.ids == sample.ids and _counted_runs(last, tokenizer) == ["Rome.<|im_end|>\n"]
    assert all(encode_conversation(CHAT, tokenizer, "all").counted)


def test_byte_tokenizer_mask_and_text_rows() -> None:
    tokenizer = ByteTokenizer()
    sample = encode_conversation(CHAT[1:3], tokenizer)
    text = tokenizer.apply_chat_template(CHAT[1:3], add_generation_prompt=False)
    counted = bytes(t for t, c in zip(sample.ids, sample.counted) if c)
    assert counted.decode() == "Paris.\n" and text.endswith("<|assistant|>\nParis.\n")
    plain = encode_conversation([{"role": "text", "content": "hello"}], tokenizer)
    assert plain.counted is None and plain.ids == tokenizer.encode("hello")
    with pytest.raises(ValueError, match="data.loss_on='everything'"):
        encode_conversation(CHAT, tokenizer, "everything")
