"""`hpc-rlhf assets [--out DIR] [--seed S] [--force]`: write the built-in tiny assets.

    OUT/tokenizer/                   the committed character tokenizer
    OUT/models/<name>/               Hugging Face folders with random weights from the seed (llama-tiny, ...)
    OUT/data/sft_train.jsonl         prompt/response demonstrations, some with the dropped-carry mistake
    OUT/data/sft_eval.jsonl          held-out problems, correct answers
    OUT/data/pref_{train,eval}.jsonl prompt/chosen/rejected
    OUT/data/kto_{train,eval}.jsonl  prompt/completion/label
    OUT/data/prm_{train,eval}.jsonl  input/label: worked solutions, one +/- label per step (process reward model)
    OUT/data/prompts_{train,eval}.jsonl  prompt/answer (RL and evaluation)
    OUT/data/chat_train.jsonl        multi-turn messages
    OUT/data/sft_tool_train.jsonl    prompt/response demonstrations, a minority calling the calculator tool
    OUT/MANIFEST.json                what was generated and from what; written last

The folder is built beside OUT under a temporary name and renamed into place when complete, so a run that is
killed halfway never leaves a folder at OUT (a leftover `.NAME.tmp-*` folder has no MANIFEST.json and can be
deleted). A second run with the same seed finds a matching manifest and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.data import synthetic, tool_task
from hpc_rlhf.models import tiny

# Raise when the layout or the meaning of the files changes; files from another version are regenerated.
ASSETS_VERSION = 1
MANIFEST = "MANIFEST.json"


def source_fingerprint() -> str:
    """A hash of everything the assets are made from (committed tokenizer and configs, the task generator),
    so editing any of them makes existing assets out of date."""
    sources = {f"tiny/{path.relative_to(tiny.TINY_DIR).as_posix()}": path
               for path in sorted(tiny.TINY_DIR.rglob("*.json"))}
    sources["synthetic.py"] = Path(synthetic.__file__)
    sources["tool_task.py"] = Path(tool_task.__file__)
    digest = hashlib.sha256()
    for name, path in sources.items():
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def expected_header(seed: int) -> dict:
    """The manifest keys that must match for existing assets to count as up to date."""
    return {
        "version": ASSETS_VERSION,
        "seed": seed,
        "mistake_rate": synthetic.DEFAULT_MISTAKE_RATE,
        "num_heldout": synthetic.DEFAULT_NUM_HELDOUT,
        "models": list(tiny.MODEL_NAMES),
        "source": source_fingerprint(),
    }


def read_manifest(out_dir: str | Path) -> dict | None:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_up_to_date(out_dir: str | Path, seed: int | None = None) -> bool:
    """True when OUT holds complete assets of this version and sources (and of `seed`, unless None)."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        return False
    expected = expected_header(manifest.get("seed") if seed is None else seed)
    return all(manifest.get(key) == value for key, value in expected.items())


def write_jsonl(path: Path, rows: list[dict]) -> int:
    with open(path, "w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


def data_files(seed: int) -> dict[str, list[dict]]:
    """File name under data/ -> rows."""
    split = synthetic.split_problems(seed, synthetic.DEFAULT_NUM_HELDOUT)
    rate = synthetic.DEFAULT_MISTAKE_RATE
    return {
        "sft_train.jsonl": synthetic.sft_rows(split.train, seed, mistake_rate=rate),
        "sft_eval.jsonl": synthetic.sft_rows(split.heldout, seed, mistake_rate=0.0),
        "pref_train.jsonl": synthetic.preference_rows(split.train, seed),
        "pref_eval.jsonl": synthetic.preference_rows(split.heldout, seed),
        "kto_train.jsonl": synthetic.kto_rows(split.train, seed),
        "kto_eval.jsonl": synthetic.kto_rows(split.heldout, seed),
        "prm_train.jsonl": synthetic.process_rows(split.train, seed),
        "prm_eval.jsonl": synthetic.process_rows(split.heldout, seed),
        "prompts_train.jsonl": synthetic.prompt_rows(split.train),
        "prompts_eval.jsonl": synthetic.prompt_rows(split.heldout),
        "chat_train.jsonl": synthetic.chat_rows(split.train, seed, mistake_rate=rate),
        "sft_tool_train.jsonl": tool_task.tool_sft_rows(split.train, seed, mistake_rate=rate),
    }


def write_assets(folder: Path, seed: int) -> dict:
    """Write every asset into `folder` (which must exist), the manifest last; returns the manifest."""
    tiny.copy_tokenizer(folder / "tokenizer")
    for name in tiny.MODEL_NAMES:
        tiny.make_model_folder(name, folder / "models" / name, seed=seed)
    (folder / "data").mkdir()
    counts = {f"data/{name}": write_jsonl(folder / "data" / name, rows) for name, rows in data_files(seed).items()}
    manifest = {**expected_header(seed), "counts": counts}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def generate(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the assets in a temporary folder beside `out_dir`, then put it in place of `out_dir`."""
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        # mkdtemp makes a private (0700) folder; assets on a shared file system are for the whole group.
        os.chmod(staging, 0o777 & ~_umask())
        write_assets(staging, seed)
        _replace(out_dir, staging, seed)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(out_dir: Path, staging: Path, seed: int) -> None:
    # rename() cannot replace a non-empty folder, so the old one is moved aside first; between the two
    # renames OUT is missing (never half-written), and a concurrent caller then builds its own copy.
    retired = None
    if out_dir.exists():
        retired = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old-"))
        os.rename(out_dir, retired / "assets")
    try:
        os.rename(staging, out_dir)
    except OSError:
        # Another process (another rank) put complete assets there first: keep theirs.
        if not is_up_to_date(out_dir, seed):
            if retired is not None and not out_dir.exists():
                os.rename(retired / "assets", out_dir)  # put the old folder back rather than lose it
                shutil.rmtree(retired, ignore_errors=True)
            raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _check_replaceable(out_dir: Path) -> None:
    """Refuse to delete a folder that is not ours (one without a manifest that holds something), even with
    --force: `--out . --force` must not wipe a working copy."""
    if out_dir.is_file():
        raise FileExistsError(f"assets: {out_dir} is a file, not a folder")
    if out_dir.is_dir() and read_manifest(out_dir) is None and any(out_dir.iterdir()):
        raise FileExistsError(f"assets: {out_dir} exists and is not an assets folder (it has no {MANIFEST}); "
                              f"choose another --out, or delete the folder yourself")


def ensure_assets(out_dir: str | Path = TINY_ASSETS, seed: int = 0) -> Path:
    """The assets folder, generated when missing or out of date. Existing up-to-date assets are kept
    whatever their seed. Safe to call from several ranks at once (each builds privately, the first rename
    wins), though calling it on one rank and then waiting at a barrier saves work."""
    out_dir = Path(out_dir)
    if is_up_to_date(out_dir):
        return out_dir
    _check_replaceable(out_dir)
    return generate(out_dir, seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpc-rlhf assets",
                                     description="write the built-in tiny tokenizer, models and task data")
    parser.add_argument("--out", default=TINY_ASSETS, help=f"output folder (default: {TINY_ASSETS})")
    parser.add_argument("--seed", type=int, default=0, help="seed for the data split, the data and the weights")
    parser.add_argument("--force", action="store_true",
                        help="rewrite even when the folder is up to date (a folder without MANIFEST.json "
                             "is never replaced)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    if not args.force and is_up_to_date(out_dir, args.seed):
        print(f"{out_dir} is up to date (seed {args.seed}); --force rewrites it")
        return 0
    try:
        _check_replaceable(out_dir)
    except FileExistsError as exc:
        print(f"hpc-rlhf {exc}", file=sys.stderr)
        return 2
    generate(out_dir, args.seed)
    manifest = read_manifest(out_dir) or {}
    rows = sum(manifest.get("counts", {}).values())
    print(f"wrote {out_dir} (seed {args.seed}): tokenizer, {len(tiny.MODEL_NAMES)} models "
          f"({', '.join(tiny.MODEL_NAMES)}), {len(manifest.get('counts', {}))} data files with {rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
