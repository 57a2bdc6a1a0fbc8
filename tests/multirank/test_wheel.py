"""A non-editable install from the sdist's wheel, in a fresh virtualenv, runs the compiled ops.

The sdist is built from a copy of the checkout, the wheel from the sdist (so both must carry the
C++/CUDA sources), and the wheel is installed into a new virtualenv that sees torch, deepspeed and
pip through a ``.pth`` line (nothing is downloaded; the virtualenv gets no pip of its own). Two
processes there then call ``zen_ds.ops.ensure_built`` at once, with the suite's
``TORCH_EXTENSIONS_DIR``. The build's cache key hashes every source file's bytes and path inside
the source tree (not where the tree lives), so when the checkout's ops are built (tests/run.sh
builds them first) the installed package must load that very build: proof that the wheel ships
byte-for-byte the sources that built and self-checked.
A wheel that lost or changed a source gets another key and builds from the package's own copy (by
at most one of the two processes), and that build must self-check too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "wheel_test"
SOURCES = sorted(str(p.relative_to(REPO / "csrc")) for p in (REPO / "csrc").rglob("*") if p.is_file())

pytestmark = pytest.mark.timeout(1800)


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def wheel_venv():
    """(sdist, wheel, venv python) built afresh from the checkout's tracked and new files."""
    pytest.importorskip("deepspeed")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    shutil.rmtree(WORK, ignore_errors=True)
    source = WORK / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".ci-venv", ".torch_extensions", "build", "dist", "*.egg-info",
        "__pycache__", ".hypothesis", ".pytest_cache", "bench_out", "*.so", "_csrc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DS_BUILD_ZEN")}
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(WORK / "dist")], cwd=source, env=env)
    sdist = next((WORK / "dist").glob("zen_ds-*.tar.gz"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(WORK / "dist"), str(sdist)], cwd=WORK, env=env)
    wheel = next((WORK / "dist").glob("zen_ds-*.whl"))

    venv = WORK / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         env=env)
    python = venv / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                env=env).stdout.strip()
    # torch, deepspeed, pip and friends come from the suite's environment, after the venv's own
    Path(site, "zen_ds_test_parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
          "--no-index", str(wheel)], cwd=WORK, env=env)
    env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR",
                                                 str(REPO / ".torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    env["ZEN_DS_BUILD_TIMEOUT"] = "1700"  # a cold build on a loaded machine can exceed the default
    return sdist, wheel, python, Path(site), env


def test_sdist_and_wheel_carry_the_op_sources(wheel_venv):
    sdist, wheel, *_ = wheel_venv
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/csrc/", 1)[1] for name in tar.getnames() if "/csrc/" in name}
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = {name.split("zen_ds/_csrc/", 1)[1] for name in whl.namelist()
                    if name.startswith("zen_ds/_csrc/")}
        assert not [n for n in whl.namelist() if n.endswith(".so")]  # no prebuilt without DS_BUILD_ZEN
    assert set(SOURCES) <= in_sdist
    assert set(SOURCES) == in_wheel


ENSURE_BUILT = textwrap.dedent("""
    import json, zen_ds
    from zen_ds import ops
    from zen_ds.ops import builder
    info = ops.ensure_built()
    print("RESULT " + json.dumps({"zen_ds": zen_ds.__file__, "csrc": str(builder.CSRC),
                                  "built_here": getattr(ops.backend(), "built_here", False),
                                  **info}))
""")


def test_installed_wheel_builds_and_loads_the_compiled_ops(wheel_venv):
    _, _, python, site, env = wheel_venv
    procs = [subprocess.Popen([str(python), "-c", ENSURE_BUILT], cwd=WORK, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=1700)
        assert proc.returncode == 0, err[-4000:]
        import json

        results.append(json.loads(out.split("RESULT ", 1)[1]))
    for info in results:
        assert Path(info["zen_ds"]).parent == site / "zen_ds"  # the installed copy, not the checkout
        assert Path(info["csrc"]) == site / "zen_ds" / "_csrc" / "zen"
        assert info["implementation"].startswith("cpp-cpu"), info["reason"]
        assert "passed" in info["self_checks"] and "failed" not in info["self_checks"]
    assert results[0]["file"] == results[1]["file"]
    assert sum(info["built_here"] for info in results) <= 1
    checkout = _checkout_build()
    if checkout is not None:  # the same sources: the checkout's build, not a second compile
        assert results[0]["file"] == checkout, (results[0]["file"], checkout)
        assert not any(info["built_here"] for info in results)

    report = _run([str(python), "-m", "zen_ds", "report", "--no-color"], cwd=WORK, env=env).stdout
    assert "(shipped in the package)" in report
    assert "compiled ops ............ [OKAY]" in report


def _checkout_build():
    """The module file of the checkout's compiled ops when they are built, else None."""
    from zen_ds.ops import build_cache, builder

    try:
        ops_builder = builder.get_builder("cpu")
        name = builder.jit_name(ops_builder)
    except Exception:  # no DeepSpeed op builder here: nothing to compare with
        return None
    build_dir = build_cache.build_directory(name)
    return str(build_dir / f"{name}.so") if build_cache.is_built(name, build_dir) else None


WITHOUT_DEEPSPEED = textwrap.dedent("""
    import json, os, sys
    sys.modules["deepspeed"] = None  # as if DeepSpeed were not installed: `import deepspeed` fails
    import torch
    import torch.multiprocessing as mp

    def rank(r, port):
        import torch.distributed as dist
        import zen_ds
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
        x = torch.zeros(10, 3)
        x[[0, 9 - r]] = float(r + 1)
        got = zen_ds.sparse_allreduce(x, scheme="balanced")
        want = x.clone()
        dist.all_reduce(want)
        assert torch.equal(got, want), (got, want)
        dist.destroy_process_group()

    if __name__ == "__main__":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # forked: the ranks inherit the blocked import and this process's torch (no import each)
        mp.start_processes(rank, args=(port,), nprocs=2, start_method="fork")
        import zen_ds
        assert "deepspeed" not in [m.split(".")[0] for m, v in sys.modules.items() if v is not None]
        try:
            zen_ds.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1})
        except ImportError as exc:
            print("RESULT " + json.dumps({"error": str(exc)}))
""")


def test_core_library_runs_without_deepspeed(wheel_venv):
    """``pip install zen_ds`` needs no DeepSpeed: sparse_allreduce works on 2 gloo ranks, and the
    plug-in's entry point says in one message what to install."""
    _, wheel, python, _, env = wheel_venv
    with zipfile.ZipFile(wheel) as whl:
        meta = next(whl.read(n).decode() for n in whl.namelist() if n.endswith("METADATA"))
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: deepspeed")]
    assert requires and all("extra ==" in line for line in requires), requires
    script = WORK / "without_deepspeed.py"
    script.write_text(WITHOUT_DEEPSPEED)
    out = _run([str(python), str(script)], cwd=WORK, env=env).stdout
    import json

    message = json.loads(out.split("RESULT ", 1)[1])["error"]
    assert "pip install 'zen_ds[deepspeed]'" in message and "sparse_allreduce" in message, message
