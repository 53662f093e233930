"""Record the stage bounds DeepSpeed's own partition_balanced gives, as tests/fixtures/deepspeed_partitions.json.

    pip download deepspeed --no-deps -d /tmp/ds && tar xzf /tmp/ds/deepspeed-*.tar.gz -C /tmp/ds
    /work/venv/bin/python tests/make_partition_fixture.py /tmp/ds/deepspeed-*/deepspeed/runtime/utils.py

DeepSpeed itself is not imported (it needs torch and an accelerator): its partition_uniform and partition_balanced,
which need only numpy, are read out of deepspeed/runtime/utils.py and run as they are. The cases: seeded random
integer weights (many zeros, as parameter counts of activations and pools are), equal weights, one heavy layer
first or last (an embedding, a head), and fractional costs.
"""
from __future__ import annotations

import ast
import json
import os
import re
import sys

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "deepspeed_partitions.json")


def deepspeed_functions(path: str) -> dict:
    source = open(path).read()
    tree = ast.parse(source)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef)
              and node.name in ("partition_uniform", "partition_balanced")]
    module = ast.Module(body=wanted, type_ignores=[])
    scope: dict = {"np": np, "numpy": np}
    exec(compile(module, path, "exec"), scope)
    return scope


def cases(rng: np.random.Generator) -> list[tuple[list, int]]:
    out = []
    for _ in range(150):
        n = int(rng.integers(2, 16))
        w = rng.integers(0, 1000, n) * rng.integers(0, 2, n)
        out.append(([int(x) for x in w], int(rng.integers(1, n + 1))))
    for n in range(2, 14):
        for p in range(1, n + 1):
            out.append(([1] * n, p))
    for n in (6, 10, 14):
        for p in (2, 3, 4, 8):
            if p <= n:
                out.append(([40_000] + [7_000] * (n - 2) + [0], p))  # a GPT: the embedding, blocks, a tied head
                out.append(([50] + [7_000] * (n - 2) + [40_000], p))
    for _ in range(40):
        n = int(rng.integers(2, 12))
        out.append(([float(x) for x in rng.random(n) * 10.0 ** rng.integers(0, 5, n)], int(rng.integers(1, n + 1))))
    return out


def main(path: str) -> None:
    ds = deepspeed_functions(path)
    version = re.search(r"deepspeed-([\d.]+)", path)
    records = [{"weights": w, "num_parts": p, "bounds": [int(b) for b in ds["partition_balanced"](w, p)]}
               for w, p in cases(np.random.default_rng(0))]
    with open(FIXTURE, "w") as f:
        json.dump({"deepspeed": version.group(1) if version else "unknown", "cases": records}, f)
    print(f"wrote {FIXTURE}: {len(records)} cases")


if __name__ == "__main__":
    main(sys.argv[1])
