"""Train a model with one of jaxpar's parallel strategies: the command line of `jaxpar.cli`.

    python train.py --cpu-devices 8 --strategy ddp --epochs 1                 # 8 simulated CPU devices
    python train.py --cpu-devices 4 --strategy pipeline --num-stages 2 --micro-batches 8 --schedule 1f1b
    python train.py --model examples/regression.py:make_model --loss examples/regression.py:loss ...
    python -m jaxpar.launch --nproc-per-node 2 train.py --cpu-devices 2 --strategy ddp    # 2 processes

`python train.py --help` lists every flag (the fields of jaxpar.Config). Installed, the same command is
`jaxpar-train`.
"""
from jaxpar.cli import main

if __name__ == "__main__":
    main()
