"""`hpc-rlhf chat` through a pseudo-terminal: it streams the greedy answer of the chat-templated conversation,
/reset forgets the history, /exit leaves with status 0; a missing folder, or one that is not a usable model
folder, is one clear error."""

from __future__ import annotations

import shutil
import sys

import pexpect
import pytest
import torch

from hpc_rlhf.config import TINY_ASSETS
from tests.distributed import REPO, worker_env, zygote_for
from tests.zygote_python import SOCKET_VAR

MODEL = f"{TINY_ASSETS}/models/llama-tiny"


def expected_answer(messages: list[dict], max_new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.chat import build_prompt

    tokenizer = AutoTokenizer.from_pretrained(REPO / MODEL)
    model = AutoModelForCausalLM.from_pretrained(REPO / MODEL).eval()
    ids = torch.tensor([build_prompt(tokenizer, messages)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def spawn(*args: str) -> pexpect.spawn:
    """`python -m hpc_rlhf.chat ARGS` on a pseudo-terminal, forked from the tests' zygote where there is one:
    tests/zygote_python.py stands in for it on the terminal and hands the zygote's fork its three streams."""
    env = worker_env()
    zygote = zygote_for(env)
    stand_in = [str(REPO / "tests" / "zygote_python.py")] if zygote is not None else []
    if zygote is not None:
        env[SOCKET_VAR] = zygote.path
    return pexpect.spawn(sys.executable, [*stand_in, "-m", "hpc_rlhf.chat", *args], cwd=str(REPO), env=env,
                         encoding="utf-8", timeout=60)


def answer_of(child: pexpect.spawn) -> str:
    child.expect_exact("model> ")
    child.expect_exact("you> ")
    return child.before.replace("\r\n", "\n").rstrip("\n")


def test_chat_streams_answers_and_obeys_commands():
    from hpc_rlhf.data.assets import ensure_assets

    ensure_assets(REPO / TINY_ASSETS)
    child = spawn(MODEL, "--max-new-tokens", "6")
    child.expect_exact("you> ")
    child.sendline("12+34=")
    first = answer_of(child)
    assert first and first == expected_answer([{"role": "user", "content": "12+34="}], 6)

    # a second turn is answered with the first one in the context
    child.sendline("5+5=")
    second = answer_of(child)
    history = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": first},
               {"role": "user", "content": "5+5="}]
    assert second == expected_answer(history, 6)

    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.expect_exact("you> ")
    child.sendline("5+5=")
    assert answer_of(child) == expected_answer([{"role": "user", "content": "5+5="}], 6)

    child.sendline("/nonsense")
    child.expect_exact("unknown command /nonsense")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_names_a_missing_model_folder(tmp_path):
    child = spawn(str(tmp_path / "nowhere"))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 2
    assert "nowhere" in child.before and "does not exist" in child.before


def _not_a_model(folder):
    folder.mkdir()
    (folder / "notes.txt").write_text("a folder of other things\n")


def _without_tokenizer(folder):
    shutil.copytree(REPO / MODEL, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


def _truncated_weights(folder):
    shutil.copytree(REPO / MODEL, folder)
    with open(folder / "model.safetensors", "r+b") as handle:
        handle.truncate(100)


@pytest.mark.parametrize("make, expected", [
    (_not_a_model, "model folder '{folder}' has no config.json, so it is not a Hugging Face model folder"),
    (_without_tokenizer, "tokenizer folder '{folder}' has no tokenizer files"),
    (_truncated_weights, "model folder '{folder}': weight file model.safetensors is truncated or corrupt"),
], ids=["not a model", "no tokenizer", "truncated weights"])
def test_chat_names_a_folder_it_cannot_use(tmp_path, capsys, make, expected):
    from hpc_rlhf.chat import main
    from hpc_rlhf.data.assets import ensure_assets

    ensure_assets(REPO / TINY_ASSETS)
    folder = tmp_path / "folder"
    make(folder)
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpc-rlhf chat: " + expected.format(folder=folder)), err
    assert len(err.strip().splitlines()) == 1, err  # one line, not transformers' advice on slow tokenizers
