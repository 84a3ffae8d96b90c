"""Fit-report plots of ``lorapack calibrate --report DIR`` (PNG, matplotlib Agg backend).

One plot per closed-form fit against its data (memory, decode step, prefill, LoRA overhead, loading,
scheduler) and, when runs were given, twin vs real for the runs (throughput, ITL, TTFT, per group) and the
residuals against the number of slots. Together they are the overhead analysis of the paper: memory,
compute, loading, scheduler.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..profile import Profile
from ..realruns import RunComparison
from ..server import ServerConfig
from ..twin.run import step_model
from ..twin.steptime import S0, SB, SBASE, SW, SWA, compute_ms, sched_ms

GROUP_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _rows(path: Path, model: str | None = None) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if model is None or r.get("model") == model]


def _f(r: dict, k: str) -> float:
    try:
        return float((r.get(k) or "").strip())
    except ValueError:
        return math.nan


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, written: list[str]) -> None:
    from ..checks import atomic_path

    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:  # a failed write leaves no half-written plot
            fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    finally:
        _plt().close(fig)
    written.append(path.name)


def _lora_ms(prof: Profile, steptime, a: int, s: int, b_dec: float, n_pf: float, n_lora: float,
             ctx: float = 0.0) -> float:
    """Forward-pass time of one step with the given composition under ``steptime``."""
    p = prof.model_copy(update={"steptime": steptime})
    srv = ServerConfig(max_loras=a, max_lora_rank=s, max_cpu_loras=max(a, 1), max_num_batched_tokens=2048,
                       max_num_seqs=2048, max_model_len=prof.max_model_len)
    coef = step_model(p, srv).to_array()
    return float(compute_ms(coef, int(round(b_dec + (n_pf > 0))), int(round(n_pf)),
                            int(round(b_dec + n_pf)), ctx, int(round(n_lora))))


def write_report(out_dir: Path, prof: Profile, profiling: Path, runs_table: list[RunComparison],
                 prior_table: list[RunComparison] | None = None) -> list[str]:
    """Write every plot into ``out_dir`` (created); returns the file names."""
    try:
        _plt()
    except ImportError as e:  # matplotlib is a dependency, but keep the message clear if it is missing
        raise DataError(f"--report needs matplotlib ({e})") from None
    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)  # its parent was checked up front (checks.check_output_dir)
    written: list[str] = []
    m = prof.model
    _memory(out_dir, prof, _rows(profiling / "memory_kv_capacity.csv", m), written)
    default = _rows(profiling / "latency_default.csv", m)
    _decode(out_dir, prof, default, written)
    _prefill(out_dir, prof, default, written)
    _lora(out_dir, prof, _rows(profiling / "latency_lora_overhead.csv", m), written)
    _loading(out_dir, prof, _rows(profiling / "loading_events.csv", m), written)
    sched = []
    for name in ("scheduler_overhead_aggregated_rate.csv", "scheduler_overhead_adapter_rates.csv"):
        sched += _rows(profiling / name)
    _scheduler(out_dir, prof, sched, written)
    if runs_table:
        _runs(out_dir, prof, runs_table, prior_table or [], written)
        _runs_by_rank(out_dir, prof, runs_table, written)
    return written


def _memory(d: Path, prof: Profile, rows: list[dict], written: list[str]) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    mm = prof.memory
    for j, s in enumerate(sorted({int(_f(r, "max_lora_rank")) for r in rows})):
        col = GROUP_COLORS[j % len(GROUP_COLORS)]
        ok = [r for r in rows if int(_f(r, "max_lora_rank")) == s and r["status"].strip() == "ok"]
        bad = [r for r in rows if int(_f(r, "max_lora_rank")) == s and r["status"].strip() != "ok"]
        ax.scatter([_f(r, "max_loras") for r in ok], [_f(r, "kv_cache_tokens") / 1e3 for r in ok], color=col,
                   s=18, label=f"measured S={s}")
        ax.scatter([_f(r, "max_loras") for r in bad], [0.0] * len(bad), color=col, marker="x", s=25)
        a = np.linspace(1, 400, 100)
        ax.plot(a, (mm.kv_tokens_base - a * (mm.kv_tokens_per_slot_rank * s + mm.kv_tokens_per_slot)) / 1e3,
                color=col, lw=1)
    ax.axhline(prof.max_model_len / 1e3, color="k", ls="--", lw=0.8, label="max_model_len (start-up rule)")
    f = prof.provenance.get("fits", {}).get("memory", {})
    ax.set(xlabel="--max-loras A", ylabel="KV cache (k tokens)",
           title=f"{prof.model}: T_max = T0 - A(kS + c); R2 {f.get('r2', math.nan):.4f}, n {f.get('n_points')}"
                 "\n(x = server refused to start)")
    ax.legend(fontsize=7)
    _save(fig, d / "memory.png", written)


def _decode(d: Path, prof: Profile, rows: list[dict], written: list[str]) -> None:
    plt = _plt()
    dec = [r for r in rows if r.get("phase") == "decode" and r["status"].strip() == "ok"]
    b = np.array([_f(r, "mean_batch_size") for r in dec])
    y = np.array([_f(r, "mean_itl_ms") for r in dec])
    st = prof.steptime
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(b, y, s=18, label="decode runs (mean ITL)")
    x = np.linspace(0, max(b.max(initial=1.0), 1.0) * 1.05, 50)
    ax.plot(x, st.c0_ms + st.c1_ms_per_req * x, color="k", lw=1, label=f"c0 + c1 B ({st.c0_ms:.2f} + "
                                                                       f"{st.c1_ms_per_req:.4f} B)")
    f = prof.provenance.get("fits", {}).get("decode", {})
    ax.set(xlabel="mean running requests B", ylabel="ms", title=f"{prof.model}: decode step without LoRA; "
           f"R2 {f.get('r2', math.nan):.3f}, n {f.get('n_points')}")
    ax.legend(fontsize=8)
    _save(fig, d / "decode_step.png", written)


def _prefill(d: Path, prof: Profile, rows: list[dict], written: list[str]) -> None:
    plt = _plt()
    pf = [r for r in rows if r.get("phase") == "prefill" and r["status"].strip() == "ok"]
    tps = np.array([_f(r, "total_input_tokens") / _f(r, "n_steps") for r in pf])
    y = np.array([_f(r, "step_ms_mean") for r in pf])
    st = prof.steptime
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(tps, y, s=18, label="prefill flood runs (step_ms_mean)")
    x = np.linspace(0, 2048, 50)
    ax.plot(x, st.c0_ms + st.p1_ms_per_prefill_token * x, color="k", lw=1,
            label=f"c0 + p1 n_pf (p1 = {st.p1_ms_per_prefill_token:.4f} ms/token)")
    if prof.priors is not None and prof.priors.steptime.p1_ms_per_prefill_token != st.p1_ms_per_prefill_token:
        ax.plot(x, st.c0_ms + prof.priors.steptime.p1_ms_per_prefill_token * x, color="gray", ls="--", lw=1,
                label="prior p1")
    f = prof.provenance.get("fits", {}).get("prefill", {})
    ax.set(xlabel="prefill tokens per step", ylabel="ms per step",
           title=f"{prof.model}: prefill cost; n {f.get('n_points')}, rmse {f.get('rmse', math.nan):.2f} ms")
    ax.legend(fontsize=8)
    _save(fig, d / "prefill.png", written)


def _lora(d: Path, prof: Profile, rows: list[dict], written: list[str]) -> None:
    """LoRA overhead runs (A = 300, rank 8, S = 8): measured ITL - base vs distinct adapters, and models."""
    plt = _plt()
    ov = [r for r in rows if r.get("kind") == "overhead_small" and r["status"].strip() == "ok"]
    lv = np.array([_f(r, "unique_adapters_mean") if math.isfinite(_f(r, "unique_adapters_mean"))
                   else _f(r, "expected_unique_adapters_uniform") for r in ov])
    b = np.array([_f(r, "mean_batch_size") for r in ov])
    itl = np.array([_f(r, "mean_itl_ms") for r in ov])
    st = prof.steptime
    base = st.c0_ms + st.c1_ms_per_req * b
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    ax = axes[0]
    ax.scatter(lv, itl - base, s=18, label="overhead runs: ITL - (c0 + c1 B)")
    a_slots = [int(_f(r, "max_loras")) for r in ov]
    s_rank = [int(_f(r, "max_lora_rank")) for r in ov]
    models = [("refined", st, "k", "-")]
    if prof.priors is not None:
        models.append(("prior", prof.priors.steptime, "gray", "--"))
    order = np.argsort(lv)
    for name, stm, col, ls in models:
        pred = np.array([_lora_ms(prof, stm.model_copy(update={"lora_form": "additive"}), a, s, bb, 0.0, ll)
                         - (stm.c0_ms + stm.c1_ms_per_req * bb)
                         for a, s, bb, ll in zip(a_slots, s_rank, b, lv, strict=True)])
        ax.plot(lv[order], pred[order], color=col, ls=ls, lw=1, label=f"additive, {name} constants")
    k0, k1 = st.k0_pct, st.k1_pct_per_adapter
    ax.plot(lv[order], (base * (k0 + k1 * lv) / 100 - base)[order], color="tab:red", ls=":", lw=1,
            label="multiplicative (paper form)")
    f = prof.provenance.get("fits", {}).get("lora_additive", {})
    ax.set(xlabel="distinct adapters per batch L", ylabel="LoRA overhead (ms per step)",
           title=f"LoRA overhead at A={a_slots[0] if a_slots else '?'}, B~{np.mean(b):.0f}; "
                 f"prior fit R2 {f.get('r2', math.nan):.3f}, n {f.get('n_points')}")
    ax.legend(fontsize=7)
    # the refined overhead model over batch size, for several slot counts (L = min(A, B))
    ax = axes[1]
    x = np.linspace(1, 900, 60)
    for j, a in enumerate((8, 32, 128, 384)):
        y = [_lora_ms(prof, st, a, 16, bb, 0.0, min(a, bb)) - (st.c0_ms + st.c1_ms_per_req * bb) for bb in x]
        ax.plot(x, y, color=GROUP_COLORS[j], label=f"A={a}, S=16, L=min(A,B)")
    ax.set(xlabel="decode batch B", ylabel="LoRA overhead (ms per step)", title="refined LoRA term (decode steps)")
    ax.legend(fontsize=7)
    _save(fig, d / "lora_overhead.png", written)


def _loading(d: Path, prof: Profile, events: list[dict], written: list[str]) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    pts = prof.loading.activation
    labels = [f"S{p.max_lora_rank}/r{p.rank}" for p in pts]
    ax.bar(labels, [p.ms for p in pts], color="tab:blue", alpha=0.7, label="profile (mean after start-up)")
    for j, p in enumerate(pts):
        ev = [_f(e, "load_time_ms") for e in events if e.get("load_kind") == "memory"
              and int(_f(e, "event_index")) > 50 and int(_f(e, "max_lora_rank")) == p.max_lora_rank
              and int(_f(e, "adapter_rank")) == p.rank]
        ax.scatter(np.full(len(ev), j) + np.linspace(-0.25, 0.25, len(ev)), ev, s=4, color="k", alpha=0.5)
    ax.set(ylabel="ms", title=f"{prof.model}: CPU -> GPU activation (events 51-100)")
    ax.legend(fontsize=7)
    ax = axes[1]
    disk = sorted(prof.loading.disk, key=lambda p: p.rank)
    for j, p in enumerate(disk):
        ev = [_f(e, "load_time_ms") for e in events if e.get("load_kind") == "disk"
              and int(_f(e, "event_index")) > 1 and int(_f(e, "adapter_rank")) == p.rank]
        ax.scatter(np.full(len(ev), j) + np.linspace(-0.25, 0.25, len(ev)), ev, s=4, color="k", alpha=0.4)
        ax.hlines(p.ms, j - 0.35, j + 0.35, color="tab:red", lw=2)
    ax.set_xticks(range(len(disk)), [f"r{p.rank}" for p in disk])
    ax.set(ylabel="ms", title="disk -> CPU load (red: median, event 1 excluded)")
    _save(fig, d / "loading.png", written)


def _scheduler(d: Path, prof: Profile, rows: list[dict], written: list[str]) -> None:
    plt = _plt()
    sc = prof.scheduler
    meas, pred, w = [], [], []
    for r in rows:
        b, ww, a, n = _f(r, "avg_batch_size"), _f(r, "avg_waiting_queue"), _f(r, "gpu_loras"), _f(r, "cpu_loras")
        y = 1000.0 * _f(r, "total_scheduling_time") / _f(r, "steps")
        if not all(math.isfinite(v) for v in (b, ww, a, n, y)):
            continue
        coef = np.zeros(32)
        coef[SB], coef[S0], coef[SW], coef[SWA], coef[SBASE] = (sc.ms_per_running, sc.const_ms, sc.ms_per_waiting,
                                                                sc.ms_per_waiting_slot_ratio * a / n, 0.0)
        meas.append(y)
        pred.append(sched_ms(coef, int(round(b)), int(round(ww))))
        w.append(ww)
    meas_a, pred_a = np.array(meas), np.array(pred)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    ax.scatter(meas_a, pred_a, s=6, c=np.log10(np.array(w) + 1), cmap="viridis")
    hi = max(meas_a.max(initial=1.0), pred_a.max(initial=1.0))
    ax.plot([0, hi], [0, hi], color="k", lw=0.8)
    f = prof.provenance.get("fits", {}).get("scheduler", {})
    ax.set(xlabel="measured scheduler ms per step", ylabel="model (before the baseline subtraction)",
           title=f"scheduler: R2 {f.get('r2', math.nan):.3f}, n {f.get('n_points')} (colour: log10 W)")
    ax = axes[1]
    ax.scatter(w, meas_a - pred_a, s=6)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="mean waiting requests W", ylabel="measured - model (ms)", title="scheduler residuals")
    _save(fig, d / "scheduler.png", written)


def _measured(t: RunComparison, key: str) -> float | None:
    return getattr(t, f"measured_{key}")


def _predicted(t: RunComparison, key: str) -> float:
    return getattr(t, f"predicted_{key}")


def _runs(d: Path, prof: Profile, table: list[RunComparison], prior: list[RunComparison],
          written: list[str]) -> None:
    plt = _plt()
    groups = sorted({t.group for t in table})
    colors = {g: GROUP_COLORS[j % len(GROUP_COLORS)] for j, g in enumerate(groups)}
    ok = [t for t in table if t.scored]
    pok = [t for t in prior if t.scored]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, key, label in zip(axes, ("throughput_tok_s", "itl_ms", "ttft_ms"),
                              ("throughput (tok/s)", "ITL mean (ms)", "TTFT mean, completed (ms)"), strict=True):
        for g in groups:
            sel = [t for t in ok if t.group == g]
            ax.scatter([_measured(t, key) for t in sel], [_predicted(t, key) for t in sel], s=14,
                       color=colors[g], label=g)
            psel = [t for t in pok if t.group == g]
            if psel:
                ax.scatter([_measured(t, key) for t in psel], [_predicted(t, key) for t in psel], s=10,
                           facecolors="none", edgecolors=colors[g], alpha=0.4, lw=0.6)
        vals = [v for t in ok for v in (_measured(t, key), _predicted(t, key)) if v and v > 0]
        if vals:
            lo, hi = min(vals) * 0.8, max(vals) * 1.25
            ax.plot([lo, hi], [lo, hi], color="k", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set(xlabel=f"real {label}", ylabel=f"twin {label}")
        ax.set_title(f"{prof.model}: {label}\n(filled: refined, open: priors only)", fontsize=9)
    axes[0].legend(fontsize=7)
    _save(fig, d / "runs_twin_vs_real.png", written)

    fig, axes = plt.subplots(2, len(groups), figsize=(5 * len(groups), 7.5), squeeze=False)
    for j, g in enumerate(groups):
        sel = [t for t in ok if t.group == g]
        for i, key in enumerate(("throughput_tok_s", "itl_ms")):
            ax = axes[i][j]
            for t in sel:
                e = 100 * (_predicted(t, key) / _measured(t, key) - 1)
                ax.scatter(t.max_loras, e, s=8 + t.n_adapters / 8, color=colors[g], alpha=0.7)
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set(xlabel="A (marker size ~ N)", ylabel=f"twin / real - 1 (%), {key.split('_')[0]}")
            ax.set_title(g, fontsize=9)
    _save(fig, d / "runs_residuals.png", written)


def _runs_by_rank(d: Path, prof: Profile, table: list[RunComparison], written: list[str]) -> None:
    """Signed errors per slot rank S (twin - real, % of real), each run a dot, the mean a bar: the rank
    dependence of the step-time model (per-token vs per-adapter exponents) shows here first."""
    plt = _plt()
    ok = [t for t in table if t.scored and t.max_lora_rank is not None]
    ranks = sorted({t.max_lora_rank for t in ok})
    if not ranks:
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    rng = np.random.default_rng(0)
    for ax, key, label in zip(axes, ("throughput_tok_s", "itl_ms", "ttft_ms"),
                              ("throughput", "ITL mean", "TTFT mean (real < 30 s)"), strict=True):
        for j, s in enumerate(ranks):
            sel = [t for t in ok if t.max_lora_rank == s and _measured(t, key)
                   and (key != "ttft_ms" or _measured(t, key) < 30_000)]
            e = np.array([100 * (_predicted(t, key) / _measured(t, key) - 1) for t in sel], float)
            e = e[np.isfinite(e)]
            ax.scatter(j + rng.uniform(-0.15, 0.15, len(e)), e, s=10, alpha=0.6,
                       color=GROUP_COLORS[j % len(GROUP_COLORS)])
            if len(e):
                ax.hlines(e.mean(), j - 0.3, j + 0.3, color="k", lw=2)
                ax.annotate(f"mean {e.mean():+.1f} %\nn {len(e)}", (j + 0.32, e.mean()), fontsize=7, va="center")
        ax.axhline(0, color="k", lw=0.6, ls=":")
        ax.set_xticks(range(len(ranks)), [f"S = {s}" for s in ranks])
        ax.set_xlim(-0.6, len(ranks) - 0.1)
        ax.set(ylabel="twin / real - 1 (%)", title=f"{prof.model}: {label}")
    _save(fig, d / "runs_residuals_by_rank.png", written)
