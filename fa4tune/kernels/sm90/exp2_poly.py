"""The software exp2 that the kernels run on the FMA pipe, and its exact model on the CPU.

Algorithm (all float32, the same sequence the kernel issues):
  1. x = max(x, -126)                        clamps so the exponent arithmetic cannot wrap: with
                                             p(0) just under 1 (exponent field 126), -127 would
                                             borrow into the sign bit
  2. t = x + 1.5·2^23, rounded toward -inf   t's low mantissa bits now hold floor(x)
  3. j = t - 1.5·2^23 ;  f = x - j           exact: j = floor(x), f in [0, 1)
  4. p = c_n; p = fma(p, f, c_k) ... c_0     2^f by Horner, one FMA per degree
  5. bits(result) = bits(p) + (bits(t) << 23) adds floor(x) into the exponent field
The split in 2-3 is the Cody-Waite reduction for base 2 (exact, since j and x share the float32
grid).

The coefficients come from a Remez exchange for the minimax *relative* error of 2^f on [0, 1],
computed here in float64, then rounded to float32 and polished by a small search over neighbouring
float32 values using the exact float32 model, so that the accuracy the feasibility check reports is
the kernel's own.
"""

from __future__ import annotations

import functools

import numpy as np

MIN_DEGREE, MAX_DEGREE = 1, 5
ROUND_MAGIC = np.float32(1.5 * 2**23)  # 0x4B400000
CLAMP_LOW = np.float32(-126.0)

# Relative half-ulp of each storage dtype: the error below which an exponential is invisible after P
# is rounded to that dtype.
HALF_ULP = {"bf16": 2.0**-8, "fp16": 2.0**-11}


# ------------------------------------------------------------------------------------------------
# Exact float32 arithmetic helpers (numpy has no float32 FMA nor directed rounding)
# ------------------------------------------------------------------------------------------------
def _round_f64_to_f32_with_residual(s: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Round the exact real s + residual (|residual| <= ulp64(s)/2) to float32, nearest-even.

    Rounding s alone is right except when s sits exactly on a float32 tie, where the residual's sign
    decides; s cannot cross a tie because ties are float64 numbers themselves."""
    r = s.astype(np.float32)
    lo = np.nextafter(r, np.float32(-np.inf))
    hi = np.nextafter(r, np.float32(np.inf))
    # s is a tie if it is the midpoint of r and a neighbour.
    tie_below = s == (r.astype(np.float64) + lo.astype(np.float64)) / 2
    tie_above = s == (r.astype(np.float64) + hi.astype(np.float64)) / 2
    r = np.where(tie_below & (residual < 0), lo, r)
    r = np.where(tie_above & (residual > 0), hi, r)
    return r


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fma.rn.f32: a*b + c with a single rounding. a*b is exact in float64 (24+24 bits)."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    prod = a64 * b64
    s = prod + c64
    # TwoSum: the exact error of the float64 addition.
    bb = s - prod
    err = (prod - (s - bb)) + (c64 - bb)
    return _round_f64_to_f32_with_residual(s, err)


def add_round_down_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """add.rm.f32 for operands whose exact sum fits float64 (true for the ranges used here)."""
    s = np.asarray(a, np.float32).astype(np.float64) + np.asarray(b, np.float32).astype(np.float64)
    r = s.astype(np.float32)
    return np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)), r)


# ------------------------------------------------------------------------------------------------
# Remez exchange (float64) for min max |p(f) / 2^f - 1| on [0, 1]
# ------------------------------------------------------------------------------------------------
def _remez_relative(degree: int, iterations: int = 60) -> np.ndarray:
    n = degree
    # Chebyshev extrema as the first reference.
    k = np.arange(n + 2)
    ref = 0.5 - 0.5 * np.cos(np.pi * k / (n + 1))
    grid = np.linspace(0.0, 1.0, 20001)
    coeffs = np.zeros(n + 1)
    for _ in range(iterations):
        # Solve p(x_i) - (-1)^i E 2^{x_i} = 2^{x_i}: n+2 unknowns (c_0..c_n, E).
        a = np.zeros((n + 2, n + 2))
        a[:, : n + 1] = ref[:, None] ** np.arange(n + 1)[None, :]
        a[:, n + 1] = -((-1.0) ** k) * np.exp2(ref)
        sol = np.linalg.solve(a, np.exp2(ref))
        coeffs = sol[: n + 1]
        err = np.polyval(coeffs[::-1], grid) / np.exp2(grid) - 1.0
        # New reference: the extremum of each sign-alternating run.
        sign = np.sign(err)
        sign[sign == 0] = 1
        runs = np.flatnonzero(np.diff(sign)) + 1
        bounds = np.concatenate(([0], runs, [len(grid)]))
        extrema = [
            lo + int(np.argmax(np.abs(err[lo:hi]))) for lo, hi in zip(bounds[:-1], bounds[1:])
        ]
        if len(extrema) < n + 2:
            break
        # Keep the n+2 consecutive extrema with the largest smallest magnitude.
        best = max(
            range(len(extrema) - n - 1),
            key=lambda i: min(abs(err[j]) for j in extrema[i : i + n + 2]),
        )
        new_ref = grid[extrema[best : best + n + 2]]
        if np.allclose(new_ref, ref, atol=1e-12):
            break
        ref = new_ref
    return coeffs


# ------------------------------------------------------------------------------------------------
# The kernel's sequence, modelled bit for bit
# ------------------------------------------------------------------------------------------------
def emulate_exp2_f32(
    x: np.ndarray, degree: int, coeffs: tuple[float, ...] | None = None
) -> np.ndarray:
    """exp2(x) exactly as the kernel's FMA-pipe path computes it, in float32. Valid for x <= 127."""
    _check_degree(degree)
    c = np.asarray(coefficients(degree) if coeffs is None else coeffs, dtype=np.float32)
    x = np.asarray(x, dtype=np.float32)
    xc = np.maximum(
        x, CLAMP_LOW
    )  # NaN never reaches here in the kernel (scores are finite or -inf)
    t = add_round_down_f32(xc, ROUND_MAGIC)
    j = (t.astype(np.float64) - np.float64(ROUND_MAGIC)).astype(np.float32)  # exact
    f = (xc.astype(np.float64) - j.astype(np.float64)).astype(np.float32)  # exact
    p = np.full_like(f, c[degree])
    for k in range(degree - 1, -1, -1):
        p = fma_f32(p, f, np.full_like(f, c[k]))
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _sample_points() -> np.ndarray:
    """Every float32 fraction step that matters: a dense sweep of [0, 1) plus integer offsets."""
    frac = np.linspace(0.0, 1.0, 1 << 16, endpoint=False, dtype=np.float64)
    frac = np.concatenate(
        [frac, np.nextafter(np.float32(1.0), np.float32(0.0), dtype=np.float32)[None]]
    )
    return np.concatenate([(frac - 1.0), (frac - 17.0), (frac - 100.0)]).astype(np.float32)


def _rel_error(degree: int, coeffs: np.ndarray, xs: np.ndarray) -> float:
    got = emulate_exp2_f32(xs, degree, tuple(coeffs)).astype(np.float64)
    want = np.exp2(xs.astype(np.float64))
    return float(np.max(np.abs(got / want - 1.0)))


@functools.cache
def coefficients(degree: int) -> tuple[float, ...]:
    """float32 coefficients c_0..c_degree of the polynomial for 2^f on [0, 1)."""
    _check_degree(degree)
    c = _remez_relative(degree).astype(np.float32)
    xs = _sample_points()[::7]
    best = _rel_error(degree, c, xs)
    # Polish: coordinate descent over +-1 ulp of each float32 coefficient against the exact model.
    improved = True
    while improved:
        improved = False
        for i in range(degree + 1):
            for direction in (-np.inf, np.inf):
                trial = c.copy()
                trial[i] = np.nextafter(c[i], np.float32(direction))
                e = _rel_error(degree, trial, xs)
                if e < best:
                    best, c, improved = e, trial, True
    return tuple(float(v) for v in c)


@functools.cache
def max_relative_error(degree: int) -> float:
    """Largest |emulated / exact - 1| over a dense sweep of the fraction at several exponents."""
    return _rel_error(degree, np.asarray(coefficients(degree), np.float32), _sample_points())


def accuracy_reasons(poly_degree: int, emu_share: float, dtype: str) -> list[str]:
    """Why this exp2 setting would make the kernel less accurate than MUFU-only beyond rounding."""
    if emu_share == 0:
        return []  # the polynomial is never evaluated
    if not MIN_DEGREE <= poly_degree <= MAX_DEGREE:
        return [f"poly_degree {poly_degree} outside {MIN_DEGREE}..{MAX_DEGREE}"]
    if dtype not in HALF_ULP:
        return [f"no accuracy budget known for dtype {dtype!r}"]
    err = max_relative_error(poly_degree)
    budget = HALF_ULP[dtype]
    if err > budget:
        return [
            f"exp2 polynomial of degree {poly_degree} has max relative error {err:.2e}, above the "
            f"{dtype} half-ulp {budget:.2e}: emulated exponentials would be visibly "
            "less accurate than MUFU ones"
        ]
    return []


def _check_degree(degree: int) -> None:
    if not isinstance(degree, (int, np.integer)) or not MIN_DEGREE <= degree <= MAX_DEGREE:
        raise ValueError(
            f"poly_degree must be an integer in {MIN_DEGREE}..{MAX_DEGREE}, got {degree!r}"
        )
