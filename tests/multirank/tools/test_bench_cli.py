"""The sync benchmark's command line with real ranks: validation before spawning, end-to-end
``zen-bench sync --local 2`` (sparse and dense input), ``calibrate``, and launch/reduction_compare.py
(the generators themselves are tests/unit/tools/test_bench_workloads.py).

One check runs ``python -m zen_ds bench`` as a new process (the console entry and its exit status;
tests/test_readme_commands.py runs ``zen-bench sync --local 2``, ranks and all, as a command);
the others call the command's (or the script's) ``main`` in this process, checking it leaves this
process as it found it. Their ranks are still separate processes joined by gloo, forked from the
session's preloaded fork server (tests/support/dist_utils.py; ``multiprocessing`` keeps one per
process) instead of a fork server or spawned interpreters of their own: no rank pays the imports.
A rank's output reaches this process's stdout (``zen-bench``'s ranks write to the caller's
stdout), a failing rank makes ``main`` raise."""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import dist_utils
import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)  # a hung rank: ``main`` waits on its ranks without a bound


def _process_state() -> tuple:
    """What running a command in this process could leave changed."""
    import zen_ds

    root = logging.getLogger()
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's phase
    return (environ, list(root.handlers), root.level, list(warnings.filters),
            {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                    signal.SIGUSR1)},
            zen_ds.default_options(), os.getcwd())


@pytest.fixture
def bench_main():
    """``zen-bench``'s ``main``, run in this process; its ``--local`` ranks fork from the session's
    fork server (started first, with the suite's preload list, so the command cannot start it
    with its own shorter one). Fails if the command left this process changed."""
    from zen_ds.tools.bench import cli

    dist_utils.start_fork_server()
    before = _process_state()
    yield cli.main
    assert _process_state() == before


def test_bench_cli_validates_before_spawning(monkeypatch, capsys):
    env = dict(os.environ, RANK="", WORLD_SIZE="")
    env.pop("RANK")
    run = lambda *a: subprocess.run([sys.executable, "-m", "zen_ds", "bench", "sync", *a],
                                    capture_output=True, text=True, env=env, timeout=120)
    p = run("-s", "nope")
    assert p.returncode == 2 and "unknown scheme" in p.stderr
    # the second check in this process (an interpreter costs a torch import)
    from zen_ds.tools.bench import cli

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["sync", "-w", "lm"]) == 2 and "--local N" in capsys.readouterr().err


def test_sync_end_to_end_two_local_ranks(tmp_path, bench_main, capfd):
    out = tmp_path / "r.json"
    assert bench_main(["sync", "--local", "2", "--no-progress",
                       "-w", "synthetic:rows=4000,width=8,density=0.05,overlap=0.5",
                       "-w", "dense:mb=0.25", "--iters", "1", "--warmup", "0", "--rate", "1gbit",
                       "--json", str(out)]) == 0
    stdout = capfd.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    import zen_ds

    assert {r["scheme"] for r in rows} == set(zen_ds.SCHEMES)
    assert all(r["correct"] for r in rows), [(r["workload"], r["scheme"], r["max_abs_err"]) for r in rows]
    for r in rows:
        assert r["bytes_sent_max"] > 0 and r["bound_s"] > 0 and r["speedup_vs_dense"] > 0
    assert "vs_dense" in stdout


def test_reduction_compare_checks_every_variant_against_the_dense_allreduce(tmp_path, capfd,
                                                                              monkeypatch):
    if importlib.util.find_spec("deepspeed") is None:  # found, not imported here: only ranks use it
        pytest.skip("deepspeed is not installed")
    out = tmp_path / "compare.json"
    monkeypatch.syspath_prepend(str(REPO / "launch"))  # where its ranks import it from too
    script = importlib.import_module("reduction_compare")
    dist_utils.start_fork_server()
    before = _process_state()
    assert script.main(["--ranks", "2", "--rounds", "1", "--port", "29587",
                        "--json", str(out)]) == 0
    assert _process_state() == before
    stdout = capfd.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["medians"]) == set(result["max_error"]) == {
        "ds-sparse", "zen-sparse-agsparse", "zen-sparse-auto", "zen-dense-agsparse", "zen-dense-auto",
        "ds-dense"}
    assert all(e <= 1.0 for e in result["max_error"].values()), result["max_error"]  # allclose(1e-5)
    assert result["schemes"]["zen-sparse-agsparse"] == result["schemes"]["zen-dense-agsparse"] == "agsparse"
    assert "zen / DeepSpeed, sparse=True, same algorithm (agsparse)" in stdout


def test_sync_dense_input_is_synced_in_place_and_compared_with_dense_allreduce(tmp_path,
                                                                              bench_main):
    """``--dense-input``: sparse workloads go in as dense tensors written in place (out=), every
    call from a fresh copy, so repeated calls stay correct also when the schemes take turns
    (``--interleave``); DeepSpeed's path is then dense."""
    out = tmp_path / "r.json"
    assert bench_main(["sync", "--local", "2", "--no-progress",
                       "-w", "synthetic:rows=3001,width=4,density=0.03,overlap=0.3",
                       "-s", "balanced", "agsparse", "deepspeed", "--dense-input", "--interleave",
                       "--iters", "2", "--warmup", "1", "--json", str(out)]) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["correct"] and r["input"] == "dense" and r["iters"] == 2 for r in rows.values())
    assert rows["deepspeed"]["scheme_run"] == "dense"
    assert rows["balanced"]["bytes_sent_max"] < rows["deepspeed"]["bytes_sent_max"]


def test_sync_dense_input_both_ways_and_both_handshakes(tmp_path, bench_main, capfd):
    """``--dense-input both`` syncs each scheme in place and without ``out=`` (a new result per
    call, still exact after every round), and ``--handshake allgather reduce`` with both
    handshakes, all interleaved, reporting the handshake's measured time."""
    out = tmp_path / "r.json"
    assert bench_main(["sync", "--local", "2", "--no-progress",
                       "-w", "synthetic:rows=3001,width=4,density=0.03,overlap=0.3",
                       "-s", "balanced", "dense", "--dense-input", "both", "--interleave",
                       "--handshake", "allgather", "reduce", "--iters", "2", "--warmup", "1",
                       "--json", str(out)]) == 0
    stdout = capfd.readouterr().out
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {f"{s}@{h}/{m}" for s in ("balanced", "dense")
                         for h in ("allgather", "reduce") for m in ("inplace", "alloc")}
    assert all(r["correct"] and r["handshake_s"] > 0 for r in rows.values())
    assert {r["result"] for r in rows.values()} == {"in place", "new tensor"}
    alloc, in_place = rows["balanced@reduce/alloc"], rows["balanced@reduce/inplace"]
    assert alloc["speedup_vs_dense"] == pytest.approx(
        rows["dense@reduce/alloc"]["time_s"] / alloc["time_s"])
    assert alloc["time_over_in_place"] == pytest.approx(alloc["time_s"] / in_place["time_s"])
    assert "hs_ms" in stdout


def test_calibrate_prints_a_network_block_with_the_sync_latency(bench_main, capfd):
    """``zen-bench calibrate`` on 2 loopback ranks prints a ``network`` block the config accepts;
    its latency per step is the one zen's own syncs show, never below a bare all-gather's."""
    from zen_ds.integrations.config import load_zen_config

    assert bench_main(["calibrate", "--local", "2", "--repeats", "1", "--bytes", "65536"]) == 0
    text = capfd.readouterr().out
    block = json.loads(text[text.index("{"):text.rindex("}") + 1])
    network = load_zen_config({"zen": block["zen"]}).network
    assert network.alpha > 0 and network.bandwidth > 0 and network.ranks_per_node == 1
    assert 1.0 <= network.duplex <= 2.0 and 1.0 <= network.all_to_all_duplex <= 2.0
    line = next(line for line in text.splitlines() if line.startswith("# latency per step"))
    sync_ms, bare_ms = (float(part.split(" ms")[0].split()[-1]) for part in line.split(","))
    assert sync_ms >= bare_ms > 0
