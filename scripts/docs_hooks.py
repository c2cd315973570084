"""The generated pages of the documentation site, and the mkdocs hook that adds them to every build (mkdocs.yml).

    python scripts/docs_hooks.py OUT_DIR      # writes the generated pages into OUT_DIR, to read them without mkdocs

- reference/configuration.md: every key of every mode (`hpc-rlhf MODE --help`), with its type, default, range or
  choices and meaning, read from the config classes by hpc_rlhf.config.key_infos, the function `--help` prints
  from: the page cannot drift from the command line (tests/docs/test_reference.py compares them).
- reference/openrlhf.md: the flag tables of `hpc-rlhf from-openrlhf`, rendered from its own table
  (hpc_rlhf.openrlhf.FLAGS), and its worked example (an OpenRLHF-style 70B PPO command, converted, beside
  sbatch/ppo_70b.sbatch and examples/cluster/ppo_70b.yaml).

The pages are made in memory at each build (mkdocs' on_files event): they are never committed, so never stale.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # mkdocs loads this file by path, from any working directory
    sys.path.insert(0, str(REPO))

GENERATED = {"reference/configuration.md": "config_reference", "reference/openrlhf.md": "openrlhf_reference"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _range(info) -> str:
    if info.choices:
        return " ".join(f"`{c}`" for c in info.choices)
    low = "" if info.min is None else f">= {info.min:g}"
    high = "" if info.max is None else f"<= {info.max:g}"
    return ", ".join(part for part in (low, high) if part)


def mode_reference(mode: str) -> str:
    """The table of one mode's keys."""
    from hpc_rlhf.config import key_infos
    from hpc_rlhf.launch.modes import DESCRIPTIONS, mode_config

    config_class = mode_config(mode)  # from the module that imports no torch: the build needs only the keys
    rows = [f"## hpc-rlhf {mode}", "", f"{DESCRIPTIONS.get(mode, '')}. `hpc-rlhf {mode} --help` prints the same keys.",
            "", "| key | type | default | range or choices | meaning |", "|---|---|---|---|---|"]
    for info in key_infos(config_class):
        rows.append(f"| `{info.key}` | {_cell(info.type)} | `{_cell(info.default)}` | {_cell(_range(info))} | "
                    f"{_cell(info.help)} |")
    return "\n".join(rows) + "\n"


def config_reference() -> str:
    from hpc_rlhf.launch.modes import TRAINING_MODES

    intro = ("# Configuration reference\n\nEvery key of every mode, generated from the config classes at each build "
             "(scripts/docs_hooks.py): the same keys, defaults and meanings as `hpc-rlhf MODE --help`. A key is set "
             "in a YAML file (`--config FILE.yaml`, sections as nested mappings) or on the command line as "
             "`key=value`, which wins over the file.\n\n"
             + "\n".join(f"- [hpc-rlhf {mode}](#hpc-rlhf-{mode})" for mode in TRAINING_MODES) + "\n")
    return intro + "\n" + "\n".join(mode_reference(mode) for mode in TRAINING_MODES)


def openrlhf_reference() -> str:
    import yaml

    from hpc_rlhf import openrlhf

    mode, flags, sets = openrlhf.EXAMPLE_70B
    tree, conv = openrlhf.convert(mode, flags, dict(openrlhf.parse_override(s) for s in sets))
    pairs, i = [], 0
    while i < len(flags):  # one flag (and its values) per line of the shown command
        j = i + 1
        while j < len(flags) and not flags[j].startswith("--"):
            j += 1
        pairs.append(" ".join(shlex.quote(f) for f in flags[i:j]))
        i = j
    command = " \\\n    ".join(["hpc-rlhf from-openrlhf --mode ppo", *(f"--set {s}" for s in sets), "--", *pairs])
    ours = yaml.safe_load((REPO / "examples/cluster/ppo_70b.yaml").read_text())
    parts = [
        "# OpenRLHF flags and hpc_rlhf keys\n",
        "`hpc-rlhf from-openrlhf [--mode ppo|dpo|rm|prm|sft] [--set KEY=VALUE ...] -- <OpenRLHF flags>` prints the "
        "hpc_rlhf config of an OpenRLHF command. The tables below are generated from the converter's own table "
        "(hpc_rlhf/openrlhf.py), so they say exactly what it does: a flag is mapped to the keys shown, ignored "
        "(it changes nothing hpc_rlhf computes, for the reason given), or refused (no exact equivalent; the "
        "converter stops naming it). A flag in no table is refused by name. Only the flags given are translated: "
        "the other keys keep hpc_rlhf's defaults, which the printed config lists.\n",
        "## Worked example: PPO of a 70B model\n",
        "An OpenRLHF-style command for the layout of `sbatch/ppo_70b.sbatch` (4 nodes x 8 GPUs: actor and critic "
        "on 8 GPUs each, reference and reward model on 4 each, 2 vLLM engines of tensor-parallel 4). OpenRLHF counts "
        "episodes and a warmup ratio; hpc_rlhf counts steps, so those come with `--set`:\n",
        f"```bash\n{command}\n```\n",
        "It prints this config (the comments it adds are left out here):\n",
        f"```yaml\n{yaml.safe_dump(tree, sort_keys=False)}```\n",
        "`examples/cluster/ppo_70b.yaml`, the config of `sbatch/ppo_70b.sbatch`, sets the same placement, models, "
        "batch sizes, lengths, learning rates and checkpointing, and adds what the converted config leaves at "
        "hpc_rlhf's defaults or OpenRLHF has no flag for:\n",
        f"```yaml\n{yaml.safe_dump(ours, sort_keys=False)}```\n",
        "Either runs as the same job: `sbatch sbatch/ppo_70b.sbatch` with `CONFIG=` naming the file.\n",
    ]
    if conv.ignored:
        parts.append("Flags of the example accepted and ignored: "
                     + "; ".join(f"`{name}` ({why})" for name, why in conv.ignored) + ".\n")
    for mode_name, script in openrlhf.SCRIPTS.items():
        parts += [f"## {script} (--mode {mode_name})\n", openrlhf.flag_table(mode_name)]
    return "\n".join(parts)


def on_files(files, config):
    """mkdocs hook: add the generated pages to the build."""
    from mkdocs.structure.files import File

    for path, maker in GENERATED.items():
        files.append(File.generated(config, path, content=globals()[maker]()))
    return files


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/docs_hooks.py OUT_DIR", file=sys.stderr)
        return 2
    for path, maker in GENERATED.items():
        target = Path(argv[0]) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(globals()[maker]())
        print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
