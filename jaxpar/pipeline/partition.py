"""Stage partitions: contiguous layer ranges as plain data, DeepSpeed's methods plus a cost profile.

A partition of L layers into P parts is the list of bounds ``[0, b1, ..., L]``: part k holds layers
``bounds[k]:bounds[k+1]``. Every part holds at least one layer. Roughly (``balanced([4, 0, 4, 0, 1], 2)``)::

    weights  4 0 | 4 0 1        bounds [0, 2, 5]: the heaviest part weighs 5, the least any split allows
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

METHODS = ("parameters", "uniform", "type:REGEX", "profile")


def check_parts(num_layers: int, num_parts: int, what: str = "num_stages x virtual_stages") -> None:
    """A clear error when there are more parts than layers (a part would be empty)."""
    if num_parts < 1:
        raise ValueError(f"{what}={num_parts} must be >= 1; use --num-stages 1 or more.")
    if num_parts > num_layers:
        raise ValueError(
            f"{what}={num_parts} parts cannot be cut from {num_layers} layers (each stage needs a layer); "
            f"use at most {num_layers} stages (--num-stages / --virtual-stages) or a model with more layers.")


def uniform(num_layers: int, num_parts: int) -> list[int]:
    """DeepSpeed's partition_uniform: L // P layers per part, the first L % P parts one more."""
    check_parts(num_layers, num_parts)
    size, extra = divmod(num_layers, num_parts)
    bounds = [0]
    for k in range(num_parts):
        bounds.append(bounds[-1] + size + (k < extra))
    return bounds


def balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's partition_balanced (since 0.13): contiguous parts chosen by dynamic programming over (layers,
    parts), each prefix split keeping the one whose heaviest part minus lightest part is smallest, the last such
    split point on a tie -- the same bounds DeepSpeed gives (tests/fixtures/deepspeed_partitions.json). It spreads
    layers of equal weight evenly (7 into 3: 3, 2, 2) and, behind a heavy embedding, the blocks over the other
    stages. `parameters` and `type:REGEX` cut by it."""
    n = len(weights)
    check_parts(n, num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"{list(weights)=} must be >= 0; a layer weight is a count or a cost")
    if n == num_parts:
        return uniform(n, num_parts)
    m = num_parts
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, np.float64))
    big, small = np.full((n + 1, m + 1), np.inf), np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), int)
    big[0, 0] = 0.0
    with np.errstate(invalid="ignore"):  # inf - inf: splits with an empty part, never kept
        for i in range(1, n + 1):
            last = prefix[i] - prefix[:i]  # the part k..i for every k < i
            for j in range(1, min(i, m) + 1):
                hi, lo = np.maximum(big[:i, j - 1], last), np.minimum(small[:i, j - 1], last)
                c = hi - lo
                if np.all(np.isnan(c)):
                    continue
                k = int(np.flatnonzero(c <= np.nanmin(c))[-1])  # DeepSpeed's: the last k as good as the best
                big[i, j], small[i, j], position[i, j] = hi[k], lo[k], k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(int(position[bounds[-1], j]))
    return bounds[::-1]


def min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising the heaviest part's weight (the step time of a pipeline whose stages cost
    `weights`), the greedy left split among the optimal ones: `profile`'s cut. Exact: the optimum is the sum of a
    contiguous run of layers, and every sum is taken as a difference of the same prefix sums."""
    n = len(weights)
    check_parts(n, num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"{list(weights)=} must be >= 0; a layer weight is a count or a cost")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    run = lambda a, b: prefix[b] - prefix[a]  # noqa: E731  (the weight of layers a..b-1)

    def cut(cap: float) -> list[int] | None:  # the greedy left split under cap, or None when it needs more parts
        bounds, start = [0], 0
        for k in range(num_parts - 1):
            if run(start, start + 1) > cap:
                return None
            end = start + 1  # a part holds at least one layer
            while end < n - (num_parts - k - 1) and run(start, end + 1) <= cap:
                end += 1
            bounds.append(end)
            start = end
        return bounds + [n] if run(start, n) <= cap else None

    candidates = sorted({run(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cut(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    return cut(candidates[lo])


def type_weights(names: Sequence[str], regex: str) -> list[int]:
    """DeepSpeed's ``type:REGEX``: weight 1 for layers whose class name matches (case-insensitive), else 0."""
    try:
        pattern = re.compile(regex, re.IGNORECASE)
    except re.error as e:  # a ValueError, so train.py answers in one line (re.error is not one)
        raise ValueError(f"partition_method='type:{regex}' is not a valid regular expression ({e}); pass e.g. "
                         "'type:Linear|Conv' or 'type:Block'.") from None
    weights = [int(bool(pattern.search(n))) for n in names]
    if not any(weights):
        raise ValueError(f"partition_method='type:{regex}' matches none of the layer classes {sorted(set(names))}; "
                         "use a regex matching at least one, e.g. 'type:Linear|Conv'.")
    return weights


def partition(method: str, num_parts: int, *, names: Sequence[str], params: Callable[[], Sequence[int]],
              profile: Callable[[], Sequence[float]] | None = None) -> list[int]:
    """Bounds for `method`: parameters | uniform | type:REGEX | profile (the weights are computed on demand)."""
    n = len(names)
    check_parts(n, num_parts)
    if not isinstance(method, str):
        raise ValueError(f"partition_method={method!r} is not known; use one of {', '.join(METHODS)}.")
    if not method.lower().startswith("type:"):
        method = method.lower()  # DeepSpeed's _partition_layers lower-cases it ('Parameters' is 'parameters')
    if method == "uniform":
        return uniform(n, num_parts)
    if method == "parameters":
        return balanced(params(), num_parts)
    if method.lower().startswith("type:"):
        return balanced(type_weights(names, method[len("type:"):]), num_parts)
    if method == "profile":
        if profile is None:
            raise ValueError("partition_method='profile' needs an example input to cost the layers; "
                             "pass example_input=... (one batch's model input: a row or a few) to jaxpar.Pipeline or "
                             "PipelineModule.")
        return min_max(profile(), num_parts)
    raise ValueError(f"partition_method={method!r} is not known; use one of {', '.join(METHODS)}.")
