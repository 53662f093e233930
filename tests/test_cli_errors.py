"""Wrong invocations of train.py: each is answered by ONE line that names the value, the rule and the fix, exit
status 2, and nothing written (no metrics file, checkpoint folder or exported weights appear)."""
import os
import re

import numpy as np
import pytest

import train
from jaxpar.run import checkpoint
from jaxpar.run import devices
from jaxpar.data import idx
from jaxpar.run import trainer
from jaxpar.config import Config

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "regression.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Data files (good, truncated, corrupt, missing), a checkpoint of a linear model, an unwritable path."""
    root = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype(np.float32)
    np.savez(root / "ok.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    np.savez(root / "no_y.npz", x=x)
    tok = rng.integers(0, 50, (8, 16)).astype(np.int32)
    np.savez(root / "eval_neg.npz", x=tok, y=tok, x_test=np.where(tok == tok[0, 0], -5, tok), y_test=tok)
    np.savez(root / "tokens_neg.npz", x=np.where(tok == tok[0, 0], -1, tok), y=tok)
    np.savez(root / "targets_neg.npz", x=tok, y=np.where(tok == tok[0, 0], -1, tok))
    np.savez(root / "tokens_short_y.npz", x=tok, y=tok[:, 1:])
    np.savez(root / "no_rows.npz", x=x[:0], y=x[:0, 0])
    np.savez(root / "tokens_odd.npz", x=tok[:, :15], y=tok[:, 1:])
    images, labels = rng.integers(0, 256, (20, 28, 28), np.uint8), rng.integers(0, 10, 20).astype(np.uint8)
    for name, cut in (("mnist_ok", None), ("mnist_truncated", -100), ("mnist_corrupt", 0)):
        folder = root / name
        folder.mkdir()
        idx.write_idx(folder / "t10k-labels-idx1-ubyte", labels)
        idx.write_idx(folder / "t10k-images-idx3-ubyte", images)
        data = (folder / "t10k-images-idx3-ubyte").read_bytes()
        if cut == 0:  # a wrong magic number: not an IDX file
            data = b"\x50\x4b\x03\x04" + data[4:]
        elif cut:
            data = data[:cut]
        (folder / "t10k-images-idx3-ubyte").write_bytes(data)
    (root / "mnist_no_labels").mkdir()
    idx.write_idx(root / "mnist_no_labels" / "t10k-images-idx3-ubyte", images)
    (root / "empty").mkdir()
    (root / "a_file").write_text("not a folder")
    (root / "bad.safetensors").write_bytes(b"\x10" + bytes(7) + b"not a JSON header")  # a corrupt safetensors file
    from jaxpar import models

    np.savez(root / "one_class.npz", **models.to_torch_state_dict(models.get("linear", input_size=5, output_size=1)))
    np.savez(root / "seven_wide.npz", **models.to_torch_state_dict(models.get("linear", input_size=7, output_size=2)))
    ckpt = str(root / "linear_ckpt")
    trainer.run(Config(model="linear", dataset="npz", data_path=str(root / "ok.npz"), eval_split="", batch_size=16,
                       steps=1, quiet=True, checkpoint_dir=ckpt))
    names = ("ok.npz", "no_rows.npz", "tokens_odd.npz", "no_y.npz", "tokens_neg.npz", "targets_neg.npz", "eval_neg.npz",
             "tokens_short_y.npz", "mnist_ok", "mnist_truncated", "mnist_corrupt", "mnist_no_labels", "empty", "a_file",
             "one_class.npz", "seven_wide.npz")
    return {k.replace(".", "_"): str(root / k) for k in names} | {"ckpt": ckpt, "root": str(root)}


BASE = ["--model", "linear", "--dataset", "npz", "--data-path", "{ok_npz}", "--eval-split", "", "--batch-size", "16",
        "--steps", "1", "--quiet"]
MNIST = ["--dataset", "mnist", "--model", "linear", "--train-split", "test", "--eval-split", "", "--steps", "1",
         "--quiet"]

UNSET = "<unset>"  # in a case's argv: the flag before it is left out (the harness gives each output flag a path)

# (id, argv (later flags override BASE's), patterns the one-line message must contain: the value ... the fix)
CASES = [
    ("unknown strategy", ["--strategy", "fsdp"], ["'fsdp'", "use one of", "ddp"]),
    # a QA pass: each failed with a message naming no flag, or with a fix that could not help
    ("empty checkpoint dir", ["--checkpoint-dir", ""], ["--checkpoint-dir '' names no path", "leave"]),
    ("empty metrics out", ["--metrics-out", " "], ["--metrics-out ' ' names no path", "leave"]),
    ("output device negative", ["--strategy", "dp", "--output-device", "-1"],
     ["--output-device -1", "pass e.g. --output-device 0"]),
    ("num devices 0", ["--strategy", "ddp", "--num-devices", "0"], ["--num-devices 0 must be >= 1"]),
    ("n_head 0", ["--model", "gpt-nano", "--dataset", "text", "--n-head", "0"], ["--n-head 0 must be >= 1"]),
    ("image size negative", ["--dataset", "synthetic", "--model", "mlp", "--image-size", "-3"],
     ["--image-size -3 must be >= 1"]),
    ("train split syntax", ["--dataset", "synthetic", "--train-split", "train[abc]"],
     ["--train-split 'train[abc]'", "is not valid here", "use tfds syntax"]),
    ("eval split syntax", ["--dataset", "synthetic", "--eval-split", "test[abc]"],
     ["--eval-split 'test[abc]'", "is not valid here", "use tfds syntax"]),
    ("unknown model", ["--model", "resnet50"], ["'resnet50'", "use one of", "mlp"]),
    ("unknown dataset", ["--dataset", "imagenet"], ["'imagenet'", "use one of", "mnist"]),
    ("unknown optimizer", ["--optimizer", "lamb"], ["'lamb'", "use one of", "adamw"]),
    ("unknown conv impl", ["--model", "convnet", "--conv-impl", "winograd"], ["'winograd'", "use one of", "im2col"]),
    ("conv impl without a conv", ["--conv-impl", "im2col"], ["--conv-impl", "'linear'", "drop --conv-impl"]),
    ("unknown precision", ["--precision", "fp8"], ["'fp8'", "use one of", "bf16"]),
    ("loss scale without fp16", ["--loss-scale", "128"], ["--loss-scale", "--precision is fp32",
                                                         "add --precision fp16"]),
    ("fp16 hysteresis 0", ["--precision", "fp16", "--hysteresis", "0"], ["--hysteresis=0", ">= 1"]),
    ("dynamic flags under a static scale", ["--precision", "fp16", "--loss-scale", "128", "--initial-scale-power",
                                            "20", "--hysteresis", "1"],
     ["--initial-scale-power, --hysteresis", "--loss-scale 128.0 is a fixed scale", "--loss-scale 0"]),
    ("a static scale float32 cannot hold", ["--precision", "fp16", "--loss-scale", "1e39"],
     ["--loss-scale=1e+39", "float32 holds (at most 3.403e+38)", "such as 128"]),
    ("zero batch", ["--batch-size", "0"], ["--batch-size 0", ">= 1"]),
    ("zero steps", ["--steps", "0"], ["--steps 0", ">= 1", "leave it out"]),
    ("negative lr", ["--lr", "-0.1"], ["--lr -0.1", "> 0"]),
    # flags that nothing in the run reads were accepted and ignored: another strategy's, a GPT's, a dataset's
    ("grad accum under single", ["--grad-accum", "2"], ["--grad-accum 2", "--strategy ddp and zero, not single",
                                                        "drop --grad-accum"]),
    ("grad accum under the pipeline", ["--strategy", "pipeline", "--model", "mlp", "--grad-accum", "2"],
     ["--grad-accum 2", "not pipeline (the pipeline accumulates over --micro-batches"]),
    ("stages under ddp", ["--strategy", "ddp", "--num-stages", "4"],
     ["--num-stages 4", "--strategy pipeline, not ddp"]),
    ("tensor parallel under ddp", ["--strategy", "ddp", "--tensor-parallel", "2"],
     ["--tensor-parallel 2", "--strategy tp and pipeline, not ddp"]),
    ("tp on a model without splits", ["--strategy", "tp", "--model", "convnet"],
     ["--model convnet has no module that tensor parallelism can split", "--strategy ddp"]),
    ("tp splitting over 1 device", ["--strategy", "tp", "--model", "gpt-nano", "--dataset", "text"],
     ["--strategy tp with --tensor-parallel 1 (the default) splits no layer", "pass --tensor-parallel T >= 2",
      "--strategy ddp"]),
    ("3-D on a model without splits", ["--strategy", "pipeline", "--model", "mlp", "--tensor-parallel", "2"],
     ["--model mlp has no module", "--tensor-parallel 1"]),
    ("ring under zero", ["--strategy", "zero", "--allreduce", "ring"], ["--allreduce ring", "ddp, not zero"]),
    ("devices under single", ["--num-devices", "2"], ["--num-devices 2 would be ignored",
                                                      "--strategy single runs on one device", "drop --num-devices"]),
    ("no overlap under single", ["--no-overlap"], ["--no-overlap is read by --strategy ddp, not single",
                                                    "drop --no-overlap"]),
    ("deferred W's under ddp", ["--strategy", "ddp", "--defer-wgrad"],
     ["--defer-wgrad is read by --strategy pipeline, not ddp", "drop --defer-wgrad"]),
    ("dropout on a non-GPT", ["--dropout", "0.5"], ["--dropout 0.5 would be ignored", "--model linear is not one of "
                                                    "jaxpar's GPTs", "drop --dropout"]),
    ("seq len off text", ["--seq-len", "64"], ["--seq-len 64 would be ignored", "--dataset npz is not text"]),
    ("seq len whose attention cannot fit", ["--model", "gpt-nano", "--dataset", "text", "--seq-len", "1000000"],
     ["--seq-len 1000000", "6,286.4 GiB", "3 heads", "lower --seq-len"]),  # 6 TiB: more than any machine has
    ("data dir for npz", ["--data-dir", "/nonexistent"], ["--data-dir /nonexistent would be ignored", "reads no IDX"]),
    ("gamma under cosine", ["--lr-schedule", "cosine", "--gamma", "0.5"], ["--gamma 0.5 would be ignored",
                                                                          "--lr-schedule cosine is not StepLR's"]),
    ("momentum under adam", ["--optimizer", "adam", "--momentum", "0.9"], ["--momentum 0.9 would be ignored",
                                                                          "--optimizer adam has no momentum"]),
    ("nesterov under adam", ["--optimizer", "adam", "--nesterov"], ["--nesterov would be ignored",
                                                                    "--optimizer adam has no momentum"]),
    ("nesterov without momentum", ["--optimizer", "sgd", "--nesterov"], ["--nesterov needs a momentum",
                                                                         "--momentum is 0", "--momentum 0.9"]),
    ("eps under sgd", ["--optimizer", "sgd", "--eps", "1e-6"], ["--eps 1e-06 would be ignored",
                                                                "--optimizer sgd has no eps", "drop --eps"]),
    ("zero eps", ["--optimizer", "adam", "--eps", "0"], ["--eps 0.0 must be a finite number of at least 1.18e-38",
                                                         "leave it out"]),
    ("infinite eps", ["--optimizer", "adamw", "--eps", "inf"], ["--eps inf must be a finite number"]),
    ("eps that float32 rounds to zero", ["--optimizer", "adadelta", "--eps", "1e-50"], ["--eps 1e-50 must be"]),
    # values accepted before, and training on them (a negative gamma ascends after the first epoch)
    ("negative gamma", ["--gamma", "-1"], ["--gamma -1.0 must be > 0", "1.0 for a constant rate"]),
    ("nan gamma", ["--gamma", "nan"], ["--gamma nan must be > 0"]),
    ("nan momentum", ["--optimizer", "sgd", "--momentum", "nan"], ["--momentum nan must be a finite number >= 0"]),
    ("negative weight decay", ["--weight-decay", "-0.5"], ["--weight-decay -0.5 must be a finite number >= 0",
                                                          "torch.optim's rule"]),
    # accepted before (QA, 2026-11-27): infinite rates trained to NaN weights and exported them; a bad regex ended
    # in a traceback after the data and model were built; flag names read with underscores; token ids < 0 in npz
    ("infinite lr", ["--lr", "inf"], ["--lr inf must be a finite number > 0"]),
    ("infinite momentum", ["--optimizer", "sgd", "--momentum", "inf"], ["--momentum inf must be a finite number >= 0"]),
    ("infinite weight decay", ["--optimizer", "adamw", "--weight-decay", "inf"],
     ["--weight-decay inf must be a finite number >= 0"]),
    ("partition regex that does not compile", ["--strategy", "pipeline", "--model", "mlp", "--num-stages", "2",
                                               "--num-devices", "2", "--partition-method", "type:("],
     ["partition_method='type:('", "not a valid regular expression", "'type:Linear|Conv'"]),
    ("flag names with hyphens", ["--lr-schedule", "poly"], ["--lr-schedule 'poly' is not known"]),
    ("unknown GELU", ["--model", "gpt-nano", "--dataset", "text", "--activation-function", "relu"],
     ["activation_function='relu'", "use gelu_new", "or gelu"]),
    ("GELU on a non-GPT", ["--activation-function", "gelu"],
     ["--activation-function gelu would be ignored", "--model linear is not one of", "drop --activation-function"]),
    ("zero seq len", ["--model", "gpt-nano", "--dataset", "text", "--seq-len", "0"],
     ["--seq-len 0 must be >= 1", "e.g. 256"]),
    ("infinite peak tflops", ["--model", "gpt-nano", "--dataset", "text", "--peak-tflops", "inf"],
     ["--peak-tflops inf must be a finite number > 0"]),
    ("negative token ids", ["--model", "gpt-nano", "--data-path", "{tokens_neg_npz}"],
     ["x holds token -1", "token ids must be >= 0", "fix the file"]),
    ("negative token ids in the eval split", ["--model", "gpt-nano", "--data-path", "{eval_neg_npz}",
                                               "--eval-split", "test"],
     ["--eval-split 'test': x holds token -5", "fix the file"]),
    # QA findings: flags that were taken and ignored, and a fix the CLI itself refuses (--model-kwargs for a GPT)
    ("torch layout without an export", ["--model", "gpt-nano", "--dataset", "text", "--torch-layout", "nanogpt",
                                        "--export-torch", UNSET],  # (the harness's export path left out)
     ["--torch-layout nanogpt would be ignored: nothing is exported without --export-torch"]),
    ("no parallel output without a split", ["--model", "gpt-nano", "--dataset", "text", "--strategy", "pipeline",
                                            "--no-parallel-output"],
     ["--no-parallel-output would be ignored: no vocabulary is split without --tensor-parallel >= 2"]),
    ("an npz without rows", ["--data-path", "{no_rows_npz}"],  # was "split 'train' selects no samples; choose a
     ["no_rows.npz': x has shape (0, 5), no rows", "write the file with at least one sample"]),  # slice"
    # QA round 47: refused when the first step was traced, after the start line (and --metrics-out reset)
    ("sequence parallel over an odd --seq-len", ["--model", "gpt-nano", "--dataset", "text", "--strategy", "tp",
                                                 "--tensor-parallel", "2", "--sequence-parallel", "--seq-len", "15"],
     ["--seq-len 15 does not split over --tensor-parallel 2 ranks", "use a --seq-len that is a multiple of 2"]),
    ("sequence parallel over odd npz sequences", ["--model", "gpt-nano", "--data-path", "{tokens_odd_npz}",
                                                  "--strategy", "tp", "--tensor-parallel", "2", "--sequence-parallel",
                                                  "--n-head", "4"],
     ["holds sequences of 15 tokens, which do not split over --tensor-parallel 2",  # it named --seq-len, which
      "write x and y as [N, T] with T a multiple of 2"]),  # npz refuses
    ("more stages than devices", ["--model", "mlp", "--strategy", "pipeline", "--num-devices", "4", "--num-stages",
                                  "6"],  # it advised --num-devices 6 on 4 devices
     ["num_devices=4 must be a multiple of num_stages=6", "use num_stages (--num-stages) dividing 4 (1, 2, 4)"]),
    ("dropout out of range", ["--model", "gpt-nano", "--dataset", "text", "--dropout", "1.5"],
     ["--dropout 1.5 must be in [0, 1)", "pass e.g. --dropout 0.1"]),  # named dropout=1.5, no flag, no fix
    ("interleaved with one chunk", ["--strategy", "pipeline", "--schedule", "interleaved"],  # ran 1F1B quietly
     ["--schedule interleaved needs --virtual-stages >= 2", "pass --virtual-stages 2, or --schedule 1f1b"]),
    ("a text split selecting nothing", ["--model", "gpt-nano", "--dataset", "text", "--train-split", "train[:0]"],
     ["split 'train[:0]' selects no windows", "windows of --seq-len tokens)", "choose a non-empty slice"]),
    ("a GPT's targets shorter than its tokens", ["--model", "gpt-nano", "--data-path", "{tokens_short_y_npz}"],
     ["does not fit the data", "pass data whose shapes fit it (npz: x and y token arrays of the same [N, T]"]),
    ("negative targets other than ignore_index", ["--model", "gpt-nano", "--data-path", "{targets_neg_npz}"],
     ["y holds target -1", "-100 (torch's ignore_index; nanoGPT's -1 is not)"]),
    # a user's model with an nnx.Embed trained on the negative id (the table's 62nd row), a QA finding
    ("negative token ids, a user's embedding", ["--model", "examples.lm:TinyLM", "--model-kwargs", '{{"vocab": 64}}',
                                                "--loss", "cross_entropy", "--data-path", "{tokens_neg_npz}"],
     ["x holds token -1", "token ids must be >= 0 (the model's nnx.Embed would read a negative one"]),
    ("negative seed", ["--seed", "-1"], ["--seed -1 must be in [0, 2**63)", "--seed 0"]),
    ("seed past int64", ["--seed", str(2 ** 63)], [f"--seed {2 ** 63} must be in [0, 2**63)"]),  # JAX's key failed
    ("no stages", ["--strategy", "pipeline", "--model", "mlp", "--num-stages", "0"],
     ["--num-stages 0 must be >= 1", "pass a positive count"]),
    ("stages more than layers", ["--strategy", "pipeline", "--model", "mlp", "--num-stages", "4",
                                 "--num-devices", "8"], ["4", "3 layers", "at most 3 stages"]),
    ("devices not divisible by stages", ["--strategy", "pipeline", "--model", "mlp", "--num-stages", "3",
                                         "--num-devices", "8"],
     ["num_devices=8", "num_stages=3", "use devices=6 (--num-devices, of the 8)"]),
    ("ZeRO stage without ZeRO", ["--strategy", "ddp", "--zero-stage", "1"],
     ["--zero-stage 1", "zero", "pipeline", "not ddp", "drop --zero-stage"]),
    ("ZeRO reduction without ZeRO", ["--strategy", "ddp", "--zero-reduce", "all_reduce"],
     ["--zero-reduce all_reduce", "zero, tp or pipeline", "not ddp"]),
    ("ZeRO fetch without stage 3", ["--strategy", "zero", "--zero-stage", "2", "--zero-fetch", "model"],
     ["--zero-fetch model", "ZeRO stage 3", "with --zero-stage 2", "add --strategy zero --zero-stage 3"]),
    ("ZeRO fetch at the default stage", ["--strategy", "zero", "--zero-fetch", "model"],
     ["--zero-fetch model", "--strategy zero with its default stage", "--zero-stage 3"]),
    ("unknown ZeRO fetch", ["--strategy", "zero", "--zero-stage", "3", "--zero-fetch", "layers"],
     ["fetch='layers' (--zero-fetch) is not known", "'layer'", "'model'"]),
    ("pipeline ZeRO-1, unknown reduction", ["--strategy", "pipeline", "--model", "mlp", "--num-devices", "4",
                                            "--zero-stage", "1", "--zero-reduce", "tree"],
     ["zero_reduce='tree'", "is not known", "reduce_scatter", "all_reduce"]),
    ("pipeline ZeRO reduction without ZeRO-1", ["--strategy", "pipeline", "--model", "mlp", "--num-devices", "4",
                                                "--zero-reduce", "all_reduce"],
     ["--zero-reduce all_reduce", "--strategy pipeline runs without ZeRO", "add --zero-stage 1"]),
    ("tp ZeRO reduction without ZeRO-1", ["--strategy", "tp", "--model", "gpt-micro", "--tensor-parallel", "2",
                                          "--zero-reduce", "all_reduce"],
     ["--zero-reduce all_reduce", "--strategy tp runs without ZeRO", "drop --zero-reduce"]),
    ("pmap under ZeRO", ["--strategy", "zero", "--spmd", "pmap"],  # sent to zero by the dp refusal, then refused
     ["--spmd pmap", "--strategy ddp", "not zero"]),                   # late by zero's builder
    ("compressed gradients under ZeRO", ["--strategy", "zero", "--grad-comm-dtype", "bf16"],
     ["--grad-comm-dtype bf16", "--strategy ddp", "not zero"]),
    ("pipeline with ZeRO-2", ["--strategy", "pipeline", "--model", "mlp", "--zero-stage", "2"],
     ["--zero-stage 2 under --strategy pipeline", "stage 0 or 1", "--strategy zero"]),
    ("tp with ZeRO-2", ["--strategy", "tp", "--model", "gpt-nano", "--dataset", "text", "--n-head", "4",
                        "--tensor-parallel", "2", "--zero-stage", "2"],
     ["--zero-stage 2 under --strategy tp", "stage 0 or 1", "--strategy zero"]),
    ("tp group above the devices", ["--strategy", "tp", "--model", "gpt-nano", "--dataset", "text",
                                    "--tensor-parallel", "16", "--num-devices", "8"],  # before the heads (3)
     ["--tensor-parallel 16 must divide the 8 devices", "use a divisor of 8"]),
    ("negative tp group", ["--strategy", "tp", "--model", "gpt-nano", "--dataset", "text", "--tensor-parallel", "-2"],
     ["--tensor-parallel -2 is not a group size", "pass --tensor-parallel T >= 2"]),
    ("unknown schedule", ["--strategy", "pipeline", "--model", "mlp", "--schedule", "zigzag"],
     ["'zigzag'", "use one of", "1f1b"]),
    ("zero micro-batches", ["--strategy", "pipeline", "--model", "mlp", "--micro-batches", "0"],
     ["micro", "0", ">= 1"]),
    ("more devices than present", ["--strategy", "ddp", "--num-devices", "9"], ["9", "8 devices", "pass fewer"]),
    ("unknown all-reduce", ["--strategy", "ddp", "--allreduce", "tree"], ["'tree'", "use one of", "ring"]),
    ("zero grad-accum", ["--strategy", "ddp", "--grad-accum", "0"], ["grad_accum=0", ">= 1", "use 1"]),
    ("npz without --data-path", ["--data-path", ""], ["--data-path", "npz", "x and y"]),
    ("npz file missing", ["--data-path", "{root}/nope.npz"], ["nope.npz", "could not be read", "np.savez"]),
    ("npz without labels", ["--data-path", "{no_y_npz}"], ["no_y.npz", "'y'", "together"]),
    ("mnist folder missing", MNIST + ["--data-dir", "{root}/no_such_folder"], ["no_such_folder", "not a folder",
                                                                                "--data-dir"]),
    ("mnist labels file missing", MNIST + ["--data-dir", "{mnist_no_labels}"], ["t10k-labels-idx1-ubyte",
                                                                                 "add those files"]),
    ("mnist IDX truncated", MNIST + ["--data-dir", "{mnist_truncated}"], ["t10k-images-idx3-ubyte", "truncated",
                                                                           "re-download"]),
    ("mnist IDX corrupt", MNIST + ["--data-dir", "{mnist_corrupt}"], ["t10k-images-idx3-ubyte", "magic number",
                                                                       "not an IDX file"]),
    ("tfds data absent offline", ["--dataset", "cifar10", "--model", "linear", "--data-dir", "{empty}"],
     ["cifar10", "not prepared", "tfds build cifar10"]),
    ("checkpoint dir under a file", ["--checkpoint-dir", "{a_file}/ckpt"], ["a_file", "must be a directory",
                                                                            "pass a directory"]),
    ("checkpoint dir not writable", ["--checkpoint-dir", "/proc/jaxpar_ckpt"], ["/proc/jaxpar_ckpt", "not writable",
                                                                                "pass a directory"]),
    ("checkpoint dir of another model", ["--model", "mlp", "--checkpoint-dir", "{ckpt}", "--resume"],
     ["'linear'", "not --model 'mlp'", "pass --model linear or another --checkpoint-dir"]),
    ("checkpoint dir in use without --resume", ["--checkpoint-dir", "{ckpt}"], ["up to step 1", "pass --resume"]),
    ("--resume with nothing to resume", ["--checkpoint-dir", "{empty}", "--resume"], ["empty", "no complete checkpoint",
                                                                                       "drop --resume"]),
    ("--resume without --checkpoint-dir", ["--resume", "--checkpoint-dir", UNSET], ["--resume needs --checkpoint-dir"]),
    ("negative --checkpoint-every", ["--checkpoint-every", "-1"], ["--checkpoint-every -1", ">= 0"]),
    ("--init-torch missing", ["--init-torch", "{root}/w.npz"], ["w.npz", "does not exist", "pass a .npz"]),
    ("--init-torch not a state dict", ["--init-torch", "{a_file}"], ["a_file", "names no state-dict format",
                                                                     ".safetensors"]),
    # a QA pass: a 5-class state dict on 10-class data ran, and its first step's NaN was blamed on --lr
    ("--init-torch with fewer outputs than classes", ["--init-torch", "{one_class_npz}"],
     ["one_class.npz", "holds a linear with 1 outputs, but the data has 2 classes",
      "pass the state dict of a model with 2 outputs or more"]),
    # a state dict of another input width: the data fits the flags, the weights do not (dot_general's TypeError)
    ("--init-torch of another input width", ["--init-torch", "{seven_wide_npz}"],
     ["does not fit the data", "got (5,) and (7,)",
      "pass an --init-torch state dict of a linear built for rows shaped (5,) (the data's)"]),
    ("--init-torch corrupt", ["--init-torch", "{root}/bad.safetensors"], ["bad.safetensors", "could not be read as "
                                                                          ".safetensors", "pass a file safetensors"]),
    ("--export-torch without a suffix", ["--export-torch", "{root}/weights"], ["weights'", "suffix '(none)'",
                                                                              "pass a .npz"]),
    ("--export-torch as a folder, not a GPT", ["--export-torch", "{root}/hf/"], ["is a folder", "only a GPT",
                                                                                  "pass a file path"]),
    ("--export-torch into a missing folder", ["--export-torch", "{root}/no/w.npz"], ["does not exist", "create it"]),
    ("--metrics-out is a folder", ["--metrics-out", "{empty}"], ["empty", "is a directory", "pass a file path"]),
    ("user model module missing", ["--model", "no_such_module:make"], ["'no_such_module'", "could not be imported",
                                                                        "FILE.py:NAME"]),
    ("user model file missing", ["--model", "{root}/nope.py:make"], ["nope.py", "no file", "pass an existing"]),
    ("user model name missing", ["--model", f"{EXAMPLE}:nope"], ["has no 'nope'", "make_model"]),
    ("user model kwargs not JSON", ["--model", f"{EXAMPLE}:make_model", "--model-kwargs", "{{bad"],
     ["--model-kwargs", "not JSON", "pass an object"]),
    ("user model kwargs wrong", ["--model", f"{EXAMPLE}:make_model", "--model-kwargs", '{{"depth": 3}}'],
     ["could not be built", "depth", "pass the arguments"]),
    ("model kwargs for a built-in", ["--model-kwargs", '{{"a": 1}}'], ["--model-kwargs", "built-in", "drop --model-kwargs"]),
    ("user model does not fit the data", ["--model", f"{EXAMPLE}:make_model", "--loss", "mse"],
     ["does not fit the data", "(5,)"]),
    ("unknown loss", ["--loss", "hinge"], ["'hinge'", "use one of", "mse"]),
    ("unknown CPU collectives, alone too", ["--cpu-collectives", "bogus"], ["'bogus'", "use one of", "gloo, mpi"]),
    ("CPU collectives in one process", ["--cpu-collectives", "mpi"], ["--cpu-collectives mpi would be ignored",
                                                                     "this is one process", "drop --cpu-collectives"]),
    ("unknown per-sample", ["--per-sample", "maybe"], ["'maybe'", "use on, off"]),
    ("negative momentum", ["--momentum", "-0.5"], ["--momentum -0.5", ">= 0", "torch's default"]),
    ("negative grad clip", ["--grad-clip", "-1"], ["--grad-clip -1.0", ">= 0", "0 for no clipping"]),
    ("unknown lr schedule", ["--lr-schedule", "linear"], ["'linear'", "use one of", "cosine"]),
    ("negative activation checkpoint interval", ["--activation-checkpoint-interval", "-1"],
     ["--activation-checkpoint-interval -1", ">= 0", "pass 0 (keep every activation)"]),
    ("activation checkpointing under ZeRO-3", ["--strategy", "zero", "--zero-stage", "3",
                                               "--activation-checkpoint-interval", "1"],
     ["--activation-checkpoint-interval 1", "--zero-stage 3", "use --zero-stage 1 or 2"]),
    ("warmup without the cosine schedule", ["--warmup-steps", "5"], ["--warmup-steps 5", "--lr-schedule is step",
                                                                     "add --lr-schedule cosine"]),
    ("negative warmup", ["--lr-schedule", "cosine", "--warmup-steps", "-1"], ["--warmup-steps -1 must be >= 0",
                                                                              "pass 0 for no warmup"]),
    ("unknown pipeline schedule", ["--strategy", "pipeline", "--model", "mlp", "--num-stages", "2", "--num-devices",
                                   "2", "--schedule", "nosuch"], ["schedule 'nosuch' is not known (--schedule)",
                                                                  "use one of", "1f1b"]),
    ("zero sample top-k", ["--model", "gpt-nano", "--dataset", "text", "--sample", "8", "--sample-top-k", "0"],
     ["--sample-top-k 0 must be >= 1", "pass e.g. 200"]),
    ("negative sample temperature", ["--model", "gpt-nano", "--dataset", "text", "--sample", "8",
                                     "--sample-temperature", "-1"], ["--sample-temperature -1.0 must be a finite number"]),
    ("warmup as long as the decay", ["--lr-schedule", "cosine", "--warmup-steps", "4", "--lr-decay-steps", "4"],
     ["--warmup-steps 4", "below --lr-decay-steps 4"]),
    ("warmup as long as the run", ["--lr-schedule", "cosine", "--warmup-steps", "3", "--steps", "3"],
     ["--warmup-steps 3", "the run has 3 steps", "fewer --warmup-steps"]),
    ("min lr above lr", ["--lr-schedule", "cosine", "--lr", "0.01", "--min-lr", "0.1"],
     ["--min-lr 0.1", "[0, --lr 0.01]", "--min-lr 0.001"]),
    ("3-D devices not D x S x T", ["--strategy", "pipeline", "--num-stages", "2", "--tensor-parallel", "2",
                                   "--num-devices", "6"], ["--num-devices 6", "multiple of", "2 x 2", "--num-devices 4"]),
    ("3-D heads not split by T", ["--strategy", "pipeline", "--model", "gpt-nano", "--tensor-parallel", "2",
                                  "--num-devices", "4"], ["3 heads", "--tensor-parallel 2", "use a --tensor-parallel"]),
    ("sequence parallel outside tp and pipeline", ["--strategy", "ddp", "--sequence-parallel"],
     ["--sequence-parallel", "--strategy ddp", "--tensor-parallel 1", "drop --sequence-parallel"]),
    ("label smoothing out of range", ["--label-smoothing", "1.5"], ["--label-smoothing 1.5", "[0, 1]", "0.1"]),
    ("label smoothing on mse", ["--loss", "mse", "--label-smoothing", "0.1"],
     ["--label-smoothing 0.1", "--loss is mse", "drop --label-smoothing"]),
    ("eval split the npz lacks", ["--eval-split", "test"], ["--eval-split 'test'", "'train'",
                                                           "pass --eval-split '' (that skips evaluation)"]),
    # more flags nothing read: accepted, then ignored
    ("checkpoint keep without a checkpoint dir", ["--checkpoint-keep", "5", "--checkpoint-dir", UNSET],
     ["--checkpoint-keep 5 would be ignored", "no --checkpoint-dir", "drop --checkpoint-keep"]),
    ("eval batch size without evaluation", ["--eval-batch-size", "10"],
     ["--eval-batch-size 10 would be ignored", "--eval-split '' skips evaluation"]),
    ("sample top-k without --sample", ["--sample-top-k", "10"], ["--sample-top-k 10 would be ignored",
                                                                  "without --sample N", "drop --sample-top-k"]),
    ("sample temperature without --sample", ["--sample-temperature", "0.5"],
     ["--sample-temperature 0.5 would be ignored", "drop --sample-temperature"]),
    ("sample prompt without --sample", ["--sample-prompt", "a\nb"], ["--sample-prompt 'a\\nb' would be ignored"]),
    ("peak TFLOP/s on a non-GPT", ["--peak-tflops", "100"], ["--peak-tflops 100.0 would be ignored",
                                                             "--model linear is not one of jaxpar's GPTs"]),
    ("image size on synthetic vectors", ["--dataset", "synthetic", "--image-size", "14"],
     ["--image-size 14 would be ignored", "--dataset synthetic holds vectors", "drop --image-size"]),
    ("image size on npz vectors", ["--image-size", "14"], ["--image-size 14 would be ignored", "--dataset npz"]),
    ("bucket cap under ZeRO-3", ["--strategy", "zero", "--zero-stage", "3", "--bucket-cap-mb", "1"],
     ["--bucket-cap-mb 1.0 would be ignored", "--zero-stage 3", "drop --bucket-cap-mb"]),
    # a loss that sees whole shards takes no padding rows: a batch the devices do not divide, --drop-last or not
    ("whole-shard loss, batch not a multiple of the devices", ["--strategy", "ddp", "--model", "mlp", "--per-sample",
                                                               "off", "--num-devices", "4", "--batch-size", "30",
                                                               "--drop-last"],
     ["--batch-size 30", "the 4 devices", "--drop-last cannot help", "pass --batch-size 28 or 32"]),
    ("whole-shard loss, batch not a multiple of devices x accumulation",
     ["--strategy", "ddp", "--model", "mlp", "--per-sample", "off", "--num-devices", "4", "--grad-accum", "2",
      "--batch-size", "12", "--drop-last"], ["--batch-size 12", "4 devices x --grad-accum 2 = 8", "8 or 16"]),
]


def outputs(files: dict, case: str) -> dict[str, str]:
    """Where this case's run would write: none of these may exist afterwards."""
    folder = os.path.join(files["root"], "out", re.sub(r"\W+", "_", case))
    os.makedirs(folder, exist_ok=True)
    return {"--metrics-out": f"{folder}/metrics.jsonl", "--export-torch": f"{folder}/weights.npz",
            "--checkpoint-dir": f"{folder}/ckpt"}


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    return exit_info.value.code, capsys.readouterr().err


def check_answer(code: int, err: str, patterns: list[str]) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"not one line:\n{err}"
    assert lines[0].startswith("train.py: error: "), lines[0]
    for p in patterns:
        assert p in lines[0], f"{p!r} missing from: {lines[0]}"
    assert re.search(r"\b(use|pass|drop|set|add|create|re-download|choose|leave|fix|lower|write)\b", lines[0]), \
        f"no fix in: {lines[0]}"


def test_flags_are_never_abbreviated(capsys):
    """argparse's allow_abbrev is off: `--loss-on` is not taken for --loss-on-device, nor `--los` for --loss."""
    for flag in (["--loss-on"], ["--los", "mse"]):
        with pytest.raises(SystemExit) as e:
            train.main(["--steps", "1", *flag])
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_malformed_invocation_is_one_line_naming_the_closest_flag(capsys):
    """argparse printed its whole usage block (47 lines; once per rank under the launcher) before its error; now the
    error alone, with the closest flag to an unknown one and --help, exit status 2 -- train.py's and the launcher's."""
    from jaxpar.launch import parser as launch_parser

    cases = [(["--modle", "mlp"], "unrecognized arguments: --modle mlp; did you mean --model?"),
             (["--los=mse"], "unrecognized arguments: --los=mse; did you mean --loss?"),
             (["--epochs", "x"], "argument --epochs: invalid int value: 'x'; train.py --help lists every flag."),
             (["--zzz"], "unrecognized arguments: --zzz; train.py --help lists every flag.")]
    for argv, want in cases:
        code, err = run_main(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("train.py: error: ") and want in err, err
    with pytest.raises(SystemExit) as e:
        launch_parser().parse_args(["--nproc-per-nde", "2", "train.py"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "unrecognized arguments: --nproc-per-nde; did you mean --nproc-per-node?" in err, err


def test_help_gives_every_flag_a_meaning_and_a_visible_default():
    """--help is the flags' reference: each has its config.py comment, and a whitespace default (the sample
    prompt's newline) shows quoted instead of as an empty '(default: )'."""
    from jaxpar import cli

    actions = [a for a in cli.parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 60
    for a in actions:
        assert a.help and not a.help.startswith(" ("), f"{a.option_strings[0]} has no meaning in --help"
    text = cli.parser().format_help()
    assert "(default: '\\n')" in text and "(default: )" not in text
    assert ".safetensors" in text  # --init-torch / --export-torch name every file kind, not only .npz


def test_at_least_twenty_cases():
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case,argv,patterns", CASES, ids=[c[0] for c in CASES])
def test_wrong_invocation(case, argv, patterns, files, capsys):
    out = outputs(files, case)
    flags = {k: v for k, v in out.items() if k not in argv}  # the case's own paths win
    base = BASE if "--dataset" not in argv else [a for a in BASE if a not in ("--data-path", "{ok_npz}")]
    argv = [a for i, a in enumerate(argv) if a != UNSET and argv[i + 1:i + 2] != [UNSET]]
    full = [a.format(**files) for a in base + [a for kv in flags.items() for a in kv] + argv]
    ckpt_before = sorted(os.listdir(files["ckpt"]))
    code, err = run_main(full, capsys)
    check_answer(code, err, [p.format(**files) for p in patterns])
    assert not any(os.path.exists(p) for p in out.values()), [p for p in out.values() if os.path.exists(p)]
    assert sorted(os.listdir(files["ckpt"])) == ckpt_before  # the existing checkpoint is untouched
    assert os.listdir(files["empty"]) == []


def test_cpu_devices_with_accelerators_present(monkeypatch, files, capsys):
    """--cpu-devices simulates CPU devices; where a GPU backend is up it is refused (simulated backend)."""
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    out = outputs(files, "cpu devices")
    argv = [a.format(**files) for a in BASE] + ["--cpu-devices", "8"] + [a for kv in out.items() for a in kv]
    code, err = run_main(argv, capsys)
    check_answer(code, err, ["--cpu-devices 8", "gpu accelerators", "drop --cpu-devices"])
    assert not any(os.path.exists(p) for p in out.values())
    with pytest.raises(ValueError, match="gpu accelerators"):  # the function itself, with a fake backend
        devices.setup(Config(cpu_devices=8))


def test_writable_checks_write_nothing(tmp_path):
    checkpoint.writable_dir(str(tmp_path / "a" / "b"), "--checkpoint-dir")
    checkpoint.writable_file(str(tmp_path / "m.jsonl"), "--metrics-out")
    assert os.listdir(tmp_path) == []


def test_export_torch_of_a_model_without_torch_names_is_refused_before_training(tmp_path):
    """--export-torch of a user model with neither torch_state_dict() nor torch_modules() failed only after the
    whole run; prepare_outputs, which runs before the first step, now refuses it, and accepts the bundled MLP."""
    import jaxpar
    from flax import nnx

    from jaxpar.run import trainer

    cfg = Config(export_torch=str(tmp_path / "w.npz"))
    plain = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    state = jaxpar.init_state(plain, jaxpar.make_optimizer("sgd", 0.1))
    with pytest.raises(ValueError, match=r"--export-torch: Sequential has neither torch_state_dict\(\) nor "
                                         r"torch_modules\(\).* or drop --export-torch"):
        trainer.prepare_outputs(cfg, state, plain)
    mlp = jaxpar.get_model("mlp")
    assert trainer.prepare_outputs(cfg, jaxpar.init_state(mlp, jaxpar.make_optimizer("sgd", 0.1)), mlp) is None
    assert not os.listdir(tmp_path)  # nothing written


def test_a_batch_the_processes_do_not_divide_is_refused_before_joining(monkeypatch, files, capsys):
    """Under a launcher (torch's variables here) --batch-size 7 over 2 processes is refused by validate(): it was
    refused in run(), after every rank had joined the group."""
    from jaxpar.run import distributed

    def join(*a, **k):
        raise AssertionError("joined the group before refusing the batch size")

    monkeypatch.setattr(distributed, "initialize", join)
    for name, value in dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(name, value)
    out = outputs(files, "batch over processes")
    argv = [a.format(**files) for a in BASE] + ["--strategy", "ddp", "--batch-size", "7"]
    code, err = run_main(argv + [a for kv in out.items() for a in kv], capsys)
    check_answer(code, err, ["--batch-size 7 must be divisible by the 2 processes", "use a multiple of 2"])
    assert not any(os.path.exists(p) for p in out.values())
    for strategy in ("single", "dp"):  # one-process strategies: they were refused only after joining (QA 49)
        code, err = run_main([a.format(**files) for a in BASE] + ["--strategy", strategy], capsys)
        check_answer(code, err, [f"--strategy {strategy} runs in one process, but the launcher started 2",
                                 "use --strategy ddp"])


def test_a_stage_or_tensor_group_across_processes_is_refused_before_joining(monkeypatch, capsys):
    """Under a launcher with --cpu-devices known, a tensor group or pipeline stage that would lie on two processes'
    devices is refused by validate(), not after every rank joined (QA 50), and the --num-stages it advises passes."""
    from jaxpar.run import distributed, trainer

    def join(*a, **k):
        raise AssertionError("joined the group before refusing the layout")

    monkeypatch.setattr(distributed, "initialize", join)
    for name, value in dict(WORLD_SIZE="4", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(name, value)
    gpt = ["--model", "gpt-micro", "--dataset", "text", "--seq-len", "16", "--batch-size", "12", "--steps", "1",
           "--quiet", "--eval-split", "", "--cpu-devices"]
    cases = [(["1", "--strategy", "tp", "--tensor-parallel", "2"],
              ["tensor_parallel=2 (--tensor-parallel) puts a tensor group on devices of processes [0, 1]",
               "--cpu-devices 2"]),
             (["1", "--strategy", "pipeline", "--num-stages", "2", "--tensor-parallel", "2"],
              ["stage's 1 x 2 (D x T) devices on processes [0, 1]", "--cpu-devices 2"]),
             (["1", "--strategy", "pipeline", "--num-stages", "2"],
              ["--num-stages 2 over 4 processes of 1 device(s) puts a stage's 2 devices on processes [0, 1]",
               "use num_stages (--num-stages) 4,"]),
             (["2", "--strategy", "pipeline", "--num-stages", "2"],
              ["stage's 4 devices on processes [0, 1]", "use num_stages (--num-stages) 4 or 8,"]),
             (["4", "--strategy", "pipeline", "--num-stages", "2", "--tensor-parallel", "2"],
              ["stage's 4 x 2 (D x T) devices on processes [0, 1]", "use num_stages (--num-stages) 4 or 8,"])]
    for argv, patterns in cases:
        code, err = run_main(gpt + argv, capsys)
        check_answer(code, err, patterns)
    for stages in (4, 8):  # the advice holds: those layouts pass, on 4 processes of 2 devices
        trainer.check_process_layout(Config(strategy="pipeline", num_stages=stages), 4, 2)
    trainer.check_process_layout(Config(strategy="pipeline", num_stages=4, tensor_parallel=2), 4, 4)
    trainer.check_process_layout(Config(strategy="tp", tensor_parallel=2), 4, 2)


def test_the_layout_check_follows_the_meshes_device_order():
    """check_process_layout's rule (a tensor group: T consecutive devices; a stage: n / S consecutive) agrees with the
    meshes the strategies build, on the 8 devices here as if processes held `per` devices each (process = id // per)."""
    import jax
    import numpy as np

    from jaxpar.mesh import straddler
    from jaxpar.strategies.pipeline import pipeline_mesh

    devices = jax.devices()[:8]
    index = {d: i for i, d in enumerate(devices)}
    spans = lambda groups, per: any(len({index[d] // per for d in g}) > 1 for g in groups)  # noqa: E731
    seen = set()
    for per in (1, 2, 4, 8):
        for S in (1, 2, 4, 8):
            for T in (1, 2, 4):
                if 8 % (S * T):
                    continue
                mesh = pipeline_mesh(devices, S, T)
                stages = [mesh.devices[:, s].ravel() for s in range(S)]
                seen.add(spans(stages, per))
                assert spans(stages, per) == (straddler(8, 8 // S, per) is not None), (per, S, T)
            if S == 1:  # tp: TensorParallel's build reshapes the devices to (D, T)
                for T in (2, 4, 8):
                    rows = np.array(devices).reshape(8 // T, T)
                    assert spans(rows, per) == (straddler(8, T, per) is not None), (per, T)
    assert seen == {True, False}  # both answers occur


def test_flags_read_only_by_what_this_run_does_not_do_are_refused(files, tmp_path, capsys):
    """A QA pass: --log-every under --quiet with no --metrics-out, --eval-batch-size where the default evaluation
    split turns out empty (the npz holds no x_test), and --peak-tflops for a user's model (MFU is a GPT's) were
    accepted and did nothing."""
    lm = ["--model", "examples.lm:TinyLM", "--model-kwargs", '{"vocab": 50}', "--dataset", "npz", "--data-path",
          files["eval_neg_npz"], "--eval-split", "", "--batch-size", "4", "--steps", "1", "--quiet"]
    for argv, patterns in (
            ([a.format(**files) for a in BASE] + ["--log-every", "1"],
             ["--log-every 1 would be ignored", "--quiet", "drop --log-every"]),
            (["--model", "linear", "--dataset", "npz", "--data-path", files["ok_npz"], "--steps", "1", "--quiet",
              "--eval-batch-size", "7"], ["--eval-batch-size 7 would be ignored", "no test split", "drop"]),
            (lm + ["--peak-tflops", "100"], ["--peak-tflops 100.0 would be ignored", "TinyLM", "drop --peak-tflops"])):
        check_answer(*run_main(argv, capsys), patterns)
    train.main(lm + ["--metrics-out", str(tmp_path / "m.jsonl"), "--log-every", "1"])  # a file to write: read
    assert os.path.getsize(tmp_path / "m.jsonl") > 0


def test_profile_partitioning_reads_a_users_model_input_off_the_data(files, monkeypatch):
    """--partition-method profile costs each layer on one sample; for a user's model it built that sample from the
    built-in models' shapes ("unknown model name='examples.lm:TinyLM'", a QA pass) or from an nnx.Conv's
    in_features (its channels). The sample is now the data's own."""
    from jaxpar.strategies import pipeline

    seen = []
    real = pipeline.Pipeline

    def spy(*args, **kw):
        seen.append(kw.get("example_input"))
        return real(*args, **kw)

    monkeypatch.setattr(pipeline, "Pipeline", spy)
    train.main(["--model", "examples.lm:TinyLM", "--model-kwargs", '{"vocab": 50}', "--dataset", "npz", "--data-path",
                files["eval_neg_npz"], "--eval-split", "", "--batch-size", "4", "--steps", "1", "--quiet",
                "--strategy", "pipeline", "--num-stages", "2", "--num-devices", "2", "--partition-method", "profile"])
    assert [(s.shape, s.dtype) for s in seen] == [((1, 16), np.dtype("int32"))]
