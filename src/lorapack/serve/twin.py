"""The twin behind a server: a live engine (``twin.engine.Engine.live``) driven in (scaled) wall time.

No HTTP here (``serve.http`` is the API server); this is what vLLM's engine core and its output processor are
to the API server. One ``TwinServer`` per server process:

* **adapters**: ``AdapterBook`` maps served names to engine indices. Index 0 is the base model (the engine's
  ``base_adapter``: no slot, no load, no LoRA cost). ``--lora-modules`` adapters are registered at start-up
  and, as vLLM's ``init_static_loras`` does, loaded into the CPU cache (the last ``--max-cpu-loras`` of them);
  ``load_lora_adapter`` registers one more at run time (into the CPU cache, LRU; the load itself is not
  charged to a step), ``unload_lora_adapter`` forgets the name (its slot in the caches ages out, as in vLLM).
  An adapter's rank comes from its ``--lora-modules`` JSON ``"rank"`` (a lorapack key; vLLM reads it from the
  adapter's files, which the twin never opens) or defaults to ``--max-lora-rank``.
* **clock**: twin seconds = ``time_scale`` x wall seconds since start. A request arrives at the twin time it
  reaches the server. The engine runs one step at a time; the tokens of a step ending at twin time ``e`` are
  handed to their streams at wall time ``(e + frontend) / time_scale - http_path`` (``frontend``: the profile's
  share of the TTFT outside the engine, ``Profile.frontend``, fitted from what real clients saw; ``http_path``:
  what this server's own HTTP path adds for a client, measured at start-up by ``serve.http``'s loopback probe
  and taken out of that share so it is not counted twice; never earlier than ``e``), so a client sees the
  twin's TTFT (frontend included) and ITL. If the machine cannot keep up, steps are published late: the lag
  (wall seconds) is recorded (``lorapack:twin_lag_seconds``).
* **one step at a time**: ``advance_to(nextafter(t))`` runs exactly the next step (or an idle jump), so a
  request that arrives while a step "runs" joins the next one, as in the batch twin: the same arrivals give
  the same per-request times as ``lorapack simulate`` (up to the arrival times the HTTP clients achieve).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import SpecError
from ..profile import Profile
from ..server import ServerConfig
from ..twin.engine import Engine
from ..twin.run import ResolvedServer, resolve_server, step_model
from ..twin.types import EngineConfig, default_walk_order

BASE_INDEX = 0  # the engine's pseudo-adapter of base-model requests
RUNTIME_ADAPTERS = 256  # adapter indices kept for load_lora_adapter beyond the --lora-modules ones
VLLM_DEFAULT_MAX_LORA_RANK = 16  # vLLM's --max-lora-rank default
LAG_WINDOW = 100_000  # the most recent publication lags kept for the percentiles
WAKE_EWMA = 0.05  # weight of one wake-up in the running lateness the publisher aims early by
MAX_AIM_EARLY_S = 0.002  # at most this early (a stall must not shift every later publication)


def startup_refusal(srv: ResolvedServer, model: str) -> str:
    """vLLM's start-up error, in its words (``lorapack measure --launch`` reads the kind from them)."""
    flags = f"--max-loras {srv.max_loras} --max-lora-rank {srv.max_lora_rank} --max-model-len {srv.max_model_len}"
    if srv.error_type == "no_cache_blocks":
        return f"No available memory for the cache blocks ({model}'s profile at {flags})"
    return (f"To serve at least one request with the model's max seq len ({srv.max_model_len}), "
            f"{srv.max_model_len} tokens of KV cache is needed, which is larger than the available KV cache memory "
            f"({srv.kv_cache_tokens} tokens in {model}'s profile at {flags}); {srv.error_type}")


def walk_order(n_static: int, capacity: int, seed: int) -> np.ndarray:
    """The order the worker walks a batch's adapters (a Python set's in vLLM, fixed for the server's life).

    Seed 0: the base model first, then the ``--lora-modules`` adapters in the batch twin's order for that many
    adapters (``twin.types.default_walk_order``: so ``lorapack simulate`` of the same adapters and arrivals gives
    the same per-request times), then the run-time slots. Another seed: a random permutation."""
    if seed:
        return np.random.default_rng([int(seed), capacity]).permutation(capacity).astype(np.int64)
    order = np.arange(capacity, dtype=np.int64)
    if n_static:
        order[1:1 + n_static] = 1 + default_walk_order(n_static)
    return order


class TwinServerError(SpecError):
    """A request or an adapter operation the server refuses: ``status`` is the HTTP code vLLM answers with,
    ``err_type`` its error type."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.err_type = status, err_type


@dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry (either form) or one ``load_lora_adapter`` body."""

    name: str
    path: str
    rank: int | None = None  # None: --max-lora-rank
    base_model_name: str | None = None


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    index: int  # engine adapter index
    created_s: float  # wall clock (the /v1/models "created")


@dataclass
class RequestStream:
    """One request as its HTTP handler sees it: new tokens arrive on ``tokens`` (counts; None = the end)."""

    request_id: int
    model: str
    prompt_tokens: int
    max_tokens: int
    t_arr_s: float  # twin time of arrival
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)
    produced: int = 0  # tokens handed out so far
    t_last_s: float = math.nan  # twin time of the latest token
    t_first_s: float = math.nan
    finished: bool = False
    aborted: bool = False


class AdapterBook:
    """Served adapter names -> engine indices (see the module docstring)."""

    def __init__(self, capacity: int, static: int) -> None:
        self.capacity = capacity  # engine adapters, the base model included
        self.static = static  # the --lora-modules adapters
        self.by_name: dict[str, Adapter] = {}
        self.retired: list[int] = []  # indices of unloaded adapters (reused once they are idle)
        self.next_index = BASE_INDEX + 1
        self.name_of_index: dict[int, str] = {}


class TwinServer:
    """The calibrated twin of one vLLM server, stepped in wall time (module docstring)."""

    def __init__(self, profile: Profile, flags: ServerConfig, lora_modules: list[LoraModule] = (),
                 enable_lora: bool = True, served_model_name: str | None = None, time_scale: float = 1.0,
                 seed: int = 0, runtime_adapters: int = RUNTIME_ADAPTERS) -> None:
        if not (isinstance(time_scale, int | float) and math.isfinite(time_scale) and time_scale > 0):
            raise SpecError(f"--time-scale {time_scale!r}: expected a positive number (twin seconds per wall second)")
        if lora_modules and not enable_lora:
            raise SpecError("--lora-modules needs --enable-lora (vLLM refuses LoRA modules without it)")
        names = [m.name for m in lora_modules]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise SpecError(f"--lora-modules: the adapter name {dup!r} is given twice")
        self.profile = profile
        self.model_name = served_model_name or profile.model
        if self.model_name in names:
            raise SpecError(f"--lora-modules: the adapter name {self.model_name!r} is the served model's name")
        self.enable_lora = enable_lora
        slot_rank = flags.max_lora_rank or VLLM_DEFAULT_MAX_LORA_RANK
        # vLLM's defaults, not the twin's workload-derived ones: --max-cpu-loras = --max-loras
        flags = flags.replace(max_lora_rank=slot_rank, max_cpu_loras=flags.max_cpu_loras or flags.max_loras,
                              warm_start=False, client_cap=0)
        for m in lora_modules:  # vLLM loads the --lora-modules at start-up and refuses one above the slot rank
            if (m.rank or slot_rank) > slot_rank:
                raise SpecError(f"LoRA rank {m.rank} is greater than max_lora_rank {slot_rank}. (--lora-modules "
                                f"{m.name}; expected --max-lora-rank >= {m.rank})")
        ranks = np.array([m.rank or slot_rank for m in lora_modules] or [slot_rank], dtype=np.int64)
        srv = resolve_server(profile, ranks, flags)
        if not srv.starts:
            raise SpecError(startup_refusal(srv, profile.model))
        self.srv: ResolvedServer = srv
        self.time_scale = float(time_scale)
        self.frontend_s = (profile.frontend.ttft_overhead_ms / 1000.0) if profile.frontend is not None else 0.0
        self.http_path_s = 0.0  # wall seconds of the server's own HTTP path (set_http_path_s)
        capacity = 1 + len(lora_modules) + int(runtime_adapters)
        slot = self.srv.max_lora_rank
        self.cfg = EngineConfig.from_server(
            srv.config.replace(warm_start=False), load_ms=np.zeros(capacity), disk_ms=np.zeros(capacity),
            kv_blocks=srv.kv_cache_tokens // profile.block_size, step_coef=step_model(profile, srv).to_array(),
            block_size=profile.block_size, duration_s=1.0, warm_cpu=False,
            adapter_order=walk_order(len(lora_modules), capacity, seed))
        self._slot_rank = slot
        self.engine = Engine.live(self.cfg, base_adapter=BASE_INDEX)
        self.engine.advance_to(0.0)  # compile (or load from the cache) now, not during the first request
        self.adapters = AdapterBook(capacity, len(lora_modules))
        for m in lora_modules:
            self.load_adapter(m, at_start=True)
        self.streams: dict[int, RequestStream] = {}
        self._wall0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.lags_s: deque[float] = deque(maxlen=LAG_WINDOW)
        self.max_lag_s = 0.0
        self._aim_early_s = 0.0  # the running lateness of the loop's wake-ups (seconds)
        self.on_token = None  # callback(stream, n_new, gap_s) for the metrics
        self.on_finish = None  # callback(stream, e2e_s)
        self.on_lag = None  # callback(lag_s)

    # ---- the clock ------------------------------------------------------------------------------

    def now_s(self) -> float:
        """Twin time now."""
        return (time.monotonic() - self._wall0) * self.time_scale

    def wall_at(self, t_s: float) -> float:
        return self._wall0 + t_s / self.time_scale

    def set_http_path_s(self, path_s: float) -> None:
        """What the server's HTTP path adds to a client's TTFT (wall seconds, >= 0): taken out of the frontend
        share (at most all of it), since that share already holds a real API server's path."""
        if not (math.isfinite(path_s) and path_s >= 0):
            raise SpecError(f"HTTP path {path_s!r} s: expected a finite number >= 0")
        self.http_path_s = float(path_s)

    def publish_wall(self, t_s: float) -> float:
        """Wall time at which the tokens of a step ending at twin time ``t_s`` go to their streams."""
        return max(self.wall_at(t_s + self.frontend_s) - self.http_path_s, self.wall_at(t_s))

    # ---- adapters -------------------------------------------------------------------------------

    def load_adapter(self, m: LoraModule, at_start: bool = False) -> Adapter:
        """Register an adapter (``--lora-modules`` or ``/v1/load_lora_adapter``) and load it into the CPU cache."""
        if not self.enable_lora:
            raise TwinServerError("LoRA is not enabled on this server (start it with --enable-lora)")
        if m.name == self.model_name:
            raise TwinServerError(f"The lora adapter '{m.name}' conflicts with a served base model.",
                                  err_type="InvalidUserInput")
        if m.name in self.adapters.by_name:
            raise TwinServerError(f"The lora adapter '{m.name}' has already been loaded. If you want to load the "
                                  "adapter in place, set 'load_inplace' to True.", err_type="InvalidUserInput")
        rank = m.rank or self._slot_rank
        if rank > self._slot_rank:
            raise TwinServerError(f"LoRA rank {rank} is greater than max_lora_rank {self._slot_rank}.")
        index = self._free_index()
        self.cfg.load_ms[index] = self.profile.activation_ms(self._slot_rank, rank)
        self.cfg.disk_ms[index] = self.profile.disk_ms(rank)
        a = Adapter(name=m.name, path=m.path, rank=int(rank), index=index, created_s=time.time())
        self.adapters.by_name[m.name] = a
        self.adapters.name_of_index[index] = m.name
        self._into_cpu_cache(index, at_start)
        return a

    def unload_adapter(self, name: str) -> None:
        a = self.adapters.by_name.pop(name, None)
        if a is None:
            raise TwinServerError(f"The lora adapter '{name}' cannot be found.", status=404, err_type="NotFoundError")
        self.adapters.retired.append(a.index)

    def _free_index(self) -> int:
        book = self.adapters
        if book.next_index < book.capacity:
            book.next_index += 1
            return book.next_index - 1
        st = self.engine.state
        for j, index in enumerate(book.retired):  # an unloaded adapter with no request left and out of the caches
            if st.adapters.n_running[index] == 0 and st.queue.head[index] < 0 and not st.adapters.in_gpu[index] \
                    and not st.adapters.in_cpu[index]:
                del book.retired[j]
                book.name_of_index.pop(index, None)
                return index
        raise TwinServerError(f"the twin server has no room for another adapter: {book.capacity - 1} were registered "
                              f"over its life (--lora-modules plus {book.capacity - book.static - 1} loaded at run "
                              "time) and none unloaded has left the caches; restart it", status=507,
                              err_type="InsufficientStorage")

    def _into_cpu_cache(self, index: int, at_start: bool = False) -> None:
        """vLLM's ``add_lora``: the adapter enters the worker's CPU cache (evicting the least recently used one)."""
        st, c = self.engine.state, self.engine.counters
        ad = st.adapters
        if ad.in_cpu[index]:
            return
        n_cpu = int(c["n_cpu_resident"])
        if n_cpu >= self.cfg.max_cpu_loras:
            j = int(np.argmin(ad.last_touch[ad.cpu_slots[:n_cpu]]))
            old = int(ad.cpu_slots[j])
            ad.in_cpu[old] = False
            ad.cpu_slots[j] = ad.cpu_slots[n_cpu - 1]
            n_cpu -= 1
            if ad.in_gpu[old]:
                ad.in_gpu[old] = False
                n_gpu = int(c["n_gpu_resident"])
                k = int(np.flatnonzero(ad.gpu_slots[:n_gpu] == old)[0])
                ad.gpu_slots[k] = ad.gpu_slots[n_gpu - 1]
                c["n_gpu_resident"] = n_gpu - 1
        ad.in_cpu[index] = True
        ad.cpu_slots[n_cpu] = index
        c["n_cpu_resident"] = n_cpu + 1
        if not at_start:  # touched "in the previous step": newer than every adapter not used since, distinct
            order = self.engine.server.adapter_order  # (at start the stamps keep registration order, as the
            ad.last_touch[index] = (int(c["step"]) - 1) * self.cfg.n_adapters + int(order[index])  # batch twin's)

    def adapter_index(self, model: str) -> int:
        """The engine index of a request's ``model`` (the base model or an adapter), else vLLM's 404."""
        if model == self.model_name:
            return BASE_INDEX
        a = self.adapters.by_name.get(model)
        if a is None:
            raise TwinServerError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError")
        return a.index

    # ---- requests -------------------------------------------------------------------------------

    def check_lengths(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """vLLM's length rules (the version's over-long rule); returns the output tokens to generate."""
        mml = int(self.srv.max_model_len)
        if prompt_tokens < 1:
            raise TwinServerError("The prompt is empty: expected at least one token.")
        if max_tokens is None:
            max_tokens = mml - prompt_tokens
        if max_tokens < 1 and prompt_tokens < mml:
            raise TwinServerError(f"max_tokens must be at least 1, got {max_tokens}.")
        rules = self.srv.rules
        if rules.over_long == "refuse_sum":
            if prompt_tokens + max_tokens > mml:
                raise TwinServerError(f"This model's maximum context length is {mml} tokens. However, you requested "
                                      f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                                      f"{max_tokens} in the completion). Please reduce the length of the messages "
                                      "or completion.")
            return max_tokens
        if prompt_tokens >= mml:
            raise TwinServerError(f"This model's maximum context length is {mml} tokens. However, your request has "
                                  f"{prompt_tokens} input tokens. Please reduce the length of the input messages.")
        if max_tokens > mml:
            raise TwinServerError(f"max_tokens {max_tokens} is larger than this model's maximum context length "
                                  f"{mml}.")
        return min(max_tokens, mml - prompt_tokens)

    def submit(self, model: str, prompt_tokens: int, max_tokens: int, received_wall: float | None = None
               ) -> RequestStream:
        """Add a checked request; its tokens come on the returned stream. It arrives at the twin time of
        ``received_wall`` (``time.monotonic()`` when the server began to receive it; default now), or at the
        latest step start if the engine has passed that time (a request cannot join a step already run)."""
        index = self.adapter_index(model)
        eng = self.engine
        now = self.now_s() if received_wall is None else (received_wall - self._wall0) * self.time_scale
        t = max(now, eng.arrival_floor_s)
        rid = eng.add_request(t, index, int(prompt_tokens), int(max_tokens))
        s = RequestStream(request_id=rid, model=model, prompt_tokens=int(prompt_tokens), max_tokens=int(max_tokens),
                          t_arr_s=t)
        self.streams[rid] = s
        self._wake.set()
        return s

    def abort(self, s: RequestStream) -> None:
        """The client went away: drop the request (vLLM aborts it)."""
        if not s.finished and self.engine.abort(s.request_id):
            s.aborted = True
            self._wake.set()

    # ---- the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start stepping (in the running event loop)."""
        self._wall0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lorapack-twin")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        eng = self.engine
        while True:
            if eng.idle:
                self._publish()  # aborted requests leave
                self._wake.clear()
                await self._wake.wait()
                continue
            eng.advance_to(np.nextafter(eng.t_s, math.inf))  # exactly the next step (t_s >= every stop time)
            target = self.publish_wall(eng.t_s)
            delay = target - time.monotonic() - self._aim_early_s
            if delay > 0:
                await asyncio.sleep(delay)
                # the event loop's timers wake late (libuv's have millisecond resolution, plus the loop's own
                # work): aim early by the recent lateness, so that the median publication is on time
                late_s = time.monotonic() + self._aim_early_s - target  # as if aimed at the target
                self._aim_early_s += WAKE_EWMA * (min(max(late_s, 0.0), MAX_AIM_EARLY_S) - self._aim_early_s)
            else:
                await asyncio.sleep(0)  # let the HTTP side run
            lag = max(time.monotonic() - target, 0.0)
            self.lags_s.append(lag)
            self.max_lag_s = max(self.max_lag_s, lag)
            if self.on_lag is not None:
                self.on_lag(lag)
            self._publish()

    def _publish(self) -> None:
        """Hand each stream its new tokens (as of the engine's time), then close the finished ones."""
        eng = self.engine
        ids, produced = eng.running_outputs()
        # First tokens first: every stream of a step wakes at once and the event loop serves them in the order
        # they were handed out (~0.2 ms each on 2 cores, both sides in Python), and the running queue lists the
        # newest requests last; handed out last, a first token waited for every other stream's event (+3-5 ms on
        # a ~40 ms TTFT with ~14 streams, docs/serve.md "Measured"). Later tokens only move within a step, which
        # leaves their gaps as they were.
        streams = self.streams
        later = []
        for rid, n in zip(ids.tolist(), produced.tolist(), strict=True):
            if n:
                s = streams.get(rid)
                if s is not None and not s.produced:
                    self._hand_out(rid, n)
                else:
                    later.append((rid, n))
        for rid, n in later:
            self._hand_out(rid, n)
        done = eng.drain_finished()  # (a vectorised scan: cheap next to the streams' work)
        for j, rid in enumerate(done["id"].tolist()):
            self._hand_out(rid, int(done["tokens_out"][j]))
            s = self.streams.pop(rid, None)
            if s is None:
                continue
            s.finished = True
            s.aborted = s.aborted or not np.isfinite(done["t_finish_s"][j])
            if self.on_finish is not None:  # the end-to-end latency a client sees (frontend share included)
                self.on_finish(s, float(done["t_finish_s"][j] - s.t_arr_s) + self.frontend_s)
            s.tokens.put_nowait(None)

    def _hand_out(self, rid: int, produced: int) -> None:
        s = self.streams.get(rid)
        if s is None:
            return
        n_new = produced - s.produced
        if n_new <= 0:
            return
        t = self.engine.t_s
        gap = (t - s.t_last_s) / n_new if s.produced else math.nan
        if not s.produced:
            s.t_first_s = t
        s.produced = produced
        s.t_last_s = t
        s.tokens.put_nowait(n_new)
        if self.on_token is not None:
            self.on_token(s, n_new, gap)

    # ---- what /metrics and /version read --------------------------------------------------------

    def state(self) -> dict:
        """Gauges of the server now: requests, KV use, the adapters running / waiting / resident."""
        eng = self.engine
        c, st = eng.counters, eng.state
        n = int(c["n_known"])
        lo, n_run = int(c["running_lo"]), int(c["n_running"])
        running_idx = set(int(a) for a in st.running.adapter[lo:lo + n_run]) - {BASE_INDEX}
        waiting_idx = set(int(a) for a in np.flatnonzero(st.queue.head >= 0)) - {BASE_INDEX}
        names = self.adapters.name_of_index
        ad = st.adapters
        gpu = [int(a) for a in ad.gpu_slots[:int(c["n_gpu_resident"])]]
        cpu = [int(a) for a in ad.cpu_slots[:int(c["n_cpu_resident"])]]
        return {
            "t_s": eng.t_s, "num_requests_running": n_run, "num_requests_waiting": int(c["n_waiting"]),
            "kv_cache_usage_perc": (self.cfg.kv_blocks - int(c["free_kv_blocks"])) / max(self.cfg.kv_blocks, 1),
            "running_lora_adapters": sorted(names.get(a, str(a)) for a in running_idx),
            "waiting_lora_adapters": sorted(names.get(a, str(a)) for a in waiting_idx),
            "gpu_adapters": sorted(names.get(a, str(a)) for a in gpu),
            "cpu_adapters": sorted(names.get(a, str(a)) for a in cpu),
            "n_preemptions": int(c["n_preemptions"]), "n_steps": int(c["step"]), "n_known": n,
        }

    def lag_summary(self) -> dict:
        lags = np.array(self.lags_s) if self.lags_s else np.zeros(1)
        return {"p50_s": float(np.percentile(lags, 50)), "p99_s": float(np.percentile(lags, 99)),
                "max_s": float(self.max_lag_s), "n": len(self.lags_s)}
