"""Where the project lives on each TPU host, and the shell commands that install it there.

The project runs in a virtual environment, VENV_DIR, with Python --python or newer. A host whose python3 is new
enough makes it with `python3 -m venv`. tpu-ubuntu2204-base (Ubuntu 22.04) ships Python 3.10 as python3; there uv,
pip-installed for the user, makes it with that Python version, which it downloads: no sudo, no apt lock to wait
for, no third-party apt repository, and any version on any image (Ubuntu 22.04's own python3.11 needs root and
offers no other version).

An install is skipped on a host whose environment already holds one for the same setup.py and Python: the install
is editable, so the code is read from ~/pod-pretrain as it is, and only setup.py and the Python decide what gets
installed. A recreated slice has fresh hosts, so it installs. With a wheel cache (a gs:// folder), a host installs
offline from the cache's wheels; where they are missing or do not fit (the first setup, a changed setup.py,
another Python), it builds the wheels from PyPI, installs from them, and worker 0 then adds them to the cache. So
later setups read the same versions from the bucket, in the slice's region, instead of asking PyPI's resolver
again on every host.
"""
import shlex

REMOTE_DIR_NAME = "pod-pretrain"
REMOTE_DIR = f"~/{REMOTE_DIR_NAME}"  # left unquoted in remote commands so the host's shell expands ~
# $HOME, not ~, in the paths below: the shell expands no ~ inside a word such as --find-links=....
# Outside REMOTE_DIR, which a clone replaces.
VENV_DIR = "$HOME/.pod-pretrain-venv"
REMOTE_PYTHON = f"{VENV_DIR}/bin/python"
# The image's own Python: `python` may not exist (Ubuntu ships only python3).
SYSTEM_PYTHON = "python3"
INSTALL_TARGET = shlex.quote(".[tpu]")
# What the environment's install was made from (setup.py and Python), written after it succeeded; inside the
# environment, so a new environment always installs.
INSTALLED_STAMP = f"{VENV_DIR}/.pod-pretrain-installed"
WHEEL_DIR = "$HOME/.pod-pretrain-wheels"
# Left by a host that built wheels the cache lacked: worker 0's then go up.
WHEELS_ADDED = f"{WHEEL_DIR}/.added"


def _at_least(python: str, version: str) -> str:
  """A shell test: `python` runs and is Python `version` (like 3.11) or newer."""
  check = f"import sys; sys.exit(sys.version_info < {tuple(map(int, version.split('.')))})"
  return f"{python} -c {shlex.quote(check)} 2>/dev/null"


def _make_venv_command(python_version: str) -> str:
  # --seed puts pip, setuptools and wheel in the environment, as `python3 -m venv` puts pip.
  uv_venv = (f"{SYSTEM_PYTHON} -m pip install --user uv && "
             f"{SYSTEM_PYTHON} -m uv venv --seed --python={python_version} {VENV_DIR}")
  return (f"{{ rm -rf {VENV_DIR} && if {_at_least(SYSTEM_PYTHON, python_version)}; "
          f"then {SYSTEM_PYTHON} -m venv {VENV_DIR}; else {uv_venv}; fi; }}")


def install_command(wheel_cache: str | None, python_version: str) -> str:
  """Run on every host: makes the environment unless it has Python `python_version` or newer, and installs the
  project in it unless this setup.py's install for this Python is already there."""
  pip = f"{REMOTE_PYTHON} -m pip"
  if wheel_cache:
    offline = f"{pip} install --no-index --find-links={WHEEL_DIR} -e {INSTALL_TARGET}"
    # setuptools and wheel build the editable install offline; the project's own wheel is code, not environment.
    build = (f"{pip} wheel --wheel-dir={WHEEL_DIR} --find-links={WHEEL_DIR} setuptools wheel {INSTALL_TARGET} && "
             f"rm -f {WHEEL_DIR}/pod_pretrain-*.whl && touch {WHEELS_ADDED}")
    install = (f"rm -rf {WHEEL_DIR} && mkdir -p {WHEEL_DIR} && "
               f"{{ gcloud storage cp {shlex.quote(wheel_cache + '/*.whl')} {WHEEL_DIR}/ || "
               f"echo 'pod-pretrain: wheel cache empty or unreadable'; }} && "
               f"{{ {offline} || {{ echo 'pod-pretrain: building the wheels the cache lacks' && {build} && "
               f"{offline}; }}; }}")
  else:
    install = f"{pip} install -e {INSTALL_TARGET}"
  return (f"cd {REMOTE_DIR} && {{ {_at_least(REMOTE_PYTHON, python_version)} || "
          f"{_make_venv_command(python_version)}; }} && "
          f'fingerprint="$(sha256sum setup.py) $({REMOTE_PYTHON} -V)" && '
          f'if [ "$(cat {INSTALLED_STAMP} 2>/dev/null)" = "$fingerprint" ]; then '
          f"echo 'pod-pretrain: already installed for this setup.py and Python'; "
          f'else {install} && echo "$fingerprint" > {INSTALLED_STAMP}; fi')


def fill_wheel_cache_command(wheel_cache: str) -> str:
  """Run on worker 0 after `install_command`: uploads the wheels it built, if it built any (every host built the
  same ones)."""
  return (f"if [ -e {WHEELS_ADDED} ]; then "
          f"gcloud storage cp --no-clobber {WHEEL_DIR}/*.whl {shlex.quote(wheel_cache + '/')}; fi")
