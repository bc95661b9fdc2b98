"""benchmarks/attention.py at a tiny size on the CPU, in this process: XLA's attention and the interpreted Triton
kernel are timed with and without dropout, cuDNN's is skipped with the reason, and the kernel's error against
XLA's attention with the same decisions is printed and small."""
import re
import runpy


def test_the_attention_benchmark_times_each_implementation_and_checks_the_kernel(capsys):
  main = runpy.run_path("benchmarks/attention.py")["main"]
  main(["--batch=2", "--length=128", "--heads=2", "--head_dim=32", "--repeats=2", "--rate=0.2",
        "--tilings=128x64/8/2"])
  out = capsys.readouterr().out
  assert "skipping cudnn: needs an NVIDIA GPU, not cpu" in out
  rows = re.findall(r"^(xla|triton|triton 128x64/8/2)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
  assert sorted((name, rate) for name, rate, _, _ in rows) == [
      ("triton", "0"), ("triton", "0.2"), ("triton 128x64/8/2", "0"), ("triton 128x64/8/2", "0.2"), ("xla", "0"),
      ("xla", "0.2")], out
  assert all(float(ms) > 0 for _, _, ms, _ in rows)
  errors = re.findall(r"^triton (\S+) at dropout \S+: .* same decisions ([\d.e+-]+) \(relative\)", out, re.M)
  assert sorted(tiling for tiling, _ in errors) == ["128x64/8/2"] * 2 + ["64x64/4/2"] * 2, out
  assert max(float(error) for _, error in errors) < 1e-5, out
