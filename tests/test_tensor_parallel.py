"""Tensor parallelism on CPU (gloo): two ranks give the greedy tokens of one rank, for every Llama-family
architecture (and a model with fewer KV heads than ranks), with prefix caching, chunked prefill, preemption and
lookahead scheduling in play; with worker processes of our own (mp) and with Ray actors; a worker killed
mid-stream ends the streams with an error and leaves no process behind; bad values fail at start-up naming the
flag. Weights load sharded: each rank reads only its slices."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.distributed import parallel_state
from checkpoints import ARCHITECTURES, build_checkpoint
from conftest import assert_no_leaks
from listening import listening_sockets

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog. Hello world!",  # shares a prefix (prefix cache hits)
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# small KV cache and step budget: prompts are prefilled in chunks and running requests get preempted
TIGHT = dict(num_kv_blocks=28, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=96,
             enable_prefix_caching=True, seed=0)


class Checkpoints:
    """Tiny checkpoints by name, built on first use (a run of the default tests builds one)."""

    def __init__(self, root):
        self.root, self.built = root, {}

    def __getitem__(self, name: str):
        if name not in self.built:
            if name == "one_kv_head":  # one KV head for two ranks: replicated, each rank's cache holds it
                self.built[name] = build_checkpoint(self.root / name, "Qwen3ForCausalLM", lm_head_std=0.5,
                                                    num_key_value_heads=1)
            elif name == "MistralForCausalLM":  # no sliding window here, so that the tight cache preempts
                self.built[name] = build_checkpoint(self.root / name, name, lm_head_std=0.5, sliding_window=None)
            elif name == "mistral_sliding_window":  # the test checkpoints' Mistral (window 12)
                self.built[name] = build_checkpoint(self.root / name, "MistralForCausalLM", lm_head_std=0.5)
            else:
                self.built[name] = build_checkpoint(self.root / name, name, lm_head_std=0.5)
        return self.built[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("tp"))


def generate(folder, tp: int, backend: str = "mp", lookahead: bool = False):
    """Greedy token ids per prompt, and the engine's counters, with `tp` ranks."""
    llm = LLM(model=str(folder), tensor_parallel_size=tp, distributed_executor_backend=backend,
              async_scheduling=lookahead, **TIGHT)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_no_leaks(llm.engine)
        stats = llm.engine.stats()
        return [o.outputs[0].token_ids for o in outputs], stats
    finally:
        llm.close()


def assert_same_tokens(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: first difference at token {next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)}"


# The four families and a model with fewer KV heads than ranks; ~40 s each on 2 loaded cores:
# one_kv_head (Qwen3's q/k norms, a replicated KV head) runs always, the rest are slow.
FAMILIES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
CASES = [pytest.param(a, marks=() if a == "one_kv_head" else pytest.mark.slow) for a in FAMILIES + ["one_kv_head"]]
# families added since (sliding windows, soft-caps, experts): the same tokens, slow
OTHERS = [a for a in ARCHITECTURES if a not in FAMILIES] + ["mistral_sliding_window"]


@pytest.mark.parametrize("arch", CASES)
def test_two_ranks_give_the_greedy_tokens_of_one(checkpoints, arch):
    one, stats_one = generate(checkpoints[arch], tp=1)
    two, stats_two = generate(checkpoints[arch], tp=2, lookahead=True)  # in-flight tokens reach rank 1 too
    assert_same_tokens(two, one)
    for stats in (stats_one, stats_two):  # the conditions the test claims were really met
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert parallel_state.tp_size() == 1, "closing the engine leaves the process with one rank again"


@pytest.mark.slow
def test_two_ranks_give_the_greedy_tokens_of_one_on_a_block_wise_fp8_mixture_of_experts(checkpoints, tmp_path):
    """Qwen3-MoE in block-wise FP8 (16 x 16 blocks): each rank takes its blocks of the experts' intermediate
    dimension (gate / up rows, down's inputs) and of the dense layers' slices, scales included."""
    import quant_checkpoints as qc

    folder, _ = qc.fp8_block_checkpoint(checkpoints["Qwen3MoeForCausalLM"], tmp_path, block=(16, 16))
    one, _ = generate(folder, tp=1)
    two, _ = generate(folder, tp=2)
    assert_same_tokens(two, one)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_two_ranks_give_the_greedy_tokens_of_one_on_int4_checkpoints(checkpoints, tmp_path, fmt, arch):
    """Qwen3-MoE and Llama in GPTQ (asymmetric) and AWQ int4, groups of 16: each rank takes its words and groups
    of the experts' intermediate dimension (gate / up outputs, down's inputs) and of the dense layers' slices;
    GPTQ's g_idx of a row-parallel slice counts groups from the rank's first (rank 1 refused it before)."""
    import quant_checkpoints as qc

    src = checkpoints[arch]
    if fmt == "awq":
        pytest.importorskip("awq", reason="AutoAWQ (the test extra) packs the AWQ checkpoint")
        folder, _ = qc.awq_checkpoint(src, tmp_path, group_size=16)
    else:
        folder, _ = qc.gptq_checkpoint(src, tmp_path, sym=False, group_size=16)
    one, _ = generate(folder, tp=1)
    two, _ = generate(folder, tp=2)
    assert_same_tokens(two, one)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_two_ranks_give_the_greedy_tokens_of_one_on_gptq_act_order(checkpoints, tmp_path, sym):
    """GPTQ act-order (desc_act, inputs in random group order) split over two ranks: the row-parallel layers
    (o_proj, down_proj) keep every group's scales on each rank and regroup their slice into padded groups of 32
    (refused before: "act-order ... split over tensor-parallel ranks"); the column-parallel ones sort their inputs
    by group as at one rank."""
    import quant_checkpoints as qc

    folder, _ = qc.gptq_checkpoint(checkpoints["LlamaForCausalLM"], tmp_path, desc_act=True, sym=sym)
    one, _ = generate(folder, tp=1)
    two, _ = generate(folder, tp=2)
    assert_same_tokens(two, one)


def test_gptq_act_order_experts_split_over_ranks_are_refused_naming_it(checkpoints, tmp_path):
    """Act-order experts at one rank run (test_quantization.py); split over ranks their down projections' inputs
    would each draw on every group: refused at start-up, saying what is supported."""
    import quant_checkpoints as qc

    folder, _ = qc.gptq_checkpoint(checkpoints["Qwen3MoeForCausalLM"], tmp_path, desc_act=True, group_size=16)
    with pytest.raises(Exception, match="act-order .* experts split over tensor-parallel ranks"):
        generate(folder, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch", OTHERS)
def test_two_ranks_give_the_greedy_tokens_of_one_for_the_other_families(checkpoints, arch):
    one, _ = generate(checkpoints[arch], tp=1)
    two, _ = generate(checkpoints[arch], tp=2, lookahead=True)
    assert_same_tokens(two, one)


@pytest.mark.slow
def test_two_ranks_on_ray_give_the_greedy_tokens_of_one(checkpoints):
    ray = pytest.importorskip("ray")
    temp_dir = tempfile.mkdtemp(prefix="tp-ray-")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, _node_ip_address="127.0.0.1",
             configure_logging=False, log_to_driver=False)
    try:
        arch = "Qwen2ForCausalLM"
        two, _ = generate(checkpoints[arch], tp=2, backend="ray")
        one, _ = generate(checkpoints[arch], tp=1)
        assert_same_tokens(two, one)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_rank_reads_only_its_slices(checkpoints):
    """Load a rank's model on its own (world of 2 declared, no collective needed to load) and check each
    parameter holds the checkpoint's slice for that rank, from a loader that never sees a whole tensor."""
    from safetensors import safe_open

    from asyncengine.config import load_model_config
    from asyncengine.models.checkpoint_slice import CheckpointSlice
    from asyncengine.models.loader import load_model

    folder = checkpoints["one_kv_head"]
    config = EngineConfig(model=str(folder), tensor_parallel_size=2, device="cpu")
    mc = load_model_config(config, torch.device("cpu"))
    read_elements = []
    original = CheckpointSlice.read
    CheckpointSlice.read = lambda self: read_elements.append(self.shape.numel()) or original(self)
    parallel_state._RANK, parallel_state._SIZE = 1, 2
    try:
        model = load_model(mc, torch.device("cpu"), max_positions=128)
    finally:
        parallel_state._RANK, parallel_state._SIZE = 0, 1
        CheckpointSlice.read = original
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}
    total = sum(t.numel() for t in full.values())
    assert sum(read_elements) < 0.7 * total, "rank 1 read more than its share"
    q_rows = mc.num_heads // 2 * mc.head_dim
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(qkv[:q_rows], full["model.layers.0.self_attn.q_proj.weight"][q_rows:])
    # the one KV head is replicated: rank 1 holds all of it
    assert torch.equal(qkv[q_rows:q_rows + mc.head_dim], full["model.layers.0.self_attn.k_proj.weight"])
    half_vocab = -(-mc.vocab_size // 2)
    assert torch.equal(model.embed_tokens.weight[: mc.vocab_size - half_vocab],
                       full["model.embed_tokens.weight"][half_vocab:])
    down = model.layers[0].mlp.down_proj.weight
    inter = mc.hf_config.intermediate_size
    assert torch.equal(down, full["model.layers.0.mlp.down_proj.weight"][:, inter // 2:])


def _worker_pids(engine: AsyncLLMEngine) -> list[int]:
    return [proc.pid for _, proc in engine.client.engine.runner.workers._backend.procs]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _signal_a_worker_mid_stream(engine, pid: int, sig: int, timeout_s: float):
    """Two greedy streams of 200 tokens; after stream "a"'s third output the worker `pid` gets `sig`. Returns
    (each stream's token count or exception, when the signal was sent)."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    signalled_at = []

    async def consume(request_id):
        got = 0
        async for _ in engine.generate(PROMPTS[0], params, request_id):
            got += 1
            if got == 3 and request_id == "a":
                os.kill(pid, sig)
                signalled_at.append(time.monotonic())
        return got

    results = await asyncio.wait_for(asyncio.gather(consume("a"), consume("b"), return_exceptions=True), timeout_s)
    return results, signalled_at[0]


def test_killing_a_worker_mid_stream_ends_the_streams_with_an_error(checkpoints):
    async def run():
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoints["one_kv_head"]), tensor_parallel_size=2,
                                             max_model_len=256, seed=0))
        pids = _worker_pids(engine)
        results, _ = await _signal_a_worker_mid_stream(engine, pids[0], signal.SIGKILL, timeout_s=60)
        assert all(isinstance(r, Exception) for r in results), results
        with pytest.raises(Exception):
            engine.check_health()
        await engine.shutdown()
        return pids

    pids = asyncio.run(run())
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "a worker process was left behind"
    assert parallel_state.tp_size() == 1 or not torch.distributed.is_initialized()


def test_a_hung_worker_ends_the_streams_within_the_step_timeout(checkpoints):
    """A worker stopped (SIGSTOP) mid-stream is a hung rank: within step_timeout_s every stream ends with an error
    naming the hang, the engine reports itself dead, and the stopped worker is killed, not left behind. Before
    that, an engine idle for longer than the step timeout lives on (its clock runs only while steps do)."""
    step_timeout = 2.0

    async def run():
        engine = AsyncLLMEngine(EngineConfig(model=str(checkpoints["one_kv_head"]), tensor_parallel_size=2,
                                             max_model_len=256, seed=0, step_timeout_s=step_timeout))
        pids = _worker_pids(engine)
        host, port = engine.client.engine.runner.workers.rendezvous
        # rank 0's rendezvous store listens where the ranks meet, not on every interface (as TCPStore would)
        assert {a for a, p, _ in listening_sockets([os.getpid()]) if p == port} == {host} == {"127.0.0.1"}
        short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len([o async for o in engine.generate(PROMPTS[1], short, "warm")][-1].outputs[0].token_ids) == 4
        await asyncio.sleep(step_timeout + 0.5)  # idle past the step timeout
        engine.check_health()
        results, stopped_at = await _signal_a_worker_mid_stream(engine, pids[0], signal.SIGSTOP, timeout_s=30)
        waited = time.monotonic() - stopped_at
        assert all(isinstance(r, Exception) for r in results), results
        assert all("hung" in repr(r) or "hung" in repr(r.__cause__) for r in results), results
        assert step_timeout <= waited < step_timeout + 10, waited
        with pytest.raises(Exception, match="hung"):
            engine.check_health()
        await engine.shutdown()
        return pids

    pids = asyncio.run(run())
    assert all(_gone(p) for p in pids), "the stopped worker was left behind"
    assert parallel_state.tp_size() == 1 or not torch.distributed.is_initialized()


_IDLE_WORKER = """
import sys, torch
from asyncengine.distributed import parallel_state
from asyncengine.distributed.executor import StepChannel
print("imported", flush=True)
parallel_state.init_tensor_parallel(1, 2, sys.argv[1], torch.device("cpu"), timeout_s=1.0)
channel = StepChannel(torch.device("cpu"), block_size=4)
step = channel.receive()
print("step", step.input_ids.tolist(), step.metadata.block_tables.tolist(), flush=True)
assert channel.receive() is None
parallel_state.destroy_tensor_parallel()
"""


def test_a_worker_waits_for_the_next_step_longer_than_the_distributed_timeout():
    """An idle engine's workers wait for rank 0's next step however long it takes (the header's control group has
    no timeout), while the world's collectives keep distributed_timeout_s (1 s here)."""
    import subprocess

    from asyncengine.distributed.executor import StepChannel, free_port
    from asyncengine.models.layers import AttentionMetadata

    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    worker = subprocess.Popen([sys.executable, "-c", _IDLE_WORKER, init], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "imported\n"  # torch imported: the rendezvous now takes no time
        cpu = torch.device("cpu")
        parallel_state.init_tensor_parallel(0, 2, init, cpu, timeout_s=1.0)
        try:
            time.sleep(2.5)  # idle: past the world's timeout
            i32 = dict(dtype=torch.int32)
            metadata = AttentionMetadata(
                query_start_loc=torch.tensor([0, 3], **i32), seq_lens=torch.tensor([3], **i32),
                block_tables=torch.tensor([[7]], **i32), slot_mapping=torch.tensor([28, 29, 30]),
                query_start_loc_cpu=torch.tensor([0, 3], **i32), seq_lens_cpu=torch.tensor([3], **i32),
                max_query_len=3, max_seq_len=3)
            channel = StepChannel(cpu, block_size=4)
            channel.send(torch.tensor([5, 6, 7]), torch.arange(3), metadata, torch.tensor([2]), None)
            channel.send_stop()
        finally:
            parallel_state.destroy_tensor_parallel()
        out, _ = worker.communicate(timeout=30)
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == 0 and "step [5, 6, 7] [[7]]" in out, out


def test_the_engine_core_reports_a_broken_engine_whose_step_never_ends(monkeypatch):
    """On CUDA a step may wait forever for a rank that is gone (a kernel in a graph replay or a symmetric-memory
    barrier): once the engine is known broken, the core stops waiting for that step after STUCK_STEP_GRACE_S."""
    from concurrent.futures import Future

    from asyncengine import engine_core

    monkeypatch.setattr(engine_core, "STUCK_STEP_GRACE_S", 0.2)
    never_ends: Future = Future()
    broken = TimeoutError("no tensor-parallel step finished in 2 s: a rank is hung")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a rank is hung .*did not end"):
        engine_core._step_result(never_ends, lambda: broken)
    assert time.monotonic() - started < 5
    ends = Future()
    ends.set_result("tokens")
    assert engine_core._step_result(ends, lambda: broken) == "tokens", "a step that ends gives its result"


def test_the_step_clock_gives_the_first_step_the_longer_limit_and_runs_only_while_steps_are_in_flight():
    from asyncengine.distributed.executor import StepClock

    clock = StepClock(step_timeout_s=0.05, first_step_timeout_s=30)
    time.sleep(0.1)
    assert not clock.overdue(), "no step in flight: idle time is not a hang"
    clock.started()
    time.sleep(0.1)
    assert not clock.overdue(), "the first step may take the start-up limit (kernels still compiling)"
    clock.finished()
    clock.started()
    clock.started()  # lookahead: the next step launched before this one is collected
    clock.finished()
    assert not clock.overdue()
    time.sleep(0.1)
    assert clock.overdue(), "a later step past step_timeout_s is a hang"
    clock.finished()
    assert not clock.overdue()


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(tensor_parallel_size=3), "--tensor-parallel-size"),  # 4 heads do not split over 3 ranks
    (dict(tensor_parallel_size=2, distributed_executor_backend="slurm"), "--distributed-executor-backend"),
])
def test_bad_values_fail_at_start_naming_the_flag(checkpoints, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(checkpoints["one_kv_head"]), **kwargs)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").iterdir():
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            found += children
            todo += children
    return found


def _workers_of(pid: int) -> list[int]:
    return [c for c in _descendants(pid) if b"asyncengine.distributed.worker" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_served_worker_killed_or_hung_mid_stream_ends_the_stream_503s_and_the_server_exits_1(tmp_path, sig):
    """`asyncengine serve -tp 2` (engine process, rank 0 in it, rank 1 its child): killing rank 1 mid-stream, or
    stopping it (a hung rank, caught by --step-timeout), ends the stream with an error frame, /health answers 503,
    the server exits 1 and no process is left (the stopped worker is killed)."""
    import httpx
    from test_server_cli import CLIServer, stream_events
    from test_server_engine_process import wait_gone

    server = CLIServer(None, "-tp", "2", "--max-model-len", "512", "--step-timeout", "2", log_dir=tmp_path,
                       num_kv_blocks=256)
    try:
        everyone = _descendants(server.proc.pid)
        workers = _workers_of(server.proc.pid)
        assert len(workers) == 1, everyone
        events, first = [], threading.Event()
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=stream_events, args=(server.url, body, events, first), daemon=True)
        reader.start()
        assert first.wait(60), server.logs()
        os.kill(workers[0], sig)
        reader.join(30)
        assert not reader.is_alive()
        assert any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        health = httpx.get(server.url + "/health", timeout=10)
        code = server.proc.wait(30)
    finally:
        server.kill()
    assert health.status_code == 503
    assert code == 1, server.logs()
    assert all(wait_gone(p, 10) for p in everyone), "a process was left behind"


def test_the_ray_backend_without_ray_names_the_extra(checkpoints, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ValueError, match=r"asyncengine\[ray\]"):
        LLM(model=str(checkpoints["one_kv_head"]), tensor_parallel_size=2, distributed_executor_backend="ray")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "one_kv_head"])
def test_two_gpus_give_the_greedy_tokens_of_one(checkpoints, arch):
    """On CUDA: NCCL, CUDA graphs captured on both ranks with the collectives inside, lookahead on (the default);
    float32 so that the ranks' partial sums cannot flip a greedy token."""
    def run(tp):
        llm = LLM(model=str(checkpoints[arch]), tensor_parallel_size=tp, dtype="float32", max_model_len=256,
                  gpu_memory_utilization=0.3, seed=0)
        try:
            assert llm.engine.runner.graphs is not None
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 4, GREEDY, use_tqdm=False)]
        finally:
            llm.close()

    assert_same_tokens(run(2), run(1))


def _all_reduce_rank(rank: int, port: int, queue) -> None:
    """Rank `rank` of two: the symmetric-memory path and NCCL sum the same random tensors (each rank draws its
    own, seeded by rank), decode- and prefill-sized, bf16 and float32; rank 0 reports the largest difference."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    parallel_state.init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", device)
    try:
        assert parallel_state._SYMMETRIC is not None, "the symmetric-memory path was not taken up"
        worst = 0.0
        for shape in [(1, 4096), (3, 8192), (256, 4096), (2048, 4096)]:  # the last is over the buffer: NCCL
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(shape, generator=torch.Generator(device).manual_seed(rank), device=device).to(dtype)
                want = x.float().clone()
                torch.distributed.all_reduce(want)  # NCCL, float32
                got = parallel_state.all_reduce(x.clone()).float()
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        if rank == 0:
            queue.put(worst)
    finally:
        parallel_state.destroy_tensor_parallel()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_symmetric_memory_all_reduce_equals_nccl():
    """Relative error of the sum at most 1/128 (bf16's rounding of the summed values; float32 is exact up to
    summation order), and leaving the world (an NCCL abort) returns at once on both ranks."""
    import torch.multiprocessing as mp

    from asyncengine.distributed.executor import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_all_reduce_rank, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    worst = queue.get(timeout=120)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, "a rank failed or did not leave the world"
    assert worst <= 1 / 128


def test_leaving_a_cuda_world_waits_for_nccls_abort_only_so_long(monkeypatch, caplog):
    """NCCL's abort may wait for the node's other ranks (run 89: rank 0 hung in it after its worker was killed).
    destroy_tensor_parallel gives it ABORT_WAIT_S in a daemon thread, then goes on with one rank and says so; a new
    world in this process is refused until the abort returns; once it has, leaving and joining work again. The
    abort here is a stand-in that blocks (no GPU needed)."""
    release = threading.Event()
    aborts = []

    def blocking_abort():
        aborts.append(threading.current_thread().name)
        release.wait(30)

    monkeypatch.setattr(parallel_state.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state.dist.distributed_c10d, "_abort_process_group", blocking_abort)
    monkeypatch.setattr(parallel_state, "_RANK", 1)
    monkeypatch.setattr(parallel_state, "_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_DEVICE", torch.device("cuda", 1))
    try:
        start = time.monotonic()
        parallel_state.destroy_tensor_parallel(wait_s=0.3)
        assert 0.3 <= time.monotonic() - start < 5
        assert aborts == ["nccl-leave"] and "abort did not return within" in caplog.text
        assert (parallel_state.tp_rank(), parallel_state.tp_size()) == (0, 1)
        parallel_state.destroy_tensor_parallel(wait_s=0.3)  # idempotent: no second abort while the first runs
        assert aborts == ["nccl-leave"]
        with pytest.raises(RuntimeError, match="has not finished leaving"):
            parallel_state.init_tensor_parallel(0, 2, "tcp://127.0.0.1:1", torch.device("cpu"))
    finally:
        release.set()
    parallel_state._LEAVING.join(5)
    monkeypatch.setattr(parallel_state.dist, "is_initialized", lambda: False)
    parallel_state.destroy_tensor_parallel()
    assert parallel_state._LEAVING is None
