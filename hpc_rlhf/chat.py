"""`hpc-rlhf chat MODEL_DIR`: talk to a model in the terminal.

Each turn is rendered with the tokenizer's chat template (a plain "user text -> model text" transcript when the
tokenizer has none) and the answer is printed token by token as it is generated (transformers' TextStreamer).
Commands: /reset forgets the conversation, /exit (or end of input) leaves.
"""

from __future__ import annotations

import argparse
import sys

from hpc_rlhf.config import ConfigError, ModelSection

HELP = "commands: /reset forgets the conversation, /exit leaves"


def build_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation so far, ending where the assistant's next turn starts."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    # No template: the turns one after the other, each closed by EOS as in plain-text SFT data.
    eos = tokenizer.eos_token or ""
    text = "".join(m["content"] + (eos if m["role"] == "assistant" else "") for m in messages)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hpc-rlhf chat", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="Hugging Face model folder (e.g. runs/sft/final)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--system", default=None, help="a system message at the start of every conversation")
    parser.add_argument("--max-context", type=int, default=None,
                        help="keep at most this many tokens of history (default: the model's positions)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # torch and transformers (~3 s) only once the arguments are good: `--help` and usage errors answer at once.
    import torch
    from transformers import TextStreamer

    from hpc_rlhf.models.builders import build_causal_lm, check_model_folder, load_tokenizer

    try:
        # The folder first: a folder that is no model at all would otherwise be reported by the tokenizer loader
        # in terms of slow tokenizers and sentencepiece.
        check_model_folder(args.model_dir)
        tokenizer = load_tokenizer(args.model_dir, pad_to_eos=True)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = build_causal_lm(ModelSection(path=args.model_dir), for_training=False, device=device)
    except ConfigError as exc:
        print(f"hpc-rlhf chat: {exc}", file=sys.stderr)
        return 2
    limit = args.max_context or getattr(model.config, "max_position_embeddings", None) or 4096
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print(f"chatting with {args.model_dir}; {HELP}", flush=True)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            messages = list(start)
            print("(conversation cleared)", flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]}; {HELP}", flush=True)
            continue
        messages.append({"role": "user", "content": text})
        ids = build_prompt(tokenizer, messages)
        budget = max(1, min(args.max_new_tokens, limit - 1))
        ids = ids[-(limit - budget):]  # the oldest history goes first when the context is full
        input_ids = torch.tensor([ids], device=model.device)
        sampling = ({"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
                    if args.temperature > 0 else {"do_sample": False})
        print("model> ", end="", flush=True)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=budget, streamer=streamer, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, **sampling)
        answer = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
