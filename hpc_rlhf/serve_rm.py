"""`hpc-rlhf serve-rm MODEL_DIR`: a reward model served over HTTP, for runs that score remotely (`reward.http_url`).

One reward model (a folder `hpc-rlhf rm` wrote, or any value model `reward.models` takes) answers POSTs of JSON:

    {"prompts": [...], "responses": [...]}  ->  {"rewards": [...]}     what `reward.http_url` sends (the RL recipes,
                                                                         `generate`'s scoring); extra keys ignored
    {"query": [...]}                        ->  {"rewards": [...]}     whole texts (prompt and response together,
                                                                         special tokens as text), as OpenRLHF's
                                                                         remote reward clients send them

A prompt is tokenised as the RL recipes tokenise it (the tokenizer's special tokens, or its chat template with
`--chat-template`, where a prompt may also be a list of messages), a response as the text of its tokens (the RL
client decodes responses with their special tokens, which tokenise back to the same ids), and the reward is read
at the last token, as the in-job reward roles read it; with `--normalize` it is normalised by the model's
`reward_mean` and `reward_std`, as `reward.normalize` does. A sequence longer than `--max-len` keeps its last
`--max-len` tokens (the reward is read at the end).

The network is not trusted: the server listens on 127.0.0.1 unless `--host` says otherwise, and any other address
needs a shared secret (`--token-env NAME`: the environment variable holding it; clients send `Authorization:
Bearer <secret>`, as `reward.http_headers_from_env={Authorization: NAME}` does when NAME holds `Bearer <secret>`)
or an explicit `--allow-anyone`. A request must arrive whole within `--read-timeout-s` of its connection (a client
that trickles bytes loses it as one that sends nothing does), is at most `--max-request-mb` and `--max-texts` texts,
and is answered 4xx with a JSON `error` naming what was wrong (500 and the cause when the scoring itself fails; the
server goes on). At most `--max-connections` are served at once, each on a thread of its own; one more is answered
503 at once and closed. Requests are scored one at a time (the model is one).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RequestError(Exception):
    """A request the server refuses: the HTTP status and the reason, sent back as {"error": reason}."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def read_request(body: bytes, max_texts: int) -> tuple[str, list, list | None]:
    """("pairs", prompts, responses) or ("texts", texts, None) of a request body; RequestError (400) naming the key
    otherwise."""
    try:
        request = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestError(400, f"the body is not JSON in UTF-8 ({type(exc).__name__})") from None
    if not isinstance(request, dict):
        raise RequestError(400, "the body must be a JSON object with 'prompts' and 'responses', or 'query'")
    if "query" in request:
        texts = _strings(request["query"], "query", max_texts)
        return "texts", texts, None
    if "prompts" not in request or "responses" not in request:
        raise RequestError(400, "the body needs 'prompts' and 'responses' (or 'query': whole texts)")
    responses = _strings(request["responses"], "responses", max_texts)
    prompts = request["prompts"]
    if not isinstance(prompts, list) or len(prompts) != len(responses):
        raise RequestError(400, f"'prompts' must be a list as long as 'responses' ({len(responses)})")
    for i, prompt in enumerate(prompts):
        chat = isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                and isinstance(m.get("role"), str) for m in prompt)
        if not (isinstance(prompt, str) or chat):
            raise RequestError(400, f"prompts[{i}] is neither text nor a list of messages with role and content")
    return "pairs", prompts, responses


def _strings(value: Any, key: str, max_texts: int) -> list[str]:
    if not isinstance(value, list):
        raise RequestError(400, f"'{key}' must be a list of strings")
    if len(value) > max_texts:
        raise RequestError(413, f"'{key}' has {len(value)} texts; this server takes at most {max_texts} a request "
                                f"(--max-texts)")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise RequestError(400, f"{key}[{i}] is {type(item).__name__}, not a string")
    return value


class RewardScorer:
    """A reward model folder's rewards for prompt/response pairs or whole texts, in micro-batches."""

    def __init__(self, folder: str, *, max_len: int, batch_size: int, normalize: bool, chat_template: bool,
                 dtype: str = "auto"):
        # the model's libraries (~3 s) load once the arguments are good: --help and usage errors answer at once
        import torch

        from hpc_rlhf.config import ModelSection
        from hpc_rlhf.models.builders import check_model_folder, load_tokenizer
        from hpc_rlhf.models.folders import not_a_process_reward_model
        from hpc_rlhf.models.value_model import build_value_model

        check_model_folder(folder)  # before the tokenizer, whose loader would name a folder that is no model otherwise
        not_a_process_reward_model(folder, "serve-rm MODEL_DIR")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(folder, pad_to_eos=True)
        self.model = build_value_model(ModelSection(path=folder, dtype=dtype, init_value_head=False),
                                       for_training=False, device=self.device)
        self.max_len, self.batch_size = max_len, batch_size
        self.normalize, self.chat_template = normalize, chat_template
        self.lock = threading.Lock()  # one model: requests take turns

    def pair_sequences(self, prompts: Sequence, responses: Sequence[str]) -> list[list[int]]:
        # the RL recipes' own prompt tokenisation (torch and transformers: imported by __init__ already)
        from hpc_rlhf.data.examples import prompt_examples
        from hpc_rlhf.data.templates import encode_many

        examples = prompt_examples(self.tokenizer, list(prompts), max_prompt_len=self.max_len,
                                   chat_template=self.chat_template)
        prompt_ids = [example["input_ids"] for example in examples]
        response_ids = encode_many(self.tokenizer, list(responses), add_special_tokens=False)
        return [(p + r)[-self.max_len:] for p, r in zip(prompt_ids, response_ids)]

    def text_sequences(self, texts: Sequence[str]) -> list[list[int]]:
        # the data's batched tokenisation (transformers: imported by __init__ already)
        from hpc_rlhf.data.templates import encode_many

        return [ids[-self.max_len:] for ids in encode_many(self.tokenizer, list(texts), add_special_tokens=False)]

    def rewards(self, sequences: list[list[int]]) -> list[float]:
        # torch and the model code: imported by __init__ already
        import torch

        from hpc_rlhf.data.examples import pad_collate
        from hpc_rlhf.models.value_model import sequence_scores

        out: list[float] = []
        with self.lock, torch.no_grad():
            for start in range(0, len(sequences), self.batch_size):
                rows = [s or [self.tokenizer.eos_token_id] for s in sequences[start:start + self.batch_size]]
                batch = pad_collate([{"input_ids": s} for s in rows], self.tokenizer.pad_token_id)
                scores = sequence_scores(self.model, batch["input_ids"].to(self.device),
                                         batch["attention_mask"].to(self.device), normalize=self.normalize)
                out.extend(scores.float().cpu().tolist())
        return out


BUSY_REPLY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
              b"Connection: close\r\n\r\n%s")


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most `max_connections` connections at once (a thread each) and
    answers one more with a 503 from the accepting thread, so that callers on the network cannot make it start a
    thread for each of theirs."""
    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            reason = json.dumps({"error": f"busy: {self.max_connections} connections are being served "
                                          f"(--max-connections); try again"}).encode()
            try:
                request.settimeout(1.0)  # the accepting thread waits on no caller
                request.sendall(BUSY_REPLY % (len(reason), reason))
            except OSError:
                pass
            print(f"serve-rm: {client_address[0]}: refused (503): {self.max_connections} connections already "
                  f"(--max-connections)", file=sys.stderr, flush=True)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(scorer: RewardScorer, host: str, port: int, *, token: str | None, max_request_bytes: int,
                max_texts: int, read_timeout_s: float, max_connections: int = 64) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving) of `scorer` at host:port (port 0: any free port)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout_s + 5  # a backstop: the deadline below ends a request that is not whole first

        def setup(self):
            super().setup()
            # A client that sends a byte now and then would renew a per-read timeout forever: the request, headers
            # and body, must be whole by this deadline, or the connection is shut, which ends its reads.
            self.cut = False
            self.deadline = threading.Timer(read_timeout_s, self._cut)
            self.deadline.daemon = True
            self.deadline.start()

        def _cut(self) -> None:
            self.cut = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def handle(self):
            try:
                super().handle()
            except OSError as exc:  # the connection went while its request was read or answered: one line
                if not self.cut:  # (a cut one is said by finish)
                    print(f"serve-rm: {self.client_address[0]}: connection lost ({exc})", file=sys.stderr,
                          flush=True)

        def finish(self):
            self.deadline.cancel()
            if self.cut:  # whatever the handler made of the partial request, nobody was answered
                print(f"serve-rm: {self.client_address[0]}: no whole request within {read_timeout_s:g} s "
                      f"(--read-timeout-s)", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                super().finish()

        def do_POST(self):
            started = time.monotonic()
            try:
                kind, first, second = read_request(self._body(), max_texts)
                sequences = (scorer.pair_sequences(first, second) if kind == "pairs" else
                             scorer.text_sequences(first))
                self._answer(200, {"rewards": scorer.rewards(sequences)})
                print(f"serve-rm: {self.client_address[0]}: {len(sequences)} rewards in "
                      f"{time.monotonic() - started:.2f} s", file=sys.stderr, flush=True)
            except RequestError as exc:
                self._refuse(exc.status, str(exc))
            except TimeoutError:  # the body did not come by the deadline: nothing to answer to (finish logs it)
                self.cut = True
            except ValueError as exc:  # what the tokenizer refuses (a chat prompt its template cannot render, ...)
                self._refuse(400, f"the texts cannot be tokenised: {exc}")
            except Exception as exc:  # the server goes on; the caller learns that this batch failed, and why
                self._refuse(500, f"scoring failed: {type(exc).__name__}: {exc}")

        def _refuse(self, status: int, reason: str) -> None:
            self._answer(status, {"error": reason})
            if self.cut:  # a partial request the deadline cut short: finish says so
                return
            print(f"serve-rm: {self.client_address[0]}: refused ({status}): {reason}", file=sys.stderr, flush=True)

        def do_GET(self):
            self._answer(405, {"error": "POST a JSON body: {'prompts': [...], 'responses': [...]} or {'query': [...]}"})

        def _body(self) -> bytes:
            if token is not None:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    raise RequestError(401, "no or wrong 'Authorization: Bearer' secret")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise RequestError(411, "a Content-Length header is needed")
            if int(length) > max_request_bytes:
                raise RequestError(413, f"the body is {int(length)} bytes; this server reads at most "
                                        f"{max_request_bytes} (--max-request-mb)")
            body = self.rfile.read(int(length))
            if len(body) < int(length):
                if self.cut:  # the deadline shut the connection
                    raise TimeoutError
                raise RequestError(400, f"the body ended after {len(body)} of its {int(length)} bytes")
            self.deadline.cancel()
            return body

        def _answer(self, status: int, payload: dict) -> None:
            reply = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
            except OSError:  # the client gave up, or the deadline shut the connection: nothing to tell
                pass

        def log_message(self, *args):  # one line per request is printed by do_POST
            pass

    return BoundedServer((host, port), Handler, max_connections)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hpc-rlhf serve-rm", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="the reward model's folder (e.g. runs/rm/final)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    parser.add_argument("--port", type=int, default=5000, help="port (0: any free one, printed)")
    parser.add_argument("--token-env", default=None,
                        help="environment variable holding the secret clients send as 'Authorization: Bearer ...'")
    parser.add_argument("--allow-anyone", action="store_true",
                        help="listen on a non-loopback address without a secret")
    parser.add_argument("--normalize", action="store_true", help="(reward - reward_mean) / reward_std of the model")
    parser.add_argument("--chat-template", action="store_true",
                        help="render prompts with the tokenizer's chat template (data.apply_chat_template)")
    parser.add_argument("--max-len", type=int, default=2048, help="tokens kept of each sequence (the last ones)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-request-mb", type=float, default=16.0)
    parser.add_argument("--max-texts", type=int, default=4096, help="texts per request at most")
    parser.add_argument("--read-timeout-s", type=float, default=60.0,
                        help="time a client has to send its whole request, from its connection")
    parser.add_argument("--max-connections", type=int, default=64,
                        help="connections served at once; one more is answered 503 (busy)")
    args = parser.parse_args(argv)
    for name in ("max_len", "batch_size", "max_texts", "max_connections"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_request_mb <= 0 or args.read_timeout_s <= 0:
        parser.error("--max-request-mb and --read-timeout-s must be positive")
    return args


def secret_of(args: argparse.Namespace) -> str | None:
    """The shared secret (from --token-env), or None where the address allows none; ValueError saying why not."""
    if args.token_env:
        secret = os.environ.get(args.token_env)
        if not secret:
            raise ValueError(f"--token-env {args.token_env}: that environment variable is not set or empty")
        if any(c in secret for c in "\r\n\0"):
            raise ValueError(f"--token-env {args.token_env}: the secret holds a line break or a NUL")
        return secret
    if args.host not in LOOPBACK and not args.allow_anyone:
        raise ValueError(f"--host {args.host} lets other machines in: give a secret with --token-env NAME, or "
                         f"--allow-anyone to serve every caller on the network")
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # the config loader (no torch), after the arguments
    from hpc_rlhf.config import ConfigError

    try:
        token = secret_of(args)
        scorer = RewardScorer(args.model_dir, max_len=args.max_len, batch_size=args.batch_size,
                              normalize=args.normalize, chat_template=args.chat_template, dtype=args.dtype)
        server = make_server(scorer, args.host, args.port, token=token,
                             max_request_bytes=int(args.max_request_mb * 2 ** 20), max_texts=args.max_texts,
                             read_timeout_s=args.read_timeout_s, max_connections=args.max_connections)
    except (ValueError, ConfigError, OSError) as exc:
        print(f"hpc-rlhf serve-rm: {exc}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"serving the reward model {args.model_dir} at http://{host}:{port}/ (POST prompts and responses, or "
          f"query)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # scancel / kill: close the socket on the way out
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
