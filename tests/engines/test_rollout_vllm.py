"""The vLLM engine on CPU (vLLM's CPU build), for real: one 2-rank run where rank 0 plays the actor and rank 1
drives a vLLM engine checks generation against the hf engine, the weight sync over the weight-sync group (read back
from vLLM's worker bit for bit), that vLLM's processes stay out of our world and end on close. Then the pure parts:
sampling translation, output conversion, the worker environment, and actor -> Hugging Face weight names (the
weight-transfer buckets and transports: test_rollout_vllm_transfer.py).

Cost: the 2-rank run starts one vLLM engine (~25 s on a quiet 2-core machine, ~50 s under load) and takes about a
minute in all.
"""

import importlib
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from hpc_rlhf.config import TINY_ASSETS
from hpc_rlhf.engines.rollout import vllm as vr
from hpc_rlhf.engines.rollout.base import RolloutError, SamplingParams, hf_named_tensors, hf_param_name
from hpc_rlhf.engines.rollout.vllm_transfer import CUDA_IPC_BACKEND, SHM_BACKEND
from tests.distributed import REAL_SPAWN_VAR, REPO, run_ranks

pytestmark = pytest.mark.vllm  # a skip fails CI (tests/ci_skips.py)

TINY = str(REPO / TINY_ASSETS / "models" / "llama-tiny")
EOS = 2
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10], [1, 20, 21, 22, 23, 24], [1, 30, 31], [1, 40, 41, 42]]
OUR_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HPC_RLHF_MARK")


# ------------------------------------------------------------------------------------ the real engine, 2 ranks
def perturbed(model, seed: int, scale: float = 0.05):
    """The actor after an update: every weight moved by seeded noise (the same on both ranks)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return model


def teacher_forced(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


class LongObservations:
    """An environment whose every observation is 20 tokens (digits, one token each in the tiny tokenizer), so that
    an episode's context grows by about 24 tokens a turn."""

    def reset(self, row: dict) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        return "01234567890123456789", 0.0, False


def play_crowded_episodes(engine, seed: int):
    """100 seeded episodes of 3 turns: their first turn's prompts hold 1,200 tokens, their third turn's contexts
    about 6,000, more than vLLM's CPU scheduler takes in one step (4,096). Returns the episodes' tokens and the
    largest turn's token count."""
    from transformers import AutoTokenizer

    from hpc_rlhf.envs.config import EnvSection
    from hpc_rlhf.envs.episodes import run_episodes
    from hpc_rlhf.envs.loading import EnvFactory

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    prompts = [[1] + [3 + (i + j) % 90 for j in range(11)] for i in range(100)]
    contexts = []

    def generate(prompt_ids, sampling):
        contexts.append(sum(len(p) for p in prompt_ids))
        return engine.generate(prompt_ids, sampling)

    settings = EnvSection(name="long_observations", max_turns=3, max_episode_tokens=52)
    batch = run_episodes([{"prompt": str(i)} for i in range(100)], prompts, generate,
                         SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=seed),
                         env=EnvFactory(name="long_observations", make=LongObservations), tokenizer=tokenizer,
                         settings=settings)
    return [torch.as_tensor(e.tokens).tolist() for e in batch.episodes], contexts


def _rank_main(out: str) -> None:
    """Rank 0: the actor, sends two updates over the group. Rank 1: drives vLLM and records what it sees."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.dist import weight_sync
    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine
    from hpc_rlhf.engines.rollout.reaper import children_of
    from hpc_rlhf.engines.rollout.vllm_worker import tensor_digest

    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    group = dist.new_group([0, 1])
    if rank == 0:
        for seed, bucket_mb in ((1, 0.5), (2, 3.0)):  # several buckets, then larger ones (the buffer grows)
            weight_sync.send_weights(perturbed(model, seed).state_dict().items(), src=0, group=group,
                                     bucket_mb=bucket_mb)
        dist.barrier()
        return
    os.environ["HPC_RLHF_MARK"] = "our-rank-only"
    engine = vr.VLLMRolloutEngine(TINY, EOS, dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_mb=64,
                                  seed=0)
    result = {"pids": engine.worker_pids(), "children": sorted(children_of({os.getpid()})), "rank_pid": os.getpid()}

    result["worker"] = engine.worker_info(OUR_VARS)[0]
    result["temp_dir"] = str(engine.temp_dir)
    result["temp_files"] = sorted(os.listdir(engine.temp_dir))
    result["worker_temp"] = engine.worker_info(("TMPDIR", "VLLM_RPC_BASE_PATH"))[0]["env"]
    result["our_env"] = {name: os.environ.get(name) for name in ("TMPDIR", "VLLM_RPC_BASE_PATH")}
    result["file_store"] = engine.file_store
    result["file_store_while_running"] = engine.file_store is not None and os.path.isfile(engine.file_store)
    result["our_master_port"] = os.environ["MASTER_PORT"]
    hf = HFRolloutEngine(model, pad_id=0, eos_id=EOS)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    sampled = SamplingParams(n=4, temperature=0.8, max_new_tokens=8, seed=123)

    def compare(tag):
        ours, theirs = engine.generate(PROMPTS, greedy), hf.generate(PROMPTS, greedy)
        result[f"{tag}_greedy"] = [[t.tolist() for t in ours.flat_responses()],
                                   [t.tolist() for t in theirs.flat_responses()]]
        result[f"{tag}_greedy_lp_gap"] = max(float((a - b).abs().max()) for a, b in zip(
            ours.flat_logprobs(), theirs.flat_logprobs(), strict=True) if a.shape == b.shape)
        first, again = engine.generate(PROMPTS, sampled), engine.generate(PROMPTS, sampled)
        result[f"{tag}_seeded_repeat"] = ([t.tolist() for t in first.flat_responses()] ==
                                          [t.tolist() for t in again.flat_responses()])
        gaps = [float((lp - teacher_forced(model, PROMPTS[i // 4], t.tolist(), 0.8)).abs().max())
                for i, (t, lp) in enumerate(zip(first.flat_responses(), first.flat_logprobs(), strict=True))]
        result[f"{tag}_sampled_lp_gap"] = max(gaps)
        result[f"{tag}_digests"] = engine.weight_digests()
        result[f"{tag}_expected"] = {k: tensor_digest(v) for k, v in model.state_dict().items()}

    compare("initial")
    # Seeded prompts that one scheduler step cannot hold (vLLM's CPU budget: 4,096 tokens a step): with chunked
    # prefill vLLM would split one of them across steps and its CPU build would die rewinding that request's
    # generator. Each prompt fits max_model_len=64 with its 8 new tokens.
    crowd = [[1] + [3 + (i + j) % 90 for j in range(49)] for i in range(100)]
    crowd_sampling = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=7)
    crowded = engine.generate(crowd, crowd_sampling)
    result["crowd_prompt_tokens"] = sum(len(p) for p in crowd)
    result["crowd_repeats"] = ([t.tolist() for t in crowded.flat_responses()] ==
                               [t.tolist() for t in engine.generate(crowd, crowd_sampling).flat_responses()])
    # Multi-turn episodes, where the later turns are the crowd: every live episode's whole context is a prompt.
    episodes, result["episode_turn_tokens"] = play_crowded_episodes(engine, seed=11)
    result["episodes_repeat"] = episodes == play_crowded_episodes(engine, seed=11)[0]
    result["episode_lengths"] = sorted({len(tokens) for tokens in episodes})
    for seed in (1, 2):
        stats = weight_sync.receive_weights(src=0, group=group, load_fn=engine.load_weights)
        perturbed(model, seed)  # what the actor now holds
        compare(f"sync{seed}")
        result[f"sync{seed}_buckets"] = stats.buckets
    engine.close()
    from hpc_rlhf.engines.rollout.reaper import process_stat

    result["alive_after_close"] = [pid for pid in result["pids"] if (stat := process_stat(pid)) and stat[2] != "Z"]
    result["left_after_close"] = [path for path in (str(engine.temp_dir), engine.file_store) if os.path.exists(path)]
    dist.barrier()
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_engine") / "result.json"
    # vLLM spawns its engine core as it does in a job, not through the tests' zygote: which process is whose child
    # is what test_vllm_processes_stay_out_of_our_world checks.
    run_ranks(2, __file__, "engine", str(out), timeout=600, env={REAL_SPAWN_VAR: "1"})
    return json.loads(out.read_text())


def test_vllm_processes_stay_out_of_our_world(run):
    worker = run["worker"]
    # On CPU without thread binding the worker runs inside vLLM's engine core (engine_kwargs): a process vLLM spawned
    # from our rank (its child, not a grandchild under the engine core), not our rank's own.
    assert worker["pid"] in run["children"] and worker["pid"] in run["pids"] and worker["pid"] != run["rank_pid"]
    assert all(value is None for value in worker["env"].values()), worker["env"]
    assert worker["world_size"] == 1  # vLLM's own torch world (its worker alone), not our 2 ranks


def test_greedy_output_equals_the_hf_engine_before_and_after_each_sync(run):
    for tag in ("initial", "sync1", "sync2"):
        ours, theirs = run[f"{tag}_greedy"]
        assert ours == theirs, tag
        assert run[f"{tag}_greedy_lp_gap"] < 1e-4, tag
    assert run["initial_greedy"][0] != run["sync1_greedy"][0] != run["sync2_greedy"][0]  # the syncs mattered


def test_sampled_log_probs_are_those_of_the_sampling_distribution(run):
    for tag in ("initial", "sync1", "sync2"):
        assert run[f"{tag}_sampled_lp_gap"] < 1e-4, tag


def test_seeded_sampling_repeats(run):
    assert all(run[f"{tag}_seeded_repeat"] for tag in ("initial", "sync1", "sync2"))


def test_seeded_prompts_beyond_one_steps_token_budget_generate_and_repeat(run):
    """More prompt tokens than vLLM's CPU scheduler takes in one step (4,096): the engine survives (no prefill is
    split, engine_kwargs) and the seeded samples still repeat."""
    assert run["crowd_prompt_tokens"] > 4096
    assert run["crowd_repeats"]


def test_seeded_episodes_whose_later_turns_exceed_one_steps_token_budget_play_out_and_repeat(run):
    """Multi-turn episodes on the vLLM engine (issue 38): the first turn's prompts fit one scheduler step, the third
    turn's contexts do not; every episode plays its 3 turns and the seeded episodes repeat token for token."""
    first, *later = run["episode_turn_tokens"]
    assert len(later) == 2 and first < 4096 < later[-1], run["episode_turn_tokens"]
    assert run["episodes_repeat"]
    assert min(run["episode_lengths"]) > 20  # past the first turn: an observation of 20 tokens and more turns


def test_weight_sync_over_the_group_reaches_the_worker_bit_for_bit(run):
    assert run["sync1_buckets"] >= 3  # the update session spans buckets that cut layers
    for tag in ("initial", "sync1", "sync2"):
        assert run[f"{tag}_digests"] == run[f"{tag}_expected"], tag
    assert run["sync1_digests"] != run["initial_digests"]
    assert len(run["sync2_digests"]) == 21  # every weight of the 2-layer model, q/k/v and gate/up split back


def test_close_ends_vllm_processes(run):
    assert run["alive_after_close"] == []


def test_vllms_sockets_and_file_store_are_removed_by_close(run):
    # vLLM names its sockets by uuid and its engine core's file store vllm_dist_<hex> in the temporary folder; a
    # killed or os._exit-ed process leaves them behind. The sockets go into the engine's own folder (TMPDIR stays
    # the rank's: torch keeps its compiled kernels' header under it), the file store is asked of the worker.
    assert run["worker_temp"] == {"TMPDIR": run["our_env"]["TMPDIR"], "VLLM_RPC_BASE_PATH": run["temp_dir"]}
    assert run["our_env"]["VLLM_RPC_BASE_PATH"] is None  # the rank's own environment is as it was
    assert os.path.basename(run["temp_dir"]).startswith("hpc_rlhf_vllm_")
    assert len(run["temp_files"]) >= 2, run["temp_files"]  # the sockets between the rank and its engine core
    assert os.path.basename(run["file_store"]).startswith("vllm_dist_") and run["file_store_while_running"]
    assert run["left_after_close"] == []


# ------------------------------------------------------------------------------------------ pure helpers


# ---------------------------------------------------------------------------------------- sampling params
def test_sampling_kwargs_translate_every_field_and_space_the_seeds():
    sampling = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=48, stop_token_ids=(7,),
                              seed=100)
    kwargs = vr.vllm_sampling_kwargs(sampling, stop_ids=[2, 7], num_prompts=3)
    assert [kw["seed"] for kw in kwargs] == [100, 104, 108]  # vLLM adds 0..n-1 per sample: all 12 distinct
    expected = dict(n=4, temperature=0.7, top_p=0.9, top_k=-1, max_tokens=48, stop_token_ids=[2, 7],
                    ignore_eos=False, logprobs=0, detokenize=False, skip_special_tokens=False)
    assert all({k: v for k, v in kw.items() if k != "seed"} == expected for kw in kwargs)
    unseeded = vr.vllm_sampling_kwargs(SamplingParams(top_k=5), stop_ids=[2], num_prompts=2)
    assert all("seed" not in kw and kw["top_k"] == 5 for kw in unseeded)


# ------------------------------------------------------------------------------------------ outputs
def completion(index, token_ids, logprobs, finish_reason):
    per_token = [{t: SimpleNamespace(logprob=lp), t + 1000: SimpleNamespace(logprob=-99.0)}
                 for t, lp in zip(token_ids, logprobs, strict=True)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=per_token, finish_reason=finish_reason)


def test_outputs_become_a_rollout_batch_in_prompt_and_sample_order():
    outputs = [
        SimpleNamespace(outputs=[completion(1, [5, 6, 2], [-0.1, -0.2, -0.3], "stop"),
                                 completion(0, [8, 9, 10, 11], [-1.0, -1.5, -2.0, -2.5], "length")]),
        # A stop token followed by more tokens (an engine that returns them): cut after the stop token.
        SimpleNamespace(outputs=[completion(0, [4, 7, 3, 3], [-0.5, -0.6, -0.7, -0.8], "stop"),
                                 completion(1, [2], [-0.05], "stop")]),
    ]
    batch = vr.rollout_batch_from_outputs([[1, 4], [1]], outputs, SamplingParams(n=2, max_new_tokens=4), [2, 7])
    assert [[t.tolist() for t in per] for per in batch.responses] == [[[8, 9, 10, 11], [5, 6, 2]], [[4, 7], [2]]]
    expected = [[[-1.0, -1.5, -2.0, -2.5], [-0.1, -0.2, -0.3]], [[-0.5, -0.6], [-0.05]]]
    for got_row, want_row in zip(batch.flat_logprobs(), [row for per in expected for row in per], strict=True):
        torch.testing.assert_close(got_row, torch.tensor(want_row))
    assert batch.finish_reasons == [["length", "stop"], ["stop", "stop"]]
    assert batch.prompt_ids == [[1, 4], [1]]


def test_incomplete_outputs_are_refused_with_the_prompt_named():
    sampling = SamplingParams(n=1, max_new_tokens=4)
    no_logprobs = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[5], logprobs=None,
                                                           finish_reason="length")])
    with pytest.raises(RolloutError, match="prompt 0 sample 0 no log-prob"):
        vr.rollout_batch_from_outputs([[1]], [no_logprobs], sampling, [2])
    aborted = SimpleNamespace(outputs=[completion(0, [5], [-1.0], "abort")])
    with pytest.raises(RolloutError, match="reason 'abort'"):
        vr.rollout_batch_from_outputs([[1]], [aborted], sampling, [2])
    with pytest.raises(RolloutError, match="2 samples for prompt 0, expected n=1"):
        vr.rollout_batch_from_outputs([[1]], [SimpleNamespace(outputs=[completion(0, [5], [-1.0], "length")] * 2)],
                                      sampling, [2])
    with pytest.raises(RolloutError, match="1 results for 2 prompts"):
        vr.rollout_batch_from_outputs([[1], [1]], [aborted], sampling, [2])


# ------------------------------------------------------------------------------------- engine plumbing
def test_engine_kwargs_name_an_importable_worker_extension_and_our_transport():
    kwargs = vr.engine_kwargs("/models/actor", tensor_parallel_size=2, dtype="bfloat16", gpu_memory_utilization=0.4,
                              seed=3, enable_sleep_mode=True, max_model_len=None, enforce_eager=False,
                              weight_backend=CUDA_IPC_BACKEND, extra={"enable_prefix_caching": False})
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["weight_transfer_config"] == {"backend": "hpc_rlhf_cuda_ipc"} and kwargs["skip_tokenizer_init"]
    assert "max_model_len" not in kwargs and "kv_cache_memory_bytes" not in kwargs
    assert kwargs["enable_prefix_caching"] is False and "enable_chunked_prefill" not in kwargs  # vLLM's default
    module, cls = kwargs["worker_extension_cls"].rsplit(".", 1)
    worker = importlib.import_module(module)  # registers both transports with vLLM's factory
    assert getattr(worker, cls) is worker.WorkerExtension
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    assert {SHM_BACKEND, CUDA_IPC_BACKEND} <= set(WeightTransferEngineFactory._registry)
    single = vr.engine_kwargs("/m", tensor_parallel_size=1, dtype="float32", gpu_memory_utilization=0.3, seed=0,
                              enable_sleep_mode=False, max_model_len=512, enforce_eager=True,
                              weight_backend=SHM_BACKEND, kv_cache_bytes=64 << 20, on_cpu=True)
    assert single["max_model_len"] == 512
    # On CPU the worker runs in the engine core's process unless the user pins vLLM's threads (that needs a
    # process per worker); the name is a class vLLM resolves.
    assert single["distributed_executor_backend"] == vr.WORKER_IN_ENGINE_CORE
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    module, cls = vr.WORKER_IN_ENGINE_CORE.rsplit(".", 1)
    assert getattr(importlib.import_module(module), cls) is UniProcExecutor
    pinned = vr.engine_kwargs("/m", tensor_parallel_size=1, dtype="float32", gpu_memory_utilization=0.3, seed=0,
                              enable_sleep_mode=False, max_model_len=512, enforce_eager=True,
                              weight_backend=SHM_BACKEND, on_cpu=True, cpu_thread_binding=True)
    on_gpu = vr.engine_kwargs("/m", tensor_parallel_size=1, dtype="bfloat16", gpu_memory_utilization=0.3, seed=0,
                              enable_sleep_mode=True, max_model_len=512, enforce_eager=False,
                              weight_backend=CUDA_IPC_BACKEND)
    assert "distributed_executor_backend" not in pinned and "distributed_executor_backend" not in on_gpu
    assert not vr.cpu_thread_binding({}) and not vr.cpu_thread_binding({"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert vr.cpu_thread_binding({"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert single["enable_chunked_prefill"] is False  # a split prefill of a seeded request kills vLLM's CPU build
    assert single["kv_cache_memory_bytes"] == 64 << 20


def test_worker_environment_hides_our_launcher_and_our_own_variables():
    ours = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "node1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "x", "HPC_RLHF_FAULT": "rank=3,kind=kill", "HPC_RLHF_LOCAL_LAUNCH": "1",
            "HPC_RLHF_STORE_SECRET": "the job's secret",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin", "SLURM_JOB_ID": "42",
            "HPC_RLHF_CPU_KERNELS": "native"}
    gpu = vr.worker_environment(ours, [2, 3], on_cpu=False)
    assert gpu == {"PATH": "/usr/bin", "SLURM_JOB_ID": "42", "HPC_RLHF_CPU_KERNELS": "native",
                   "CUDA_VISIBLE_DEVICES": "2,3",
                   "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cpu = vr.worker_environment(ours, None, on_cpu=True)
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and cpu["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert vr.worker_environment({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, None, True)["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    with_folder = vr.worker_environment({**ours, "TMPDIR": "/scratch/tmp"}, None, True, "/tmp/hpc_rlhf_vllm_x")
    assert with_folder["VLLM_RPC_BASE_PATH"] == "/tmp/hpc_rlhf_vllm_x" and with_folder["TMPDIR"] == "/scratch/tmp"


def test_the_file_store_is_read_from_the_init_method():
    assert vr.file_store_path("file:///tmp/vllm_dist_0a1b") == "/tmp/vllm_dist_0a1b"
    assert vr.file_store_path("tcp://127.0.0.1:29500") is None
    assert vr.file_store_path(None) is None
    assert vr.file_store_path("file:///home/user/results.json") is None  # not vLLM's store: never removed


def test_spawn_environment_restores_everything(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    with pytest.raises(KeyError):
        with vr.spawn_environment([2, 3]):
            assert "RANK" not in os.environ and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
            raise KeyError("vLLM failed to start")
    assert os.environ["RANK"] == "3" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


def test_creating_an_engine_without_vllm_gives_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    with pytest.raises(RolloutError, match="needs the vllm package"):
        vr.VLLMRolloutEngine("/models/actor", eos_id=2)


def test_the_sleeping_worker_looks_at_its_queue_without_a_notification(tmp_path):
    """On CPU vLLM's worker sleeps between orders instead of spinning, and it must not rely on the wake-up alone: the
    engine core's notifications can be lost (with the old wait, PPO on two vLLM engines stalled 5 s, vLLM's own
    recheck interval, in a step out of five), so every wait looks at the queue again within NOTIFY_RECHECK_MS."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.platforms import current_platform

    from hpc_rlhf.engines.rollout import vllm_worker

    if not current_platform.is_cpu():
        pytest.skip("the worker sleeps between orders only on vLLM's CPU platform")
    context = zmq.Context()
    reader = shm_broadcast.SpinCondition(True, context, f"ipc://{tmp_path}/notify")
    timeouts = []
    reader.poller = SimpleNamespace(poll=lambda timeout=None: timeouts.append(timeout) or [])
    try:
        assert reader.busy_loop_s == 0  # no spinning after a read
        reader.wait()  # the engine core's reads wait without a deadline
        reader.wait(timeout_ms=60_000)
        reader.wait(timeout_ms=3)
        assert timeouts == [vllm_worker.NOTIFY_RECHECK_MS, vllm_worker.NOTIFY_RECHECK_MS, 3]
    finally:
        context.destroy(linger=0)


# ------------------------------------------------------------------------------------------ weight names
@pytest.mark.parametrize("wrapped, plain", [
    ("module.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight", "model.layers.1.self_attn.q_proj.weight"),
    ("module.base_model.model.model.layers.1.self_attn.q_proj.base_layer.bias", "model.layers.1.self_attn.q_proj.bias"),
    ("module.base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
    ("_orig_mod.model.norm.weight", "model.norm.weight"),
    ("base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight", None),
    ("base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight", None),
    ("base_model.model.model.embed_tokens.lora_embedding_A.default", None),
    ("base_model.model.lm_head.original_module.weight", None),
])
def test_actor_names_map_to_hugging_face_names(wrapped, plain):
    assert hf_param_name(wrapped) == plain


def test_a_merged_peft_actor_wrapped_like_deepspeed_loads_into_a_plain_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.engines.rollout.hf import HFRolloutEngine

    def tiny(seed):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))

    actor = get_peft_model(tiny(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in actor.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make the adapters matter
            torch.nn.init.normal_(p, std=0.5)
    actor.merge_adapter()
    wrapped = torch.nn.Module()
    wrapped.module = actor  # what DeepSpeed's engine does: parameter names gain "module."
    engine = HFRolloutEngine(tiny(1), pad_id=0, eos_id=1)
    engine.load_weights(hf_named_tensors(wrapped.named_parameters()))
    actor.unmerge_adapter()
    expected = actor.merge_and_unload().state_dict()
    got = engine.model.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


if __name__ == "__main__":
    from tests.distributed import run_worker

    run_worker({"engine": _rank_main})
