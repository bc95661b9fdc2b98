"""Where the project lives on each TPU host, and the shell commands that install it there.

An install is skipped on a host that already holds one for the same setup.py: the install is editable, so the
code is read from ~/pod-pretrain as it is, and only setup.py decides what gets installed. A recreated slice has
fresh hosts, so it installs. With a wheel cache (a gs:// folder), a host installs offline from the cache's wheels;
where they are missing or do not fit (the first setup, a changed setup.py, another Python), it builds the wheels
from PyPI, installs from them, and worker 0 then adds them to the cache. So later setups read the same versions
from the bucket, in the slice's region, instead of asking PyPI's resolver again on every host.
"""
import shlex

REMOTE_DIR_NAME = "pod-pretrain"
REMOTE_DIR = f"~/{REMOTE_DIR_NAME}"  # left unquoted in remote commands so the host's shell expands ~
# `python` may not exist on TPU VM images (Ubuntu ships only python3).
REMOTE_PYTHON = "python3"
INSTALL_TARGET = shlex.quote(".[tpu]")
# The setup.py fingerprint of the host's install, written after it succeeded; outside REMOTE_DIR, which a clone
# replaces.
INSTALLED_STAMP = "~/.pod-pretrain-installed"
# $HOME, not ~: the shell expands no ~ inside pip's --find-links=... words.
WHEEL_DIR = "$HOME/.pod-pretrain-wheels"
# Left by a host that built wheels the cache lacked: worker 0's then go up.
WHEELS_ADDED = f"{WHEEL_DIR}/.added"


def install_command(wheel_cache: str | None) -> str:
  """Run in REMOTE_DIR on every host: installs the project unless this setup.py's install is already there."""
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
  return (f'cd {REMOTE_DIR} && fingerprint="$(sha256sum setup.py)" && '
          f'if [ "$(cat {INSTALLED_STAMP} 2>/dev/null)" = "$fingerprint" ]; then '
          f"echo 'pod-pretrain: already installed for this setup.py'; "
          f'else {install} && echo "$fingerprint" > {INSTALLED_STAMP}; fi')


def fill_wheel_cache_command(wheel_cache: str) -> str:
  """Run on worker 0 after `install_command`: uploads the wheels it built, if it built any (every host built the
  same ones)."""
  return (f"if [ -e {WHEELS_ADDED} ]; then "
          f"gcloud storage cp --no-clobber {WHEEL_DIR}/*.whl {shlex.quote(wheel_cache + '/')}; fi")
