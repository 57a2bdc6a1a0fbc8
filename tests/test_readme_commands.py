"""Every command in README.md's and docs/*.md's code blocks works as written from a plain shell.

Each distinct shell line of the README and the docs (docs/benchmarks/, the dated record of earlier
runs, is not documentation to follow) runs once, under ``env -i`` (PATH without any virtualenv, HOME, and
``ZEN_DS_VENV`` naming this test venv so the launchers reuse it instead of installing one), with
small sizes where the command takes them (steps, vocabulary, 2 ranks where 4 only add data-parallel
replicas), and must exit 0. Launch scripts run as written;
``python`` / ``zen-bench`` lines run after ``source launch/env.sh``, the one line the README asks
for. Lines that cannot run on a 2-core CPU machine, and variants that differ from a line run here
only by a flag another test covers, are skipped with the reason listed in SKIPPED. The JSON examples
must parse into the config they document, and docs/configuration.md's block must show ZenConfig's
defaults. The quick start runs with every warning shown and attributed to the code that raised it;
its logs must hold none raised from zen_ds.

The lines that run as written start when collection ends, one at a time at the lowest CPU
priority, in the cores the other multirank tests leave idle (tests/support/early_runs.py); each
test takes its line's outcome when it runs.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

import pytest

import early_runs
from zen_ds.integrations.config import ZenConfig, load_zen_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
CONFIGURATION = os.path.join(REPO, "docs", "configuration.md")
TIMEOUT_S = 600

# Command prefix -> why it is not run here.
SKIPPED = {
    "bash tests/run.sh": "runs this whole suite (CI runs it through .ci/run)",
    "sudo ": "needs root for network namespaces and tc",
    "launch/single_node.sh 4 --tp 2 --steps 20 --no-zen":
        "same launcher and environment as the line before; stock-vs-zen equality is tests/multirank/integrations/test_megatron.py's",
    "launch/torchrun.sh 4 --tp 2 --pp 2": "same launcher as the line before; TP x PP is covered by tests/multirank/integrations/test_megatron.py",
    "SCRIPT=examples/hf_trainer.py launch/single_node.sh 4 --model llama --zero 2":
        "same launcher and script as the --zero 3 line; the Trainer at ZeRO-2 is tests/multirank/integrations/test_hf_trainer.py's",
}
# Command prefix -> why its flags run in-process instead: launch/single_node.sh already runs as
# written in the --tp 2 line (finding the environment, the deepspeed launcher, the example's
# ``__main__`` wrapper, example_utils.run_example, shared by every example), so this line adds only
# its script and flags, which run through the script's own main(argv) with the same arguments on
# as many real gloo ranks (each launch costs ~40 s of CPU in interpreter start-ups on a 2-core
# machine). single_node.sh's per-script ZEN_NEEDS only matters in an environment that lacks the
# script's packages, which this test's venv never does, so a launch as written would not check it
# either.
_SAME_LAUNCHER = "launch/single_node.sh runs as written in the --tp 2 line"
IN_PROCESS = {
    "launch/single_node.sh 4 --vocab 262144 --zero 2 --optimizer-state sharded": _SAME_LAUNCHER,
    "launch/single_node.sh 4 --zero 3 --vocab 262144": _SAME_LAUNCHER,
    "launch/single_node.sh 4 --vocab 262144 --zero 2 --row-sharded": _SAME_LAUNCHER,
    "SCRIPT=examples/hf_trainer.py launch/single_node.sh 4 --model llama --zero 3": _SAME_LAUNCHER,
    "SCRIPT=examples/train_pipeline.py launch/single_node.sh 4": _SAME_LAUNCHER,
}
# Command prefix -> (extra environment, extra arguments): small sizes for a 2-core machine.
SMALL = {
    "bash launch/quickstart.sh": ({"NPROC": "2", "STEPS": "2"}, []),
    "launch/single_node.sh": ({}, ["--steps", "2", "--vocab", "4096"]),
    "launch/torchrun.sh": ({}, ["--steps", "2", "--vocab", "4096"]),
    "SCRIPT=examples/train_pipeline.py": ({}, ["--steps", "2"]),
    "SCRIPT=examples/hf_trainer.py": ({}, ["--steps", "2", "--vocab", "2000"]),
    "zen-bench sync": ({}, ["--scale", "0.01", "--iters", "1", "--warmup", "0", "--no-progress",
                            "--local", "2"]),
    "zen-bench ops": ({}, ["--workload", "embedding", "--rows", "20000", "--repeat", "1"]),
}


def _code_blocks(text: str) -> List[Tuple[str, str]]:
    """(language, body) of every fenced block."""
    return [(m.group(1).strip(), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def _file_commands(path: str) -> List[str]:
    commands = []
    with open(path) as fh:
        blocks = _code_blocks(fh.read())
    for lang, body in blocks:
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        for line in body.splitlines():
            command = re.split(r"\s+#", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def readme_commands() -> List[str]:
    """Every distinct shell line of the README and docs/*.md, in order of first appearance: a
    command shown in several places runs once."""
    commands: List[str] = []
    for path in DOCS:
        commands += [c for c in _file_commands(path) if c not in commands]
    return commands


# A launcher line at 4 ranks runs at 2 unless it splits the ranks into tensor- or pipeline-parallel
# groups (then data parallelism, what zen reduces over, needs all 4): each rank imports torch,
# DeepSpeed and megatron-core, ~20 s of CPU on a 2-core machine.
_FOUR_RANK_LAUNCH = re.compile(r"^((?:SCRIPT=\S+ )?launch/(?:single_node|torchrun)\.sh) 4 ")


def small_ranks(command: str) -> str:
    if re.search(r"--(tp|pp)\b|pipeline", command):
        return command
    return _FOUR_RANK_LAUNCH.sub(r"\1 2 ", command)


def _match(table: Dict, command: str):
    return next((value for prefix, value in table.items() if command.startswith(prefix)), None)


def _plain_environment(extra: Dict[str, str]) -> Dict[str, str]:
    """What a fresh login shell has: no virtualenv on PATH, nothing of this process's setup."""
    venv_bins = {os.path.join(sys.prefix, "bin"), os.path.dirname(sys.executable)}
    path = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                           if p and p not in venv_bins)
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), "ZEN_DS_VENV": sys.prefix}
    env.update(extra)
    return env


WARNING_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warning_probe")


def _zen_warnings_shown() -> Dict[str, str]:
    """Environment that shows every FutureWarning / UserWarning and marks the ones raised from zen_ds
    code with a ``zen_ds warning:`` line (tests/warning_probe/sitecustomize.py)."""
    return {"PYTHONWARNINGS": "always::FutureWarning,always::UserWarning", "PYTHONPATH": WARNING_PROBE}


def _command_argv(command: str, extra_env: Dict[str, str] = None) -> List[str]:
    """The README line as a plain login shell runs it, with this test's small sizes."""
    env_extra, args = _match(SMALL, command) or ({}, [])
    env = _plain_environment({**env_extra, **(extra_env or {})})
    line = small_ranks(command) + "".join(" " + shlex.quote(a) for a in args)
    if not line.startswith(("bash launch/", "launch/", "SCRIPT=")):
        line = "source launch/env.sh && " + line  # what the README asks for python / zen-bench
    return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "bash", "-c", line]


QUICKSTART = "bash launch/quickstart.sh"
_QUICKSTART_OUT = os.path.join(tempfile.gettempdir(), f"zen_ds_quickstart_{os.getpid()}")


def _extra_env(command: str) -> Dict[str, str]:
    if command == QUICKSTART:  # its logs, and every warning shown and attributed
        return {"OUT": _QUICKSTART_OUT, **_zen_warnings_shown()}
    return {}


def runs_as_written(command: str) -> bool:
    return not _match(SKIPPED, command) and not _match(IN_PROCESS, command)


def run_command(command: str) -> subprocess.CompletedProcess:
    """The line's outcome (run ahead by start_early_runs when the suite started it)."""
    return early_runs.runs().result(command, _command_argv(command, _extra_env(command)), REPO,
                                    TIMEOUT_S)


def start_early_runs(config, items) -> None:
    """tests/conftest.py's hook: queue the selected lines that run as written, in order."""
    wanted = set()
    for item in items:
        if item.originalname.startswith("test_quickstart_"):
            wanted.add(QUICKSTART)
        elif item.originalname == "test_readme_command" and runs_as_written(item.callspec.params["command"]):
            wanted.add(item.callspec.params["command"])
    queue = early_runs.runs()
    for command in COMMANDS:
        if command in wanted:
            queue.add(command, _command_argv(command, _extra_env(command)), REPO)
    if wanted:
        queue.start(after_pid=int(os.environ.get("ZEN_DS_EARLY_BUILD_PID") or 0))


def _failure(command: str, proc: subprocess.CompletedProcess) -> str:
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    return f"`{command}` exited {proc.returncode}:\n{tail}"


COMMANDS = readme_commands()


def test_readme_has_the_documented_commands():
    """The extraction finds the commands (an empty list would pass everything below); the README
    itself shows exactly the two quick-start commands, the rest lives in docs/."""
    assert _file_commands(README) == ["bash launch/quickstart.sh", "bash tests/run.sh"]
    assert "bash launch/quickstart.sh" in COMMANDS
    assert any(c.startswith("launch/single_node.sh") for c in COMMANDS)
    assert any(c.startswith("zen-bench") for c in COMMANDS)


@pytest.fixture(scope="module")
def quickstart():
    proc = run_command(QUICKSTART)
    yield proc, _QUICKSTART_OUT
    shutil.rmtree(_QUICKSTART_OUT, ignore_errors=True)


def test_quickstart_from_a_plain_shell(quickstart):
    proc, out = quickstart
    assert proc.returncode == 0, _failure("bash launch/quickstart.sh", proc)
    assert re.search(r"^   step +1/2 ", proc.stdout, re.M), "no per-step progress line"
    assert "mlp sent" in proc.stdout
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith("verdict (")]
    assert len(verdict) == 1 and "fewer embedding bytes" in verdict[0] and "losses agree to" in verdict[0]
    assert "lossless bound (this run's supports)" in proc.stdout
    assert re.search(r"all-gather / bound as the ranks grow .*n=8: \d", proc.stdout)
    # The scale story: the simulator's prediction at 16, 128 and 1024 ranks, labelled as such.
    assert proc.stdout.count("PREDICTION, not measured") == 2
    assert re.search(r"^ +1024 +\w+ +[\d.,]+ MB", proc.stdout, re.M)


def test_quickstart_raises_no_warning_from_zen_ds(quickstart):
    _, out = quickstart
    logs = sorted(p for p in os.listdir(out) if p.endswith(".log") and p != "build.log")
    assert logs, "the quick start left no run logs"
    warned = []
    for name in logs:
        with open(os.path.join(out, name), errors="replace") as fh:
            warned += [f"{name}: {ln.strip()}" for ln in fh if "zen_ds warning:" in ln]
    assert not warned, "warnings raised from zen_ds code:\n" + "\n".join(sorted(set(warned)))


def _example_in_process(rank: int, world: int, script: str, argv: List[str]) -> Dict[str, object]:
    """examples/<script>.py's main(argv) on this rank (a job of tests/support/dist_utils.py): its
    losses on this rank and whether zen is attached."""
    import zen_ds
    from ds_cases import load_example, set_env

    set_env(rank, world)
    out = load_example(script).main(argv)
    if script == "train_lm":
        state = zen_ds.state_of(out["engine"])
        return {"losses": out["summary"]["losses"], "zen": state is not None,
                "row_sharded": [t.name for t in state.route.tables] if state else []}
    return {"losses": out["losses"], "zen": out["zen"], "row_sharded": out.get("row_sharded", [])}


def run_in_process(command: str) -> List[Dict[str, object]]:
    """A ``[SCRIPT=examples/X.py] launch/single_node.sh N ARGS`` line as ``X.main(ARGS + small
    sizes)`` on N ranks (X = train_lm without SCRIPT=, as the launcher does)."""
    from dist_utils import run_ranks

    words = shlex.split(small_ranks(command))
    script = "train_lm"
    if words[0].startswith("SCRIPT="):
        script = os.path.splitext(os.path.basename(words.pop(0)[len("SCRIPT="):]))[0]
    assert words[0] == "launch/single_node.sh" and words[1].isdigit(), command
    _, args = _match(SMALL, command) or ({}, [])
    args = list(args)
    if script == "train_lm" and "--row-sharded" in words and "--optimizer-state" not in words:
        # the small vocabulary saves less than "shard_min_mb": take the table anyway, as the
        # documented size would be
        args += ["--optimizer-state", "sharded"]
    return run_ranks(int(words[1]), _example_in_process, script, words[2:] + args, fresh=True,
                     timeout=TIMEOUT_S)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != QUICKSTART],
                         ids=lambda c: re.sub(r"[^\w./ -]", "_", c))
def test_readme_command(command):
    reason = _match(SKIPPED, command)
    if reason:
        pytest.skip(reason)
    if _match(IN_PROCESS, command):
        results = run_in_process(command)
        for rank, result in enumerate(results):
            assert all(map(math.isfinite, result["losses"])), (rank, result)
            assert result["zen"], f"rank {rank}: zen is not attached ({command})"
        assert any(result["losses"] for result in results), f"no rank trained ({command})"
        if "pipeline" not in command:  # a pipeline's loss is on its last stage only
            assert all(result["losses"] for result in results), results
        if "--row-sharded" in command:  # the flag took effect: a table is held in rows
            assert all(result["row_sharded"] for result in results), results
        return
    proc = run_command(command)
    assert proc.returncode == 0, _failure(command, proc)


def _json_examples(paths: List[str]) -> List[Tuple[str, dict]]:
    examples = []
    for path in paths:
        with open(path) as fh:
            bodies = [body for lang, body in _code_blocks(fh.read()) if lang == "json"]
        # the blocks are "zen": {...} members of a ds_config
        examples += [(os.path.relpath(path, REPO), json.loads("{" + body + "}")) for body in bodies]
    return examples


def test_json_examples_are_valid_zen_blocks():
    examples = _json_examples(DOCS)
    assert len(examples) >= 2
    assert any(path == "README.md" for path, _ in examples), "README lost its ds_config example"
    for path, ds_config in examples:
        assert load_zen_config(ds_config) is not None, path


def test_json_example_of_the_configuration_page_shows_the_defaults():
    documented = _json_examples([CONFIGURATION])[0][1]["zen"]
    assert documented == ZenConfig().model_dump(), "docs/configuration.md's defaults block drifted from ZenConfig"
