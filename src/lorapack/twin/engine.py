"""The fast engine: one vLLM V1 server, step by step, on flat arrays (twin.md §7).

The step below reads like vLLM's ``Scheduler.schedule()``: the running pass, then the waiting pass with
the ``max_loras`` skip rule, then adapter activation, step time and the update. Exact semantics (ties,
held arrivals, timeline sampling) are in ``docs/engine-semantics.md``; ``reference.py`` is the literal
version the tests compare against.

What makes it fast:

* state lives in numpy arrays indexed by request, by adapter, or by slot of the running list (the hot
  per-step state of running requests is contiguous: ``run_comp[i]``, ``run_blk[i]``);
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

from ..guards import Limits, check_engine
from . import steptime as _steptime_mod
from .types import TIMELINE_COLUMNS, EngineConfig, EngineResult, RequestArrays


def _drop_stale_numba_cache() -> None:
    """numba's cache only tracks the file of each cached function, not the step-time code it inlines from
    ``steptime.py``: drop the twin's cached machine code whenever either source file changed."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    digest = hashlib.sha256(b"".join((here / f).read_bytes() for f in ("engine.py", "steptime.py"))).hexdigest()
    cache = here / "__pycache__"
    stamp = cache / "lorapack_twin_sources.sha256"
    try:
        if stamp.is_file() and stamp.read_text() == digest:
            return
        for f in list(cache.glob("*.nbi")) + list(cache.glob("*.nbc")):
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # read-only install: numba then simply recompiles or reuses what is there
        pass


_drop_stale_numba_cache()
compute_ms, sched_ms = _steptime_mod.compute_ms, _steptime_mod.sched_ms

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


# Scalar state lives in two small arrays so that a run can pause and resume (``Engine.advance_to``).
(I_STEP, I_PTR, I_HELD_END, I_PREEMPT_CTR, I_N_PREEMPT, I_N_GPU_LOADS, I_N_DISK_LOADS, I_N_WAITING,
 I_N_RUN, I_N_ACTIVE, I_N_GPU, I_N_CPU, I_NEXT_SAMPLE, I_FREE, I_N_DONE, I_DONE_TOK, I_N_SENT,
 I_SENT_TOK, I_INFLIGHT_TOK) = range(19)
N_ISC = 19
F_T, F_BUSY, F_SCHED, F_LOAD = range(4)
N_FSC = 4
# positions in the state tuple that the Python side reads
A_STATUS, A_T_SENT, A_T_FIRST, A_T_FINISH, A_N_PREEMPTED, A_TIMELINE = 1, 3, 4, 5, 6, 32


@njit(cache=True)
def _new_state(n, n_ad, max_loras, max_cpu_loras, kv_blocks, max_num_seqs, warm_gpu, warm_cpu,
               duration_s, timeline_dt_s):
    """All arrays of one run, with the warm-start adapter caches (semantics doc, "State")."""
    out_done = np.zeros(n, np.int64)  # written back when a request leaves the running list
    status = np.zeros(n, np.int8)
    key = np.zeros(n, np.int64)
    t_sent = np.full(n, np.nan)
    t_first = np.full(n, np.nan)
    t_finish = np.full(n, np.nan)
    n_preempted = np.zeros(n, np.int32)
    # waiting queue: one FIFO per adapter, linked through w_next / w_prev; two min-trees over head keys
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
    # running list in admission order, one slot per running request: its hot state is copied into
    # contiguous slot arrays (the step walks them every step; request-indexed arrays would miss the cache).
    # The step's schedule is always a prefix of the slots: run_num[slot] = tokens scheduled.
    cap_run = min(n, max_num_seqs) + 1
    run_req = np.zeros(cap_run, np.int64)
    run_comp = np.zeros(cap_run, np.int64)  # computed tokens
    run_out = np.zeros(cap_run, np.int64)  # output tokens produced
    run_blk = np.zeros(cap_run, np.int64)  # KV blocks held
    run_p = np.zeros(cap_run, np.int64)
    run_o = np.zeros(cap_run, np.int64)
    run_ad = np.zeros(cap_run, np.int64)
    run_num = np.zeros(cap_run, np.int64)
    run_count = np.zeros(n_ad, np.int64)  # running requests per adapter
    # adapter caches: LRU by stamp (ties: lowest index)
    gpu_res = np.zeros(max(max_loras, 1), np.int64)
    in_gpu = np.zeros(n_ad, np.bool_)
    cpu_res = np.zeros(max(max_cpu_loras, 1), np.int64)
    in_cpu = np.zeros(n_ad, np.bool_)
    gpu_stamp = np.zeros(n_ad, np.int64)
    cpu_stamp = np.zeros(n_ad, np.int64)
    step_mark = np.full(n_ad, -1, np.int64)
    u_list = np.zeros(max(max_loras, 1) + 1, np.int64)
    n_samples = 0
    while n_samples * timeline_dt_s < duration_s:
        n_samples += 1
    timeline = np.zeros((n_samples, 7))

    isc = np.zeros(N_ISC, np.int64)
    fsc = np.zeros(N_FSC, np.float64)
    isc[I_FREE] = kv_blocks
    for a in range(n_ad):
        gpu_stamp[a] = a - n_ad
        cpu_stamp[a] = a - n_ad
    n_cpu = 0
    n_gpu = 0
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
    isc[I_N_GPU] = n_gpu
    isc[I_N_CPU] = n_cpu
    arrays = (out_done, status, key, t_sent, t_first, t_finish, n_preempted,
              w_head, w_tail, w_next, w_prev, tk_all, ta_all, tk_u, ta_u,
              run_req, run_comp, run_out, run_blk, run_p, run_o, run_ad, run_num, run_count,
              gpu_res, in_gpu, cpu_res, in_cpu, gpu_stamp, cpu_stamp, step_mark, u_list, timeline)
    return arrays, isc, fsc


@njit(cache=True)
def _emit_samples(timeline, next_sample, t_upto, inclusive, timeline_dt_s, n_run, n_waiting, kv_blocks,
                  free, n_preemptions, n_gpu, n_active):
    """Timeline rows for sample times <= t_upto (or all remaining when ``inclusive`` is False)."""
    n_samples = timeline.shape[0]
    while next_sample < n_samples and (not inclusive or next_sample * timeline_dt_s <= t_upto):
        timeline[next_sample, 0] = next_sample * timeline_dt_s
        timeline[next_sample, 1] = n_run
        timeline[next_sample, 2] = n_waiting
        timeline[next_sample, 3] = (kv_blocks - free) / kv_blocks if kv_blocks > 0 else 0.0
        timeline[next_sample, 4] = n_preemptions
        timeline[next_sample, 5] = n_gpu
        timeline[next_sample, 6] = n_active
        next_sample += 1
    return next_sample


@njit(cache=True)
def _advance(t_arr, adapter, p_tok, o_tok, load_ms, disk_ms, coef,
             max_loras, max_cpu_loras, kv_blocks, duration_s, max_num_seqs, mnbt, bs,
             client_cap, timeline_dt_s, arrays, isc, fsc, t_stop):
    """Run steps while ``t < min(t_stop, duration_s)``; the state is read from and written back to
    ``arrays``/``isc``/``fsc``, so pausing and resuming gives exactly the uninterrupted run."""
    (out_done, status, key, t_sent, t_first, t_finish, n_preempted,
     w_head, w_tail, w_next, w_prev, tk_all, ta_all, tk_u, ta_u,
     run_req, run_comp, run_out, run_blk, run_p, run_o, run_ad, run_num, run_count,
     gpu_res, in_gpu, cpu_res, in_cpu, gpu_stamp, cpu_stamp, step_mark, u_list, timeline) = arrays
    n = t_arr.shape[0]
    size = tk_all.shape[0] // 2
    s = isc[I_STEP]
    ptr = isc[I_PTR]
    held_end = isc[I_HELD_END]
    preempt_counter = isc[I_PREEMPT_CTR]
    n_preemptions = isc[I_N_PREEMPT]
    n_gpu_loads = isc[I_N_GPU_LOADS]
    n_disk_loads = isc[I_N_DISK_LOADS]
    n_waiting = isc[I_N_WAITING]
    n_run = isc[I_N_RUN]
    n_active = isc[I_N_ACTIVE]  # adapters with running requests (= U when the waiting pass runs)
    n_gpu = isc[I_N_GPU]
    n_cpu = isc[I_N_CPU]
    next_sample = isc[I_NEXT_SAMPLE]
    free = isc[I_FREE]
    n_done = isc[I_N_DONE]
    done_tok = isc[I_DONE_TOK]
    n_sent = isc[I_N_SENT]
    sent_tok = isc[I_SENT_TOK]
    inflight_tok = isc[I_INFLIGHT_TOK]
    t = fsc[F_T]
    busy_s = fsc[F_BUSY]
    sched_s_total = fsc[F_SCHED]
    load_s_total = fsc[F_LOAD]
    t_end_loop = min(t_stop, duration_s)

    while t < t_end_loop:
        # 0. timeline samples up to now
        next_sample = _emit_samples(timeline, next_sample, t, True, timeline_dt_s, n_run, n_waiting,
                                    kv_blocks, free, n_preemptions, n_gpu, n_active)

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
            n_sent += 1
            sent_tok += p_tok[r] + o_tok[r]
            inflight_tok += p_tok[r] + o_tok[r]
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
            pending = run_p[i] + run_out[i] - run_comp[i]
            num = min(pending, budget)
            can_schedule = True
            while True:
                need = (run_comp[i] + num + bs - 1) // bs - run_blk[i]
                if need <= free:
                    if need > 0:
                        run_blk[i] += need
                        free -= need
                    break
                n_run -= 1  # preempt the tail (recompute): it loses its blocks and computed tokens
                v = run_req[n_run]
                free += run_blk[n_run]
                out_done[v] = run_out[n_run]
                n_preempted[v] += 1
                n_preemptions += 1
                preempted = True
                preempt_counter += 1
                key[v] = -preempt_counter  # sorts before every arrival; latest victim first
                status[v] = WAITING
                av = run_ad[n_run]
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
                if n_run == i:  # the victim was this request itself
                    can_schedule = False
                    break
            if not can_schedule:
                break
            if run_out[i] >= 1 and pending == 1:
                n_dec += 1
            ctx += run_comp[i]
            run_num[i] = num
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
                num = min(p_tok[r] + out_done[r], budget)  # a waiting request has computed nothing
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
                free -= need
                status[r] = RUNNING
                run_req[n_run] = r
                run_comp[n_run] = 0
                run_out[n_run] = out_done[r]
                run_blk[n_run] = need
                run_p[n_run] = p_tok[r]
                run_o[n_run] = o_tok[r]
                run_ad[n_run] = a
                run_num[n_run] = num
                n_run += 1
                if run_count[a] == 0:
                    n_active += 1
                run_count[a] += 1
                _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
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
        for k in range(n_sched):  # the schedule is the slot prefix [0, n_sched)
            n_tok += run_num[k]
            a = run_ad[k]
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
        first_fin = n_run
        for k in range(n_sched):
            run_comp[k] += run_num[k]
            if run_comp[k] == run_p[k] + run_out[k]:
                run_out[k] += 1
                r = run_req[k]
                if run_out[k] == 1:
                    t_first[r] = t_end
                if run_out[k] == run_o[k]:
                    t_finish[r] = t_end
                    status[r] = FINISHED
                    out_done[r] = run_out[k]
                    free += run_blk[k]
                    run_blk[k] = 0
                    tok = run_p[k] + run_o[k]
                    inflight_tok -= tok
                    if t_end <= duration_s:
                        n_done += 1
                        done_tok += tok
                    a = run_ad[k]
                    run_count[a] -= 1
                    if run_count[a] == 0:
                        n_active -= 1
                        _refresh(a, w_head, key, run_count, tk_all, ta_all, tk_u, ta_u, size)
                    if n_fin == 0:
                        first_fin = k
                    n_fin += 1
        if n_fin > 0:  # drop finished requests from running, keeping admission order
            j = first_fin
            for k in range(first_fin, n_run):
                if status[run_req[k]] != FINISHED:
                    if j != k:
                        run_req[j] = run_req[k]
                        run_comp[j] = run_comp[k]
                        run_out[j] = run_out[k]
                        run_blk[j] = run_blk[k]
                        run_p[j] = run_p[k]
                        run_o[j] = run_o[k]
                        run_ad[j] = run_ad[k]
                    j += 1
            n_run = j

        t = t_end
        s += 1
        busy_s += dt
        sched_s_total += step_sched_ms / 1000.0
        load_s_total += step_load_ms / 1000.0

    if t >= duration_s:  # the run is over: the remaining samples show the final state
        next_sample = _emit_samples(timeline, next_sample, t, False, timeline_dt_s, n_run, n_waiting,
                                    kv_blocks, free, n_preemptions, n_gpu, n_active)
    isc[I_STEP] = s
    isc[I_PTR] = ptr
    isc[I_HELD_END] = held_end
    isc[I_PREEMPT_CTR] = preempt_counter
    isc[I_N_PREEMPT] = n_preemptions
    isc[I_N_GPU_LOADS] = n_gpu_loads
    isc[I_N_DISK_LOADS] = n_disk_loads
    isc[I_N_WAITING] = n_waiting
    isc[I_N_RUN] = n_run
    isc[I_N_ACTIVE] = n_active
    isc[I_N_GPU] = n_gpu
    isc[I_N_CPU] = n_cpu
    isc[I_NEXT_SAMPLE] = next_sample
    isc[I_FREE] = free
    isc[I_N_DONE] = n_done
    isc[I_DONE_TOK] = done_tok
    isc[I_N_SENT] = n_sent
    isc[I_SENT_TOK] = sent_tok
    isc[I_INFLIGHT_TOK] = inflight_tok
    fsc[F_T] = t
    fsc[F_BUSY] = busy_s
    fsc[F_SCHED] = sched_s_total
    fsc[F_LOAD] = load_s_total


class Engine:
    """One server run that can pause and resume: ``advance_to(t)`` then ``result()``.

    ``run(cfg, req)`` (= ``simulate_fast``) is ``Engine(cfg, req).advance_to(inf).result()``. Pausing never
    changes the outcome: a pause happens between two steps, exactly where the uninterrupted loop would be.
    """

    def __init__(self, cfg: EngineConfig, req: RequestArrays, compiled: bool = True,
                 limits: Limits | None = None) -> None:
        # compiled code indexes without bounds checks: a bad index is a crash, not an exception
        check_engine(cfg, req, limits)
        self.cfg, self.req = cfg, req
        self._new = _new_state if compiled else _new_state.py_func
        self._adv = _advance if compiled else _advance.py_func
        self.arrays, self.isc, self.fsc = self._new(
            len(req), cfg.n_adapters, int(cfg.max_loras), int(cfg.max_cpu_loras), int(cfg.kv_blocks),
            int(cfg.max_num_seqs), bool(cfg.warm_gpu), bool(cfg.warm_cpu), float(cfg.duration_s),
            float(cfg.timeline_dt_s))

    @property
    def t_s(self) -> float:
        """Simulated time: the end of the last step (or of the last idle jump)."""
        return float(self.fsc[F_T])

    @property
    def done(self) -> bool:
        return self.t_s >= self.cfg.duration_s

    def advance_to(self, t_stop_s: float) -> Engine:
        cfg, req = self.cfg, self.req
        self._adv(req.t_arr_s, req.adapter, req.prompt_tokens, req.output_tokens, cfg.load_ms, cfg.disk_ms,
                  cfg.step_coef, int(cfg.max_loras), int(cfg.max_cpu_loras), int(cfg.kv_blocks),
                  float(cfg.duration_s), int(cfg.max_num_seqs), int(cfg.max_num_batched_tokens),
                  int(cfg.block_size), int(cfg.client_cap), float(cfg.timeline_dt_s), self.arrays, self.isc,
                  self.fsc, float(t_stop_s))
        return self

    def snapshot(self) -> dict:
        """Counters a router or an early-stop rule may look at (cheap: no per-request work)."""
        isc = self.isc
        a = self.arrays
        oldest_wait_s = 0.0
        if isc[I_N_WAITING] > 0:
            # the age of the oldest *waiting* request (a preemption victim keeps its send time). Queue keys
            # order admission, not age (victims sort first, latest victim first), so scan the injected ones.
            ptr = int(isc[I_PTR])
            waiting = a[A_STATUS][:ptr] == WAITING
            oldest_wait_s = self.t_s - float(a[A_T_SENT][:ptr][waiting].min())
        return {
            "t_s": self.t_s, "num_requests_running": int(isc[I_N_RUN]),
            "num_requests_waiting": int(isc[I_N_WAITING]), "kv_used_blocks": int(self.cfg.kv_blocks - isc[I_FREE]),
            "n_sent": int(isc[I_N_SENT]), "sent_tokens": int(isc[I_SENT_TOK]),
            "n_completed": int(isc[I_N_DONE]), "completed_tokens": int(isc[I_DONE_TOK]),
            "inflight_tokens": int(isc[I_INFLIGHT_TOK]), "next_arrival": int(isc[I_PTR]),
            "n_preemptions": int(isc[I_N_PREEMPT]), "n_gpu_loads": int(isc[I_N_GPU_LOADS]),
            "oldest_wait_s": oldest_wait_s, "busy_s": float(self.fsc[F_BUSY]), "steps": int(isc[I_STEP]),
        }

    def result(self) -> EngineResult:
        a, isc, fsc = self.arrays, self.isc, self.fsc
        timeline = a[A_TIMELINE]
        n_rows = int(isc[I_NEXT_SAMPLE])
        return EngineResult(
            t_sent_s=a[A_T_SENT], t_first_s=a[A_T_FIRST], t_finish_s=a[A_T_FINISH], n_preempted=a[A_N_PREEMPTED],
            n_steps=int(isc[I_STEP]), n_preemptions=int(isc[I_N_PREEMPT]), n_gpu_loads=int(isc[I_N_GPU_LOADS]),
            n_disk_loads=int(isc[I_N_DISK_LOADS]), busy_s=float(fsc[F_BUSY]), sched_s=float(fsc[F_SCHED]),
            load_s=float(fsc[F_LOAD]), held_end=int(isc[I_HELD_END]),
            timeline={name: timeline[:n_rows, j] for j, name in enumerate(TIMELINE_COLUMNS)},
        )


def simulate_fast(cfg: EngineConfig, req: RequestArrays, compiled: bool = True,
                  limits: Limits | None = None) -> EngineResult:
    """Simulate one server over ``[0, cfg.duration_s)``; ``compiled=False`` runs the same code uncompiled.

    Inputs are checked first (``guards.check_engine``): ``SpecError`` / ``ResourceLimitError``."""
    return Engine(cfg, req, compiled, limits).advance_to(float("inf")).result()


def warm_up() -> float:
    """Compile the engine once (or load it from numba's cache); returns the seconds it took."""
    t0 = time.perf_counter()
    from .steptime import StepModel

    cfg = EngineConfig(load_ms=np.ones(2), disk_ms=np.ones(2), max_loras=1, max_cpu_loras=2, kv_blocks=64,
                       step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.05).to_array(), duration_s=1.0)
    req = RequestArrays(np.array([0.0, 0.1]), np.array([0, 1]), np.array([20, 30]), np.array([3, 4]))
    simulate_fast(cfg, req)
    return time.perf_counter() - t0
