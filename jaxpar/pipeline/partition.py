"""Stage partitions: contiguous layer ranges as plain data, DeepSpeed's methods plus a cost profile.

A partition of L layers into P parts is the list of bounds ``[0, b1, ..., L]``: part k holds layers
``bounds[k]:bounds[k+1]``. Every part holds at least one layer. Roughly (``balanced([4, 0, 4, 0, 1], 2)``)::

    weights  4 0 | 4 0 1        bounds [0, 2, 5]: the heaviest part weighs 5, the least any split allows
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

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


def _fits(weights: Sequence[float], num_parts: int, cap: float) -> bool:
    """Whether a left-to-right greedy cut into <= num_parts parts keeps every part's weight <= cap."""
    parts, total = 1, 0.0
    for w in weights:
        if w > cap:
            return False
        if total + w > cap:
            parts, total = parts + 1, w
        else:
            total += w
    return parts <= num_parts


def bottleneck(weights: Sequence[float], num_parts: int) -> float:
    """The smallest possible weight of the heaviest part (binary search over the candidate sums).

    The optimum is the sum of some contiguous run of layers, so the search runs over those sums: exact, no eps.
    """
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    n = len(weights)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_parts, candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising the heaviest part's weight (DeepSpeed's partition_balanced).

    Among the optimal splits it takes the greedy left one (each part as many layers as fit under the bottleneck,
    leaving one layer for every later part), as DeepSpeed's ``_lprobe`` does.
    """
    n = len(weights)
    check_parts(n, num_parts)
    if any(w < 0 for w in weights):
        raise ValueError(f"{list(weights)=} must be >= 0; a layer weight is a count or a cost")
    cap = bottleneck(weights, num_parts)
    bounds, start = [0], 0
    for k in range(num_parts - 1):
        end, total = start + 1, weights[start]  # a part holds at least one layer
        while end < n - (num_parts - k - 1) and total + weights[end] <= cap:
            total += weights[end]
            end += 1
        bounds.append(end)
        start = end
    bounds.append(n)
    return bounds


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
    if method == "uniform":
        return uniform(n, num_parts)
    if method == "parameters":
        return balanced(params(), num_parts)
    if method.startswith("type:"):
        return balanced(type_weights(names, method[len("type:"):]), num_parts)
    if method == "profile":
        if profile is None:
            raise ValueError("partition_method='profile' needs an example input to cost the layers; "
                             "pass example_input=... (one batch's model input: a row or a few) to jaxpar.Pipeline or "
                             "PipelineModule.")
        return balanced(profile(), num_parts)
    raise ValueError(f"partition_method={method!r} is not known; use one of {', '.join(METHODS)}.")
