"""The reference engine: a slow, literal transcription of ``docs/engine-semantics.md``.

This module exists only to check the fast engine (``engine.simulate_fast``). It is written to be reviewed
line by line against ``docs/engine-semantics.md``: plain Python lists, a
``collections.deque`` for the waiting queue, sets for the adapter caches, loops over every request in
every step. It is deliberately unoptimised; never use it for real simulations.

Numbered comments (``# 0.`` ... ``# 7.``) refer to the numbered items of the semantics doc's loop.

``simulate_reference(cfg, req)`` returns the ``EngineResult``. ``run_reference`` also returns a
``ReferenceTrace`` with the final per-request state, token accounting and (optionally) a per-step log, so
the tests can check conservation laws and hand-computed cases.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .gaps import gap_bin, new_histogram
from .steptime import compute_ms, noise_index, noise_table, sched_ms
from .types import TIMELINE_COLUMNS, EngineConfig, EngineResult, RequestArrays, label_set_keys

# request status
NOT_INJECTED, WAITING, RUNNING, FINISHED = 0, 1, 2, 3


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepRecord:
    """Everything that happened in one (non-idle) step; recorded when ``record_steps=True``."""

    s: int  # step index
    t_start: float  # s
    t_end: float  # s
    injected: tuple[int, ...]  # requests pushed to the waiting tail at the start of this step
    scheduled: tuple[tuple[int, int], ...]  # (request, tokens) in scheduling order
    admitted: tuple[int, ...]  # requests moved from waiting to running by the waiting pass
    victims: tuple[int, ...]  # preempted requests, in preemption order
    finished: tuple[int, ...]
    u_step: tuple[int, ...]  # distinct adapters of the scheduled requests, increasing
    disk_loaded: tuple[int, ...]
    gpu_loaded: tuple[int, ...]
    cpu_evicted: tuple[int, ...]
    gpu_evicted: tuple[int, ...]  # explicit GPU evictions (not those caused by a CPU eviction)
    budget_left: int
    n_running: int  # len(running) after the passes (the sched_ms argument)
    n_waiting: int  # len(waiting) after the passes (the sched_ms argument)
    b: int
    n_pf: int
    n_tok: int
    b_dec: int
    ctx: int
    n_lora: int
    sched_ms: float
    load_ms: float
    compute_ms: float
    dt_s: float


@dataclass
class ReferenceTrace:
    """Final state and bookkeeping of a reference run (for tests)."""

    final_t_s: float
    final_step: int
    status: np.ndarray  # int8 [n]: NOT_INJECTED / WAITING / RUNNING / FINISHED
    computed: np.ndarray  # int64 [n], final
    out_done: np.ndarray  # int64 [n], final
    blocks: np.ndarray  # int64 [n], final
    tokens_scheduled: np.ndarray  # int64 [n]: Σ n over every step that scheduled the request
    tokens_lost: np.ndarray  # int64 [n]: Σ computed discarded by preemptions of the request
    tokens_computed_total: int  # Σ over steps of Σ n (= n_tok summed over steps)
    final_running: list[int]
    final_waiting: list[int]  # head first
    ptr: int  # arrivals [0, ptr) were injected
    held_end: int  # arrivals [ptr, held_end) were held back by the client cap (if held_end > ptr)
    free_blocks: int
    gpu_resident: list[int]
    cpu_resident: list[int]
    n_idle: int  # idle iterations (no step)
    n_idle_preemptions: int  # preemptions in idle iterations (a running pass that preempted everything)
    max_running: int
    max_u_step: int
    steps: list[StepRecord] = field(default_factory=list)


def simulate_reference(cfg: EngineConfig, req: RequestArrays, check_invariants: bool = False) -> EngineResult:
    """Run the literal reference engine; see ``docs/engine-semantics.md``."""
    return run_reference(cfg, req, check_invariants=check_invariants)[0]


def _validate(cfg: EngineConfig, req: RequestArrays) -> None:
    """The same checks as the fast engine (``SpecError``, a ``ValueError``); no resource limits here."""
    cfg.check()
    req.check(cfg.n_adapters)


def run_reference(cfg: EngineConfig, req: RequestArrays, check_invariants: bool = False,
                  record_steps: bool = False) -> tuple[EngineResult, ReferenceTrace]:
    """Run the literal reference engine; return the result and a ``ReferenceTrace``.

    ``check_invariants`` asserts the engine's invariants (those tests/test_engine_properties.py checks) after every step;
    ``record_steps`` keeps a ``StepRecord`` per step in ``trace.steps``.
    """
    _validate(cfg, req)

    # ---------------------------------------------------------------- inputs as plain Python values
    n = len(req)
    n_adapters = cfg.n_adapters
    max_loras = int(cfg.max_loras)
    admission_running = cfg.admission == "running"
    max_cpu_loras = int(cfg.max_cpu_loras)
    kv_blocks = int(cfg.kv_blocks)
    bs = int(cfg.block_size)
    mns = int(cfg.max_num_seqs)
    mnbt = int(cfg.max_num_batched_tokens)
    client_cap = int(cfg.client_cap)
    duration = float(cfg.duration_s)
    tl_dt = float(cfg.timeline_dt_s)
    coef = cfg.step_coef
    noise = noise_table(float(cfg.step_noise_sigma))
    noise_key = int(cfg.step_noise_seed)
    adapter_load_ms = [float(x) for x in cfg.load_ms]
    adapter_disk_ms = [float(x) for x in cfg.disk_ms]

    t_arr = [float(x) for x in req.t_arr_s]
    adapter = [int(x) for x in req.adapter]
    prompt = [int(x) for x in req.prompt_tokens]
    output = [int(x) for x in req.output_tokens]

    # ---------------------------------------------------------------- state
    nan = float("nan")
    computed = [0] * n
    out_done = [0] * n
    blocks = [0] * n
    status = [NOT_INJECTED] * n
    t_sent = [nan] * n
    t_first = [nan] * n
    t_finish = [nan] * n
    t_last_token = [nan] * n  # when the latest token of each request was streamed
    gap_hist = new_histogram()  # every inter-token gap that ends in the window (twin.gaps)
    n_preempted = [0] * n
    tokens_scheduled = [0] * n
    tokens_lost = [0] * n

    def pending(r: int) -> int:
        return prompt[r] + out_done[r] - computed[r]

    running: list[int] = []  # admission order
    waiting: deque[int] = deque()  # head = left
    free_blocks = kv_blocks

    # adapters: GPU-resident and CPU-resident sets with LRU stamps (initial stamp[i] = i - N)
    gpu_resident: set[int] = set()
    cpu_resident: set[int] = set()
    gpu_stamp = [i - n_adapters for i in range(n_adapters)]
    cpu_stamp = [i - n_adapters for i in range(n_adapters)]
    walk = [int(x) for x in cfg.adapter_walk_order()]  # each adapter's position in the worker's walk
    protect = bool(cfg.lru_protects_batch)
    if cfg.warm_gpu:
        for a in range(n_adapters - min(max_loras, n_adapters), n_adapters):
            gpu_resident.add(a)
    if cfg.warm_cpu:
        for a in range(n_adapters - min(max_cpu_loras, n_adapters), n_adapters):
            cpu_resident.add(a)
    if cfg.warm_gpu and not cfg.warm_cpu:
        for a in gpu_resident:
            cpu_resident.add(a)

    # counters
    s = 0
    t = 0.0
    n_steps = 0
    n_preemptions = 0
    n_gpu_loads = 0
    n_disk_loads = 0
    busy_s = 0.0
    sched_s = 0.0
    load_s = 0.0
    tokens_computed_total = 0
    n_idle = 0
    n_idle_preemptions = 0
    max_running = 0
    max_u_step = 0
    steps: list[StepRecord] = []

    ptr = 0
    held_end = 0

    # ---------------------------------------------------------------- the API server's loop ("The API server")
    api_on = float(cfg.api_ms_per_output) > 0.0 or float(cfg.metrics_scrape_s) > 0.0
    api_s_per_output = float(cfg.api_ms_per_output) / 1000.0
    output_proc_chunk = int(cfg.output_proc_chunk)
    scrape_period = float(cfg.metrics_scrape_s)
    scrape_base_s = float(cfg.scrape_base_ms) / 1000.0
    scrape_s_per_series = float(cfg.scrape_us_per_series) / 1e6
    scrape_s_per_name = float(cfg.scrape_us_per_label_name) / 1e6
    key_running, key_waiting = (list(map(int, k)) for k in label_set_keys(cfg))
    ready = [nan] * n  # when the loop handed the request to the engine core
    n_merged = [0] * n
    api = {"free": 0.0, "floor_before": 0.0, "floor_after": 0.0, "first_scrape": math.inf, "done": -math.inf,
           "next": 0, "next_scrape": 0.0, "batch_start": 0.0, "batch_work": 0.0, "last_deliv": 0.0,
           "n_scrapes": 0, "scrape_s": 0.0}
    batch: dict[int, int] = {}  # the open batch: request -> its tokens in it (insertion order)
    batch_open = False
    label_seen: set[int] = set()  # the registry's label sets, by the top bits of their fingerprint
    label_last = 0
    label_series = 0
    label_names = 0
    label_pending = False

    def api_floor() -> float:
        return api["batch_start"] + api["batch_work"] if batch_open else api["free"]

    def deliver_batch() -> None:
        """The loop sends the open batch: one chunk per request at its end."""
        nonlocal batch_open
        d = api["batch_start"] + api["batch_work"]
        for r, k in batch.items():
            if math.isnan(t_first[r]):
                t_first[r] = d
            elif d <= duration:
                gap_hist[gap_bin(d - t_last_token[r])] += 1
            n_merged[r] += k - 1
            t_last_token[r] = d
            if status[r] == FINISHED and out_done[r] == output[r]:
                t_finish[r] = d
        batch.clear()
        batch_open = False
        api["free"] = d
        api["last_deliv"] = d

    def api_until(t_now: float) -> None:
        """Scrapes up to ``t_now`` in time order, then each arrival's ready time: max(arrival, the loop's floor
        before the interval's first scrape if it came before it, else after its scrapes)."""
        if t_now <= api["done"]:
            return
        api["floor_before"] = api_floor()
        api["first_scrape"] = math.inf
        if scrape_period > 0.0:
            while api["next_scrape"] <= t_now:
                if batch_open:
                    deliver_batch()
                if api["first_scrape"] == math.inf:
                    api["first_scrape"] = api["next_scrape"]
                render_s = scrape_base_s + scrape_s_per_series * label_series + scrape_s_per_name * label_names
                api["free"] = max(api["free"], api["next_scrape"]) + render_s
                api["n_scrapes"] += 1
                api["scrape_s"] += render_s
                api["next_scrape"] = api["free"] + scrape_period
        api["floor_after"] = api_floor()
        while api["next"] < n and t_arr[api["next"]] <= t_now:
            r = api["next"]
            ready[r] = max(t_arr[r], api["floor_before"] if t_arr[r] < api["first_scrape"] else api["floor_after"])
            api["next"] = r + 1
        api["done"] = t_now

    def take_outputs(n_outputs: int, t_end_s: float) -> float:
        """A step's outputs reach the loop: when their chunks leave, or -1.0 (they join the open batch)."""
        nonlocal batch_open
        api_until(t_end_s)
        merges = n_outputs <= output_proc_chunk  # the loop yields inside a step with more outputs
        if batch_open and (not merges or api["batch_start"] + api["batch_work"] <= t_end_s):
            deliver_batch()
        work_s = api_s_per_output * n_outputs
        if batch_open:
            api["batch_work"] += work_s
            return -1.0
        if api["free"] <= t_end_s:
            api["free"] = t_end_s + work_s
            return api["free"]
        if not merges:
            api["free"] += work_s
            return api["free"]
        batch_open = True
        api["batch_start"] = api["free"]
        api["batch_work"] = work_s
        return -1.0

    # ---------------------------------------------------------------- timeline
    timeline: dict[str, list] = {c: [] for c in TIMELINE_COLUMNS}
    k_next = 0

    def emit_samples(limit: float) -> None:
        """Emit every pending sample time tau_k = k * dt with tau_k <= limit and tau_k < duration."""
        nonlocal k_next
        while True:
            tau = k_next * tl_dt
            if not (tau <= limit and tau < duration):
                return
            used = kv_blocks - free_blocks
            timeline["t_s"].append(tau)
            timeline["num_requests_running"].append(len(running))
            timeline["num_requests_waiting"].append(len(waiting))
            timeline["kv_cache_usage_perc"].append(used / kv_blocks if kv_blocks > 0 else 0.0)
            timeline["num_preemptions_total"].append(n_preemptions)
            timeline["num_adapters_resident"].append(len(gpu_resident))
            timeline["num_adapters_running"].append(len({adapter[r] for r in running}))
            k_next += 1

    # ---------------------------------------------------------------- the loop
    while t < duration:
        # 0. timeline samples up to the current time, with the current state
        emit_samples(t)

        # 1. inject arrivals with t_arr <= t at the waiting tail (client cap: hold them back); with the API
        #    server's loop, once it has handed them over (ready <= t)
        if api_on:
            api_until(t)
        # the metrics registry records the previous step's label set (once per step): a set never seen is a new
        # series; waiting = queued, or handed over by the API server and not queued yet
        if label_pending:
            label_pending = False
            h = 0
            for a in {adapter[r] for r in running}:
                h ^= key_running[a]
            handed = [r for r in range(max(ptr, held_end), api["next"]) if ready[r] <= t]
            waiting_adapters = {adapter[r] for r in waiting} | {adapter[r] for r in handed}
            for a in waiting_adapters:
                h ^= key_waiting[a]
            if h != label_last:
                label_last = h
                if h >> 40 not in label_seen:
                    label_seen.add(h >> 40)
                    label_series += 1
                    label_names += len({adapter[r] for r in running}) + len(waiting_adapters)
        injected: list[int] = []
        while ptr < n and t_arr[ptr] <= t and (not api_on or ready[ptr] <= t):
            if client_cap > 0 and len(waiting) >= client_cap:
                first_later = ptr
                while first_later < n and t_arr[first_later] <= t:
                    first_later += 1
                held_end = max(held_end, first_later)
                break
            r = ptr
            waiting.append(r)
            status[r] = WAITING
            t_sent[r] = t if r < held_end else t_arr[r]
            injected.append(r)
            ptr += 1

        # 2. running pass
        budget = mnbt
        preempted = False
        scheduled: list[tuple[int, int]] = []
        victims: list[int] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n_r = min(pending(r), budget)
            stop_running_pass = False
            while True:
                need = _ceil_div(computed[r] + n_r, bs) - blocks[r]
                if need <= free_blocks:
                    alloc = max(need, 0)
                    blocks[r] += alloc
                    free_blocks -= alloc
                    break
                v = running.pop()  # preempt the TAIL of running
                free_blocks += blocks[v]
                blocks[v] = 0
                tokens_lost[v] += computed[v]
                computed[v] = 0
                n_preempted[v] += 1
                n_preemptions += 1
                status[v] = WAITING
                waiting.appendleft(v)  # victims go to the waiting HEAD
                victims.append(v)
                preempted = True
                if v == r:
                    stop_running_pass = True
                    break
            if stop_running_pass:
                break
            scheduled.append((r, n_r))
            budget -= n_r
            i += 1

        # 3. waiting pass, only if nothing was preempted in this step
        admitted: list[int] = []
        if not preempted:
            # the max_loras rule (EngineConfig.admission): adapters of the requests scheduled this step
            # (vLLM <= 0.32) or of all running requests (0.33)
            lora_set = {adapter[r] for r in running} if admission_running else {adapter[r] for r, _ in scheduled}
            skipped: list[int] = []
            while len(waiting) > 0 and budget > 0:
                if len(running) == mns:
                    break
                r = waiting[0]
                if len(lora_set) == max_loras and adapter[r] not in lora_set:
                    skipped.append(waiting.popleft())  # the max_loras skip: keep scanning
                    continue
                n_r = min(pending(r), budget)
                if _ceil_div(n_r, bs) > free_blocks:
                    break  # r keeps its place (the skipped requests go back in front of it)
                waiting.popleft()
                alloc = _ceil_div(n_r, bs)
                blocks[r] += alloc
                free_blocks -= alloc
                running.append(r)
                status[r] = RUNNING
                lora_set.add(adapter[r])
                scheduled.append((r, n_r))
                admitted.append(r)
                budget -= n_r
            for r in reversed(skipped):  # put the skipped requests back at the head, in order
                waiting.appendleft(r)

        # 4. idle: nothing scheduled -> jump to the next arrival (or the window end), no time charged
        if len(scheduled) == 0:
            if check_invariants:
                assert len(running) == 0, "nothing scheduled but requests are running"
                assert free_blocks == kv_blocks
                assert not admitted
            n_idle += 1
            n_idle_preemptions += len(victims)
            t_next = (ready[ptr] if api_on and ptr < api["next"] else t_arr[ptr]) if ptr < n else 0.0
            if ptr < n and t_next > t:
                t = t_next
            else:
                t = duration
            continue

        # 5. adapters: walk the step's adapters in walk order; touch each (stamp = s * N + its position);
        #    a missing one is loaded at its turn, evicting the least recently used resident adapter (with
        #    lru_protects_batch: one outside the step's batch)
        u_step = sorted({adapter[r] for r, _ in scheduled}, key=lambda a: walk[a])
        u_step_set = set(u_step)
        step_load_ms = 0.0
        disk_loaded: list[int] = []
        gpu_loaded: list[int] = []
        cpu_evicted: list[int] = []
        gpu_evicted: list[int] = []
        for a in u_step:
            if a not in gpu_resident:
                if a not in cpu_resident:
                    if len(cpu_resident) == max_cpu_loras:
                        candidates = [c for c in cpu_resident if not (protect and c in u_step_set)]
                        victim = min(candidates, key=lambda c: cpu_stamp[c])
                        cpu_resident.remove(victim)
                        gpu_resident.discard(victim)  # leaving the CPU cache also leaves the GPU
                        cpu_evicted.append(victim)
                    cpu_resident.add(a)
                    step_load_ms += adapter_disk_ms[a]
                    n_disk_loads += 1
                    disk_loaded.append(a)
                if len(gpu_resident) == max_loras:
                    candidates = [g for g in gpu_resident if not (protect and g in u_step_set)]
                    victim = min(candidates, key=lambda g: gpu_stamp[g])
                    gpu_resident.remove(victim)
                    gpu_evicted.append(victim)
                gpu_resident.add(a)
                step_load_ms += adapter_load_ms[a]
                n_gpu_loads += 1
                gpu_loaded.append(a)
            gpu_stamp[a] = cpu_stamp[a] = s * n_adapters + walk[a]

        # 6. step time
        b = len(scheduled)
        n_tok = 0
        b_dec = 0
        ctx = 0
        for r, n_r in scheduled:
            n_tok += n_r
            if out_done[r] >= 1 and pending(r) == 1:
                b_dec += 1
            ctx += computed[r]
        n_pf = n_tok - b_dec
        n_lora = len(u_step)
        step_sched_ms = float(sched_ms(coef, len(running), len(waiting)))
        step_compute_ms = float(compute_ms(coef, b, n_pf, n_tok, ctx, n_lora))
        if len(noise):  # the step's own variability multiplies the scheduler and the forward pass
            ms = (step_sched_ms + step_compute_ms) * float(noise[noise_index(noise_key, s)]) + step_load_ms
        else:
            ms = step_sched_ms + step_load_ms + step_compute_ms
        dt = ms / 1000.0

        n_running_sched = len(running)
        n_waiting_sched = len(waiting)

        # 7. update at the step end, in scheduling order
        t_end = t + dt
        # the client gets the tokens at the step end, when the API server's loop has made them chunks, or with
        # its open batch (deliver = -1)
        deliver = take_outputs(b, t_end) if api_on else t_end
        finished: list[int] = []
        for r, n_r in scheduled:
            computed[r] += n_r
            tokens_scheduled[r] += n_r
            tokens_computed_total += n_r
            if computed[r] == prompt[r] + out_done[r]:
                out_done[r] += 1
                if deliver < 0.0:
                    batch[r] = batch.get(r, 0) + 1
                else:
                    if out_done[r] == 1:
                        t_first[r] = deliver
                    elif deliver <= duration:
                        gap_hist[gap_bin(deliver - t_last_token[r])] += 1
                    t_last_token[r] = deliver
                if out_done[r] == output[r]:
                    t_finish[r] = t_end if deliver < 0.0 else deliver
                    free_blocks += blocks[r]
                    blocks[r] = 0
                    running.remove(r)
                    status[r] = FINISHED
                    finished.append(r)

        if check_invariants:
            assert len(u_step) <= max_loras, "|U_step| > A"
            assert len(gpu_resident) <= max_loras, "GPU-resident adapters > A"
            assert len(cpu_resident) <= max_cpu_loras, "CPU-resident adapters > N_cpu"
            assert gpu_resident <= cpu_resident, "a GPU-resident adapter is not CPU-resident"
            assert u_step_set <= gpu_resident, "a scheduled adapter is not GPU-resident"
            assert 0 <= free_blocks <= kv_blocks, "free blocks out of range"
            assert sum(blocks[r] for r in running) == kv_blocks - free_blocks, "block leak"
            assert sum(blocks) == kv_blocks - free_blocks, "blocks held outside running"
            assert n_running_sched <= mns and len(running) <= mns, "running > max_num_seqs"
            assert budget >= 0, "negative budget"
            assert not (preempted and admitted), "admission in a step that preempted"
            assert t_end >= t, "time went backwards"
            assert n_tok <= mnbt, "more tokens than the budget"
            assert len(set(running)) == len(running)
            assert len(set(waiting)) == len(waiting)
            assert not set(running) & set(waiting)
            assert len({adapter[r] for r in running}) <= max_loras, "running adapters > A"
            for r in running:
                assert status[r] == RUNNING
                assert blocks[r] == _ceil_div(computed[r], bs), "blocks != ceil(computed / BS)"
                assert 0 < computed[r] <= prompt[r] + out_done[r]
                assert out_done[r] < output[r]
            for r in waiting:
                assert status[r] == WAITING
                assert computed[r] == 0 and blocks[r] == 0
            for r, _ in scheduled:
                assert tokens_scheduled[r] == computed[r] + tokens_lost[r]

        if record_steps:
            steps.append(StepRecord(
                s=s, t_start=t, t_end=t_end, injected=tuple(injected), scheduled=tuple(scheduled),
                admitted=tuple(admitted), victims=tuple(victims), finished=tuple(finished),
                u_step=tuple(sorted(u_step)), disk_loaded=tuple(disk_loaded), gpu_loaded=tuple(gpu_loaded),
                cpu_evicted=tuple(cpu_evicted), gpu_evicted=tuple(gpu_evicted), budget_left=budget,
                n_running=n_running_sched, n_waiting=n_waiting_sched, b=b, n_pf=n_pf, n_tok=n_tok,
                b_dec=b_dec, ctx=ctx, n_lora=n_lora, sched_ms=step_sched_ms, load_ms=step_load_ms,
                compute_ms=step_compute_ms, dt_s=dt))

        if deliver >= 0.0:
            api["last_deliv"] = deliver
        label_pending = scrape_period > 0.0

        max_running = max(max_running, n_running_sched)
        max_u_step = max(max_u_step, len(u_step))
        t = t_end
        s += 1
        n_steps += 1
        busy_s += dt
        sched_s += step_sched_ms / 1000.0
        load_s += step_load_ms / 1000.0

    # after the loop: the remaining samples with the final state, and what the API server's loop holds
    emit_samples(math.inf)
    if batch_open:
        deliver_batch()

    result = EngineResult(
        t_sent_s=np.array(t_sent, dtype=np.float64),
        t_first_s=np.array(t_first, dtype=np.float64),
        t_finish_s=np.array(t_finish, dtype=np.float64),
        n_preempted=np.array(n_preempted, dtype=np.int32),
        n_steps=n_steps,
        n_preemptions=n_preemptions,
        n_gpu_loads=n_gpu_loads,
        n_disk_loads=n_disk_loads,
        held_end=held_end,
        busy_s=busy_s,
        sched_s=sched_s,
        load_s=load_s,
        timeline={
            "t_s": np.array(timeline["t_s"], dtype=np.float64),
            "num_requests_running": np.array(timeline["num_requests_running"], dtype=np.int64),
            "num_requests_waiting": np.array(timeline["num_requests_waiting"], dtype=np.int64),
            "kv_cache_usage_perc": np.array(timeline["kv_cache_usage_perc"], dtype=np.float64),
            "num_preemptions_total": np.array(timeline["num_preemptions_total"], dtype=np.int64),
            "num_adapters_resident": np.array(timeline["num_adapters_resident"], dtype=np.int64),
            "num_adapters_running": np.array(timeline["num_adapters_running"], dtype=np.int64),
        },
        gap_hist=gap_hist,
        ttft_overhead_ms=float(cfg.ttft_overhead_ms),
        n_merged=np.array(n_merged, dtype=np.int32),
        n_scrapes=api["n_scrapes"],
        scrape_s=api["scrape_s"],
        label_series=label_series,
    )
    trace = ReferenceTrace(
        final_t_s=t,
        final_step=s,
        status=np.array(status, dtype=np.int8),
        computed=np.array(computed, dtype=np.int64),
        out_done=np.array(out_done, dtype=np.int64),
        blocks=np.array(blocks, dtype=np.int64),
        tokens_scheduled=np.array(tokens_scheduled, dtype=np.int64),
        tokens_lost=np.array(tokens_lost, dtype=np.int64),
        tokens_computed_total=tokens_computed_total,
        final_running=list(running),
        final_waiting=list(waiting),
        ptr=ptr,
        held_end=held_end,
        free_blocks=free_blocks,
        gpu_resident=sorted(gpu_resident),
        cpu_resident=sorted(cpu_resident),
        n_idle=n_idle,
        n_idle_preemptions=n_idle_preemptions,
        max_running=max_running,
        max_u_step=max_u_step,
        steps=steps,
    )
    return result, trace
