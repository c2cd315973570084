"""Slurm's compressed host lists and task counts, parsed in Python.

Compute nodes do not always have `scontrol` on the PATH of a container, and calling it once per rank of a
large job puts load on the controller, so the two formats Slurm puts into the environment are read here:

    SLURM_JOB_NODELIST    gpu-[001-004,010],cpu7    ->  gpu-001 gpu-002 gpu-003 gpu-004 gpu-010 cpu7
    SLURM_TASKS_PER_NODE  4(x2),3                   ->  [4, 4, 3]
"""

from __future__ import annotations

import itertools


def _split_top_level(text: str, whole: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list '{whole}': nested '[' at position {i}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list '{whole}': ']' at position {i} has no matching '['")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list '{whole}': a '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_range_list(body: str, whole: str) -> list[str]:
    """`001-004,010` -> ['001', '002', '003', '004', '010'], keeping the width of zero-padded numbers."""
    values = []
    for item in body.split(","):
        if not item:
            raise ValueError(f"node list '{whole}': empty entry inside '[{body}]'")
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"node list '{whole}': '{item}' inside '[{body}]' is not a number or a range "
                             f"like 01-04")
        if not sep:
            values.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"node list '{whole}': range '{item}' goes backwards")
        # Slurm pads every number of a range to the width of its first bound ("08-10" -> 08 09 10).
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(first, last + 1))
    return values


def _expand_name(name: str, whole: str) -> list[str]:
    """One host pattern, possibly with several bracket groups: `r[1-2]n[01-02]` -> r1n01 r1n02 r2n01 r2n02."""
    if not name:
        raise ValueError(f"node list '{whole}': empty host name (a stray comma?)")
    pieces: list[list[str]] = []
    pos = 0
    while pos < len(name):
        open_at = name.find("[", pos)
        if open_at < 0:
            pieces.append([name[pos:]])
            break
        if open_at > pos:
            pieces.append([name[pos:open_at]])
        close_at = name.index("]", open_at)  # balanced: checked by _split_top_level
        body = name[open_at + 1:close_at]
        if not body:
            raise ValueError(f"node list '{whole}': empty brackets '[]' in '{name}'")
        pieces.append(_expand_range_list(body, whole))
        pos = close_at + 1
    return ["".join(combo) for combo in itertools.product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm node list into host names, in Slurm's order (later bracket groups vary fastest)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"node list {text!r} is empty")
    stripped = text.strip()
    if any(c.isspace() for c in stripped):
        raise ValueError(f"node list '{text}' contains white space")
    hosts: list[str] = []
    for name in _split_top_level(stripped, text):
        hosts.extend(_expand_name(name, text))
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """`4(x2),3` -> [4, 4, 3]: SLURM_TASKS_PER_NODE, one count per node of the node list."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"tasks per node {text!r} is empty")
    counts: list[int] = []
    for item in text.strip().split(","):
        count, _, repeat = item.partition("(x")
        if repeat:
            if not repeat.endswith(")") or not repeat[:-1].isdigit():
                raise ValueError(f"tasks per node '{text}': '{item}' is not of the form N or N(xM)")
            times = int(repeat[:-1])
        else:
            times = 1
        if not count.isdigit() or times < 1:
            raise ValueError(f"tasks per node '{text}': '{item}' is not of the form N or N(xM)")
        counts.extend([int(count)] * times)
    return counts
