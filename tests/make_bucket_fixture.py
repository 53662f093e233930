"""Record the gradient buckets torch DDP really reduces, as tests/fixtures/torch_buckets.json.

    /work/venv/bin/python tests/make_bucket_fixture.py      # needs torch; the tests do not

One process of a gloo group; each model (nn.Sequential of nn.Linear, parameters in forward order) is wrapped in
DistributedDataParallel with a bucket_cap_mb (None: torch's default), and a communication hook records the buckets
of the third backward, after the Reducer rebuilt them in the order the gradients became ready. Each case holds
the parameters' byte sizes in forward order, the cap, and torch's buckets as lists of parameter indices, in the
order torch reduced them.
"""
from __future__ import annotations

import json
import os
import tempfile

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "torch_buckets.json")
WIDTHS = {"six_400": [400] * 7, "taper": [1000, 700, 300, 900, 64, 512, 10], "tiny": [8, 16, 8, 4],
          "wide_first": [2000, 300, 300, 300, 300]}
CAPS = (None, 0, 0.5, 1.5, 2, 25)


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    cases = []
    for name, widths in WIDTHS.items():
        for cap in CAPS:
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])])
            params = list(model.parameters())
            index = {id(p): i for i, p in enumerate(params)}
            ddp = nn.parallel.DistributedDataParallel(model, **({} if cap is None else {"bucket_cap_mb": cap}))
            seen: list[list[int]] = []

            def hook(state, bucket):
                seen.append([index[id(p)] for p in bucket.parameters()])
                done = torch.futures.Future()
                done.set_result(bucket.buffer())
                return done

            ddp.register_comm_hook(None, hook)
            for _ in range(3):
                seen.clear()
                ddp(torch.randn(2, widths[0])).sum().backward()
            cases.append({"model": name, "bucket_cap_mb": cap, "nbytes": [p.numel() * 4 for p in params],
                          "buckets": seen})
    dist.destroy_process_group()
    with open(FIXTURE, "w") as f:
        json.dump({"torch": torch.__version__, "cases": cases}, f, indent=0)
    print(f"wrote {FIXTURE}: {len(cases)} cases")


if __name__ == "__main__":
    main()
