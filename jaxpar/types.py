"""Type aliases shared across jaxpar (one place, so signatures read the same everywhere)."""
from __future__ import annotations

from typing import Any, Callable

import jax

PyTree = Any
Params = Any  # an nnx.State holding a model's parameters
Batch = dict[str, Any]  # x [B, ...] float32, y [B] int32, idx [B] int32 global sample ids, optional w [B] float32
Metrics = dict[str, jax.Array]
StepFn = Callable[[Any, Batch], tuple[Any, Metrics]]
