"""Request lengths (prompt tokens P, output tokens O): fixed, ShareGPT-like log-normal, or bootstrapped pairs.

The log-normal fallback: ``P = round(X)``, ``O = round(Y)`` with independent log-normals ``X``,
``Y``, kept only if ``P >= 4, O >= 4, P <= 1024, P + O <= 2048`` (the ShareGPT filter of the real runs). The
four log-normal parameters are solved (scipy ``root``) so that the *post-filter* means are the targets and
both post-filter CVs are ``cv``. The post-filter moments are computed exactly on the integer grid, so the
solve is deterministic and takes a few ms; results are cached per target.

Sampling is by inversion, two uniforms per request and no rejection loop: ``P`` from its exact post-filter
marginal (a table over 4..1024), then ``O`` from its log-normal restricted to ``[4, 2048 - P]``. A fixed number
of draws per request keeps common random numbers exact: request k of a stream always uses draws 2k, 2k+1.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError, SpecError
from ..monotone import first_true
from ..spec import LengthsSpec
from ..textfiles import iter_csv_rows

# ShareGPT filter of the reference runs
MIN_TOKENS = 4
MAX_INPUT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048
LENGTHS_COLUMNS = ("input_tokens", "output_tokens")


@dataclass(frozen=True)
class LognormalLengths:
    """Solved parameters of the truncated log-normal length model, plus the P sampling table."""

    mu_in: float
    sigma_in: float
    mu_out: float
    sigma_out: float
    accept_prob: float  # share of untruncated draws that pass the filter (diagnostic)
    p_values: np.ndarray  # int32 [4..1024]
    p_cdf: np.ndarray  # float64, post-filter CDF of P over p_values (last entry 1)
    p_guide: np.ndarray  # intp [K]: first index with p_cdf > k/K (start of the inverse-CDF search)
    o_cdf_lo: float  # CDF of the O log-normal at MIN_TOKENS - 0.5
    o_cdf_hi: np.ndarray  # float64, per P value: CDF of the O log-normal at MAX_TOTAL - P + 0.5

    def moments(self) -> tuple[float, float, float, float]:
        """Exact post-filter (mean P, CV P, mean O, CV O)."""
        m = _moments(self.mu_in, self.sigma_in, self.mu_out, self.sigma_out)
        return m[0], m[1], m[2], m[3]

    def sample(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map uniforms ``u`` of shape [n, 2] to (P, O) int32 arrays of length n."""
        u0 = np.ascontiguousarray(u[:, 0])
        # inverse CDF of P: a guide table gives a start index, then step while cdf <= u (a step or two at
        # most); 4x faster than a binary search per request
        idx = self.p_guide[(u0 * len(self.p_guide)).astype(np.intp)]
        while True:
            step = self.p_cdf[idx] <= u0
            if not step.any():
                break
            idx += step
        p = self.p_values[idx]
        # O conditional on P: its log-normal restricted to [MIN_TOKENS, MAX_TOTAL - P] (on the rounding grid)
        lo = self.o_cdf_lo
        v = lo + u[:, 1] * (self.o_cdf_hi[idx] - lo)
        from scipy.special import ndtri  # (scipy imports where used: ~0.1 s off every command's start)

        o = np.rint(np.exp(self.mu_out + self.sigma_out * ndtri(v)))
        o = np.clip(o, MIN_TOKENS, MAX_TOTAL_TOKENS - p)  # boundaries are hit only by rounding ties
        return p.astype(np.int32), o.astype(np.int32)


def _cdf(x: np.ndarray | float, mu: float, sigma: float) -> np.ndarray:
    from scipy.special import ndtr

    return ndtr((np.log(np.maximum(x, 1e-300)) - mu) / sigma)


_P = np.arange(MIN_TOKENS, MAX_INPUT_TOKENS + 1, dtype=np.float64)
_O = np.arange(0, MAX_TOTAL_TOKENS + 1, dtype=np.float64)
_O_MAX = (MAX_TOTAL_TOKENS - _P).astype(np.int64)  # largest admissible O for each P
_GUIDE_SIZE = 1 << 14


def _pmf_p(mu: float, sigma: float) -> np.ndarray:
    return _cdf(_P + 0.5, mu, sigma) - _cdf(_P - 0.5, mu, sigma)


def _moments(mu_p: float, s_p: float, mu_o: float, s_o: float) -> tuple[float, float, float, float, float]:
    """Exact post-filter moments on the integer grid; also the acceptance probability."""
    fp = _pmf_p(mu_p, s_p)
    fo = _cdf(_O + 0.5, mu_o, s_o) - _cdf(_O - 0.5, mu_o, s_o)
    fo[:MIN_TOKENS] = 0.0
    # cumulative O moments up to o_max(P) give each P's admissible O mass and moments in O(1)
    c0, c1, c2 = np.cumsum(fo), np.cumsum(_O * fo), np.cumsum(_O * _O * fo)
    g0, g1, g2 = c0[_O_MAX], c1[_O_MAX], c2[_O_MAX]
    w = fp * g0
    z = float(w.sum())
    if not z > 0:
        return math.nan, math.nan, math.nan, math.nan, 0.0
    mp = float((_P * w).sum() / z)
    vp = float((_P * _P * w).sum() / z) - mp * mp
    mo = float((fp * g1).sum() / z)
    vo = float((fp * g2).sum() / z) - mo * mo
    return mp, math.sqrt(max(vp, 0.0)) / mp, mo, math.sqrt(max(vo, 0.0)) / mo, z


# Solutions of solve_lognormal_lengths kept across processes (the user cache directory, as the compiled code's:
# $LORAPACK_CACHE_DIR, else $XDG_CACHE_HOME/lorapack, else ~/.cache/lorapack): the same parameters, bit for bit,
# without importing scipy.optimize and solving again in every process that loads a log-normal workload.
SOLVED_FILE = "lognormal_lengths.json"
SOLVED_FORMAT = {"format": 1, "filter": [MIN_TOKENS, MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS], "solver": "hybr 1e-12"}


def _solved_path() -> Path:
    env = os.environ.get("LORAPACK_CACHE_DIR")
    if env:
        return Path(env).expanduser() / SOLVED_FILE
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lorapack" / SOLVED_FILE


def _solved() -> dict[str, list[float]]:
    """The cached solutions (``"mean_in mean_out cv"`` -> the solver's x); empty when unreadable or stale."""
    try:
        doc = json.loads(_solved_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or {k: doc.get(k) for k in SOLVED_FORMAT} != SOLVED_FORMAT:
        return {}
    sols = doc.get("solutions")
    return {k: v for k, v in sols.items() if isinstance(v, list) and len(v) == 4
            and all(isinstance(a, float) for a in v)} if isinstance(sols, dict) else {}


def _remember(key: str, x: np.ndarray) -> None:
    sols = _solved()
    if sols.get(key) == [float(a) for a in x]:
        return
    sols[key] = [float(a) for a in x]
    path = _solved_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**SOLVED_FORMAT, "solutions": sols}, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs time


def _solved_key(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> str:
    return f"{float(mean_input_tokens)!r} {float(mean_output_tokens)!r} {float(cv)!r}"


def check_lognormal_reachable(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> None:
    """``solve_lognormal_lengths``'s ``SpecError`` when no log-normal reaches the targets; a solution this
    machine already knows (``SOLVED_FILE``) answers at once (no solve, no scipy import: what a command that
    only validates the workload, e.g. ``place --no-verify``, needs)."""
    if _solved_key(mean_input_tokens, mean_output_tokens, cv) not in _solved():
        solve_lognormal_lengths(mean_input_tokens, mean_output_tokens, cv)


def lognormal_reaches(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> bool:
    """Whether a log-normal law with ``cv`` reaches the post-filter means (``check_lognormal_reachable``
    without the error)."""
    if _solved_key(mean_input_tokens, mean_output_tokens, cv) in _solved():
        return True
    return _solve(mean_input_tokens, mean_output_tokens, cv) is not None


def _residual(x: np.ndarray, mean_input_tokens: float, mean_output_tokens: float, cv: float) -> list[float]:
    try:
        mp, cp, mo, co, _ = _moments(x[0], math.exp(x[1]), x[2], math.exp(x[3]))
    except OverflowError:  # the solver wandered to a sigma beyond floats: no solution there
        return [math.nan] * 4
    return [mp / mean_input_tokens - 1.0, cp - cv, mo / mean_output_tokens - 1.0, co - cv]


def _solve(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> np.ndarray | None:
    """The solver's x (log-normal parameters, sigmas in log space) reaching the targets, or None."""
    key = _solved_key(mean_input_tokens, mean_output_tokens, cv)
    x = _solved().get(key)
    if x is None:
        from scipy.optimize import root  # here, not at import: scipy.optimize costs ~0.3-1 s to import

        # start from the untruncated log-normal with the target mean and CV
        s0 = math.sqrt(math.log1p(cv * cv))
        x0 = [math.log(mean_input_tokens) - s0 * s0 / 2, math.log(s0), math.log(mean_output_tokens) - s0 * s0 / 2,
              math.log(s0)]
        with np.errstate(all="ignore"):
            x = root(_residual, x0, args=(mean_input_tokens, mean_output_tokens, cv), method="hybr",
                     options={"xtol": 1e-12}).x
    with np.errstate(all="ignore"):
        err = np.abs(_residual(np.asarray(x), mean_input_tokens, mean_output_tokens, cv))
    if not np.all(np.isfinite(err)) or err.max() > 1e-6:
        return None
    return np.asarray(x, dtype=np.float64)


REACHABLE_CV_FLOOR = 0.05  # the smallest cv the error's hint considers (a law that narrow is nearly 'fixed')


def largest_reachable_cv(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> float | None:
    """The largest cv on the 0.01 grid below ``cv`` at which a log-normal law reaches the post-filter means (a
    larger cv puts more mass beyond the filter, so the reachable cvs form an interval from near 0); None when
    not even ``REACHABLE_CV_FLOOR`` does (e.g. a prompt mean above 1,024). For the error's hint: bisection on
    the grid, under ten solves."""
    def reaches(k: int) -> bool:
        return _solve(mean_input_tokens, mean_output_tokens, k / 100) is not None

    lo, hi = round(REACHABLE_CV_FLOOR * 100), math.ceil(float(cv) * 100)  # reaches(hi) known not to
    if not reaches(lo):
        return None
    return (first_true(lambda k: not reaches(k), lo, hi) - 1) / 100


def unreachable_message(mean_input_tokens: float, mean_output_tokens: float, cv: float) -> str:
    """Why no log-normal law with ``cv`` reaches the means, and which cv would (or that none does)."""
    better = largest_reachable_cv(mean_input_tokens, mean_output_tokens, cv)
    fix = (f"cv {better:g} or less reaches them (lengths.cv), or use kind 'fixed' or 'empirical'"
           if better is not None else "no cv does: use kind 'fixed' or 'empirical'")
    return (f"lengths: cannot reach post-filter means {mean_input_tokens:g}/{mean_output_tokens:g} tokens with "
            f"cv {cv:g} under the ShareGPT filter (P>={MIN_TOKENS}, O>={MIN_TOKENS}, P<={MAX_INPUT_TOKENS}, "
            f"P+O<={MAX_TOTAL_TOKENS}); {fix}")


@functools.lru_cache(maxsize=64)
def solve_lognormal_lengths(
    mean_input_tokens: float, mean_output_tokens: float, cv: float = 1.1
) -> LognormalLengths:
    """Log-normal parameters whose post-filter means are the targets and post-filter CVs are ``cv``."""
    key = _solved_key(mean_input_tokens, mean_output_tokens, cv)
    x = _solve(mean_input_tokens, mean_output_tokens, cv)
    if x is None:
        raise SpecError(unreachable_message(mean_input_tokens, mean_output_tokens, cv))
    _remember(key, x)
    mu_p, s_p, mu_o, s_o = float(x[0]), math.exp(x[1]), float(x[2]), math.exp(x[3])
    fo_ok = _cdf(_O_MAX + 0.5, mu_o, s_o) - _cdf(MIN_TOKENS - 0.5, mu_o, s_o)
    w = _pmf_p(mu_p, s_p) * fo_ok
    cdf = np.cumsum(w)
    accept = float(cdf[-1])
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    cdf.setflags(write=False)
    p_values = _P.astype(np.int32)
    guide = np.searchsorted(cdf, np.arange(_GUIDE_SIZE) / _GUIDE_SIZE, side="right").astype(np.intp)
    o_hi = _cdf(_O_MAX + 0.5, mu_o, s_o)
    for a in (p_values, guide, o_hi):
        a.setflags(write=False)
    return LognormalLengths(mu_p, s_p, mu_o, s_o, accept, p_values, cdf, guide,
                            float(_cdf(MIN_TOKENS - 0.5, mu_o, s_o)), o_hi)


@functools.lru_cache(maxsize=16)
def _load_lengths_table_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    pairs: list[tuple[int, int]] = []
    for line, row in iter_csv_rows(Path(path), LENGTHS_COLUMNS, error=DataError):
        try:
            p, o = int(row["input_tokens"]), int(row["output_tokens"])
        except ValueError:
            raise DataError(f"{path}:{line}: expected integer token counts, got "
                            f"{row['input_tokens']!r},{row['output_tokens']!r}") from None
        if p < 1 or o < 1:
            raise DataError(f"{path}:{line}: expected token counts >= 1, got {p},{o}")
        pairs.append((p, o))
    if not pairs:
        raise DataError(f"{path}:2: no rows; expected at least one input_tokens,output_tokens pair")
    table = np.asarray(pairs, dtype=np.int32)
    table.setflags(write=False)
    return table


def call_cached_by_file(loader, path: str | Path):
    """``loader(resolved_path, mtime_ns, size)``: an ``lru_cache``d reader keyed by the file's identity, so an
    edited file is read again."""
    from ..checks import input_file_problem

    p = Path(path)
    problem = input_file_problem(p)
    if problem is not None:
        raise DataError(f"{p}: {problem}")
    try:
        st = p.stat()
    except OSError:
        raise DataError(f"{p}: file not found") from None
    return loader(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _table_digest_cached(path: str, mtime_ns: int, size: int) -> str:
    import hashlib

    return hashlib.sha256(_load_lengths_table_cached(path, mtime_ns, size).tobytes()).hexdigest()[:16]


def lengths_table_digest(path: str | Path) -> str:
    """A digest of a lengths table's pairs (cached by file identity): what identifies an empirical law in
    caches, so an edited table is simulated again."""
    return call_cached_by_file(_table_digest_cached, path)


def load_lengths_table(path: str | Path) -> np.ndarray:
    """(P, O) pairs from a CSV ``input_tokens,output_tokens`` as a read-only int32 [n, 2] array (cached)."""
    return call_cached_by_file(_load_lengths_table_cached, path)


def length_draws(spec: LengthsSpec, n: int, rng: np.random.Generator) -> np.ndarray | None:
    """The random draws behind ``n`` requests' lengths (None for fixed lengths).

    Split from ``lengths_from_draws`` so the generator can draw per adapter stream (common random numbers)
    and map all adapters' draws in one vectorised call. Draws form a prefix-stable sequence per request.
    """
    if spec.kind == "fixed":
        return None
    if spec.kind == "lognormal":
        return rng.random((n, 2))
    assert spec.path is not None
    return rng.integers(0, len(load_lengths_table(spec.path)), size=n)


def lengths_from_draws(spec: LengthsSpec, draws: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P, O) int32 arrays of length ``n`` from ``length_draws`` output (possibly concatenated)."""
    if spec.kind == "fixed":
        p_tok = max(1, round(spec.mean_input_tokens))
        o_tok = max(1, round(spec.mean_output_tokens))
        return np.full(n, p_tok, dtype=np.int32), np.full(n, o_tok, dtype=np.int32)
    assert draws is not None and len(draws) == n
    if spec.kind == "lognormal":
        model = solve_lognormal_lengths(spec.mean_input_tokens, spec.mean_output_tokens, spec.cv)
        return model.sample(draws.reshape(n, 2))
    assert spec.path is not None
    table = load_lengths_table(spec.path)
    return table[draws, 0].astype(np.int32), table[draws, 1].astype(np.int32)


def sample_lengths(spec: LengthsSpec, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (P, O) pairs as int32 arrays."""
    return lengths_from_draws(spec, length_draws(spec, n, rng), n)
