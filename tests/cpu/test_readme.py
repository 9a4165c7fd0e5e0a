"""The README as a user meets it: every fenced code block says where it runs, and each one marked
to run on CPU runs as written.

Markers (an HTML comment on the line before the block, invisible on the rendered page):
  <!-- readme-test: cpu torchrun=P -->   a python block, saved as a file and run by
                                         `torchrun --standalone --nproc-per-node=P FILE` on CPU ranks
  <!-- readme-test: cpu python -->       a python block run by `python FILE`
  <!-- readme-test: cpu sh -->           a shell block run line by line by `sh -e`
  <!-- readme-test: gpu TEST_FILE -->    a block that needs a GPU, run as written by TEST_FILE
Also: the two set-up commands are the first lines of "Set up and run" and .ci/run runs the second
one as written; every link to a file of the repository resolves; every number of the README's
results table is one of docs/results.md's (measured there, with card and date)."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import repo_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
MARKED = re.compile(r"<!-- readme-test: (\w+) ([^>]*?) -->\n```(\w+)\n(.*?)```", re.S)
SETUP = ('pip install -e ".[bench]" && python -m fa_a2a.bench', 'pip install -e ".[test]" && python -m pytest -q tests')


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _blocks():
    return [(where, how.strip(), lang, code) for where, how, lang, code in MARKED.findall(_readme())]


CPU_BLOCKS = [b for b in _blocks() if b[0] == "cpu"]


def test_every_code_block_says_where_it_runs():
    text = _readme()
    fences = re.findall(r"(?m)^```(\w+)$", text)
    assert len(fences) == len(_blocks()) >= 4, (fences, [b[:3] for b in _blocks()])
    assert len(CPU_BLOCKS) >= 3
    for where, how, lang, _ in _blocks():
        assert where in ("cpu", "gpu") and lang in ("python", "sh"), (where, how, lang)
        if where == "gpu":
            path = os.path.join(ROOT, how)
            assert os.path.isfile(path) and "README" in open(path).read(), f"{how}: no such test of the README"


@pytest.mark.parametrize("where, how, lang, code", CPU_BLOCKS, ids=[f"{i}-{b[1]}" for i, b in enumerate(CPU_BLOCKS)])
def test_cpu_snippet_runs_as_written(where, how, lang, code, tmp_path):
    env = repo_env(CUDA_VISIBLE_DEVICES="", FA_A2A_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    script = tmp_path / ("snippet.py" if lang == "python" else "snippet.sh")
    script.write_text(code)
    if how.startswith("torchrun="):
        # each rank's stdout to a file of its own (--redirects 1): the ranks' lines cannot interleave
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={how.split('=')[1]}",
               "--log-dir", str(tmp_path / "logs"), "--redirects", "1", str(script)]
    elif how == "python":
        cmd = [sys.executable, str(script)]
    else:
        assert how == "sh", how
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # `python` is this one
        cmd = ["sh", "-e", str(script)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    out = p.stdout + "".join(f.read_text() for f in sorted((tmp_path / "logs").rglob("stdout.log")))
    if "ulysses_attention" in code:  # the op: each rank its 1024 rows, all 24 heads
        assert sorted(re.findall(r"^(\d) \(1, 1024, 24, 128\)$", out, re.M)) == ["0", "1"], out
    if "FluxTransformer2DModel" in code:  # the DiT: both ranks the whole output, every attention call sharded
        assert sorted(re.findall(r"^(\d) \(1, 64, 16\) \{'ulysses': 2\}$", out, re.M)) == ["0", "1"], out
    if "fa_a2a.tools.bench" in code:
        assert out.startswith("No CUDA GPU: nothing was measured") and "Burst-Gap model predictions" in out, out


def test_setup_commands_and_ci_run_the_same_line():
    text = _readme()
    section = text.split("## Set up and run (fresh machine)\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"(?m)^    (\S.*)$", section)
    assert tuple(commands[:2]) == SETUP, commands
    assert len(re.findall(r'(?m)^    pip install -e "\.\[test\]"', text)) == 1  # the one line .ci/run reads
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    found = subprocess.run(["sh", "-c", re.search(r"TEST_COMMAND=\$\((.*)\)\n", ci).group(1)], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    assert found == SETUP[1] + "\n"
    assert ci.count('bash -c "$TEST_COMMAND"') == 1


def test_links_resolve():
    text = _readme()
    for doc in ("README.md", "docs/how-it-works.md", "docs/results.md", "docs/tools.md"):
        base = os.path.dirname(os.path.join(ROOT, doc))
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(os.path.join(ROOT, doc)).read()):
            if not target.startswith("http"):
                assert os.path.exists(os.path.join(base, target)), f"{doc}: {target}"
    for path in re.findall(r"`((?:examples|tests|fa_a2a|docs|notes)/[\w/.-]+\.(?:py|md))`", text):
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_results_table_numbers_are_measured_in_docs():
    text = _readme()
    table = text.split("## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| what")]
    measured = set(re.findall(r"\d+(?:\.\d+)?", open(os.path.join(ROOT, "docs", "results.md")).read()))
    assert len(rows) >= 5
    for row in rows:
        for number in re.findall(r"\d+(?:\.\d+)?", row):
            assert number in measured, f"{number} of {row!r} is not in docs/results.md"
