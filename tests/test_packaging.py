"""What installing jaxpar puts on a machine, and what importing it does: only the `jaxpar` package (no top-level
`models` or `train` to collide with a research repo's own; the repository's models/ ships as jaxpar.models), every
module of the source tree in it, and no process-wide side effects on import."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_install_puts_only_the_jaxpar_package(tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                           "--target", str(target), ROOT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    top = {name for name in os.listdir(target) if not name.endswith((".dist-info", ".egg-info"))}
    assert top - {"bin"} == {"jaxpar"}, top  # bin/: the jaxpar-train entry point
    assert os.path.isfile(target / "jaxpar" / "models" / "gpt.py")  # the models ship inside the package
    installed = {os.path.relpath(os.path.join(d, f), target / "jaxpar") for d, _, fs in os.walk(target / "jaxpar")
                 for f in fs if f.endswith(".py")}
    source = {os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "jaxpar")) for d, _, fs in
              os.walk(os.path.join(ROOT, "jaxpar")) for f in fs if f.endswith(".py")}
    source |= {os.path.join("models", f) for f in os.listdir(os.path.join(ROOT, "models")) if f.endswith(".py")}
    assert installed == source, (source - installed, installed - source)  # pyproject's package list is complete
    assert os.path.isfile(target / "jaxpar" / "cli.py") and not os.path.exists(target / "train.py")


def test_import_leaves_the_allocator_alone():
    """`import jaxpar` (everything in __all__ included) calls no mallopt; train.py / tune_host_allocator() do."""
    code = ("import jaxpar, jaxpar.run.hostmem as h; before = dict(h.applied); jaxpar.tune_host_allocator(); "
            "print(before, bool(h.applied))")
    env = {k: v for k, v in os.environ.items() if k != "JAXPAR_NO_MALLOPT"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{}", "True"], out.stdout  # nothing on import; the explicit call applies it


def test_the_models_are_reached_from_import_jaxpar_alone():
    """A fresh interpreter: `import jaxpar` and nothing else gives every name of __all__, `jaxpar.models` among
    them (the README's `jaxpar.models.GPT`, `jaxpar.models.get`), the bundled models and their names (MODELS) at
    the top level too (the same objects), and no top-level `models` module appears."""
    code = ("import sys, jaxpar; missing = [n for n in jaxpar.__all__ if not hasattr(jaxpar, n)]; "
            "top = [n for n in ('GPT', 'GPTConfig', 'ConvNet', 'AlexNet', 'MLP', 'LinearModel', "
            "'from_torch_state_dict', 'to_torch_state_dict') "
            "if getattr(jaxpar, n, None) is not getattr(jaxpar.models, n) or n not in jaxpar.__all__]; "
            "print(missing, top, jaxpar.models.__name__, jaxpar.models.GPT.__name__, callable(jaxpar.models.get), "
            "jaxpar.get_model is jaxpar.models.get, type(jaxpar.get_model('mlp')).__name__, 'models' in sys.modules, "
            "jaxpar.MODELS is jaxpar.models.NAMES and 'MODELS' in jaxpar.__all__ and 'gpt2' in jaxpar.MODELS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "[]", "jaxpar.models", "GPT", "True", "True", "MLP", "False", "True"], out.stdout
