"""The software exp2: its float32 model against exact arithmetic, and its accuracy per degree."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fa4tune.kernels.sm90 import exp2_poly


def _exact_round_f32(value: Fraction, mode: str) -> np.float32:
    """Round an exact rational to float32 (nearest-even or toward -inf), by bisection on the
    grid."""
    approx = np.float32(float(value))  # within one float32 ulp of the answer
    candidates = [
        np.nextafter(approx, np.float32(-np.inf)),
        approx,
        np.nextafter(approx, np.float32(np.inf)),
    ]
    below = max(
        (c for c in candidates if Fraction(float(c)) <= value), key=lambda c: Fraction(float(c))
    )
    if mode == "down" or Fraction(float(below)) == value:
        return below
    above = np.nextafter(below, np.float32(np.inf))
    lo, hi = value - Fraction(float(below)), Fraction(float(above)) - value
    if lo != hi:
        return below if lo < hi else above
    return below if int(below.view(np.uint32)) % 2 == 0 else above


def test_fma_model_is_exact():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(3000).astype(np.float32)
    b = rng.standard_normal(3000).astype(np.float32)
    c = rng.standard_normal(3000).astype(np.float32) * np.float32(4.0)
    # Constructed ties: a*b + c lands exactly half an ulp from a float32 for these.
    a = np.concatenate([a, np.float32([1.0 + 2**-23, 3.0])])
    b = np.concatenate([b, np.float32([1.0 + 2**-23, 2.0**-24])])
    c = np.concatenate([c, np.float32([-1.0, 1.0])])
    got = exp2_poly.fma_f32(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i] == _exact_round_f32(exact, "nearest"), (a[i], b[i], c[i])


def test_add_round_down_model_is_exact():
    rng = np.random.default_rng(1)
    x = (rng.uniform(-126, 10, 2000)).astype(np.float32)
    got = exp2_poly.add_round_down_f32(x, exp2_poly.ROUND_MAGIC)
    for xi, gi in zip(x, got):
        exact = Fraction(float(xi)) + Fraction(float(exp2_poly.ROUND_MAGIC))
        assert gi == _exact_round_f32(exact, "down")


# Measured maxima of |emulated / exact - 1| (float64 exact), with a little headroom.
ERROR_BOUNDS = {1: 3.0e-2, 2: 1.8e-3, 3: 9e-5, 4: 3e-6, 5: 2e-7}


@pytest.mark.parametrize("degree", sorted(ERROR_BOUNDS))
def test_max_relative_error_per_degree(degree):
    err = exp2_poly.max_relative_error(degree)
    assert err < ERROR_BOUNDS[degree]
    # And not absurdly better than a polynomial of that degree can be (the check itself works).
    assert err > ERROR_BOUNDS[degree] / 50


def test_error_falls_with_degree():
    errors = [exp2_poly.max_relative_error(d) for d in range(1, 6)]
    assert all(later < earlier / 10 for earlier, later in zip(errors, errors[1:]))


def test_emulation_follows_exp2_across_the_range():
    x = np.linspace(-125.9, 8.0, 200001, dtype=np.float32)
    got = exp2_poly.emulate_exp2_f32(x, 3).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= exp2_poly.max_relative_error(3) * 1.01


def test_masked_scores_give_a_tiny_positive_not_nan():
    got = exp2_poly.emulate_exp2_f32(np.float32([-np.inf, -1e30, -300.0, -126.0]), 3)
    assert np.all(np.isfinite(got)) and np.all(got > 0) and np.all(got < 2**-125)


def test_coefficients_are_float32_and_cached():
    for d in range(1, 6):
        c = exp2_poly.coefficients(d)
        assert len(c) == d + 1
        assert all(np.float32(v) == v for v in c)
        assert exp2_poly.coefficients(d) is c


def test_accuracy_rules():
    # Degree 1 is visibly wrong for both dtypes, degree 2 is fine for bf16 only, 3 and up for both.
    assert exp2_poly.accuracy_reasons(1, 0.25, "bf16")
    assert exp2_poly.accuracy_reasons(1, 0.25, "fp16")
    assert not exp2_poly.accuracy_reasons(2, 0.25, "bf16")
    assert exp2_poly.accuracy_reasons(2, 0.25, "fp16")
    assert not exp2_poly.accuracy_reasons(3, 0.5, "fp16")
    # Without emulation the polynomial is never evaluated.
    assert not exp2_poly.accuracy_reasons(1, 0.0, "fp16")
    with pytest.raises(ValueError):
        exp2_poly.coefficients(6)
