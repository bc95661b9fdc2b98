"""benchmarks/gpu_checks.sh, which a session lent a GPU for minutes runs first: each of its checks is a command
that its script accepts, so that a renamed flag or script fails here, not in the lent minutes. Running them
at a tiny size on the CPU is how the script itself was tried (its header); here nothing runs."""
import os
import runpy
import shlex
import subprocess
import sys

from helpers import ROOT
from models import flash_dropout


def test_every_check_is_a_command_its_script_accepts(monkeypatch):
  monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put benchmarks/ on it
  # The script's own knobs left unset (make passes its PYTHON=... on to the commands it runs): its defaults.
  defaults = {name: value for name, value in os.environ.items() if name not in ("DEVICE", "SIZES", "PYTHON")}
  listed = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--list"], cwd=ROOT, env=defaults, capture_output=True,
                          text=True, check=True).stdout.splitlines()
  names = [line.split("|")[0] for line in listed]
  assert names[:3] == ["attention", "bert_triton", "xlnet_start"] and len(set(names)) == len(names), names
  for line in listed:
    name, usual, command = line.split("|")
    python, script, *flags = shlex.split(command)
    assert python == "python3" and int(usual) > 0, line
    arguments = runpy.run_path(str(ROOT / script))["make_parser"]().parse_args(flags)  # exits on a bad flag
    assert arguments.device == "gpu", line
    tilings = [text for text in getattr(arguments, "tilings", "").split(",") if text]
    assert all(flash_dropout.Tiling.parse(text) for text in tilings), line  # raises on a malformed one
