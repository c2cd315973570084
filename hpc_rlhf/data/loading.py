"""Load local data files into a `datasets.Dataset`, checking every row before training starts.

A bad row found after an hour of queueing costs the hour; found here it costs a second. So every row is checked
against the keys a mode needs (`required`: key -> expected type) and every problem is reported with the file,
the row and the key:

    data/train.jsonl, line 17: key 'chosen' must be str, got list

Formats, chosen by extension: `.jsonl`, `.json` (a list of objects or one object per line), `.parquet`, `.csv`,
and folders written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`. Several files are concatenated in
the order given.

JSON files are pre-scanned line by line with `json.loads`: `datasets` reports a malformed line without saying
which one, and the scan gives line numbers for free. A clean file is then read by `datasets.load_dataset` (cached
and memory-mapped); when rows were skipped, only the good lines are handed to `datasets`.

`on_bad_row="error"` stops at the first bad row. `"skip"` drops bad rows, counts them per reason and logs one
summary line. A file whose rows are all bad is an error in both modes: that is a format mismatch (wrong key
names, wrong file), not noise.

Every returned dataset has a `_source` column ("path, line 17") so that later steps (templates, tokenisation)
can name the row they fail on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

logger = logging.getLogger(__name__)

SOURCE_KEY = "_source"
JSON_EXTENSIONS = (".jsonl", ".json")
OTHER_EXTENSIONS = {".parquet": "parquet", ".csv": "csv"}
# What Dataset.save_to_disk (state.json) and DatasetDict.save_to_disk (dataset_dict.json) write into their folder.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")

# Reasons a row is refused; skip mode counts rows per reason.
MALFORMED_JSON = "malformed_json"
NOT_AN_OBJECT = "not_an_object"
MISSING_KEY = "missing_key"
WRONG_TYPE = "wrong_type"
EMPTY_TEXT = "empty_text"
BAD_MESSAGES = "bad_messages"
BAD_LABEL = "bad_label"  # a label the recipe's own check refused (data.examples), after the row scan


class DataError(ValueError):
    """A problem with the data, naming the file, the row and the key."""


class Messages:
    """Marker type for `required`: a chat, i.e. a non-empty list of {"role": str, "content": str} objects."""


@dataclass
class BadRowReport:
    """What validation found: rows read, rows kept and, per reason, how many rows were dropped."""

    where: str
    rows_read: int = 0
    rows_kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    first_message: dict[str, str] = field(default_factory=dict)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def add(self, reason: str, message: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.first_message.setdefault(reason, message)

    def drop(self, reason: str, message: str) -> None:
        """A kept row that a later check refused (data.examples: a label no recipe can read)."""
        self.rows_kept -= 1
        self.add(reason, message)

    def summary(self) -> str:
        if not self.skipped:
            return f"{self.where}: all {self.rows_read} rows are valid"
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.counts.items()))
        first = next(iter(self.first_message.values()))
        return (f"{self.where}: skipped {self.skipped} of {self.rows_read} rows ({reasons}); "
                f"first: {first}")


# ------------------------------------------------------------------------------------------- row validation
def _type_name(expected: type | tuple) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    names = ["a list of {role, content}" if tp is Messages else tp.__name__ for tp in types]
    return " or ".join(names)


def _value_type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _is_instance(value: Any, tp: type) -> bool:
    # JSON has one number type: 1 is a fine float, but True is not a fine int.
    if tp is Messages:
        return isinstance(value, list)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _messages_problem(value: list, key: str) -> str | None:
    if not value:
        return f"key '{key}' is an empty list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"key '{key}' item {i} must be an object with role and content, got {_value_type_name(message)}"
        missing = [k for k in ("role", "content") if k not in message]
        if missing:
            return (f"key '{key}' item {i} lacks {' and '.join(missing)} "
                    f"(it has keys: {', '.join(map(str, message)) or 'none'})")
        if not isinstance(message["role"], str) or not message["role"].strip():
            return f"key '{key}' item {i} has role {message['role']!r}; a role must be a non-empty string"
        if not isinstance(message["content"], str):
            return (f"key '{key}' item {i} has content of type {_value_type_name(message['content'])}; "
                    f"content must be a string")
    return None


def check_row(row: Any, required: Mapping[str, type | tuple]) -> tuple[str, str] | None:
    """None when `row` has every required key with a usable value, else (reason, message without location).

    `str` values must not be blank; `Messages` values must be chats; a tuple allows any of its types.
    """
    if not isinstance(row, Mapping):
        return NOT_AN_OBJECT, f"a row must be a JSON object with keys, got {_value_type_name(row)}"
    for key, expected in required.items():
        value = row.get(key)
        if key not in row:
            return MISSING_KEY, f"key '{key}' is missing (the row has keys: {', '.join(map(str, row)) or 'none'})"
        if value is None:
            return MISSING_KEY, f"key '{key}' is null"
        types = expected if isinstance(expected, tuple) else (expected,)
        matching = [tp for tp in types if _is_instance(value, tp)]
        if not matching:
            reason = BAD_MESSAGES if types == (Messages,) else WRONG_TYPE
            return reason, f"key '{key}' must be {_type_name(expected)}, got {_value_type_name(value)}"
        if isinstance(value, str) and not value.strip():
            return EMPTY_TEXT, f"key '{key}' is empty text"
        if Messages in matching and isinstance(value, list):
            problem = _messages_problem(value, key)
            if problem:
                return BAD_MESSAGES, problem
    return None


# --------------------------------------------------------------------------------------------- file readers
@dataclass
class _ScannedFile:
    """Result of checking one file: the locators of its good rows and, for table formats, their positions."""

    good_sources: list[str]
    good_positions: list[int]


def _json_rows(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(row locator, parsed value, parse error) for each row of a JSON or JSON Lines file, streaming."""
    with open(path, encoding="utf-8") as handle:
        first = handle.read(1)
        while first and first.isspace():
            first = handle.read(1)
        handle.seek(0)
        if first == "[" and path.suffix == ".json":  # a JSON array: it has to be parsed as a whole
            try:
                items = json.load(handle)
            except json.JSONDecodeError as exc:
                yield f"line {exc.lineno}", None, f"malformed JSON ({exc.msg}, column {exc.colno})"
                return
            for number, item in enumerate(items, 1):
                yield f"item {number}", item, None
            return
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line), None
            except json.JSONDecodeError as exc:
                hint = " (a .json file must hold a list of rows or one JSON object per line)" \
                    if path.suffix == ".json" and number == 1 else ""
                yield f"line {number}", None, f"malformed JSON ({exc.msg}, column {exc.colno}){hint}"


def _check_json_file(path: Path, required, on_bad_row: str, report: BadRowReport) -> _ScannedFile:
    # Nothing is kept but row locators, so the check streams through files of any size.
    scanned = _ScannedFile([], [])
    try:
        for locator, value, parse_error in _json_rows(path):
            report.rows_read += 1
            problem = (MALFORMED_JSON, parse_error) if parse_error else check_row(value, required)
            if problem is None:
                scanned.good_positions.append(len(scanned.good_sources))
                scanned.good_sources.append(f"{path}, {locator}")
                continue
            reason, message = problem
            message = f"{path}, {locator}: {message}"
            if on_bad_row == "error":
                raise DataError(message)
            report.add(reason, message)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return scanned


def _good_json_rows(path: Path, good_sources: list[str]) -> Iterator[Any]:
    """Second pass over a file that had bad rows: its good rows only."""
    wanted = set(good_sources)
    for locator, value, _ in _json_rows(path):
        if f"{path}, {locator}" in wanted:
            yield value


def _iter_dataset_rows(dataset, keys: list[str]) -> Iterator[dict[str, Any]]:
    if not keys:  # none of the required columns exist: every row lacks them all
        for _ in range(len(dataset)):
            yield {}
        return
    for batch in dataset.select_columns(keys).iter(batch_size=1024):
        for i in range(len(batch[keys[0]])):
            yield {key: batch[key][i] for key in keys}


def _check_dataset_rows(dataset, path: Path, required, on_bad_row: str, report: BadRowReport) -> _ScannedFile:
    scanned = _ScannedFile([], [])
    columns = list(dataset.column_names)
    present = [key for key in required if key in columns]
    for position, partial in enumerate(_iter_dataset_rows(dataset, present)):
        report.rows_read += 1
        # Only required columns are read; the others stand in as placeholders so that a message about a
        # missing key can list every column the file has.
        row = {column: partial.get(column, ...) for column in columns}
        problem = check_row(row, required)
        locator = f"{path}, row {position + 1}"
        if problem is None:
            scanned.good_sources.append(locator)
            scanned.good_positions.append(position)
            continue
        reason, message = problem
        if on_bad_row == "error":
            raise DataError(f"{locator}: {message}")
        report.add(reason, f"{locator}: {message}")
    return scanned


def _load_error(path: Path, exc: Exception) -> DataError:
    cause = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return DataError(f"{path}: could not be read by datasets: {type(cause).__name__}: {cause}")


def _is_blank(path: Path) -> bool:
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _read_folder(path: Path, where: str, required, on_bad_row: str, report: BadRowReport):
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        if any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
            raise DataError(f"{where}: folder '{path}' holds a dataset saved with save_to_disk, but it cannot be "
                            f"read ({exc}); a file in it is truncated or corrupt") from None
        raise DataError(f"{where}: folder '{path}' is not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise DataError(f"{where}: folder '{path}' holds several splits ({', '.join(loaded)}) and none "
                            f"is called 'train'; give the split's own folder instead")
    if len(loaded) == 0:
        raise DataError(f"{where}: '{path}' is empty (no rows)")
    return loaded, _check_dataset_rows(loaded, path, required, on_bad_row, report)


def _read_table(path: Path, where: str, required, on_bad_row: str, report: BadRowReport, cache_dir):
    import datasets

    if path.stat().st_size == 0:
        raise DataError(f"{where}: file '{path}' is empty")
    try:
        dataset = datasets.load_dataset(OTHER_EXTENSIONS[path.suffix], data_files=[str(path)], split="train",
                                        cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; the root cause is what helps
        # datasets refuses to build a split with no rows (a CSV with only its header, an empty parquet table).
        if "corresponds to no data" in str(exc):
            raise DataError(f"{where}: file '{path}' is empty (no rows)") from None
        raise _load_error(path, exc) from None
    if len(dataset) == 0:
        raise DataError(f"{where}: file '{path}' is empty (no rows)")
    return dataset, _check_dataset_rows(dataset, path, required, on_bad_row, report)


def _read_json(path: Path, where: str, required, on_bad_row: str, report: BadRowReport, cache_dir):
    if _is_blank(path):
        raise DataError(f"{where}: file '{path}' is empty")
    scanned = _check_json_file(path, required, on_bad_row, report)
    if not scanned.good_sources:
        return None, scanned
    if report.skipped:
        dataset = _load_json_rows(_good_json_rows(path, scanned.good_sources), path)
    else:
        dataset = _load_json_with_datasets(path, cache_dir)
    if len(dataset) != len(scanned.good_sources):  # the two JSON readers disagree on what a row is
        raise DataError(f"{path}: datasets read {len(dataset)} rows where the line scan found "
                        f"{len(scanned.good_sources)}")
    return dataset, scanned


def _load_one(path: Path, where: str, required, on_bad_row: str, cache_dir: str | None):
    """One file or saved folder -> (dataset of its good rows with a _source column, its report)."""
    report = BadRowReport(where=str(path))
    if path.is_dir():
        dataset, scanned = _read_folder(path, where, required, on_bad_row, report)
    elif path.suffix in JSON_EXTENSIONS:
        dataset, scanned = _read_json(path, where, required, on_bad_row, report, cache_dir)
    elif path.suffix in OTHER_EXTENSIONS:
        dataset, scanned = _read_table(path, where, required, on_bad_row, report, cache_dir)
    else:
        known = ", ".join(list(JSON_EXTENSIONS) + list(OTHER_EXTENSIONS))
        raise DataError(f"{where}: '{path}' has an unknown format; use {known} or a save_to_disk folder")

    if not scanned.good_sources:
        raise DataError(f"{where}: every row of '{path}' is bad ({report.summary()})")
    report.rows_kept = len(scanned.good_sources)
    if len(scanned.good_positions) != len(dataset):
        dataset = dataset.select(scanned.good_positions)
    if SOURCE_KEY in dataset.column_names:
        dataset = dataset.remove_columns(SOURCE_KEY)
    return dataset.add_column(SOURCE_KEY, scanned.good_sources,
                              new_fingerprint=_with_sources_fingerprint(dataset, scanned.good_sources)), report


def _with_sources_fingerprint(dataset, sources: list[str]) -> str:
    """The fingerprint of `dataset` with its `_source` column: a hash of the dataset's own fingerprint and of the
    locators, which datasets would otherwise compute by pickling the column (0.17 CPU-s of a 9,500-row file's 0.5
    of loading, Intel Xeon 2-core VM, 2026-11-30). Fingerprints name the cache files of later transforms (none here)."""
    digest = hashlib.sha256(getattr(dataset, "_fingerprint", "").encode())
    for source in sources:
        digest.update(source.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def _load_json_with_datasets(path: Path, cache_dir: str | None):
    import datasets

    try:
        return datasets.load_dataset("json", data_files=[str(path)], split="train", cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001
        raise _load_error(path, exc) from None


def _load_json_rows(rows: Iterable[Any], path: Path):
    """Good rows of a file that also had bad ones -> an in-memory dataset, typed by the same JSON reader."""
    import datasets

    # Rewriting the good rows as JSON Lines keeps the column types identical to a clean file's.
    with tempfile.TemporaryDirectory(prefix="hpc_rlhf_rows_") as tmp:
        clean = Path(tmp) / "rows.jsonl"
        with open(clean, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        try:
            return datasets.load_dataset("json", data_files=[str(clean)], split="train", keep_in_memory=True,
                                         cache_dir=os.path.join(tmp, "cache"))
        except Exception as exc:  # noqa: BLE001
            raise _load_error(path, exc) from None


# ------------------------------------------------------------------------------------------------- public
def _concatenate(parts: list, paths: list[Path], where: str):
    import datasets

    if len(parts) == 1:
        return parts[0]
    # Files may carry extra columns of their own: keep those every file has.
    common = [c for c in parts[0].column_names if all(c in p.column_names for p in parts[1:])]
    parts = [p.select_columns(common) for p in parts]
    target = parts[0].features
    aligned = [parts[0]]
    for part, path in zip(parts[1:], paths[1:]):
        if part.features != target:
            try:
                part = part.cast(target)
            except Exception:  # noqa: BLE001
                differ = [f"'{c}' ({part.features[c]} vs {target[c]})" for c in common
                          if part.features[c] != target[c]]
                raise DataError(f"{where}: '{path}' has columns of other types than '{paths[0]}': "
                                f"{', '.join(differ)}") from None
        aligned.append(part)
    return datasets.concatenate_datasets(aligned)


def load_rows(paths: str | os.PathLike | Sequence[str | os.PathLike], required: Mapping[str, type | tuple],
              where: str = "data.train_files", on_bad_row: str = "error", max_rows: int | None = None,
              cache_dir: str | None = None):
    """Read and check data files -> (datasets.Dataset, BadRowReport).

    paths: files or save_to_disk folders (`where` names the config key they came from, for messages).
    required: key -> type (or tuple of types) every row needs, e.g. {"prompt": str, "chosen": str} or
        {"messages": Messages}; `str` values must not be blank.
    on_bad_row: "error" raises DataError at the first bad row; "skip" drops bad rows, counts them per reason
        and logs one summary line.
    max_rows: keep the first max_rows good rows (after concatenation).
    The dataset keeps the files' columns plus `_source` ("path, line N" / "path, row N").
    """
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError(f"{where} is empty: no data files were given")
    for path in paths:
        if not path.exists():
            raise DataError(f"{where}: file '{path}' does not exist")
    import datasets

    datasets.disable_progress_bars()
    # Every file is local, so no request to the hub: by default load_dataset first pings the hub's download
    # counter (an HTTP HEAD with a 3-second timeout) from every rank for every file, and on a compute node whose
    # outgoing traffic is dropped each rank waits out that timeout.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    datasets.config.HF_HUB_OFFLINE = True
    parts, reports = [], []
    for path in paths:
        dataset, report = _load_one(path, where, required, on_bad_row, cache_dir)
        parts.append(dataset)
        reports.append(report)
    dataset = _concatenate(parts, paths, where)
    if max_rows is not None and len(dataset) > max_rows:
        dataset = dataset.select(range(max_rows))
    total = _merge_reports(reports, where)
    if total.skipped:
        logger.warning(total.summary())
    return dataset, total


def _merge_reports(reports: Iterable[BadRowReport], where: str) -> BadRowReport:
    total = BadRowReport(where=where)
    for report in reports:
        total.rows_read += report.rows_read
        total.rows_kept += report.rows_kept
        for reason, n in report.counts.items():
            total.counts[reason] = total.counts.get(reason, 0) + n
        for reason, message in report.first_message.items():
            total.first_message.setdefault(reason, message)
    return total


def end_later_checks(report: BadRowReport, skipped_before: int, examples_kept: int) -> None:
    """After a recipe's own checks of the rows `load_rows` kept (`skipped=` of data.examples' builders): log the
    report again when they skipped more rows, and refuse data that has no row left."""
    if report.skipped == skipped_before:
        return
    if examples_kept == 0:
        raise DataError(f"{report.where}: every row is bad ({report.summary()})")
    logger.warning(report.summary())
