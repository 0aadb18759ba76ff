"""Shared test fixtures. Chapters are loaded with tools/chapter_loader.py, the
loader that tools/ uses too: a chapter's definitions and its UPPER_CASE
literal constants (the numbers its source printed) are the tests' only source
of chapter code and source numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from chapter_loader import BOOK, ROOT, load_chapter

__all__ = ["BOOK", "ROOT", "load_chapter", "require_system_tool"]

# The attention table printed by Cristina's post (chapters 1 and 2 reproduce it)
SOURCE_003_ATTENTION = [
    [0.98522025, 1.74174051, 0.75652026],
    [0.90965265, 1.40965265, 0.5],
    [0.99851226, 1.75849334, 0.75998108],
    [0.99560386, 1.90407309, 0.90846923],
]


def source_004_qkv():
    """Q, K, V of the torch post (chapters 3 and 4), in its statement order:
    seed 89, then x, then the query, key and value layers."""
    import torch
    from torch import nn

    torch.manual_seed(89)
    x = torch.randn((1, 3, 5))
    layers = [nn.Linear(5, 16, bias=False) for _ in range(3)]
    with torch.no_grad():
        return tuple(layer(x) for layer in layers)


def require_system_tool(found, what, install):
    """Skip a test that needs a system program, or fail under CI.

    On a reader's machine a missing R or Chromium skips the test with a reason
    that says what to install. Under CI (`CI=true`) it is a failure, so CI
    can never pass by skipping what it is meant to check.
    """
    if found:
        return
    message = f"{what} is not installed: install it with `{install}`"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def ch01():
    return load_chapter("01_general_attention.ipynb")


def build_site(tmp_dir):
    """Build the site with warnings as errors, from the stored outputs."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    config["execute"]["execute_notebooks"] = "off"
    # the configuration file moves: make its relative paths absolute
    extensions = config["sphinx"]["local_extensions"]
    for name, folder in extensions.items():
        extensions[name] = str(ROOT / folder)
    path = Path(tmp_dir) / "_config.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    jb = Path(sys.executable).parent / "jupyter-book"
    return subprocess.run(
        [str(jb), "build", str(ROOT), "--config", str(path)]
        + ["-W", "-n", "--keep-going"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )


@pytest.fixture(scope="session")
def built_site(tmp_path_factory, worker_id):
    """Build the site once per test run, with warnings as errors.

    The pages are built from the notebooks' stored outputs (execution off):
    nbval, in the same `make test`, re-executes every notebook and proves
    that a fresh run prints exactly those outputs, so executing them a second
    time here would only double the time. `make book` builds the same pages
    by executing the notebooks.

    Under pytest-xdist several workers may ask for the site: the first one
    builds it (under a file lock) and leaves the result for the others.
    """
    if worker_id == "master":  # not running under xdist
        return build_site(tmp_path_factory.mktemp("config"))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent
    result_file = shared / "built_site.json"
    with FileLock(str(shared / "built_site.lock")):
        if result_file.is_file():
            data = json.loads(result_file.read_text(encoding="utf-8"))
            return subprocess.CompletedProcess(**data)
        result = build_site(tmp_path_factory.mktemp("config"))
        result_file.write_text(
            json.dumps(
                {
                    "args": result.args,
                    "returncode": result.returncode,
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                }
            ),
            encoding="utf-8",
        )
        return result
