"""Scheduler with a BlockManager and Requests, no model: the token budget, chunked prefill beside running decodes,
preemption by recompute, FIFO admission, the max_num_seqs cap, and freeing on finish / abort."""

from __future__ import annotations

import random

from asyncengine.block_manager import BlockManager
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=16, max_model_len=256, prefix_caching=False,
                   chunked=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, **params) -> Request:
    seed = sum(map(ord, request_id))
    prompt = [(seed * 7 + i) % 300 + 10 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(**params), max_tokens)


def fake_token(request: Request) -> int:
    """The 'model': a token that depends only on the request and position, so a recompute samples the same."""
    return (sum(request.prompt_token_ids) + request.num_tokens) % 300 + 10


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, 'compute', sample for the requests that reach their last token."""
    out = sched.schedule()
    sampled = {s.request.request_id: fake_token(s.request) for s in out.scheduled if s.samples}
    sched.update(out, sampled)
    return out


def new_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def check_blocks(sched: Scheduler) -> None:
    """Ref counts equal the number of live tables holding each block; waiting requests hold none."""
    bm = sched.block_manager
    for block in bm.blocks:
        holders = sum(r.block_table.count(block.block_id) for r in sched.running)
        assert block.ref_count == holders, block
        assert (block.block_id in bm.free) == (holders == 0)
    assert all(not r.block_table and r.num_computed_tokens == 0 for r in sched.waiting)


# -- budget ----------------------------------------------------------------------------------------------------
def test_token_budget_and_block_tables_hold_every_step_of_a_random_workload():
    rng = random.Random(0)
    budget = 16
    sched = make_scheduler(num_blocks=24, budget=budget, max_num_seqs=6, prefix_caching=True)
    shared = [7] * 12  # some prompts share a prefix: cache hits happen too
    requests = []
    for i in range(14):
        request = make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 10))
        if i % 3 == 0:
            request.token_ids[:12] = shared[: request.num_prompt_tokens]
        requests.append(request)
    pending = list(requests)
    for _ in range(500):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        ids = [s.request.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids))
        for item in out.scheduled:  # every slot the forward pass writes lies in the request's own blocks
            request = item.request
            assert item.num_new_tokens >= 1
            assert request.num_computed_tokens == item.start + item.num_new_tokens  # booked at scheduling
            assert len(request.block_table) * BS >= item.start + item.num_new_tokens
            assert item.start + item.num_new_tokens <= request.num_tokens
        check_blocks(sched)
        sched.update(out, {s.request.request_id: fake_token(s.request) for s in out.scheduled if s.samples})
        check_blocks(sched)
    else:
        raise AssertionError("workload did not finish")
    for request in requests:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert request.num_output_tokens == request.max_tokens
    assert sched.num_preemptions > 0 and sched.block_manager.prefix_hits > 0  # the workload exercised both
    assert sched.block_manager.num_free_blocks == 24


# -- chunked prefill -------------------------------------------------------------------------------------------
def test_long_prompt_is_chunked_while_running_decodes_continue_first():
    sched = make_scheduler(budget=8)
    d1, d2 = make_request("d1", 3, max_tokens=20), make_request("d2", 3, max_tokens=20)
    sched.add(d1)
    sched.add(d2)
    assert new_tokens(step(sched)) == {"d1": 3, "d2": 3}
    long = make_request("long", 30, max_tokens=5)
    sched.add(long)
    computed = []
    for i in range(5):  # 30 prompt tokens at 6 per step (8 minus the 2 decodes)
        outputs_before = (d1.num_output_tokens, d2.num_output_tokens)
        out = step(sched)
        assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("d1", 1), ("d2", 1), ("long", 6)]
        assert (d1.num_output_tokens, d2.num_output_tokens) == (outputs_before[0] + 1, outputs_before[1] + 1)
        computed.append(long.num_computed_tokens)
        assert long.num_output_tokens == (1 if i == 4 else 0)  # samples only when the last chunk is in
    assert computed == [6, 12, 18, 24, 30]
    assert new_tokens(step(sched)) == {"d1": 1, "d2": 1, "long": 1}  # now all three decode


def test_without_chunked_prefill_a_prompt_waits_to_go_whole():
    sched = make_scheduler(budget=32, chunked=False)
    d = make_request("d", 3, max_tokens=3)
    sched.add(d)
    step(sched)
    long = make_request("long", 32)
    sched.add(long)
    assert new_tokens(step(sched)) == {"d": 1}  # 32 > 32 - 1: not split, not scheduled
    assert new_tokens(step(sched)) == {"d": 1}
    assert d.finished
    assert new_tokens(step(sched)) == {"long": 32}


# -- preemption ------------------------------------------------------------------------------------------------
def test_preemption_recomputes_the_newest_running_request():
    sched = make_scheduler(num_blocks=6, budget=64)
    a, b, c = (make_request(n, 7, max_tokens=4) for n in "abc")
    for r in (a, b, c):
        sched.add(r)
    step(sched)  # all three prefilled: 2 blocks each, the cache is full
    step(sched)  # 8th token still fits in 2 blocks
    assert sched.block_manager.num_free_blocks == 0
    late = make_request("late", 2)
    sched.add(late)
    c_tokens = list(c.token_ids)
    out = step(sched)  # a and b need a 3rd block: c, the newest, gives its blocks up
    assert out.preempted == [c]
    assert new_tokens(out) == {"a": 1, "b": 1}  # c is not rescheduled in the step that preempted it
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.num_computed_tokens == 0 and c.block_table == []
    assert list(sched.waiting) == [c, late]  # at the head of the queue, before later arrivals
    assert c.token_ids == c_tokens  # its generated tokens are kept, only the KV is dropped
    check_blocks(sched)
    step(sched)  # a and b finish (4 tokens); c cannot come back before that: blocks are short
    assert a.finished and b.finished and c.status == RequestStatus.PREEMPTED
    out = step(sched)
    assert new_tokens(out) == {"c": 9, "late": 2}  # c recomputes prompt + 2 generated tokens, then samples
    assert c.status == RequestStatus.RUNNING and c.num_output_tokens == 3
    while sched.has_unfinished():
        step(sched)
    assert c.finish_reason == "length" and c.num_output_tokens == 4
    assert c.token_ids[:9] == c_tokens
    assert sched.block_manager.num_free_blocks == 6


def test_a_request_that_is_newest_preempts_itself():
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_request("a", 5, max_tokens=10), make_request("b", 7, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out = step(sched)  # b needs a 3rd block, none is free, and b is the newest: b goes
    assert out.preempted == [b] and new_tokens(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.block_table == []
    check_blocks(sched)


def test_preempted_request_resumes_from_its_cached_prefix():
    """Preemption frees the blocks, but the full ones stay cached (unless evicted): the recompute skips them."""
    sched = make_scheduler(num_blocks=5, budget=64, prefix_caching=True)
    a, b = make_request("a", 5, max_tokens=6), make_request("b", 8, max_tokens=10)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        step(sched)
        assert sched.num_running + sched.num_waiting == 2, "a must still be running when b is preempted"
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_cached_tokens == 0
    while b.status != RequestStatus.RUNNING:
        out = step(sched)
    assert a.finished
    assert sched.block_manager.prefix_hits == 0  # the resume is not counted as a prompt lookup
    assert new_tokens(out)["b"] == b.num_tokens - 1 - 8  # its 2 full prompt blocks came from the cache
    while sched.has_unfinished():
        step(sched)
    assert b.num_output_tokens == 10 and sched.block_manager.num_free_blocks == 5


# -- admission -------------------------------------------------------------------------------------------------
def test_admission_is_fifo_the_head_blocks_the_rest():
    sched = make_scheduler(num_blocks=4, budget=64)
    r = make_request("r", 10, max_tokens=2)  # 3 blocks
    sched.add(r)
    step(sched)
    big, small = make_request("big", 6), make_request("small", 2)  # 2 blocks, 1 block
    sched.add(big)
    sched.add(small)
    out = step(sched)
    assert new_tokens(out) == {"r": 1}  # small would fit in the free block but may not jump the queue
    assert list(sched.waiting) == [big, small]
    assert r.finished
    out = step(sched)
    assert new_tokens(out) == {"big": 6, "small": 2}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(budget=256, max_num_seqs=2)
    requests = [make_request(f"r{i}", 4, max_tokens=2 + i) for i in range(5)]
    for r in requests:
        sched.add(r)
    seen_running = []
    while sched.has_unfinished():
        out = step(sched)
        assert len(out.scheduled) <= 2 and sched.num_running <= 2
        seen_running.append(sched.num_running)
    assert max(seen_running) == 2
    assert all(r.num_output_tokens == r.max_tokens for r in requests)


# -- finishing -------------------------------------------------------------------------------------------------
def test_finish_and_abort_free_blocks_in_any_state():
    sched = make_scheduler(num_blocks=16, budget=8)
    running, chunking, waiting = make_request("run", 3), make_request("chunk", 20), make_request("wait", 3)
    for r in (running, chunking, waiting):
        sched.add(r)
    step(sched)  # run: 3 tokens, chunk: 5 of 20, wait: no budget left
    assert running.status == chunking.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    assert chunking.block_table
    sched.abort([chunking, waiting])
    assert chunking.finish_reason == waiting.finish_reason == "abort"
    assert chunking.block_table == [] and chunking not in sched.running and waiting not in sched.waiting
    sched.finish(running, RequestStatus.FINISHED_STOPPED)
    sched.finish(running, RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert running.finish_reason == "stop"
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 16


def test_request_aborted_during_a_step_gets_no_token():
    sched = make_scheduler(prefix_caching=True)
    r = make_request("r", 5)
    sched.add(r)
    out = sched.schedule()
    sched.abort([r])
    assert sched.update(out, {"r": 42}) == []
    assert r.num_output_tokens == 0 and r.block_table == []
    assert sched.block_manager.num_free_blocks == 64 and not sched.block_manager.cached


def test_update_finishes_on_eos_stop_token_and_length_but_not_before_min_tokens():
    sched = make_scheduler(max_model_len=12)
    eos = make_request("eos", 3, max_tokens=10)
    eos.eos_token_ids = frozenset([1])
    ignored = make_request("ignored", 3, max_tokens=10, ignore_eos=True)
    ignored.eos_token_ids = frozenset([1])
    stop_id = make_request("stop_id", 3, max_tokens=10, stop_token_ids=[9])
    early = make_request("early", 3, max_tokens=10, min_tokens=2)
    early.eos_token_ids = frozenset([1])
    long = make_request("long", 3, max_tokens=50)  # runs into max_model_len = 12
    for r in (eos, ignored, stop_id, early, long):
        sched.add(r)
    out = sched.schedule()
    sched.update(out, {"eos": 1, "ignored": 1, "stop_id": 9, "early": 1, "long": 5})
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert stop_id.finish_reason == "stop" and stop_id.stop_reason == 9
    assert not ignored.finished and not early.finished  # min_tokens=2: the first EOS does not count
    out = sched.schedule()
    sched.update(out, {"ignored": 1, "early": 1, "long": 5})
    assert early.finish_reason == "stop" and not ignored.finished
    while not long.finished:
        out = sched.schedule()
        sched.update(out, {r.request.request_id: 5 for r in out.scheduled})
    assert long.finish_reason == "length" and long.num_tokens == 12


# -- lookahead: scheduling step N+1 before step N is booked ----------------------------------------------------
def position_token(item) -> int:
    """The 'model' for lookahead tests: the sampled token depends only on the request and the token's position,
    so it is the same whenever and in whatever batch the step runs."""
    request = item.request
    return (sum(request.prompt_token_ids) + item.start + item.num_new_tokens) % 300 + 10


def run_random_workload(lookahead: bool) -> dict:
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=24, budget=16, max_num_seqs=6, prefix_caching=True)
    requests = []
    for i in range(16):
        request = make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 10))
        if i % 3 == 0:
            request.token_ids[:12] = [7] * min(12, request.num_prompt_tokens)
        if i % 4 == 1:  # EOS at the third output token: under lookahead, a step is in flight when it is booked
            request.eos_token_ids = frozenset([(sum(request.prompt_token_ids) + request.num_prompt_tokens + 2) % 300 + 10])
        requests.append(request)
    pending, in_flight = list(requests), None
    for _ in range(1000):
        if pending:
            sched.add(pending.pop(0))
        out = sched.schedule()
        for item in out.scheduled:
            request = item.request
            assert item.start + item.num_new_tokens <= request.num_tokens
            assert len(request.block_table) * BS >= item.start + item.num_new_tokens
            assert request.num_inflight <= (2 if lookahead else 1)
        check_blocks(sched)
        booked, in_flight = (in_flight, out if not out.is_empty else None) if lookahead else (out, None)
        if booked is not None:
            sched.update(booked, {s.request.request_id: position_token(s) for s in booked.scheduled if s.samples})
        if not sched.has_unfinished() and not pending and in_flight is None:
            break
    else:
        raise AssertionError("workload did not finish")
    assert sched.block_manager.num_free_blocks == 24
    assert sched.num_preemptions > 0 and sched.block_manager.prefix_hits > 0  # the workload exercised both
    return {r.request_id: (r.output_token_ids, r.status) for r in requests}


def test_lookahead_scheduling_gives_the_same_tokens_and_stops_as_booking_each_step_first():
    plain, ahead = run_random_workload(False), run_random_workload(True)
    assert ahead == plain
    assert any(status == RequestStatus.FINISHED_STOPPED for _, status in plain.values())
    assert any(status == RequestStatus.FINISHED_LENGTH for _, status in plain.values())


def test_lookahead_does_not_schedule_past_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 3, max_tokens=2)
    sched.add(r)
    first = sched.schedule()  # prefill, samples output 1
    second = sched.schedule()  # decodes the in-flight token, samples output 2 = max_tokens
    assert new_tokens(second) == {"r": 1} and r.num_inflight == 2
    assert sched.schedule().is_empty  # both remaining tokens are in flight: nothing more to compute
    sched.update(first, {"r": 11})
    sched.update(second, {"r": 12})
    assert r.output_token_ids == [11, 12] and r.finish_reason == "length" and r.num_inflight == 0


def test_a_full_batch_admits_in_groups_of_min_prefill_batch_within_a_bounded_delay():
    from asyncengine.scheduler import MAX_ADMISSION_DELAY_STEPS

    bm = BlockManager(256, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, min_prefill_batch=3)
    running = [make_request(f"run{i}", 3, max_tokens=100) for i in range(8)]
    for r in running:
        sched.add(r)
    step(sched)
    queued = [make_request(f"wait{i}", 3, max_tokens=100) for i in range(6)]
    for r in queued:
        sched.add(r)
    sched.abort(running[:2])  # 2 free slots < 3: the queue waits for a third
    assert set(new_tokens(step(sched))) == {r.request_id for r in running[2:]}
    sched.abort(running[2:3])
    assert {"wait0", "wait1", "wait2"} <= set(new_tokens(step(sched)))  # admitted together
    sched.abort(running[3:4])  # one slot free, 3 still waiting: deferred, but never for long
    for _ in range(MAX_ADMISSION_DELAY_STEPS):
        assert "wait3" not in new_tokens(step(sched))
    assert "wait3" in new_tokens(step(sched))


def test_an_idle_or_short_queue_is_admitted_at_once():
    sched = Scheduler(BlockManager(256, BS), 8, 256, 256, min_prefill_batch=4)
    first = make_request("a", 3, max_tokens=50)
    sched.add(first)
    step(sched)  # nothing running before: admitted at once
    late = make_request("b", 3, max_tokens=5)
    sched.add(late)
    assert "b" in new_tokens(step(sched))  # 7 slots free >= min(4, 1 waiting)
