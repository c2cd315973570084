import json
import logging
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlhf.data.loading import (BAD_MESSAGES, EMPTY_TEXT, MALFORMED_JSON, MISSING_KEY, NOT_AN_OBJECT,
                                   SOURCE_KEY, WRONG_TYPE, DataError, Messages, check_row, load_rows)

SFT = {"prompt": str, "response": str}
PAIRS = {"prompt": str, "chosen": str, "rejected": str}


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def rows_of(dataset, *keys):
    return [tuple(row[k] for k in keys) for row in dataset]


def load_error(*args, **kwargs) -> str:
    with pytest.raises(DataError) as err:
        load_rows(*args, **kwargs)
    return str(err.value)


# ------------------------------------------------------------------------------------------- good files
def test_jsonl_rows_load_with_their_source(tmp_path, cache):
    path = write_lines(tmp_path / "a.jsonl", ['{"prompt": "1+1=", "response": "2", "id": 7}', "",
                                             '{"prompt": "2+2=", "response": "4", "id": 8}'])
    ds, report = load_rows([str(path)], SFT, cache_dir=cache)
    assert rows_of(ds, "prompt", "response", "id") == [("1+1=", "2", 7), ("2+2=", "4", 8)]
    assert ds[SOURCE_KEY] == [f"{path}, line 1", f"{path}, line 3"]  # the blank line is not a row
    assert (report.rows_read, report.rows_kept, report.skipped) == (2, 2, 0)


def test_the_fingerprint_follows_the_rows_and_where_they_came_from(tmp_path, cache):
    """The _source column's fingerprint is computed here, not by datasets: the same file gives the same one, and
    the same rows from another file, or one row fewer, another (datasets names cache files by fingerprints)."""
    lines = ['{"prompt": "1+1=", "response": "2"}', '{"prompt": "2+2=", "response": "4"}']
    first, second = write_lines(tmp_path / "a.jsonl", lines), write_lines(tmp_path / "b.jsonl", lines)
    fingerprints = [load_rows([str(path)], SFT, cache_dir=cache, **kw)[0]._fingerprint
                    for path, kw in ((first, {}), (first, {}), (second, {}))]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]
    fewer = write_lines(tmp_path / "c.jsonl", lines + ['{"prompt": "", "response": "0"}'])
    skipped = load_rows([str(fewer)], SFT, cache_dir=cache, on_bad_row="skip")[0]
    assert len(skipped) == 2 and skipped._fingerprint not in fingerprints


def test_local_files_load_without_a_request_to_the_hub(tmp_path, cache, monkeypatch):
    """datasets pings the hub's download counter from load_dataset (a 3-second timeout where outgoing traffic is
    dropped, as on compute nodes) unless told not to: no session may be opened."""
    import datasets
    import datasets.load

    requests = []

    def no_network(*args, **kwargs):
        requests.append(args)
        raise AssertionError("load_rows opened an HTTP session")

    monkeypatch.setattr(datasets.load, "get_session", no_network)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)  # datasets' defaults
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    path = write_lines(tmp_path / "a.jsonl", ['{"prompt": "1+1=", "response": "2"}'])
    ds, _ = load_rows([str(path)], SFT, cache_dir=cache)
    assert len(ds) == 1 and requests == []


def test_json_array_rows_are_numbered_as_items(tmp_path, cache):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"prompt": "c", "response": ""}], indent=2))
    ds, _ = load_rows(path, SFT, cache_dir=cache, on_bad_row="skip")
    assert rows_of(ds, "prompt") == [("a",)] and ds[SOURCE_KEY] == [f"{path}, item 1"]
    assert f"{path}, item 2: key 'response' is empty text" in load_error(path, SFT, cache_dir=cache)


def test_pretty_printed_object_in_json_file_gets_a_hint(tmp_path, cache):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}, indent=2))
    assert "a .json file must hold a list of rows or one JSON object per line" in load_error(path, SFT,
                                                                                              cache_dir=cache)


def test_several_files_are_concatenated_in_order_and_max_rows_applies(tmp_path, cache):
    a = write_lines(tmp_path / "a.jsonl", ['{"prompt": "a1", "response": "x", "only_a": 1}',
                                           '{"prompt": "a2", "response": "x", "only_a": 2}'])
    b = write_lines(tmp_path / "b.jsonl", ['{"prompt": "b1", "response": "y"}'])
    ds, report = load_rows([a, b], SFT, cache_dir=cache)
    assert rows_of(ds, "prompt") == [("a1",), ("a2",), ("b1",)]
    assert "only_a" not in ds.column_names  # kept columns are those every file has
    assert ds[SOURCE_KEY][-1] == f"{b}, line 1" and report.rows_read == 3
    ds, _ = load_rows([a, b], SFT, cache_dir=cache, max_rows=2)
    assert rows_of(ds, "prompt") == [("a1",), ("a2",)]


def test_csv_and_parquet_and_saved_folders(tmp_path, cache):
    import datasets

    rows = {"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"]}
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected\np1,c1,r1\np2,c2,r2\n")
    parquet = tmp_path / "pairs.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(parquet))
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(splits))
    for path in (csv, parquet, folder, splits):
        ds, _ = load_rows(path, PAIRS, cache_dir=cache)
        assert rows_of(ds, "prompt", "chosen", "rejected") == [("p1", "c1", "r1"), ("p2", "c2", "r2")], path
        assert ds[SOURCE_KEY] == [f"{path}, row 1", f"{path}, row 2"]


def test_type_rules():
    assert check_row({"x": 1}, {"x": float}) is None  # JSON's 1 is a fine float
    assert check_row({"x": True}, {"x": int})[0] == WRONG_TYPE  # but true is not an int
    assert check_row({"x": True}, {"x": (bool, int)}) is None
    assert check_row({"x": "yes"}, {"x": (bool, int)}) == (WRONG_TYPE, "key 'x' must be bool or int, got str")
    assert check_row({"x": [{"role": "user", "content": "hi"}]}, {"x": (str, Messages)}) is None
    assert check_row({"x": "  "}, {"x": (str, Messages)}) == (EMPTY_TEXT, "key 'x' is empty text")


@pytest.mark.parametrize("value, expected", [
    ("hello", "must be a list of {role, content}, got str"),
    ([], "empty list of messages"),
    (["hi"], "item 0 must be an object with role and content, got str"),
    ([{"role": "user"}], "item 0 lacks content (it has keys: role)"),
    ([{"role": "user", "content": "a"}, {"role": "", "content": "b"}], "item 1 has role ''"),
    ([{"role": "user", "content": None}], "item 0 has content of type null"),
])
def test_messages_rules(value, expected):
    reason, message = check_row({"messages": value}, {"messages": Messages})
    assert reason == BAD_MESSAGES and expected in message and "'messages'" in message


# ------------------------------------------------------------------------------------------- bad rows
@pytest.mark.parametrize("line, expected", [
    ('{"prompt": "q", "response": "a"', r"line 2: malformed JSON"),
    ('[1, 2]', r"line 2: a row must be a JSON object with keys, got list"),
    ('{"prompt": "q", "answer": "a"}', r"line 2: key 'response' is missing \(the row has keys: prompt, answer\)"),
    ('{"prompt": "q", "response": null}', r"line 2: key 'response' is null"),
    ('{"prompt": "q", "response": ["a"]}', r"line 2: key 'response' must be str, got list"),
    ('{"prompt": "q", "response": " \\n"}', r"line 2: key 'response' is empty text"),
])
def test_first_bad_jsonl_row_stops_with_file_line_and_key(tmp_path, cache, line, expected):
    path = write_lines(tmp_path / "train.jsonl", ['{"prompt": "q", "response": "a"}', line,
                                                 '{"prompt": "q", "response": []}'])
    message = load_error([path], SFT, cache_dir=cache)
    assert message.startswith(f"{path}, line 2: ")
    assert re.search(expected, message), message


def test_messages_that_are_not_a_chat_are_bad_rows(tmp_path, cache):
    path = write_lines(tmp_path / "chat.jsonl", [json.dumps({"messages": [{"role": "user", "content": "a"}]}),
                                                json.dumps({"messages": "user: a"})])
    message = load_error(path, {"messages": Messages}, cache_dir=cache)
    assert message == f"{path}, line 2: key 'messages' must be a list of {{role, content}}, got str"


def test_missing_empty_and_unknown_files(tmp_path, cache):
    missing = tmp_path / "nope.jsonl"
    assert load_error([missing], SFT, where="data.eval_files", cache_dir=cache) == \
        f"data.eval_files: file '{missing}' does not exist"
    assert load_error([], SFT, cache_dir=cache) == "data.train_files is empty: no data files were given"
    for name, text in (("empty.jsonl", ""), ("blank.json", "\n  \n"), ("empty.csv", "")):
        (tmp_path / name).write_text(text)
        assert load_error(tmp_path / name, SFT, cache_dir=cache) == \
            f"data.train_files: file '{tmp_path / name}' is empty"
    (tmp_path / "header.csv").write_text("prompt,response\n")
    assert "is empty (no rows)" in load_error(tmp_path / "header.csv", SFT, cache_dir=cache)
    (tmp_path / "data.txt").write_text("x")
    assert "unknown format" in load_error(tmp_path / "data.txt", SFT, cache_dir=cache)
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9"}'.encode("latin-1"))
    assert "not UTF-8 text" in load_error(tmp_path / "latin1.jsonl", SFT, cache_dir=cache)
    (tmp_path / "folder").mkdir()
    assert "is not a dataset saved with save_to_disk" in load_error(tmp_path / "folder", SFT, cache_dir=cache)


def test_saved_folder_with_a_truncated_file_is_named_as_damaged(tmp_path, cache):
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": ["p1"] * 50, "response": ["r1"] * 50}).save_to_disk(str(folder))
    (arrow,) = folder.glob("*.arrow")
    with open(arrow, "r+b") as handle:
        handle.truncate(100)
    message = load_error(folder, SFT, cache_dir=cache)
    assert message.startswith(f"data.train_files: folder '{folder}' holds a dataset saved with save_to_disk, but "
                              f"it cannot be read (")
    assert message.endswith("); a file in it is truncated or corrupt")


def test_csv_missing_column_and_empty_cell_name_file_row_and_key(tmp_path, cache):
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected\np1,c1,r1\np2,,r2\n")
    assert load_error(csv, PAIRS, cache_dir=cache) == f"{csv}, row 2: key 'chosen' is null"
    no_column = tmp_path / "no_column.csv"
    no_column.write_text("prompt,good,rejected\np1,c1,r1\n")
    assert load_error(no_column, PAIRS, cache_dir=cache) == \
        f"{no_column}, row 1: key 'chosen' is missing (the row has keys: prompt, good, rejected)"


def test_parquet_and_saved_folder_bad_rows(tmp_path, cache):
    import datasets

    rows = datasets.Dataset.from_dict({"prompt": ["p1", "p2", "p3"], "chosen": ["c1", "c2", ""],
                                       "rejected": ["r1", "r2", "r3"]})
    parquet = tmp_path / "pairs.parquet"
    rows.to_parquet(str(parquet))
    assert load_error(parquet, PAIRS, cache_dir=cache) == f"{parquet}, row 3: key 'chosen' is empty text"
    folder = tmp_path / "saved"
    rows.save_to_disk(str(folder))
    ds, report = load_rows(folder, PAIRS, on_bad_row="skip", cache_dir=cache)
    assert rows_of(ds, "chosen") == [("c1",), ("c2",)] and report.counts == {EMPTY_TEXT: 1}
    assert ds[SOURCE_KEY] == [f"{folder}, row 1", f"{folder}, row 2"]


def test_skip_mode_counts_per_reason_and_logs_one_line(tmp_path, cache, caplog):
    a = write_lines(tmp_path / "a.jsonl", [
        '{"prompt": "g1", "response": "x", "meta": 1}',
        '{"prompt": "g2", "response": "x"',        # malformed
        'nonsense',                                 # malformed
        '{"prompt": "q"}',                          # missing key
        '{"prompt": "q", "response": 3}',           # wrong type
        '{"prompt": "", "response": "x"}',          # empty text
        '{"prompt": "g3", "response": "x", "meta": ["a column of mixed types"]}',
    ])
    b = write_lines(tmp_path / "b.jsonl", ['"just a string"', '{"prompt": "g4", "response": "x"}'])
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.data.loading"):
        ds, report = load_rows([a, b], SFT, on_bad_row="skip", cache_dir=cache)
    assert rows_of(ds, "prompt") == [("g1",), ("g3",), ("g4",)]
    assert ds[SOURCE_KEY] == [f"{a}, line 1", f"{a}, line 7", f"{b}, line 2"]
    assert report.counts == {MALFORMED_JSON: 2, MISSING_KEY: 1, WRONG_TYPE: 1, EMPTY_TEXT: 1, NOT_AN_OBJECT: 1}
    assert (report.rows_read, report.rows_kept, report.skipped) == (9, 3, 6)
    lines = [r.getMessage() for r in caplog.records if r.name == "hpc_rlhf.data.loading"]
    assert len(lines) == 1 and "skipped 6 of 9 rows" in lines[0] and "missing_key: 1" in lines[0]


def test_a_file_whose_rows_are_all_bad_is_an_error_even_when_skipping(tmp_path, cache):
    good = write_lines(tmp_path / "good.jsonl", ['{"prompt": "q", "response": "a"}'])
    bad = write_lines(tmp_path / "bad.jsonl", ['{"question": "q", "answer": "a"}'] * 3)
    message = load_error([good, bad], SFT, on_bad_row="skip", cache_dir=cache)
    assert f"every row of '{bad}' is bad" in message and "missing_key: 3" in message


# ------------------------------------------------------------------------------------------- property
GOOD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=8).filter(
    str.strip)
BAD_LINES = st.sampled_from([
    "{", "nonsense", '{"prompt": "x"', "[1, 2]", '"text"', "42", '{"prompt": "x"}',
    '{"prompt": "x", "response": ""}', '{"prompt": 3, "response": "y"}', '{"prompt": "x", "response": null}',
])
LINES = st.lists(st.one_of(st.tuples(st.just("good"), GOOD_TEXT, GOOD_TEXT), st.tuples(st.just("bad"), BAD_LINES),
                           st.just(("blank",))), min_size=1, max_size=12)


@settings(max_examples=30, deadline=None)
@given(lines=LINES)
def test_malformed_lines_among_good_ones(lines):
    rendered = [json.dumps({"prompt": item[1], "response": item[2]}) if item[0] == "good"
                else item[1] if item[0] == "bad" else "" for item in lines]
    good = [(item[1], item[2]) for item in lines if item[0] == "good"]
    bad_lines = [n for n, item in enumerate(lines, 1) if item[0] == "bad"]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_lines(Path(tmp) / "data.jsonl", rendered)
        cache_dir = str(Path(tmp) / "cache")
        if not good and not bad_lines:
            assert "is empty" in load_error(path, SFT, cache_dir=cache_dir)
            return
        if bad_lines:
            assert load_error(path, SFT, cache_dir=cache_dir).startswith(f"{path}, line {bad_lines[0]}: ")
        if not good:
            assert "every row" in load_error(path, SFT, on_bad_row="skip", cache_dir=cache_dir)
            return
        ds, report = load_rows(path, SFT, on_bad_row="skip", cache_dir=cache_dir)
        assert rows_of(ds, "prompt", "response") == good
        assert report.skipped == len(bad_lines) and report.rows_kept == len(good)
