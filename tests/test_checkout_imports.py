"""A source checkout's top-level folders must not shadow other packages' import names.

`python -m asyncengine` run in the repository (the README's quick start) puts the checkout's root first on sys.path,
where the folder kernels/ (installed as asyncengine.kernels) would be found as the top-level package `kernels`: the
name of Hugging Face's package, which transformers 5.25+ depends on and imports at start-up (it then failed with
"cannot import name 'CUDAProperties' from 'kernels'", session 28). kernels/__init__.py hands the name over.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_checkout(code: str, *path: Path) -> subprocess.CompletedProcess:
    """`python -c code` in the checkout's root (so that '' - the root - leads sys.path, as under `python -m`), with
    `path` put right after it, where site-packages would be."""
    prelude = "import sys; sys.path[1:1] = %r\n" % [str(p) for p in path]
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_a_checkout_hands_the_top_level_name_kernels_to_the_installed_package(tmp_path):
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text("MARKER = 'the other kernels'\nfrom .sub import VALUE\n")
    (hub / "sub.py").write_text("VALUE = 42\n")
    run = run_in_checkout(
        "import kernels\n"
        "print(kernels.MARKER, kernels.VALUE, kernels.__file__)\n"
        "import asyncengine.kernels as ours\n"
        "print(ours.__name__, ours.__file__)\n"
        "import kernels as again\n"
        "print(again is kernels)\n", tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0] == f"the other kernels 42 {hub / '__init__.py'}"
    assert lines[1] == f"asyncengine.kernels {ROOT / 'kernels' / '__init__.py'}" and lines[2] == "True"


def test_without_another_package_the_bare_name_still_imports_this_folder():
    """transformers 5.23 (the test extra's) finds `kernels` on the path with no metadata and imports it to read a
    version: that import must keep working (an error there broke `import transformers` in the first version of
    the fix), and transformers must not take it for Hugging Face's package."""
    run = run_in_checkout(
        "import kernels\n"
        "print(kernels.__file__, getattr(kernels, '__version__', 'N/A'))\n"
        "from transformers import LlamaConfig\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(LlamaConfig.__name__, is_kernels_available())\n")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    installed = lines[0].split()[0] != str(ROOT / "kernels" / "__init__.py")  # a real `kernels` in this environment
    if not installed:
        assert lines[0] == f"{ROOT / 'kernels' / '__init__.py'} N/A"
        assert lines[1] == "LlamaConfig False"
