"""Loaded at interpreter start when this folder is on PYTHONPATH (tests/test_readme_commands.py puts
it there for the quick start): every warning shown is also attributed to the code that raised it,
and one raised from zen_ds code gets a ``zen_ds warning:`` line on stderr.

"Raised from" is the first frame outside the warnings machinery (warnings, typing_extensions) and
torch: a deprecation that torch reports from inside its own wrapper (``c10d_logger.py``) belongs to
whoever called the wrapper, and a warning from torch's C++ belongs to the Python line that entered it.
"""
import os
import sys
import traceback
import warnings

_SKIPPED = (os.sep + "warnings.py", os.sep + "typing_extensions.py", os.sep + "torch" + os.sep, __file__)
_ZEN_DS = os.sep + "zen_ds" + os.sep
_show = warnings.showwarning


def _origin():
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not any(part in frame.filename for part in _SKIPPED):
            return frame
    return None


def _attributed(message, category, filename, lineno, file=None, line=None):
    origin = _origin()
    if origin is not None and _ZEN_DS in origin.filename:
        print(f"zen_ds warning: {origin.filename}:{origin.lineno}: {category.__name__}: {message}",
              file=sys.stderr, flush=True)
    _show(message, category, filename, lineno, file, line)


warnings.showwarning = _attributed
