"""The documentation builds without a warning (broken links and anchors fail), and the
README stays a short front page whose links resolve."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_docs_site_builds_strict(tmp_path):
    proc = subprocess.run(
        # Not --quiet: with it mkdocs counts no warnings, and --strict passes a broken anchor.
        [sys.executable, "-m", "mkdocs", "build", "--strict",
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def _relative_links(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for target, _ in LINK.findall(text):
        if not re.match(r"^[a-z]+:", target):
            yield target


def test_front_pages_link_to_files_that_exist():
    for page in ("README.md", "CONTRIBUTING.md"):
        for target in _relative_links(os.path.join(ROOT, page)):
            assert os.path.exists(os.path.join(ROOT, target)), f"{page} links to {target}"


def test_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; details belong in docs/"


def _readme_python_example():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md shows no python example"
    return blocks[0]


def test_readme_example_trains_under_torchrun(tmp_path):
    """The README's training example runs as written on 2 ranks, and DDP left the two
    ranks' parameters equal (a check appended to the example, not part of it)."""
    script = tmp_path / "example.py"
    check = (
        "\nimport torch.distributed as _d\n"
        "_d.init_process_group(backend='gloo')\n"
        "_p = torch.cat([p.detach().flatten() for p in model.module.parameters()])\n"
        "_all = [torch.empty_like(_p) for _ in range(_d.get_world_size())]\n"
        "_d.all_gather(_all, _p)\n"
        "assert all(torch.equal(_all[0], a) for a in _all), 'ranks diverged'\n"
        "open(f'ok{_d.get_rank()}', 'w').close()\n"
        "_d.destroy_process_group()\n")
    script.write_text(_readme_python_example() + check)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists(), proc.stdout
