"""The fast engine: one vLLM V1 server, step by step, on flat arrays (exact semantics: docs/engine-semantics.md).

One engine step reads like vLLM's ``Scheduler.schedule()`` followed by the model run and
``Scheduler.update_from_output()``. Each phase is a short function (numba inlines them into the loop):

=========================  =====================================================================================
phase                      vLLM code it mirrors
=========================  =====================================================================================
``_add_arrivals``          ``EngineCore.add_request`` -> ``Scheduler.add_request``: new requests join the
                           tail of ``Scheduler.waiting`` (held back while the benchmark client is saturated)
``_schedule_running``      ``schedule()``, "First, schedule the RUNNING requests": walk ``self.running`` in
                           order while ``token_budget > 0``; ``kv_cache_manager.allocate_slots`` and, when it
                           fails, preempt ``self.running.pop()`` (``_preempt_request``) until it fits. (Both
                           schedule passes also advance ``num_computed_tokens`` and note the batch's adapters
                           with their LRU touch, ``_add_to_batch``, as they schedule a request.)
``_preempt_tail``          ``_preempt_request`` (recompute): free the victim's blocks, ``num_computed_tokens
                           = 0``, ``self.waiting.prepend_request(victim)``
``_schedule_waiting``      ``schedule()``, "Next, schedule the WAITING requests" (only without preemption):
                           stop at ``max_num_running_reqs``; skip requests whose LoRA would exceed
                           ``max_loras`` (``skipped_waiting_requests``); stop when ``allocate_slots`` fails
``_activate_adapters``     the worker's ``LRUCacheWorkerLoRAManager._apply_adapters`` /
                           ``LRUCacheLoRAModelManager.activate_adapter``: walk the batch's adapters in the
                           order of a Python set (``adapter_order``), touching each; a missing one is loaded
                           from disk into the CPU cache and into a GPU slot, evicting the least recently used
                           one, even an adapter of this batch not touched yet (it is loaded again when its
                           turn comes: vLLM's eviction cascade)
``_step_ms``               the model run (``execute_model``): scheduler CPU time + adapter loads + forward
                           pass, from the calibrated estimators in ``steptime.py``
``_update_from_output``    ``update_from_output``: sample one token per request that reached its end (and
                           bin its inter-token gap), ``_free_request`` the finished ones
=========================  =====================================================================================

Exact semantics (ties, held arrivals, timeline sampling) are in ``docs/engine-semantics.md``; ``reference.py``
is the literal, object-per-request version the tests compare against.

The state lives in named containers of flat numpy arrays (``EngineState``): per request (``Requests``), the
waiting queue (``WaitingQueue``), the running list by slot (``RunningSlots``), the adapter caches
(``AdapterCaches``), the 2 s timeline, and the scalar ``counters`` (one numpy record, ``COUNTERS``). What makes
it fast:

* the hot per-step state of running requests is contiguous by slot of the running list
  (``running.computed_tokens[i]``, ``running.kv_blocks[i]``), a window over arrays twice its length, so that
  the oldest requests, which finish first, leave it without moving the others; one pass over it per step
  schedules (and notes the batch's adapters), one samples the tokens;
* indices are known to be >= 0 where the compiled code can see it (counted up from 0, or unsigned arrays of
  adapter indices): numba then omits its fix-up for negative indices on every array access;
* the waiting queue is one FIFO per adapter, ordered by a global key (arrival index, or a negative counter
  for preemption victims so that they sort first, latest victim first). The global queue order is the merge
  of the FIFOs, so vLLM's scan "skip requests of adapters that would exceed max_loras, admit the others in
  order" becomes "take the minimum head key" over all adapters (while fewer than ``max_loras`` adapters are
  in the batch) or over the adapters with running requests (once ``max_loras`` are). Two tournament trees
  answer that minimum in O(1) and are updated in O(log N): no O(W) scan per step (a long queue would cost
  quadratic time);
* the phases are inlined into one compiled loop that allocates nothing and runs without numba's reference
  counting (``_nrt=False``): reading an array out of a container then costs what reading a local does;
* ``compiled=False`` runs the step loop as plain Python (the phases it calls stay compiled).

A live engine (``Engine.live``: ``lorapack serve``) runs the same loop on arrivals added while it runs
(``add_request``), drops finished requests from its arrays once they are drained, and can abort a request
between two steps; for the same arrivals its per-request results are those of the batch run, bit for bit
(docs/engine-semantics.md, "Live runs").

Compiled machine code is cached in a user cache directory keyed by the hash of this file, ``steptime.py`` and
``gaps.py`` (numba does not notice changes of code it inlined from another file); nothing is written into the
package.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import njit

from ..errors import SpecError
from ..guards import Limits, check_engine
from . import gaps as _gaps_mod
from . import steptime as _steptime_mod
from .jitcache import cached_njit
from .types import INT32_MAX, TIMELINE_COLUMNS, EngineConfig, EngineResult, RequestArrays, label_set_keys

_compute_ms = cached_njit()(_steptime_mod.compute_ms)
_sched_ms = cached_njit()(_steptime_mod.sched_ms)
_gap_bin = cached_njit()(_gaps_mod.gap_bin)


@cached_njit()
def _noise_index(key, step):
    """``steptime.noise_index`` in uint64 arithmetic (it wraps as the masked Python integers do)."""
    z = key + np.uint64(step) * np.uint64(_steptime_mod.NOISE_MULT)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(64 - _steptime_mod.NOISE_BITS)

INF_KEY = np.int64(2**62)  # the key of an empty FIFO
LABEL_SEEN_BITS = 24  # the API server's registry of label sets: a bitmap over this many fingerprint bits (2 MiB)
WAITING, RUNNING, FINISHED = 1, 2, 3

# Scalar state, named; one record per run so that a run can pause and resume (``Engine.advance_to``).
COUNTERS = np.dtype([
    ("t_s", np.float64),  # simulated time: end of the last step (or idle jump)
    ("step", np.int64),  # non-idle steps so far (the LRU clock of the adapter caches)
    ("next_arrival_index", np.int64),  # first request not yet injected
    ("held_end_index", np.int64),  # arrivals below this index were held back by the client cap
    ("preemption_serial", np.int64),  # victims get queue key -serial: latest victim first
    ("n_preemptions", np.int64),
    ("n_gpu_loads", np.int64),
    ("n_disk_loads", np.int64),
    ("n_waiting", np.int64),
    ("n_running", np.int64),
    ("n_active_adapters", np.int64),  # adapters with running requests
    ("n_gpu_resident", np.int64),
    ("n_cpu_resident", np.int64),
    ("next_sample", np.int64),  # index of the next timeline sample
    ("free_kv_blocks", np.int64),
    ("n_completed", np.int64),  # finished by duration_s
    ("completed_tokens", np.int64),
    ("n_sent", np.int64),
    ("sent_tokens", np.int64),
    ("inflight_tokens", np.int64),  # tokens of injected, unfinished requests
    ("busy_s", np.float64),
    ("sched_s", np.float64),
    ("load_s", np.float64),
    ("running_lo", np.int64),  # the running list is slots running_lo .. running_lo + n_running - 1
    ("n_known", np.int64),  # requests in the arrays (a batch run: all; a live run: added so far)
    ("scheduled_tokens", np.int64),  # tokens of all steps so far (vllm:iteration_tokens_total's sum)
    # the API server's loop (``_api_until``; docs/engine-semantics.md, "The API server")
    ("api_free_s", np.float64),  # when the loop ends the work it has taken (step outputs, scrapes)
    ("api_floor_s", np.float64),  # when it could take a request that arrived after its latest scrape ...
    ("api_floor_before_s", np.float64),  # ... and one that arrived before it (in the latest interval)
    ("api_first_scrape_s", np.float64),  # the first scrape of the latest interval (inf: none)
    ("api_done_s", np.float64),  # arrivals up to this time have their ready time
    ("api_next_index", np.int64),  # first arrival without a ready time
    ("next_scrape_s", np.float64),  # when the /metrics poller asks next
    ("batch_open", np.int64),  # 1: step outputs wait for the loop, to leave as one chunk per request
    ("batch_start_s", np.float64),  # when the loop takes them
    ("batch_work_s", np.float64),  # its work on them
    ("batch_len", np.int64),  # requests with tokens in the batch (``ApiLoop.batch_requests``)
    ("last_deliv_s", np.float64),  # when the latest chunks reached their clients
    ("n_scrapes", np.int64),
    ("scrape_s", np.float64),  # the loop's time on scrapes
    ("label_hash", np.uint64),  # fingerprint of (adapters running, adapters waiting): XOR of per-adapter keys
    ("label_last_hash", np.uint64),  # the one of the latest step
    ("label_series", np.int64),  # distinct label sets recorded (vllm:lora_requests_info series)
    ("label_names", np.int64),  # adapter names in their labels
    ("label_pending", np.int64),  # 1: the latest step's label set is still to record (``_record_label_set``)
    ("n_waiting_adapters", np.int64),  # adapters with waiting requests
], align=True)

class ServerLimits(NamedTuple):
    """The server as the scheduler sees it (read-only during a run)."""

    max_loras: int  # GPU adapter slots
    max_cpu_loras: int  # CPU adapter cache capacity
    kv_blocks: int
    block_size_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    client_cap_waiting: int  # client-saturation cap on waiting requests; 0 = off
    duration_s: float
    timeline_dt_s: float
    step_coef: np.ndarray  # steptime.StepModel.to_array()
    load_ms: np.ndarray  # [adapter] CPU -> GPU activation
    disk_ms: np.ndarray  # [adapter] disk -> CPU load
    adapter_order: np.ndarray  # [adapter] position in the order the worker walks a batch's adapters
    lru_protects_batch: bool  # True: eviction never picks an adapter of the current batch (no cascade)
    admission_running: bool  # max_loras rule: True = adapters of all running requests count (vLLM 0.33)
    # the API server's loop (``_api_until``); all zero and ``api_on`` False: not modelled, tokens reach the
    # client at the step's end
    api_on: bool
    api_s_per_output: float  # the loop's work per output of a step
    output_proc_chunk: int  # outputs of one step the loop processes without yielding (VllmRules.output_proc_chunk)
    scrape_period_s: float  # the /metrics poller's sleep between a response and its next scrape; 0 = no poller
    scrape_base_s: float  # a scrape's render time: fixed part ...
    scrape_s_per_series: float  # ... per label series of vllm:lora_requests_info ...
    scrape_s_per_name: float  # ... per adapter name in their labels
    step_noise: np.ndarray  # the step-time multiplier's quantile table (``steptime.noise_table``; empty: none)
    step_noise_key: np.uint64  # its draws: ``steptime.noise_index(key, step)``
    label_key_running: np.ndarray  # uint64 [adapter]: fingerprint keys of the label sets (zeros: not kept)
    label_key_waiting: np.ndarray
    # a live run (``Engine.live``): more arrivals may come, so an idle engine waits until the caller's stop time
    # instead of jumping to the end of the window
    live: bool = False

class Requests(NamedTuple):
    """Per request: the arrivals (inputs) and their state."""

    t_arr_s: np.ndarray
    adapter: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray  # tokens to generate
    status: np.ndarray  # 0 not injected, WAITING, RUNNING, FINISHED
    queue_key: np.ndarray  # position in the global waiting order
    output_tokens_done: np.ndarray  # written back when the request leaves the running list
    t_sent_s: np.ndarray
    t_first_s: np.ndarray
    t_last_token_s: np.ndarray  # when its latest token was streamed, kept while it waits (preempted)
    t_finish_s: np.ndarray
    n_preempted: np.ndarray
    t_ready_s: np.ndarray  # when the API server handed it to the engine core (``_api_until``)
    batch_tokens: np.ndarray  # its tokens in the open output batch (not delivered yet)
    n_merged: np.ndarray  # tokens that reached the client in the chunk of an earlier token (merged chunks)

class WaitingQueue(NamedTuple):
    """One FIFO per adapter (doubly linked through the requests) and two min-trees over the head keys."""

    head: np.ndarray  # [adapter] first request, -1 if empty
    tail: np.ndarray  # [adapter]
    next: np.ndarray  # [request]
    prev: np.ndarray  # [request]
    all_key: np.ndarray  # tree over every adapter's head key ...
    all_adapter: np.ndarray  # ... and the adapter holding it
    active_key: np.ndarray  # tree over the head keys of adapters with running requests
    active_adapter: np.ndarray

class RunningSlots(NamedTuple):
    """The running list in admission order, one slot per request, in the window of slots from
    ``counters.running_lo`` (``n_running`` of them); a step's schedule is a prefix of the window. The arrays
    are twice the longest list: requests finish mostly at the front (the oldest), where dropping one moves
    the window's start instead of every later slot; the window moves back to slot 0 when its end reaches the
    arrays' end."""

    request: np.ndarray
    computed_tokens: np.ndarray
    output_tokens: np.ndarray  # produced so far
    kv_blocks: np.ndarray  # held
    prompt_tokens: np.ndarray
    target_output_tokens: np.ndarray
    adapter: np.ndarray
    t_last_token_s: np.ndarray  # when the request's latest token was streamed (NaN: none yet)

class AdapterCaches(NamedTuple):
    """GPU slots and CPU cache, LRU by the stamp of the last touch (``last_touch``)."""

    n_running: np.ndarray  # [adapter] running requests
    in_gpu: np.ndarray
    gpu_slots: np.ndarray  # resident adapters, first n_gpu_resident entries (uint32, as cpu_slots)
    in_cpu: np.ndarray
    cpu_slots: np.ndarray
    # LRU stamp of both caches: step * n_adapters + adapter_order of the last step whose batch used the adapter
    # (warm start: index - N); set as the batch is formed (the walk of a step with loads redoes it in order)
    last_touch: np.ndarray
    batch_step: np.ndarray  # [adapter] last step whose batch loaded adapters and used this one
    batch: np.ndarray  # the distinct adapters of this step's batch
    batch_old_touch: np.ndarray  # their stamps before this step

class ApiLoop(NamedTuple):
    """The API server's loop beside the scalar counters: the requests of the open output batch and the label
    sets the metrics registry has seen."""

    batch_requests: np.ndarray  # [counters.batch_len] requests with tokens in the open batch
    label_seen: np.ndarray  # uint64 bitmap over the top LABEL_SEEN_BITS bits of a label set's fingerprint
    waiting_mark: np.ndarray  # [adapter] step + 1 when counted waiting for an arrival not queued yet


class EngineState(NamedTuple):
    requests: Requests
    queue: WaitingQueue
    running: RunningSlots
    adapters: AdapterCaches
    timeline: np.ndarray  # [sample, TIMELINE_COLUMNS]
    gap_hist: np.ndarray  # inter-token gaps that ended in the window, binned by ``gaps.gap_bin``
    counters: np.ndarray  # one COUNTERS record
    api: ApiLoop


# ---- the waiting queue ---------------------------------------------------------------------------


@njit(inline="always")
def _tree_set(tree_key, tree_adapter, a, key):
    """Set leaf ``a`` of a min-tournament tree to ``key`` and fix the path to the root."""
    size = tree_key.shape[0] // 2
    i = size + a
    tree_key[i] = key
    tree_adapter[i] = a
    i >>= 1
    while i >= 1:
        left = 2 * i
        if tree_key[left] <= tree_key[left + 1]:
            tree_key[i] = tree_key[left]
            tree_adapter[i] = tree_adapter[left]
        else:
            tree_key[i] = tree_key[left + 1]
            tree_adapter[i] = tree_adapter[left + 1]
        i >>= 1


@njit(inline="always")
def _publish_head(st, a):
    """Re-publish adapter ``a``'s head key in both trees after its FIFO or running count changed."""
    q = st.queue
    size = q.all_key.shape[0] // 2
    h = q.head[a]
    k = st.requests.queue_key[h] if h >= 0 else INF_KEY
    if q.all_key[size + a] != k:
        _tree_set(q.all_key, q.all_adapter, a, k)
    k_active = k if st.adapters.n_running[a] > 0 else INF_KEY
    if q.active_key[size + a] != k_active:
        _tree_set(q.active_key, q.active_adapter, a, k_active)


@njit(inline="always")
def _waiting_set_changed(lim, st, a, joins):
    """Adapter ``a`` joins (or leaves) the set of adapters with waiting requests: the label set's fingerprint."""
    c = st.counters[0]
    c.label_hash ^= lim.label_key_waiting[a]
    c.n_waiting_adapters += 1 if joins else -1


@njit(inline="always")
def _running_set_changed(lim, st, a):
    """Adapter ``a`` joins or leaves the set of adapters with running requests (``n_active_adapters``)."""
    c = st.counters[0]
    c.label_hash ^= lim.label_key_running[a]


@njit(inline="always")
def _push_tail(lim, st, r, a):
    q = st.queue
    q.prev[r] = q.tail[a]
    q.next[r] = -1
    if q.tail[a] >= 0:
        q.next[q.tail[a]] = r
    else:
        q.head[a] = r
        _publish_head(st, a)
        _waiting_set_changed(lim, st, a, True)
    q.tail[a] = r


@njit(inline="always")
def _push_head(lim, st, r, a):
    q = st.queue
    q.prev[r] = -1
    q.next[r] = q.head[a]
    if q.head[a] >= 0:
        q.prev[q.head[a]] = r
    else:
        q.tail[a] = r
        _waiting_set_changed(lim, st, a, True)
    q.head[a] = r
    _publish_head(st, a)


@njit(inline="always")
def _pop_head(lim, st, a):
    q = st.queue
    r = q.head[a]
    q.head[a] = q.next[r]
    if q.head[a] >= 0:
        q.prev[q.head[a]] = -1
    else:
        q.tail[a] = -1
        _waiting_set_changed(lim, st, a, False)
    q.next[r] = -1
    return r


# ---- the phases of one step ----------------------------------------------------------------------


@njit(inline="always")
def _emit_samples(lim, st, until_now):
    """Timeline rows for sample times <= now (``until_now``), or all remaining ones (end of the run)."""
    c = st.counters[0]
    tl = st.timeline
    while c.next_sample < tl.shape[0] and (not until_now or c.next_sample * lim.timeline_dt_s <= c.t_s):
        k = c.next_sample
        tl[k, 0] = k * lim.timeline_dt_s
        tl[k, 1] = c.n_running
        tl[k, 2] = c.n_waiting
        tl[k, 3] = (lim.kv_blocks - c.free_kv_blocks) / lim.kv_blocks if lim.kv_blocks > 0 else 0.0
        tl[k, 4] = c.n_preemptions
        tl[k, 5] = c.n_gpu_resident
        tl[k, 6] = c.n_active_adapters
        c.next_sample = k + 1


@njit(inline="always")
def _add_arrivals(lim, st):
    """Inject the arrivals up to now at the waiting tail; the client cap holds them back instead."""
    c = st.counters[0]
    req = st.requests
    n = c.n_known
    t = c.t_s
    # with the API server's loop modelled a request joins once the loop has handed it over (``_api_until``
    # gave every arrival up to now its ready time, never before its arrival; ready times grow with the index)
    while c.next_arrival_index < n and req.t_arr_s[c.next_arrival_index] <= t and \
            (not lim.api_on or req.t_ready_s[c.next_arrival_index] <= t):
        r = c.next_arrival_index
        if lim.client_cap_waiting > 0 and c.n_waiting >= lim.client_cap_waiting:
            j = max(r, c.held_end_index)  # everything before held_end_index is already marked
            while j < n and req.t_arr_s[j] <= t:
                j += 1
            if j > c.held_end_index:
                c.held_end_index = j
            return
        req.t_sent_s[r] = t if r < c.held_end_index else req.t_arr_s[r]
        tokens = req.prompt_tokens[r] + req.output_tokens[r]
        c.n_sent += 1
        c.sent_tokens += tokens
        c.inflight_tokens += tokens
        req.status[r] = WAITING
        req.queue_key[r] = r
        _push_tail(lim, st, r, req.adapter[r])
        c.n_waiting += 1
        c.next_arrival_index = r + 1


@njit(inline="always")
def _running_lo(st):
    """The first slot of the running list. (Known to be >= 0 in the compiled code, with an index counted up
    from 0 added to it: every array access then skips the fix-up for negative indices.)"""
    return max(st.counters[0].running_lo, 0)


@njit(inline="always")
def _preempt_tail(lim, st):
    """Preempt the last running request (recompute): it loses its blocks and computed tokens and
    returns to the head of the waiting queue, ahead of every arrival."""
    c = st.counters[0]
    run, req, ad = st.running, st.requests, st.adapters
    c.n_running -= 1
    slot = c.running_lo + c.n_running
    v = run.request[slot]
    c.free_kv_blocks += run.kv_blocks[slot]
    req.output_tokens_done[v] = run.output_tokens[slot]
    req.t_last_token_s[v] = run.t_last_token_s[slot]  # its next token's gap spans the wait
    req.n_preempted[v] += 1
    c.n_preemptions += 1
    c.preemption_serial += 1
    req.queue_key[v] = -c.preemption_serial
    req.status[v] = WAITING
    a = run.adapter[slot]
    ad.n_running[a] -= 1
    if ad.n_running[a] == 0:
        c.n_active_adapters -= 1
        _running_set_changed(lim, st, a)
    _push_head(lim, st, v, a)
    c.n_waiting += 1


@njit(inline="always")
def _add_to_batch(lim, st, stamp_base, a, n_adapters, n_missing):
    """Note adapter ``a`` in this step's batch (``AdapterCaches.batch``: distinct, in order of first use) and
    touch it (its stamp of this step, ``stamp_base + adapter_order[a]``, with ``stamp_base = step * N``) at the
    moment one of its requests is scheduled; returns the updated (distinct adapters, those of them not in a
    GPU slot). A scheduled request stays scheduled (preemption takes requests not scheduled yet), and no
    adapter moves before ``_activate_adapters``. Stamps of earlier steps are below ``stamp_base``."""
    ad = st.adapters
    old = ad.last_touch[a]  # (the base model's stamp is INF_KEY: it never joins, ``Engine.live``)
    if old < stamp_base:  # not in this step's batch yet
        ad.batch[n_adapters] = a
        ad.batch_old_touch[n_adapters] = old
        ad.last_touch[a] = stamp_base + lim.adapter_order[a]
        n_adapters += 1
        if not ad.in_gpu[a]:
            n_missing += 1
    return n_adapters, n_missing


@njit(inline="always")
def _schedule_running(lim, st):
    """The running pass, in admission order. Returns (token budget left, requests scheduled, decode
    requests among them, their computed context tokens, whether a request was preempted, distinct adapters
    of the batch so far, those of them not in a GPU slot)."""
    c = st.counters[0]
    run = st.running
    stamp_base = c.step * st.adapters.last_touch.shape[0]
    lo = _running_lo(st)  # (only the waiting pass moves the window)
    budget = lim.max_num_batched_tokens
    preempted = False
    n_decode = 0
    ctx_tokens = 0  # summed as an integer: the same float as a float sum (exact below 2**53), sooner
    n_adapters = 0
    n_missing = 0
    i = 0
    while i < c.n_running and budget > 0:
        s = lo + i
        computed = run.computed_tokens[s]
        pending = run.prompt_tokens[s] + run.output_tokens[s] - computed
        num = min(pending, budget)
        # allocate_slots: the blocks it holds suffice for most steps (need <= 0 <= free_kv_blocks below), so
        # the division and the preemption loop run only when the tokens outgrow them
        if computed + num > run.kv_blocks[s] * lim.block_size_tokens:
            while True:  # preempting the tail until the blocks fit
                need = (computed + num + lim.block_size_tokens - 1) // lim.block_size_tokens - run.kv_blocks[s]
                if need <= c.free_kv_blocks:
                    if need > 0:
                        run.kv_blocks[s] += need
                        c.free_kv_blocks -= need
                    break
                _preempt_tail(lim, st)
                preempted = True
                if c.n_running == i:  # the victim was this request itself
                    break
            if c.n_running == i:
                break
        if run.output_tokens[s] >= 1 and pending == 1:
            n_decode += 1
        ctx_tokens += computed
        run.computed_tokens[s] = computed + num  # computed by the end of the step
        budget -= num
        n_adapters, n_missing = _add_to_batch(lim, st, stamp_base, run.adapter[s], n_adapters, n_missing)
        i += 1
    return budget, i, n_decode, float(ctx_tokens), preempted, n_adapters, n_missing


@njit(inline="always")
def _move_window_to_start(st):
    """Move the running list's window to slot 0 (its end reached the arrays' end)."""
    c = st.counters[0]
    lo = _running_lo(st)
    for j in range(c.n_running):
        _move_slot(st.running, j, lo + j)
    c.running_lo = 0


@njit(inline="always")
def _admit(lim, st, r, a, num, need_blocks):
    """Move waiting request ``r`` (head of adapter ``a``'s FIFO) to a new running slot."""
    c = st.counters[0]
    run, req, ad = st.running, st.requests, st.adapters
    _pop_head(lim, st, a)
    c.n_waiting -= 1
    c.free_kv_blocks -= need_blocks
    req.status[r] = RUNNING
    if c.running_lo + c.n_running == run.request.shape[0]:
        _move_window_to_start(st)
    slot = c.running_lo + c.n_running
    run.request[slot] = r
    run.computed_tokens[slot] = num  # computed by the end of the step
    run.output_tokens[slot] = req.output_tokens_done[r]
    run.kv_blocks[slot] = need_blocks
    run.prompt_tokens[slot] = req.prompt_tokens[r]
    run.target_output_tokens[slot] = req.output_tokens[r]
    run.adapter[slot] = a
    run.t_last_token_s[slot] = req.t_last_token_s[r]
    c.n_running += 1
    if ad.n_running[a] == 0:
        c.n_active_adapters += 1
        _running_set_changed(lim, st, a)
    ad.n_running[a] += 1
    _publish_head(st, a)


@njit(inline="always")
def _schedule_waiting(lim, st, budget, n_scheduled, n_adapters, n_missing):
    """The waiting pass: the merge of the per-adapter FIFOs by key, with the ``max_loras`` skip rule.
    Returns (token budget left, requests scheduled, distinct adapters of the batch, those not in a GPU slot)."""
    c = st.counters[0]
    q, req = st.queue, st.requests
    stamp_base = c.step * st.adapters.last_touch.shape[0]
    while c.n_waiting > 0 and budget > 0:
        if c.n_running == lim.max_num_seqs:
            break
        # the max_loras rule (EngineConfig.admission): the adapters of this step's batch so far (vLLM <= 0.32)
        # or of all running requests (0.33). The waiting pass runs only when the running pass scheduled every
        # running request, so both sets are the running requests' adapters here and the two rules agree.
        n_lora = c.n_active_adapters if lim.admission_running else n_adapters
        if n_lora < lim.max_loras:
            a = q.all_adapter[1]  # any adapter may join the batch
        else:
            if q.active_key[1] == INF_KEY:
                break  # every waiting request belongs to an adapter outside the batch: skipped
            a = q.active_adapter[1]
        r = q.head[a]
        num = min(req.prompt_tokens[r] + req.output_tokens_done[r], budget)  # computed nothing yet
        need_blocks = (num + lim.block_size_tokens - 1) // lim.block_size_tokens
        if need_blocks > c.free_kv_blocks:
            break
        _admit(lim, st, r, a, num, need_blocks)
        n_scheduled += 1
        budget -= num
        n_adapters, n_missing = _add_to_batch(lim, st, stamp_base, a, n_adapters, n_missing)
    return budget, n_scheduled, n_adapters, n_missing


@njit(inline="always")
def _lru_victim(slots, n_resident, last_touch, batch_step, step, protect_batch):
    """Index in ``slots`` of the least recently used resident adapter (outside this step's batch when
    ``protect_batch``).

    One always exists: the batch has at most ``max_loras`` adapters and includes the one being loaded,
    which is not resident, while the caller only evicts from a full cache of >= ``max_loras`` slots; and the
    adapters touched in this step are the newest."""
    best = 0
    best_touch = INF_KEY  # above every stamp
    for j in range(n_resident):
        a = slots[j]
        if protect_batch and batch_step[a] == step:
            continue
        t = last_touch[a]
        if t < best_touch:  # stamps are distinct
            best = j
            best_touch = t
    return best


@njit(inline="always")
def _evict_cpu(lim, st):
    """Drop the least recently used adapter from the CPU cache (and from its GPU slot, if it has one)."""
    c = st.counters[0]
    ad = st.adapters
    j = _lru_victim(ad.cpu_slots, c.n_cpu_resident, ad.last_touch, ad.batch_step, c.step,
                    lim.lru_protects_batch)
    old = ad.cpu_slots[j]
    ad.in_cpu[old] = False
    ad.cpu_slots[j] = ad.cpu_slots[c.n_cpu_resident - 1]
    c.n_cpu_resident -= 1
    if ad.in_gpu[old]:
        ad.in_gpu[old] = False
        for jj in range(c.n_gpu_resident):
            if ad.gpu_slots[jj] == old:
                ad.gpu_slots[jj] = ad.gpu_slots[c.n_gpu_resident - 1]
                c.n_gpu_resident -= 1
                break


@njit(inline="always")
def _load_adapter(lim, st, a, load_ms):
    """Bring adapter ``a`` into a GPU slot (via the CPU cache); returns ``load_ms`` plus its load time."""
    c = st.counters[0]
    ad = st.adapters
    if not ad.in_cpu[a]:
        if c.n_cpu_resident >= lim.max_cpu_loras:
            _evict_cpu(lim, st)
        ad.in_cpu[a] = True
        ad.cpu_slots[c.n_cpu_resident] = a
        c.n_cpu_resident += 1
        load_ms += lim.disk_ms[a]
        c.n_disk_loads += 1
    if c.n_gpu_resident >= lim.max_loras:
        j = _lru_victim(ad.gpu_slots, c.n_gpu_resident, ad.last_touch, ad.batch_step, c.step,
                        lim.lru_protects_batch)
        ad.in_gpu[ad.gpu_slots[j]] = False
        ad.gpu_slots[j] = ad.gpu_slots[c.n_gpu_resident - 1]
        c.n_gpu_resident -= 1
    ad.in_gpu[a] = True
    ad.gpu_slots[c.n_gpu_resident] = a
    c.n_gpu_resident += 1
    load_ms += lim.load_ms[a]
    c.n_gpu_loads += 1
    return load_ms


@njit(inline="always")
def _activate_adapters(lim, st, n_adapters, n_missing):
    """Walk the batch's ``n_adapters`` adapters (noted by ``_add_to_batch``, ``n_missing`` of them not in a
    GPU slot) in ``adapter_order``, touching each (the LRU stamp of this step) and loading a missing one when
    its turn comes. Returns the load time in ms.

    Without loads the walk changes nothing but the stamps, which ``_add_to_batch`` already set. With loads an
    adapter not walked yet still has its stamp of an earlier step (an eviction may pick it): the walk starts
    from those stamps."""
    if n_missing == 0:
        return 0.0
    c = st.counters[0]
    ad = st.adapters
    for k in range(n_adapters):
        a = ad.batch[k]
        ad.last_touch[a] = ad.batch_old_touch[k]
        ad.batch_step[a] = c.step
    for k in range(1, n_adapters):  # the walk order
        a = ad.batch[k]
        j = k
        while j > 0 and lim.adapter_order[ad.batch[j - 1]] > lim.adapter_order[a]:
            ad.batch[j] = ad.batch[j - 1]
            j -= 1
        ad.batch[j] = a
    stamp_base = c.step * ad.last_touch.shape[0]
    load_ms = 0.0
    for k in range(n_adapters):
        a = ad.batch[k]
        if not ad.in_gpu[a]:  # (an adapter evicted earlier in this walk is loaded again)
            load_ms = _load_adapter(lim, st, a, load_ms)  # summed in walk order: bit-identical times
        ad.last_touch[a] = stamp_base + lim.adapter_order[a]
    return load_ms


@njit(inline="always")
def _finish(lim, st, k, t_end_s, duration_s):
    """``_free_request``: the request in slot ``k`` produced its last token at ``t_end_s`` (its client gets it
    then, or when the API server's open batch leaves: ``_deliver_batch`` moves ``t_finish_s`` there)."""
    c = st.counters[0]
    run, req, ad = st.running, st.requests, st.adapters
    r = run.request[k]
    req.t_finish_s[r] = t_end_s
    req.status[r] = FINISHED
    req.output_tokens_done[r] = run.output_tokens[k]
    c.free_kv_blocks += run.kv_blocks[k]
    run.kv_blocks[k] = 0
    tokens = run.prompt_tokens[k] + run.target_output_tokens[k]
    c.inflight_tokens -= tokens
    if t_end_s <= duration_s:
        c.n_completed += 1
        c.completed_tokens += tokens
    a = run.adapter[k]
    ad.n_running[a] -= 1
    if ad.n_running[a] == 0:
        c.n_active_adapters -= 1
        _running_set_changed(lim, st, a)
        _publish_head(st, a)


@njit(inline="always")
def _move_slot(run, j, k):
    """Copy the request of slot ``k`` to slot ``j``."""
    run.request[j] = run.request[k]
    run.computed_tokens[j] = run.computed_tokens[k]
    run.output_tokens[j] = run.output_tokens[k]
    run.kv_blocks[j] = run.kv_blocks[k]
    run.prompt_tokens[j] = run.prompt_tokens[k]
    run.target_output_tokens[j] = run.target_output_tokens[k]
    run.adapter[j] = run.adapter[k]
    run.t_last_token_s[j] = run.t_last_token_s[k]


@njit(inline="always")
def _compact_running(st, first_finished, last_finished, n_finished):
    """Drop the requests that finished in this step (the ``first_finished``-th .. ``last_finished``-th of
    the running list) from it, keeping admission order: the requests before the last finished one move up
    (the window's start moves past the dropped ones) or those after the first one move down, whichever are
    fewer."""
    c = st.counters[0]
    run, status = st.running, st.requests.status
    lo = _running_lo(st)
    n = c.n_running
    if last_finished < n - first_finished:
        j = last_finished
        for i in range(last_finished - 1, -1, -1):
            if status[run.request[lo + i]] != FINISHED:
                if j != i:
                    _move_slot(run, lo + j, lo + i)
                j -= 1
        c.running_lo = lo + n_finished
    else:
        j = first_finished
        for i in range(first_finished, n):
            if status[run.request[lo + i]] != FINISHED:
                if j != i:
                    _move_slot(run, lo + j, lo + i)
                j += 1
    c.n_running = n - n_finished


# ---- the API server's loop -------------------------------------------------------------------------
# vLLM's API server is one asyncio loop (docs/engine-semantics.md, "The API server"; docs/trust-under-load.md):
# it hands arrivals to the engine core, turns every step's outputs into chunks for the clients (vLLM 0.8.5
# ``AsyncLLM._run_output_handler``: work per output) and answers /metrics scrapes, whose rendering stops it for
# a time that grows with the label series of ``vllm:lora_requests_info`` (one per distinct set of running and
# waiting adapters ever seen, ``PrometheusStatLogger.record``). Step outputs that arrive while it is busy wait
# and leave together, one chunk per request (``RequestOutputCollector`` merges them).


@njit(inline="always")
def _api_floor(c):
    """When the loop could take new work: after the open output batch, else when its work ends."""
    return c.batch_start_s + c.batch_work_s if c.batch_open else c.api_free_s


@njit(inline="always")
def _deliver_batch(lim, st):
    """The loop took the open batch at ``batch_start_s``: each of its requests gets one chunk at the batch's end
    (its first token, or one gap since its previous chunk; the other tokens merged into it)."""
    c = st.counters[0]
    req, run = st.requests, st.running
    d = c.batch_start_s + c.batch_work_s
    lo = _running_lo(st)
    for i in range(c.n_running):  # the running ones keep their latest chunk's time in their slot too
        if req.batch_tokens[run.request[lo + i]] > 0:
            run.t_last_token_s[lo + i] = d
    for j in range(c.batch_len):
        r = st.api.batch_requests[j]
        if math.isnan(req.t_first_s[r]):
            req.t_first_s[r] = d
        elif d <= lim.duration_s:
            st.gap_hist[_gap_bin(d - req.t_last_token_s[r])] += 1
        req.n_merged[r] += req.batch_tokens[r] - 1
        req.batch_tokens[r] = 0
        req.t_last_token_s[r] = d
        if req.status[r] == FINISHED and req.output_tokens_done[r] == req.output_tokens[r]:
            req.t_finish_s[r] = d  # (an aborted request keeps NaN)
    c.batch_open = 0
    c.batch_len = 0
    c.api_free_s = d
    c.last_deliv_s = d


@njit(inline="always")
def _hand_over(c, req, t):
    """Ready times of the arrivals up to ``t`` not given one yet: the loop's floor of the latest interval, the one
    before its first scrape for those that came before it."""
    while c.api_next_index < c.n_known and req.t_arr_s[c.api_next_index] <= t:
        r = c.api_next_index
        x = req.t_arr_s[r]
        req.t_ready_s[r] = max(x, c.api_floor_before_s if x < c.api_first_scrape_s else c.api_floor_s)
        c.api_next_index = r + 1


@njit(inline="always")
def _api_until(lim, st, t):
    """The loop's events up to time ``t``, in time order: /metrics scrapes, and the ready time of each arrival
    (when the loop hands it to the engine core: at once, or once the work the loop had then is done). The
    outputs of the step ending at ``t`` come after the arrivals up to ``t`` (``_api_take_outputs``).

    An arrival that a live engine learns of after the loop passed its time (added after a step that ran past
    it) gets what a batch run gave it: the floor of the interval it fell in (before or after its first scrape)."""
    c = st.counters[0]
    req = st.requests
    _hand_over(c, req, c.api_done_s)
    if t <= c.api_done_s:
        return
    c.api_floor_before_s = _api_floor(c)
    c.api_first_scrape_s = math.inf
    if lim.scrape_period_s > 0.0:
        while c.next_scrape_s <= t:
            if c.batch_open:  # the scrape waits for the outputs queued before it
                _deliver_batch(lim, st)
            if c.api_first_scrape_s == math.inf:
                c.api_first_scrape_s = c.next_scrape_s
            render_s = (lim.scrape_base_s + lim.scrape_s_per_series * c.label_series
                        + lim.scrape_s_per_name * c.label_names)
            c.api_free_s = max(c.api_free_s, c.next_scrape_s) + render_s
            c.n_scrapes += 1
            c.scrape_s += render_s
            c.next_scrape_s = c.api_free_s + lim.scrape_period_s  # the poller sleeps after each answer
    c.api_floor_s = _api_floor(c)
    _hand_over(c, req, t)
    c.api_done_s = t


@njit(inline="always")
def _api_take_outputs(lim, st, n_outputs, t_end_s):
    """The outputs of a step that ended at ``t_end_s`` reach the loop. Returns when their chunks reach the
    clients, or -1.0 when they join the open batch (``_deliver_batch``).

    vLLM 0.8.5's output handler processes queued step outputs back to back, yielding to the requests' stream
    tasks only when its queue is empty or between slices of ``output_proc_chunk`` outputs of one step
    (``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE``). Outputs that arrive while the loop is busy therefore join the open batch
    (one chunk per request when it ends) while it lasts, unless the step has more outputs than a slice: then the
    loop yields inside it and every step's tokens leave on their own, once the loop has done their work."""
    c = st.counters[0]
    _api_until(lim, st, t_end_s)
    merges = n_outputs <= lim.output_proc_chunk
    if c.batch_open and (not merges or c.batch_start_s + c.batch_work_s <= t_end_s):
        _deliver_batch(lim, st)  # the batch's run ended before these outputs came, or they make the loop yield
    work_s = lim.api_s_per_output * n_outputs
    if c.batch_open:
        c.batch_work_s += work_s
        return -1.0
    if c.api_free_s <= t_end_s:  # the loop is free: it takes them at once
        c.api_free_s = t_end_s + work_s
        return c.api_free_s
    if not merges:  # busy, but they leave on their own after the work queued before them
        c.api_free_s += work_s
        return c.api_free_s
    c.batch_open = 1
    c.batch_start_s = c.api_free_s
    c.batch_work_s = work_s
    return -1.0


@njit(inline="always")
def _record_label_set(lim, st, t_end_s):
    """``PrometheusStatLogger.record`` once per step, after the step that ended at ``t_end_s`` (called at the
    next loop start, same time): a (running adapters, waiting adapters) set not seen before is a new label series
    of ``vllm:lora_requests_info``, never removed (its fingerprint's top LABEL_SEEN_BITS bits mark it in a bitmap:
    a new set whose bit is taken is missed, S / 2**24 of them at S series: 0.2 % at 40,000). vLLM's ``LoRARequestStates`` counts a request as waiting from
    the API server's ``add_request`` to its first scheduled step: the arrivals handed over by now and not queued
    yet are waiting too."""
    c = st.counters[0]
    req, q, mark = st.requests, st.queue, st.api.waiting_mark
    h = c.label_hash
    n_names = c.n_active_adapters + c.n_waiting_adapters
    r = max(c.next_arrival_index, c.held_end_index)
    while r < c.api_next_index and req.t_ready_s[r] <= t_end_s:
        a = req.adapter[r]
        if q.head[a] < 0 and mark[a] != c.step + 1:  # not waiting yet, not counted yet
            mark[a] = c.step + 1
            h ^= lim.label_key_waiting[a]
            n_names += 1
        r += 1
    if h == c.label_last_hash:
        return
    c.label_last_hash = h
    seen = st.api.label_seen
    bit = h >> np.uint64(64 - LABEL_SEEN_BITS)
    word = bit >> np.uint64(6)
    mask = np.uint64(1) << (bit & np.uint64(63))
    if seen[word] & mask == 0:
        seen[word] |= mask
        c.label_series += 1
        c.label_names += n_names


@njit(inline="always")
def _update_from_output(lim, st, n_scheduled, t_end_s):
    """Tokens computed; a request whose computed tokens reach its length samples one token (its first
    sets ``t_first_s``; the others add their gap to the ITL histogram); requests with all their output
    tokens finish. The client gets the tokens when the API server's loop has turned them into chunks
    (``_api_take_outputs``): at the step's end when it is not modelled, later, or with the next open batch."""
    run, req = st.running, st.requests
    c = st.counters[0]
    if lim.api_on:
        deliver_s = _api_take_outputs(lim, st, n_scheduled, t_end_s)  # (every scheduled request counts)
        last_deliv_s = c.last_deliv_s
    else:
        deliver_s = t_end_s
        last_deliv_s = c.t_s  # the step's start: the end of the previous step
    batched = deliver_s < 0.0
    in_window = deliver_s <= lim.duration_s
    n_gaps_of_this_step = 0  # tokens whose previous chunk was the previous delivery: one gap each, the same
    first_finished = -1
    last_finished = -1
    n_finished = 0
    lo = _running_lo(st)
    for i in range(n_scheduled):  # (the schedule passes already added this step's tokens to computed_tokens)
        k = lo + i
        if run.computed_tokens[k] == run.prompt_tokens[k] + run.output_tokens[k]:
            run.output_tokens[k] += 1
            if batched:
                r = run.request[k]
                if req.batch_tokens[r] == 0:
                    req.t_last_token_s[r] = run.t_last_token_s[k]
                    st.api.batch_requests[c.batch_len] = r
                    c.batch_len += 1
                req.batch_tokens[r] += 1
            else:
                if run.output_tokens[k] == 1:
                    req.t_first_s[run.request[k]] = deliver_s
                elif in_window:
                    if run.t_last_token_s[k] == last_deliv_s:
                        n_gaps_of_this_step += 1
                    else:  # after a stall or a preemption: one long gap
                        st.gap_hist[_gap_bin(deliver_s - run.t_last_token_s[k])] += 1
                run.t_last_token_s[k] = deliver_s
            if run.output_tokens[k] == run.target_output_tokens[k]:
                _finish(lim, st, k, t_end_s if batched else deliver_s, lim.duration_s)
                if first_finished < 0:
                    first_finished = i
                last_finished = i
                n_finished += 1
    if n_gaps_of_this_step > 0:  # one histogram update per step for them
        st.gap_hist[_gap_bin(deliver_s - last_deliv_s)] += n_gaps_of_this_step
    if not batched:
        c.last_deliv_s = deliver_s
    if n_finished > 0:
        _compact_running(st, first_finished, last_finished, n_finished)


@njit(inline="always")
def _step(lim, st, t_stop_s):
    """One iteration of the engine loop: arrivals, schedule, adapters, step time, update."""
    c = st.counters[0]
    _emit_samples(lim, st, True)
    if lim.api_on:
        _api_until(lim, st, c.t_s)
    if c.label_pending:  # the previous step's record (here: a live engine knows every arrival up to now)
        _record_label_set(lim, st, c.t_s)
        c.label_pending = 0
    _add_arrivals(lim, st)
    budget, n_scheduled, n_decode, ctx_tokens, preempted, n_adapters, n_missing = _schedule_running(lim, st)
    if not preempted:
        budget, n_scheduled, n_adapters, n_missing = _schedule_waiting(lim, st, budget, n_scheduled, n_adapters,
                                                                       n_missing)
    if n_scheduled == 0:  # idle: jump to the next arrival (no step time charged)
        req = st.requests
        nxt = c.next_arrival_index
        # the next arrival's time, or when the API server's loop hands it over, if it has passed its arrival
        t_next = req.t_ready_s[nxt] if lim.api_on and nxt < c.api_next_index else req.t_arr_s[nxt] \
            if nxt < c.n_known else 0.0
        if nxt < c.n_known and t_next > c.t_s:
            c.t_s = t_next
        elif lim.live:  # arrivals not known yet may come before the stop time: wait there
            c.t_s = max(c.t_s, min(t_stop_s, lim.duration_s))
        else:
            c.t_s = lim.duration_s
        return
    load_ms = _activate_adapters(lim, st, n_adapters, n_missing)
    n_tokens = lim.max_num_batched_tokens - budget  # the scheduled tokens
    # step time = scheduler (CPU) + adapter loads + forward pass
    sched_ms = _sched_ms(lim.step_coef, c.n_running, c.n_waiting)
    forward_ms = _compute_ms(lim.step_coef, n_scheduled, n_tokens - n_decode, n_tokens, ctx_tokens, n_adapters)
    if lim.step_noise.shape[0] > 0:  # the step's own variability: scheduler and forward pass, not the loads
        step_ms = (sched_ms + forward_ms) * lim.step_noise[_noise_index(lim.step_noise_key, c.step)] + load_ms
    else:
        step_ms = sched_ms + load_ms + forward_ms
    dt_s = step_ms / 1000.0
    t_end_s = c.t_s + dt_s
    _update_from_output(lim, st, n_scheduled, t_end_s)
    if lim.scrape_period_s > 0.0:
        c.label_pending = 1
    c.t_s = t_end_s
    c.step += 1
    c.scheduled_tokens += n_tokens
    c.busy_s += dt_s
    c.sched_s += sched_ms / 1000.0
    c.load_s += load_ms / 1000.0


# Without numba's reference counting (``_nrt=False``; the loop allocates nothing): every access to an array
# of a state container would otherwise count a reference, which made the step loop ~15x slower.
@cached_njit(_nrt=False)
def _advance(lim, st, t_stop_s):
    """Run steps while ``t < min(t_stop_s, duration_s)``. All state lives in ``st``, so pausing and
    resuming gives exactly the uninterrupted run."""
    c = st.counters[0]
    t_end_loop_s = min(t_stop_s, lim.duration_s)
    while c.t_s < t_end_loop_s:
        _step(lim, st, t_stop_s)
    if c.t_s >= lim.duration_s:  # the run is over: the remaining samples show the final state
        _emit_samples(lim, st, False)
        if c.batch_open:  # and the API server's loop sends what it holds
            _deliver_batch(lim, st)


def _advance_python(lim: ServerLimits, st: EngineState, t_stop_s: float) -> None:
    """``_advance`` with the loop and the step in the interpreter (the phases the step calls are compiled)."""
    c = st.counters[0]
    t_end_loop_s = min(t_stop_s, lim.duration_s)
    while c.t_s < t_end_loop_s:
        _step.py_func(lim, st, t_stop_s)
    if c.t_s >= lim.duration_s:
        _emit_samples(lim, st, False)
        if c.batch_open:
            _deliver_batch(lim, st)


def _timeline_samples(duration_s: float, timeline_dt_s: float) -> int:
    n = 0
    while n * timeline_dt_s < duration_s:  # the same float test as the sampling itself
        n += 1
    return n


def new_state(cfg: EngineConfig, req: RequestArrays, live: bool = False) -> EngineState:
    """All arrays of one run, with the warm-start adapter caches (semantics doc, "State").

    ``live``: ``req`` is only room for requests to come (``Engine.live``): none is known yet, the running list
    is sized for the longest one the server allows, and there is no timeline (a live run has no end)."""
    n, n_ad = len(req), cfg.n_adapters
    max_loras, max_cpu_loras = int(cfg.max_loras), int(cfg.max_cpu_loras)
    size = 1
    while size < n_ad:
        size *= 2
    requests = Requests(
        t_arr_s=req.t_arr_s, adapter=req.adapter, prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens,
        status=np.zeros(n, np.int8), queue_key=np.zeros(n, np.int64), output_tokens_done=np.zeros(n, np.int64),
        t_sent_s=np.full(n, np.nan), t_first_s=np.full(n, np.nan), t_last_token_s=np.full(n, np.nan),
        t_finish_s=np.full(n, np.nan), n_preempted=np.zeros(n, np.int32), t_ready_s=np.full(n, np.nan),
        batch_tokens=np.zeros(n, np.int32), n_merged=np.zeros(n, np.int32))
    queue = WaitingQueue(
        head=np.full(n_ad, -1, np.int64), tail=np.full(n_ad, -1, np.int64), next=np.full(n, -1, np.int64),
        prev=np.full(n, -1, np.int64), all_key=np.full(2 * size, INF_KEY, np.int64),
        all_adapter=np.full(2 * size, -1, np.int64), active_key=np.full(2 * size, INF_KEY, np.int64),
        active_adapter=np.full(2 * size, -1, np.int64))
    # the window over twice the longest list (every running request holds at least one KV block)
    cap = 2 * (min(int(cfg.max_num_seqs), int(cfg.kv_blocks)) if live else min(n, int(cfg.max_num_seqs))) + 2
    # adapter indices unsigned (N < 2**32): the compiled code indexes with them without a negative-index fix-up
    running = RunningSlots(*(np.full(cap, np.nan) if f == "t_last_token_s" else
                             np.zeros(cap, np.uint32 if f == "adapter" else np.int64) for f in RunningSlots._fields))
    stamps = np.arange(n_ad, dtype=np.int64) - n_ad  # earlier registered = less recently used
    adapters = AdapterCaches(
        n_running=np.zeros(n_ad, np.int64), in_gpu=np.zeros(n_ad, np.bool_),
        gpu_slots=np.zeros(max(max_loras, 1), np.uint32), in_cpu=np.zeros(n_ad, np.bool_),
        cpu_slots=np.zeros(max(max_cpu_loras, 1), np.uint32), last_touch=stamps,
        batch_step=np.full(n_ad, -1, np.int64), batch=np.zeros(max(max_loras, 1) + 1, np.int64),
        batch_old_touch=np.zeros(max(max_loras, 1) + 1, np.int64))
    counters = np.zeros(1, COUNTERS).view(np.recarray)  # records with attribute access, in Python too
    c = counters[0]
    c.free_kv_blocks = int(cfg.kv_blocks)
    c.n_known = 0 if live else n
    n_cpu = 0
    if cfg.warm_cpu:  # the last registered adapters
        warm = np.arange(n_ad - min(max_cpu_loras, n_ad), n_ad)
        adapters.in_cpu[warm] = True
        adapters.cpu_slots[:len(warm)] = warm
        n_cpu = len(warm)
    if cfg.warm_gpu:  # the last registered adapters, in the CPU cache too while it has room
        warm = np.arange(n_ad - min(max_loras, n_ad), n_ad)
        adapters.in_gpu[warm] = True
        adapters.gpu_slots[:len(warm)] = warm
        c.n_gpu_resident = len(warm)
        also_cpu = warm[~adapters.in_cpu[warm]][:max(max_cpu_loras - n_cpu, 0)]
        adapters.in_cpu[also_cpu] = True
        adapters.cpu_slots[n_cpu:n_cpu + len(also_cpu)] = also_cpu
        n_cpu += len(also_cpu)
    c.n_cpu_resident = n_cpu
    n_samples = 0 if live else _timeline_samples(float(cfg.duration_s), float(cfg.timeline_dt_s))
    timeline = np.zeros((n_samples, len(TIMELINE_COLUMNS)))
    c.next_scrape_s = 0.0  # the poller's first scrape: at the start
    c.api_first_scrape_s = math.inf
    c.api_done_s = -math.inf
    scraped = float(cfg.metrics_scrape_s) > 0.0
    api = ApiLoop(batch_requests=np.zeros(max(n, 1) if _api_on(cfg) else 1, np.int64),
                  label_seen=np.zeros(2 ** (LABEL_SEEN_BITS - 6) if scraped else 1, np.uint64),
                  waiting_mark=np.zeros(n_ad if scraped else 1, np.int64))
    return EngineState(requests, queue, running, adapters, timeline, _gaps_mod.new_histogram(), counters, api)


def _api_on(cfg: EngineConfig) -> bool:
    """Is the API server's loop modelled (docs/engine-semantics.md, "The API server")?"""
    return float(cfg.api_ms_per_output) > 0.0 or float(cfg.metrics_scrape_s) > 0.0


def server_limits(cfg: EngineConfig) -> ServerLimits:
    keys_running, keys_waiting = label_set_keys(cfg)
    return ServerLimits(
        max_loras=int(cfg.max_loras), max_cpu_loras=int(cfg.max_cpu_loras), kv_blocks=int(cfg.kv_blocks),
        block_size_tokens=int(cfg.block_size), max_num_seqs=int(cfg.max_num_seqs),
        max_num_batched_tokens=int(cfg.max_num_batched_tokens), client_cap_waiting=int(cfg.client_cap),
        duration_s=float(cfg.duration_s), timeline_dt_s=float(cfg.timeline_dt_s), step_coef=cfg.step_coef,
        load_ms=cfg.load_ms, disk_ms=cfg.disk_ms, adapter_order=cfg.adapter_walk_order(),
        lru_protects_batch=bool(cfg.lru_protects_batch), admission_running=cfg.admission == "running",
        api_on=_api_on(cfg), api_s_per_output=float(cfg.api_ms_per_output) / 1000.0,
        output_proc_chunk=int(cfg.output_proc_chunk),
        step_noise=_steptime_mod.noise_table(float(cfg.step_noise_sigma)), step_noise_key=np.uint64(cfg.step_noise_seed),
        scrape_period_s=float(cfg.metrics_scrape_s), scrape_base_s=float(cfg.scrape_base_ms) / 1000.0,
        scrape_s_per_series=float(cfg.scrape_us_per_series) / 1e6,
        scrape_s_per_name=float(cfg.scrape_us_per_label_name) / 1e6,
        label_key_running=keys_running, label_key_waiting=keys_waiting)


LIVE_MIN_CAPACITY = 64  # first size of a live engine's request arrays


@dataclass
class _LiveBook:
    """What a live engine keeps beside the arrays: each index's request id, whether its result was drained."""

    ids: np.ndarray  # [index] request id, increasing with the index
    drained: np.ndarray  # [index] returned by drain_finished: may leave the arrays
    next_id: int = 0
    last_arrival_s: float = 0.0
    stop_s: float = 0.0  # the latest advance_to time: no arrival may come before it
    abort_pending: set = field(default_factory=set)  # ids aborted before they were injected


def _room_for(capacity: int) -> RequestArrays:
    """Request arrays of ``capacity`` placeholder requests (a live engine fills them as requests come)."""
    ones = np.ones(capacity, np.int32)
    return RequestArrays(np.zeros(capacity), np.zeros(capacity, np.int32), ones, ones.copy())


@cached_njit(_nrt=False)
def _abort(lim, st, r):
    """vLLM's ``finish_requests(..., FINISHED_ABORTED)`` between two steps: request ``r`` leaves the waiting queue
    or the running list (freeing its KV blocks; the requests after it move up, keeping their order)."""
    c = st.counters[0]
    req, q, run, ad = st.requests, st.queue, st.running, st.adapters
    a = req.adapter[r]
    if req.status[r] == WAITING:
        p, nx = q.prev[r], q.next[r]
        if nx >= 0:
            q.prev[nx] = p
        else:
            q.tail[a] = p
        if p >= 0:
            q.next[p] = nx
        else:
            q.head[a] = nx
            _publish_head(st, a)
        if p < 0 and nx < 0:
            _waiting_set_changed(lim, st, a, False)
        q.next[r] = -1
        q.prev[r] = -1
        c.n_waiting -= 1
    elif req.status[r] == RUNNING:
        lo = _running_lo(st)
        i = 0
        while run.request[lo + i] != r:
            i += 1
        k = lo + i
        req.output_tokens_done[r] = run.output_tokens[k]
        c.free_kv_blocks += run.kv_blocks[k]
        for j in range(i, c.n_running - 1):
            _move_slot(run, lo + j, lo + j + 1)
        c.n_running -= 1
        ad.n_running[a] -= 1
        if ad.n_running[a] == 0:
            c.n_active_adapters -= 1
            _running_set_changed(lim, st, a)
            _publish_head(st, a)
    else:
        return
    req.status[r] = FINISHED
    c.inflight_tokens -= req.prompt_tokens[r] + req.output_tokens[r]


class Engine:
    """One server run that can pause and resume: ``advance_to(t)`` then ``result()``.

    ``run(cfg, req)`` (= ``simulate_fast``) is ``Engine(cfg, req).advance_to(inf).result()``. Pausing never
    changes the outcome: a pause happens between two steps, exactly where the uninterrupted loop would be.
    ``Engine.live(cfg)`` is a server's engine: requests are added as they come (``add_request``) and their
    results drained as they finish (``outputs``, ``drain_finished``, ``abort``).
    """

    def __init__(self, cfg: EngineConfig, req: RequestArrays, compiled: bool = True,
                 limits: Limits | None = None) -> None:
        # compiled code indexes without bounds checks: a bad index is a crash, not an exception
        check_engine(cfg, req, limits)
        self.cfg, self.req = cfg, req
        self.server = server_limits(cfg)
        self.state = new_state(cfg, req)
        self._advance = _advance if compiled else _advance_python
        self._live: _LiveBook | None = None

    @classmethod
    def live(cls, cfg: EngineConfig, capacity: int = LIVE_MIN_CAPACITY, compiled: bool = True,
             base_adapter: int | None = None) -> Engine:
        """An engine whose requests arrive while it runs (``add_request``), over a run without end.

        ``cfg.duration_s`` is ignored (the window is unbounded) and there is no timeline. Finished requests
        leave the arrays once ``drain_finished`` has returned them, so memory stays bounded by the requests
        in flight (``capacity`` is only the first size of the arrays; they grow as needed). For the same
        arrivals a live run and a batch run give bit-identical per-request results (the step code is the
        same; docs/engine-semantics.md).

        ``base_adapter``: the index of a pseudo-adapter standing for the base model (its load times are not used):
        it never joins a batch's adapters (no slot, no load, no LoRA cost, not counted by the max_loras rule), and
        its requests may join a batch that already has max_loras adapters (vLLM checks only LoRA requests). Both by
        its state: it counts as always running (a phantom request in ``AdapterCaches.n_running`` that never
        finishes: out of ``n_active_adapters``, in the tree of admissible heads) and its LRU stamp lies above
        every step's."""
        cfg.check()
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity < 1:
            raise SpecError(f"capacity {capacity!r}: expected an integer >= 1")
        base = -1 if base_adapter is None else int(base_adapter)
        if base_adapter is not None and not 0 <= base < cfg.n_adapters:
            raise SpecError(f"base_adapter {base_adapter!r}: expected an adapter index in [0, {cfg.n_adapters - 1}]")
        eng = cls.__new__(cls)
        eng.cfg, eng.req = cfg, None
        eng.server = server_limits(cfg)._replace(duration_s=math.inf, live=True)
        eng.state = new_state(cfg, _room_for(int(capacity)), live=True)
        if base >= 0:
            eng.state.adapters.n_running[base] = 1
            # a stamp above every step's: ``_add_to_batch`` takes it for an adapter already in the batch, so the
            # base model never joins a batch's adapters (a test of the index there instead made the whole
            # compiled loop ~10 % slower)
            eng.state.adapters.last_touch[base] = INF_KEY
        eng._advance = _advance if compiled else _advance_python
        eng._live = _LiveBook(ids=np.zeros(int(capacity), np.int64), drained=np.zeros(int(capacity), np.bool_))
        return eng

    @property
    def counters(self) -> np.void:
        return self.state.counters[0]

    @property
    def t_s(self) -> float:
        """Simulated time: the end of the last step (or of the last idle jump)."""
        return float(self.counters["t_s"])

    @property
    def done(self) -> bool:
        return self.t_s >= self.cfg.duration_s

    def advance_to(self, t_stop_s: float) -> Engine:
        t_stop_s = float(t_stop_s)
        if self._live is not None:
            if not math.isfinite(t_stop_s):
                raise SpecError(f"advance_to({t_stop_s}): a live run has no end; expected a finite time")
            self._live.stop_s = max(self._live.stop_s, t_stop_s)
        self._advance(self.server, self.state, t_stop_s)
        if self._live is not None and self._live.abort_pending:
            self._settle_aborts()
        return self

    # ---- a live run: requests added while the engine runs ------------------------------------------

    def add_request(self, t_arr_s: float, adapter: int, prompt_tokens: int, output_tokens: int) -> int:
        """Add one arrival to a live engine (``Engine.live``); returns its id (0, 1, 2, ... in order of adding).

        Arrivals come in time order and not before the latest ``advance_to`` time: a step that started before
        ``t_arr_s`` must not have missed the request (a request arriving during a step joins at the next step,
        as in a batch run). ``SpecError`` otherwise."""
        book = self._need_live("add_request")
        t = float(t_arr_s)
        if not math.isfinite(t) or t < max(book.last_arrival_s, book.stop_s):
            raise SpecError(f"t_arr_s {t_arr_s!r}: expected a finite time >= {max(book.last_arrival_s, book.stop_s)} "
                            f"s (the previous arrival and the latest advance_to time)")
        n_adapters = self.cfg.n_adapters
        if isinstance(adapter, bool) or not isinstance(adapter, int | np.integer) or not 0 <= adapter < n_adapters:
            raise SpecError(f"adapter {adapter!r}: expected an adapter index in [0, {n_adapters - 1}]")
        for name, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or not 1 <= v <= INT32_MAX:
                raise SpecError(f"{name} {v!r}: expected a token count in [1, {INT32_MAX}]")
        c = self.counters
        if int(c["n_known"]) == len(book.ids):
            self._make_room()
            c = self.counters
        r = int(c["n_known"])
        req = self.state.requests
        req.t_arr_s[r], req.adapter[r] = t, adapter
        req.prompt_tokens[r], req.output_tokens[r] = prompt_tokens, output_tokens
        req.status[r], req.queue_key[r], req.output_tokens_done[r], req.n_preempted[r] = 0, 0, 0, 0
        req.batch_tokens[r], req.n_merged[r] = 0, 0
        req.t_sent_s[r] = req.t_first_s[r] = req.t_last_token_s[r] = req.t_finish_s[r] = req.t_ready_s[r] = np.nan
        self.state.queue.next[r] = self.state.queue.prev[r] = -1
        book.ids[r], book.drained[r] = book.next_id, False
        book.next_id += 1
        book.last_arrival_s = t
        c["n_known"] = r + 1
        return int(book.ids[r])

    def abort(self, request_id: int) -> bool:
        """Drop a request, as vLLM's ``abort_requests`` between two steps: a waiting one leaves the queue, a
        running one frees its KV blocks and leaves the running list (the others keep their order). Its
        ``t_finish_s`` stays NaN. A request not injected yet is dropped when it is (next ``advance_to``).
        Returns False if the request already finished or is unknown."""
        book = self._need_live("abort")
        r = self._index(request_id)
        if r < 0 or self.state.requests.status[r] == FINISHED:
            return False
        if self.state.requests.status[r] == 0:
            book.abort_pending.add(int(request_id))
            return True
        _abort(self.server, self.state, r)
        return True

    def outputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, output tokens produced so far, status)`` of every request not yet drained (status: 0 not
        injected yet, 1 waiting, 2 running, 3 finished or aborted), as of ``t_s``: the end of the last step,
        which may lie past the latest ``advance_to`` time (a step that starts before it runs to its end). A
        streaming server sends each request's new tokens from this once its clock reaches ``t_s``."""
        book = self._need_live("outputs")
        self._settle_aborts()
        n = int(self.counters["n_known"])
        req, run = self.state.requests, self.state.running
        produced = req.output_tokens_done[:n].copy()
        lo, n_run = int(self.counters["running_lo"]), int(self.counters["n_running"])
        produced[run.request[lo:lo + n_run]] = run.output_tokens[lo:lo + n_run]
        keep = ~book.drained[:n]
        return book.ids[:n][keep].copy(), produced[keep], req.status[:n][keep].copy()

    def drain_finished(self) -> dict[str, np.ndarray]:
        """The requests that finished (or were aborted) since the last call, per-request arrays by column:
        ``id``, ``adapter``, ``prompt_tokens``, ``output_tokens``, ``t_arr_s``, ``t_sent_s``, ``t_first_s``,
        ``t_finish_s`` (NaN: aborted), ``n_preempted``, ``tokens_out`` (output tokens produced: fewer than
        ``output_tokens`` when aborted). They may then leave the engine's arrays."""
        book = self._need_live("drain_finished")
        self._settle_aborts()
        n = int(self.counters["n_known"])
        req = self.state.requests
        # (a request whose last tokens wait in the API server's open batch has not reached its client yet)
        new = (req.status[:n] == FINISHED) & ~book.drained[:n] & (req.batch_tokens[:n] == 0)
        idx = np.flatnonzero(new)
        book.drained[idx] = True
        return {"id": book.ids[idx].copy(), "adapter": req.adapter[idx].copy(),
                "prompt_tokens": req.prompt_tokens[idx].copy(), "output_tokens": req.output_tokens[idx].copy(),
                "t_arr_s": req.t_arr_s[idx].copy(), "t_sent_s": req.t_sent_s[idx].copy(),
                "t_first_s": req.t_first_s[idx].copy(), "t_finish_s": req.t_finish_s[idx].copy(),
                "n_preempted": req.n_preempted[idx].copy(), "tokens_out": req.output_tokens_done[idx].copy(),
                "n_merged": req.n_merged[idx].copy()}

    def running_outputs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, output tokens produced so far)`` of the running requests only (the cheap part of
        ``outputs()`` a streaming server needs every step: only running requests produce tokens)."""
        book = self._need_live("running_outputs")
        lo, n_run = int(self.counters["running_lo"]), int(self.counters["n_running"])
        run = self.state.running
        return book.ids[run.request[lo:lo + n_run]], run.output_tokens[lo:lo + n_run].copy()

    @property
    def arrival_floor_s(self) -> float:
        """The earliest time a request added now may arrive (``add_request``)."""
        book = self._need_live("arrival_floor_s")
        return max(book.last_arrival_s, book.stop_s)

    @property
    def idle(self) -> bool:
        """Nothing to do until a request is added: none waiting, running, not yet injected or to abort."""
        c = self.counters
        return int(c["n_waiting"]) == 0 and int(c["n_running"]) == 0 and \
            int(c["next_arrival_index"]) == int(c["n_known"]) and not (self._live and self._live.abort_pending)

    @property
    def capacity(self) -> int:
        """Room for requests in the arrays (a live engine grows it only when the requests in flight need it)."""
        return len(self.state.requests.t_arr_s)

    def _need_live(self, what: str) -> _LiveBook:
        if self._live is None:
            raise SpecError(f"Engine.{what}: only a live engine takes requests while it runs (Engine.live(cfg))")
        return self._live

    def _index(self, request_id: int) -> int:
        """The array index of a request id (ids grow with the index: a binary search), or -1."""
        n = int(self.counters["n_known"])
        ids = self._live.ids[:n]
        r = int(np.searchsorted(ids, request_id))
        return r if r < n and ids[r] == request_id else -1

    def _settle_aborts(self) -> None:
        book = self._live
        for request_id in list(book.abort_pending):
            r = self._index(request_id)
            if r < 0 or self.state.requests.status[r] != 0:
                book.abort_pending.discard(request_id)
                if r >= 0 and self.state.requests.status[r] != FINISHED:
                    _abort(self.server, self.state, r)

    def _make_room(self) -> None:
        """Drop the drained requests from the arrays, keeping the others' order (the queue keys of arrivals
        are their indices: renumbering in order keeps the queue order), and double the arrays if the requests
        in flight fill more than half of them."""
        book, st = self._live, self.state
        c = self.counters
        n = int(c["n_known"])
        keep = np.flatnonzero(~book.drained[:n])  # (only finished requests are drained)
        n_keep = len(keep)
        new_of_old = np.full(n, -1, np.int64)
        new_of_old[keep] = np.arange(n_keep)
        cap = len(book.ids) * (2 if 2 * n_keep > len(book.ids) else 1)

        def remap(values: np.ndarray) -> np.ndarray:  # request indices (or keys) >= 0 renumbered; -1 stays
            out = values.copy()
            m = (values >= 0) & (values < n)
            out[m] = new_of_old[values[m]]
            return out

        def gather(a: np.ndarray, fill) -> np.ndarray:
            out = np.full(cap, fill, a.dtype)
            out[:n_keep] = a[keep]
            return out

        req = st.requests
        # rows past n_known are never read (add_request writes every field of a row): any fill will do
        requests = Requests(*(gather(a, np.nan if a.dtype.kind == "f" else 0) for a in req))
        waiting_key = requests.queue_key[:n_keep]
        waiting_key[:] = remap(waiting_key)  # victims' keys are negative: unchanged
        q = st.queue
        queue = WaitingQueue(head=remap(q.head), tail=remap(q.tail), next=remap(gather(q.next, -1)),
                             prev=remap(gather(q.prev, -1)), all_key=remap(q.all_key), all_adapter=q.all_adapter,
                             active_key=remap(q.active_key), active_adapter=q.active_adapter)
        lo, n_run = int(c["running_lo"]), int(c["n_running"])
        st.running.request[lo:lo + n_run] = new_of_old[st.running.request[lo:lo + n_run]]
        api = st.api
        if _api_on(self.cfg):  # the API server's open batch (no drained request is in it)
            batch = np.zeros(cap, np.int64)
            n_batch = int(c["batch_len"])
            batch[:n_batch] = new_of_old[api.batch_requests[:n_batch]]
            api = api._replace(batch_requests=batch)
        self.state = st._replace(requests=requests, queue=queue, api=api)
        c = self.counters
        c["api_next_index"] = int(np.searchsorted(keep, int(c["api_next_index"])))
        c["next_arrival_index"] = int(np.searchsorted(keep, int(c["next_arrival_index"])))
        c["held_end_index"] = int(np.searchsorted(keep, int(c["held_end_index"])))
        c["n_known"] = n_keep
        ids, drained = np.zeros(cap, np.int64), np.zeros(cap, np.bool_)
        ids[:n_keep], drained[:n_keep] = book.ids[keep], book.drained[keep]
        book.ids, book.drained = ids, drained

    def oldest_wait_s(self) -> float:
        """The age of the oldest *waiting* request (0 when none waits; a preemption victim keeps its send time).

        Queue keys order admission, not age (victims sort first, latest victim first), so this scans the injected
        requests: per-request work, which ``snapshot(oldest_wait=False)`` skips."""
        c, req = self.counters, self.state.requests
        if c["n_waiting"] == 0:
            return 0.0
        n_injected = int(c["next_arrival_index"])
        waiting = req.status[:n_injected] == WAITING
        return self.t_s - float(req.t_sent_s[:n_injected][waiting].min())

    def snapshot(self, oldest_wait: bool = True) -> dict:
        """Counters a router or an early-stop rule may look at. Cheap (no per-request work) but for
        ``oldest_wait_s`` (``Engine.oldest_wait_s``), which ``oldest_wait=False`` leaves out (NaN): an early-stop
        loop scanned every injected request once a window for it, ~8 % of a starved run's time."""
        c = self.counters
        oldest_wait_s = self.oldest_wait_s() if oldest_wait else float("nan")
        return {
            "t_s": self.t_s, "num_requests_running": int(c["n_running"]),
            "num_requests_waiting": int(c["n_waiting"]),
            "kv_used_blocks": int(self.cfg.kv_blocks - c["free_kv_blocks"]),
            "n_sent": int(c["n_sent"]), "sent_tokens": int(c["sent_tokens"]),
            "n_completed": int(c["n_completed"]), "completed_tokens": int(c["completed_tokens"]),
            "inflight_tokens": int(c["inflight_tokens"]), "next_arrival_index": int(c["next_arrival_index"]),
            "next_arrival": int(c["next_arrival_index"]),  # older name of next_arrival_index
            "n_preemptions": int(c["n_preemptions"]), "n_gpu_loads": int(c["n_gpu_loads"]),
            "oldest_wait_s": oldest_wait_s, "busy_s": float(c["busy_s"]), "steps": int(c["step"]),
        }

    def result(self) -> EngineResult:
        if self._live is not None:
            raise SpecError("Engine.result: a live run has no end; its requests' results come from drain_finished()")
        c, req = self.counters, self.state.requests
        n_rows = int(c["next_sample"])
        return EngineResult(
            t_sent_s=req.t_sent_s, t_first_s=req.t_first_s, t_finish_s=req.t_finish_s, n_preempted=req.n_preempted,
            n_steps=int(c["step"]), n_preemptions=int(c["n_preemptions"]), n_gpu_loads=int(c["n_gpu_loads"]),
            n_disk_loads=int(c["n_disk_loads"]), busy_s=float(c["busy_s"]), sched_s=float(c["sched_s"]),
            load_s=float(c["load_s"]), held_end=int(c["held_end_index"]),
            timeline={name: self.state.timeline[:n_rows, j] for j, name in enumerate(TIMELINE_COLUMNS)},
            gap_hist=self.state.gap_hist.copy(), ttft_overhead_ms=float(self.cfg.ttft_overhead_ms),
            n_merged=req.n_merged, n_scrapes=int(c["n_scrapes"]), scrape_s=float(c["scrape_s"]),
            label_series=int(c["label_series"]),
        )


def simulate_fast(cfg: EngineConfig, req: RequestArrays, compiled: bool = True,
                  limits: Limits | None = None) -> EngineResult:
    """Simulate one server over ``[0, cfg.duration_s)``; ``compiled=False`` runs the step loop uncompiled.

    Inputs are checked first (``guards.check_engine``): ``SpecError`` / ``ResourceLimitError``."""
    return Engine(cfg, req, compiled, limits).advance_to(float("inf")).result()


def warm_up() -> float:
    """Compile the engine once (or load it from the cache); returns the seconds it took."""
    t0 = time.perf_counter()
    from .steptime import StepModel

    cfg = EngineConfig(load_ms=np.ones(2), disk_ms=np.ones(2), max_loras=1, max_cpu_loras=2, kv_blocks=64,
                       step_coef=StepModel(c0_ms=10.0, c1_ms_per_req=0.05).to_array(), duration_s=1.0)
    req = RequestArrays(np.array([0.0, 0.1]), np.array([0, 1]), np.array([20, 30]), np.array([3, 4]))
    simulate_fast(cfg, req)
    return time.perf_counter() - t0
