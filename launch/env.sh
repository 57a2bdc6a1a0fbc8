# Shared by the launch scripts (and by `source launch/env.sh` in a plain shell): find the Python
# environment that runs zen_ds, or create it, so that every documented command works without
# activating anything first.
#
#   source launch/env.sh                     # its python / zen-bench first on PATH
#   ZEN_NEEDS="megatron.core" source launch/env.sh   # also require megatron-core (train_lm.py)
#
# The first candidate that imports torch, deepspeed, zen_ds's dependencies and $ZEN_NEEDS wins:
#   $PYTHON (used as given, never modified), $ZEN_DS_VENV (the tests' variable), .venv (created by
#   tests/run.sh), .venv-quickstart (created by launch/quickstart.sh), python3 on PATH.
# If none does, .venv-quickstart is created (or completed) with torch's CPU build and zen_ds with
# the deepspeed extra plus those that $ZEN_NEEDS asks for (megatron, hf, data). JIT-built C++ ops are cached inside the checkout, one cache
# per environment (.torch_extensions/ for the tests' venv), so switching never rebuilds them.
# Sets ZEN_PY (the python to run), ZEN_REPO, ZEN_DEVICE (cpu | cuda), PYTHONPATH, TORCH_EXTENSIONS_DIR and, on CPU,
# OMP_NUM_THREADS; puts the environment's bin/ first on PATH (deepspeed, torchrun, zen-bench).

ZEN_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ZEN_TORCH_VERSION="${ZEN_TORCH_VERSION:-2.13.0}"

_zen_imports() {  # $1 = python; true if it runs zen_ds from this checkout with $ZEN_NEEDS
  # One interpreter start checks that the packages are there (found, not imported: DeepSpeed and
  # megatron-core take seconds to import, and the job imports them anyway) and records what the
  # rest of this file needs: "<environment prefix> <cpu|cuda>".
  local modules="'torch', 'deepspeed', 'pydantic', 'zen_ds'"
  [ -n "${ZEN_NEEDS:-}" ] && modules="$modules, '${ZEN_NEEDS// /\', \'}'"
  local out
  # torch is imported (seconds of CPU) only where a GPU device node exists: without one, CUDA is
  # not available to any torch build, and every launch line would pay the import for nothing.
  # A candidate that lacks a package prints "missing: <modules>" ($_zen_missing) and fails.
  _zen_missing=""
  out="$(PYTHONPATH="$ZEN_REPO" "$1" -c "import glob, importlib.util, os, sys
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False
missing = [m for m in ($modules,) if not found(m)]
if missing:
    print('missing:', ' '.join(missing))
    sys.exit(1)
cuda = False
if glob.glob('/dev/nvidia[0-9]*') or os.path.exists('/dev/dxg'):
    import torch
    cuda = torch.cuda.is_available()
print(os.path.realpath(sys.prefix), 'cuda' if cuda else 'cpu')" 2>/dev/null)" \
    || { _zen_missing="$(sed -n 's/^missing: //p' <<< "$out")"; _zen_missing="${_zen_missing:-its packages (the interpreter failed)}"; return 1; }
  _zen_facts="${out##*$'\n'}"  # the last line: an import may print (DeepSpeed's accelerator notice)
}

_zen_extras() {  # pip extras of zen_ds for what the job imports: DeepSpeed always, and $ZEN_NEEDS's
  local extras="deepspeed"
  case " ${ZEN_NEEDS:-} " in *megatron*) extras="$extras,megatron" ;; esac
  case " ${ZEN_NEEDS:-} " in *transformers*|*accelerate*) extras="$extras,hf" ;; esac
  case " ${ZEN_NEEDS:-} " in *sentencepiece*|*tiktoken*|*tokenizers*) extras="$extras,data" ;; esac
  echo "[$extras]"
}

_zen_find_python() {
  local candidate
  if [ -n "${PYTHON:-}" ]; then
    if _zen_imports "$PYTHON"; then ZEN_PY="$PYTHON"; return 0; fi
    echo "error: PYTHON=$PYTHON cannot import $_zen_missing; install what the job needs" \
         "($PYTHON -m pip install -e '$ZEN_REPO$(_zen_extras)', torch first: pip install torch==$ZEN_TORCH_VERSION" \
         "for the CPU build) or unset PYTHON" >&2
    return 1
  fi
  for candidate in ${ZEN_DS_VENV:+"$ZEN_DS_VENV/bin/python"} "$ZEN_REPO/.venv/bin/python" \
                   "$ZEN_REPO/.venv-quickstart/bin/python" "$(command -v python3 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && _zen_imports "$candidate"; then
      ZEN_PY="$candidate"; return 0
    fi
  done
  local venv="$ZEN_REPO/.venv-quickstart" base
  base="$(command -v python3 || true)"
  if [ -z "$base" ]; then echo "error: python3 not found on PATH; install Python 3.9+" >&2; return 1; fi
  echo "== setting up $venv (torch CPU build, zen_ds$(_zen_extras)); one time, a few minutes" >&2
  [ -x "$venv/bin/python" ] || "$base" -m venv "$venv" || return 1
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  "$venv/bin/python" -c "import torch" 2>/dev/null \
    || "$venv/bin/python" -m pip install -q "torch==$ZEN_TORCH_VERSION" || return 1
  if ! "$venv/bin/python" -m pip install -q -e "$ZEN_REPO$(_zen_extras)"; then
    echo "error: installing zen_ds$(_zen_extras) into $venv failed (pip's message is above); retry with" \
         "'$venv/bin/python -m pip install -e \"$ZEN_REPO$(_zen_extras)\"'" >&2
    return 1
  fi
  if ! _zen_imports "$venv/bin/python"; then
    echo "error: $venv was set up but cannot import $_zen_missing; install it with" \
         "'$venv/bin/python -m pip install -e \"$ZEN_REPO$(_zen_extras)\"'" >&2
    return 1
  fi
  ZEN_PY="$venv/bin/python"
}

if _zen_find_python; then
  export ZEN_PY ZEN_REPO
  export PYTHONPATH="$ZEN_REPO${PYTHONPATH:+:$PYTHONPATH}"
  ZEN_DEVICE="${_zen_facts##* }"
  _zen_prefix="${_zen_facts% *}"
  if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
    # A JIT build records its environment's include paths, so environments must not share a cache
    # (each switch would rebuild): the tests' venv uses .torch_extensions/ as tests/run.sh does,
    # any other environment a folder of its own inside it.
    if [ "$_zen_prefix" = "$(cd "${ZEN_DS_VENV:-$ZEN_REPO/.venv}" 2>/dev/null && pwd -P)" ]; then
      TORCH_EXTENSIONS_DIR="$ZEN_REPO/.torch_extensions"
    else
      TORCH_EXTENSIONS_DIR="$ZEN_REPO/.torch_extensions/env-$(basename "$_zen_prefix")"
    fi
  fi
  export TORCH_EXTENSIONS_DIR ZEN_DEVICE
  export PATH="$(dirname "$ZEN_PY"):$PATH"
  if [ "$ZEN_DEVICE" = cpu ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per CPU rank: no oversubscription
  fi
  ZEN_ENV_OK=1
else
  ZEN_ENV_OK=0
fi
