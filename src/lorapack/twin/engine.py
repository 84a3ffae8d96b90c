"""The fast engine: one vLLM V1 server, step by step, on flat arrays (twin.md §7).

The step below reads like vLLM's ``Scheduler.schedule()``: the running pass, then the waiting pass with
the ``max_loras`` skip rule, then adapter activation, step time and the update. Exact semantics (ties,
held arrivals, timeline sampling) are in ``docs/engine-semantics.md``; ``reference.py`` is the literal
version the tests compare against.

What makes it fast:

* state lives in numpy arrays indexed by request (``computed[r]``, ``blocks[r]``) or adapter;
* the waiting queue is one FIFO per adapter, ordered by a global key (arrival index, or a negative
  counter for preemption victims so that they sort first, latest victim first). The global queue order is
  the merge of the FIFOs, so vLLM's scan "skip requests of non-resident adapters, admit the others in
  order" becomes "take the minimum head key" over all adapters (while ``|U| < A``) or over the adapters
  with running requests (once ``|U| == A``). Two tournament trees answer that minimum in O(1) and are
  updated in O(log N) — no O(W) scan per step (twin.md pitfall 14);
* the core is compiled with numba; ``compiled=False`` runs the very same code as plain Python.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from .steptime import compute_ms, sched_ms
from .types import TIMELINE_COLUMNS, EngineConfig, EngineResult, RequestArrays

_compute_ms = njit(cache=True)(compute_ms)
_sched_ms = njit(cache=True)(sched_ms)

INF_KEY = np.int64(2**62)
WAITING, RUNNING, FINISHED = 1, 2, 3


@njit(cache=True)
def _tree_set(tk, ta, size, a, key):
    """Set leaf ``a`` of a min-tournament tree to ``key`` and fix the path to the root."""
    i = size + a
    tk[i] = key
    ta[i] = a
    i >>= 1
    while i >= 1:
        left = 2 * i
        if tk[left] <= tk[left + 1]:
            tk[i] = tk[left]
            ta[i] = ta[left]
        else:
            tk[i] = tk[left + 1]
            ta[i] = ta[left + 1]
        i >>= 1


@njit(cache=True)
def _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size):
    """Re-publish adapter ``a``'s head key in both trees after its FIFO or running count changed."""
    h = w_head[a]
    k = key[h] if h >= 0 else INF_KEY
    if tk_all[size + a] != k:
        _tree_set(tk_all, ta_all, size, a, k)
    ku = k if run_count[a] > 0 else INF_KEY
    if tk_u[size + a] != ku:
        _tree_set(tk_u, ta_u, size, a, ku)


@njit(cache=True)
def _lru_victim(resident, n_res, stamp, step_mark, s):
    """Index in ``resident`` of the least recently used adapter not in this step's batch."""
    best = -1
    for j in range(n_res):
        a = resident[j]
        if step_mark[a] == s:
            continue
        if best < 0 or stamp[a] < stamp[resident[best]] or (
                stamp[a] == stamp[resident[best]] and a < resident[best]):
            best = j
    return best


@njit(cache=True)
def _core(t_arr, adapter, p_tok, o_tok, load_ms, disk_ms, coef,
          max_loras, max_cpu_loras, kv_blocks, duration_s, max_num_seqs, mnbt, bs,
          warm_gpu, warm_cpu, client_cap, timeline_dt_s):
    n = t_arr.shape[0]
    n_ad = load_ms.shape[0]

    # ---- per-request state ----
    computed = np.zeros(n, np.int64)
    out_done = np.zeros(n, np.int64)
    blocks = np.zeros(n, np.int64)
    status = np.zeros(n, np.int8)
    key = np.zeros(n, np.int64)
    t_sent = np.full(n, np.nan)
    t_first = np.full(n, np.nan)
    t_finish = np.full(n, np.nan)
    n_preempted = np.zeros(n, np.int32)

    # ---- waiting queue: one FIFO per adapter (linked through w_next / w_prev) ----
    w_head = np.full(n_ad, -1, np.int64)
    w_tail = np.full(n_ad, -1, np.int64)
    w_next = np.full(n, -1, np.int64)
    w_prev = np.full(n, -1, np.int64)
    size = 1
    while size < n_ad:
        size *= 2
    tk_all = np.full(2 * size, INF_KEY, np.int64)
    ta_all = np.full(2 * size, -1, np.int64)
    tk_u = np.full(2 * size, INF_KEY, np.int64)
    ta_u = np.full(2 * size, -1, np.int64)
    n_waiting = 0

    # ---- running list (admission order) and this step's schedule ----
    cap_run = min(n, max_num_seqs) + 1
    running = np.zeros(cap_run, np.int64)
    n_run = 0
    run_count = np.zeros(n_ad, np.int64)  # running requests per adapter
    n_active = 0  # adapters with running requests (= U when the waiting pass runs)
    sched_r = np.zeros(cap_run, np.int64)
    sched_n = np.zeros(cap_run, np.int64)
    free = kv_blocks

    # ---- adapter caches (LRU by stamp, ties: lowest index) ----
    gpu_res = np.zeros(max(max_loras, 1), np.int64)
    n_gpu = 0
    in_gpu = np.zeros(n_ad, np.bool_)
    cpu_res = np.zeros(max(max_cpu_loras, 1), np.int64)
    n_cpu = 0
    in_cpu = np.zeros(n_ad, np.bool_)
    gpu_stamp = np.zeros(n_ad, np.int64)
    cpu_stamp = np.zeros(n_ad, np.int64)
    step_mark = np.full(n_ad, -1, np.int64)
    for a in range(n_ad):
        gpu_stamp[a] = a - n_ad
        cpu_stamp[a] = a - n_ad
    if warm_cpu:
        for a in range(n_ad - min(max_cpu_loras, n_ad), n_ad):
            in_cpu[a] = True
            cpu_res[n_cpu] = a
            n_cpu += 1
    if warm_gpu:
        for a in range(n_ad - min(max_loras, n_ad), n_ad):
            in_gpu[a] = True
            gpu_res[n_gpu] = a
            n_gpu += 1
            if not in_cpu[a] and n_cpu < max_cpu_loras:
                in_cpu[a] = True
                cpu_res[n_cpu] = a
                n_cpu += 1
    u_list = np.zeros(max(max_loras, 1) + 1, np.int64)

    # ---- timeline ----
    n_samples = 0
    while n_samples * timeline_dt_s < duration_s:
        n_samples += 1
    timeline = np.zeros((n_samples, 7))
    next_sample = 0

    # ---- counters ----
    t = 0.0
    s = 0
    ptr = 0
    held_end = 0
    preempt_counter = 0
    n_preemptions = 0
    n_gpu_loads = 0
    n_disk_loads = 0
    busy_s = 0.0
    sched_s_total = 0.0
    load_s_total = 0.0

    while t < duration_s:
        # 0. timeline samples up to now
        while next_sample < n_samples and next_sample * timeline_dt_s <= t:
            timeline[next_sample, 0] = next_sample * timeline_dt_s
            timeline[next_sample, 1] = n_run
            timeline[next_sample, 2] = n_waiting
            timeline[next_sample, 3] = (kv_blocks - free) / kv_blocks if kv_blocks > 0 else 0.0
            timeline[next_sample, 4] = n_preemptions
            timeline[next_sample, 5] = n_gpu
            timeline[next_sample, 6] = n_active
            next_sample += 1

        # 1. inject arrivals (client-saturation cap holds them back)
        while ptr < n and t_arr[ptr] <= t:
            if client_cap > 0 and n_waiting >= client_cap:
                j = max(ptr, held_end)  # everything before held_end is already marked
                while j < n and t_arr[j] <= t:
                    j += 1
                if j > held_end:
                    held_end = j
                break
            r = ptr
            t_sent[r] = t if r < held_end else t_arr[r]
            status[r] = WAITING
            key[r] = r
            a = adapter[r]
            w_prev[r] = w_tail[a]
            w_next[r] = -1
            if w_tail[a] >= 0:
                w_next[w_tail[a]] = r
            else:
                w_head[a] = r
                _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
            w_tail[a] = r
            n_waiting += 1
            ptr += 1

        # 2. running pass, in admission order; preempt from the tail when KV runs out
        budget = mnbt
        preempted = False
        n_sched = 0
        n_dec = 0
        ctx = 0.0
        i = 0
        while i < n_run and budget > 0:
            r = running[i]
            pending = p_tok[r] + out_done[r] - computed[r]
            num = min(pending, budget)
            can_schedule = True
            while True:
                need = (computed[r] + num + bs - 1) // bs - blocks[r]
                if need <= free:
                    if need > 0:
                        blocks[r] += need
                        free -= need
                    break
                v = running[n_run - 1]  # preempt the tail (recompute)
                n_run -= 1
                free += blocks[v]
                blocks[v] = 0
                computed[v] = 0
                n_preempted[v] += 1
                n_preemptions += 1
                preempted = True
                preempt_counter += 1
                key[v] = -preempt_counter  # sorts before every arrival; latest victim first
                status[v] = WAITING
                av = adapter[v]
                run_count[av] -= 1
                if run_count[av] == 0:
                    n_active -= 1
                w_prev[v] = -1
                w_next[v] = w_head[av]
                if w_head[av] >= 0:
                    w_prev[w_head[av]] = v
                else:
                    w_tail[av] = v
                w_head[av] = v
                n_waiting += 1
                _refresh(av, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
                if v == r:
                    can_schedule = False
                    break
            if not can_schedule:
                break
            if out_done[r] >= 1 and pending == 1:
                n_dec += 1
            ctx += computed[r]
            sched_r[n_sched] = r
            sched_n[n_sched] = num
            n_sched += 1
            budget -= num
            i += 1

        # 3. waiting pass: merge of the per-adapter FIFOs by key, with the max_loras skip rule
        if not preempted:
            while n_waiting > 0 and budget > 0:
                if n_run == max_num_seqs:
                    break
                if n_active < max_loras:
                    a = ta_all[1]  # any adapter may join the batch
                else:
                    if tk_u[1] == INF_KEY:
                        break  # every waiting request belongs to a non-resident adapter: skipped
                    a = ta_u[1]
                r = w_head[a]
                num = min(p_tok[r] + out_done[r] - computed[r], budget)
                need = (num + bs - 1) // bs
                if need > free:
                    break
                # admit r: pop the head of its adapter's FIFO
                w_head[a] = w_next[r]
                if w_head[a] >= 0:
                    w_prev[w_head[a]] = -1
                else:
                    w_tail[a] = -1
                w_next[r] = -1
                n_waiting -= 1
                blocks[r] = need
                free -= need
                status[r] = RUNNING
                running[n_run] = r
                n_run += 1
                if run_count[a] == 0:
                    n_active += 1
                run_count[a] += 1
                _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
                ctx += computed[r]
                sched_r[n_sched] = r
                sched_n[n_sched] = num
                n_sched += 1
                budget -= num

        # 4. idle: jump to the next arrival (no step time charged)
        if n_sched == 0:
            if ptr < n and t_arr[ptr] > t:
                t = t_arr[ptr]
            else:
                t = duration_s
            continue

        # 5. adapters of this batch: touch (LRU), activate the non-resident ones
        n_u = 0
        n_tok = 0
        for k in range(n_sched):
            n_tok += sched_n[k]
            a = adapter[sched_r[k]]
            if step_mark[a] != s:
                step_mark[a] = s
                u_list[n_u] = a
                n_u += 1
        step_load_ms = 0.0
        n_missing = 0
        for k in range(n_u):
            a = u_list[k]
            gpu_stamp[a] = s
            cpu_stamp[a] = s
            if not in_gpu[a]:
                n_missing += 1
        if n_missing > 0:
            missing = np.sort(u_list[:n_u])
            for k in range(n_u):
                a = missing[k]
                if in_gpu[a]:
                    continue
                if not in_cpu[a]:
                    if n_cpu >= max_cpu_loras:
                        j = _lru_victim(cpu_res, n_cpu, cpu_stamp, step_mark, s)
                        old = cpu_res[j]
                        in_cpu[old] = False
                        cpu_res[j] = cpu_res[n_cpu - 1]
                        n_cpu -= 1
                        if in_gpu[old]:
                            in_gpu[old] = False
                            for jj in range(n_gpu):
                                if gpu_res[jj] == old:
                                    gpu_res[jj] = gpu_res[n_gpu - 1]
                                    n_gpu -= 1
                                    break
                    in_cpu[a] = True
                    cpu_res[n_cpu] = a
                    n_cpu += 1
                    step_load_ms += disk_ms[a]
                    n_disk_loads += 1
                if n_gpu >= max_loras:
                    j = _lru_victim(gpu_res, n_gpu, gpu_stamp, step_mark, s)
                    in_gpu[gpu_res[j]] = False
                    gpu_res[j] = gpu_res[n_gpu - 1]
                    n_gpu -= 1
                in_gpu[a] = True
                gpu_res[n_gpu] = a
                n_gpu += 1
                step_load_ms += load_ms[a]
                n_gpu_loads += 1

        # 6. step time = scheduler (CPU) + adapter loads + forward pass
        step_sched_ms = _sched_ms(coef, n_run, n_waiting)
        ms = step_sched_ms + step_load_ms + _compute_ms(coef, n_sched, n_tok - n_dec, n_tok, ctx, n_u)
        dt = ms / 1000.0
        t_end = t + dt

        # 7. update: tokens computed, sampled, finished
        n_fin = 0
        for k in range(n_sched):
            r = sched_r[k]
            computed[r] += sched_n[k]
            if computed[r] == p_tok[r] + out_done[r]:
                out_done[r] += 1
                if out_done[r] == 1:
                    t_first[r] = t_end
                if out_done[r] == o_tok[r]:
                    t_finish[r] = t_end
                    status[r] = FINISHED
                    free += blocks[r]
                    blocks[r] = 0
                    a = adapter[r]
                    run_count[a] -= 1
                    if run_count[a] == 0:
                        n_active -= 1
                        _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
                    n_fin += 1
        if n_fin > 0:  # drop finished requests from running, keeping admission order
            j = 0
            for k in range(n_run):
                r = running[k]
                if status[r] != FINISHED:
                    running[j] = r
                    j += 1
            n_run = j

        t = t_end
        s += 1
        busy_s += dt
        sched_s_total += step_sched_ms / 1000.0
        load_s_total += step_load_ms / 1000.0

    while next_sample < n_samples:
        timeline[next_sample, 0] = next_sample * timeline_dt_s
        timeline[next_sample, 1] = n_run
        timeline[next_sample, 2] = n_waiting
        timeline[next_sample, 3] = (kv_blocks - free) / kv_blocks if kv_blocks > 0 else 0.0
        timeline[next_sample, 4] = n_preemptions
        timeline[next_sample, 5] = n_gpu
        timeline[next_sample, 6] = n_active
        next_sample += 1

    counters = np.array([s, n_preemptions, n_gpu_loads, n_disk_loads], np.int64)
    times = np.array([busy_s, sched_s_total, load_s_total])
    return t_sent, t_first, t_finish, n_preempted, counters, times, timeline


def simulate_fast(cfg: EngineConfig, req: RequestArrays, compiled: bool = True) -> EngineResult:
    """Simulate one server over ``[0, cfg.duration_s)``; ``compiled=False`` runs the same code uncompiled."""
    fn = _core if compiled else _core.py_func
    out = fn(req.t_arr_s, req.adapter, req.prompt_tokens, req.output_tokens, cfg.load_ms, cfg.disk_ms,
             cfg.step_coef, int(cfg.max_loras), int(cfg.max_cpu_loras), int(cfg.kv_blocks),
             float(cfg.duration_s), int(cfg.max_num_seqs), int(cfg.max_num_batched_tokens),
             int(cfg.block_size), bool(cfg.warm_gpu), bool(cfg.warm_cpu), int(cfg.client_cap),
             float(cfg.timeline_dt_s))
    t_sent, t_first, t_finish, n_preempted, counters, times, timeline = out
    return EngineResult(
        t_sent_s=t_sent, t_first_s=t_first, t_finish_s=t_finish, n_preempted=n_preempted,
        n_steps=int(counters[0]), n_preemptions=int(counters[1]), n_gpu_loads=int(counters[2]),
        n_disk_loads=int(counters[3]), busy_s=float(times[0]), sched_s=float(times[1]),
        load_s=float(times[2]),
        timeline={name: timeline[:, j] for j, name in enumerate(TIMELINE_COLUMNS)},
    )


def warm_up() -> float:
    """Compile the engine once (or load it from numba's cache); returns the seconds it took."""
    t0 = time.perf_counter()
    from .steptime import StepModel

    cfg = EngineConfig(load_ms=np.ones(2), disk_ms=np.ones(2), max_loras=1, max_cpu_loras=2, kv_blocks=64,
                       step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.05).to_array(), duration_s=1.0)
    req = RequestArrays(np.array([0.0, 0.1]), np.array([0, 1]), np.array([20, 30]), np.array([3, 4]))
    simulate_fast(cfg, req)
    return time.perf_counter() - t0
