"""Confidence intervals over failure trails (seeds). Relies on numpy and scipy.stats (Student t).

With ``n`` paired trails the 95% interval of a mean is ``mean +- t_{0.975, n-1} sd / sqrt(n)``; paired
differences / gains are computed per trail first, so the trail-to-trail variation that every scheme shares
cancels. One trail gives no interval (``lo = hi = nan``). Runs that did not finish (``inf``) make the mean
``inf`` and the interval ``(nan, nan)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Interval:
    mean: float
    lo: float
    hi: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2 if math.isfinite(self.hi - self.lo) else math.nan

    def excludes(self, x: float) -> bool:
        """True when ``x`` lies outside a finite interval."""
        return math.isfinite(self.lo) and math.isfinite(self.hi) and not (self.lo <= x <= self.hi)


def mean_ci(values, level: float = 0.95) -> Interval:
    x = np.asarray(list(values), dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    if not np.isfinite(x).all():
        return Interval(math.inf if (x == math.inf).any() else math.nan, math.nan, math.nan, n)
    m = float(x.mean())
    if n == 1:
        return Interval(m, math.nan, math.nan, 1)
    from scipy.stats import t

    h = float(t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return Interval(m, m - h, m + h, n)


def paired_gain_ci(a, b, level: float = 0.95) -> Interval:
    """Per-trail gain ``1 - a_i / b_i`` (``a`` faster than ``b`` -> positive), with its interval."""
    a = np.asarray(list(a), dtype=np.float64)
    b = np.asarray(list(b), dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return mean_ci(1.0 - a / b, level)


def paired_diff_ci(a, b, level: float = 0.95) -> Interval:
    """Per-trail difference ``a_i - b_i`` with its interval."""
    a = np.asarray(list(a), dtype=np.float64)
    b = np.asarray(list(b), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return mean_ci(a - b, level)
