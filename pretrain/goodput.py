"""Where a run's wall time went, over all its starts, from the records in MODEL_DIR/goodput.jsonl.

  python -m pretrain.goodput MODEL_DIR [--png=PATH]

Every start's process 0 appends its records (`pretrain.goodput_events` says which); `launch.tpu run
--restart_on_preemption` writes its own of each restart in MODEL_DIR/goodput_launcher/ (`launch.run_events`). The
report gives the wall time, from the first start's process start to the last record, the share of it spent on steps
that count (goodput), and each loss by kind; together they add up to the wall time. With --png, a timeline: one row per
start, a coloured segment per kind (the extra `pip install -e '.[goodput]'` brings matplotlib).

Each start, from its process start (a later start in one process, or train() called from a notebook: its train()
call) to its last record, is split as follows:
  restore/init, compile, saves, evals    the records' own seconds (timed records never overlap);
  input waits                            the logged windows' seconds waiting for input;
  start-up                               the rest of the time before the first step was dispatched;
  steps                                  the rest after it, split by step count at the start's mean step time:
    recomputed steps   steps from the checkpoint this start resumed from up to the furthest step an earlier
                       start reached (all of a start's steps when it logged none);
    skipped updates    updates skipped for non-finite gradients;
    goodput            the other steps.
  between starts       one start's last record to the next start's beginning. A start that died without an
                       `end` record (killed, a lost host) counts its time after its last record here. A start
                       that began before the previous start's last record (a process, such as a notebook, that
                       started while the previous start ran) begins at that record. Where the launcher restarted the
                       slice, this time is split by its records:
    detection          from the last record before it to the launcher's decision that the slice was preempted
                       (the run's end reaching the launcher, its second look at a READY slice, the state settling);
    recreate           deleting the slice and creating it until READY;
    setup              copying the code and installing it on every host;
    other              the rest: the training command's ssh until the process starts, a killed start's time after
                       its last record, restarts the launcher did not make.
                       The launcher's records are clipped to the gap and to each other, so the parts add up to it
                       exactly, even where the launcher's clock and the hosts' disagree (by that much, a part's
                       time moves to its neighbour).

Why not Google's ml-goodput-measurement: it records to and computes from Cloud Logging, so it needs a GCP project
and network access while training; runs here also train on local disks with no network, and MODEL_DIR is the one
place that every start of a run can write to and every reader can find.
"""
import argparse
import dataclasses
import datetime
import json
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from etils import epath

from launch import run_events
from pretrain import cli
from pretrain.errors import ConfigError

FILE_NAME = "goodput.jsonl"
GOODPUT = "goodput"
# The report's kinds of time, in the order a start meets them; each start's seconds over these sum to its span.
LOSSES = ("start-up", "restore/init", "compile", "saves", "evals", "input waits", "recomputed steps", "skipped updates",
          "between starts")
TIMED_KINDS = {
    "init": "restore/init", "restore": "restore/init", "compile": "compile", "save": "saves", "eval": "evals"
}  # record kind -> report kind
# "between starts" split by the launcher's records; "other" is what they do not cover.
DOWNTIME = ("detection", "recreate", "setup", "other")
LAUNCHER_TIMED_KINDS = {run_events.DELETE: "recreate", run_events.CREATE: "recreate", run_events.SETUP: "setup"}
DOWNTIME_NOTES = {
    "detection": "the last record to the launcher's decision", "recreate": "delete and create the slice",
    "setup": "copy and install the code", "other": "the rest"
}
COLOURS = {
    GOODPUT: "tab:green", "start-up": "tab:gray", "restore/init": "tab:blue", "compile": "tab:purple",
    "saves": "tab:red", "evals": "tab:cyan", "input waits": "gold", "recomputed steps": "tab:orange",
    "skipped updates": "tab:brown", "between starts": "whitesmoke", "detection": "pink", "recreate": "lightsalmon",
    "setup": "wheat"
}


@dataclasses.dataclass
class Start:
  """One start of the run: its span (`began` to `ended`, its last record), how it ended, the steps it ran and
  the seconds of each kind (LOSSES' and GOODPUT), which sum to its span; `downtime_segments`: (part, began, ended)
  of DOWNTIME's parts the launcher recorded between the previous start and this one, none for the first."""
  id: str
  began: float
  ended: float
  how: str
  first_step: int
  reached: int
  recomputed_steps: int
  skipped_updates: int
  seconds: Dict[str, float]
  records: List[dict]
  downtime_segments: List[Tuple[str, float, float]] = dataclasses.field(default_factory=list)

  @property
  def goodput_share(self) -> float:
    return self.seconds[GOODPUT] / max(self.ended - self.began, 1e-9)

  def downtime(self, previous_end: float) -> Dict[str, float]:
    """The time from `previous_end` (the previous start's last record) to this start, by DOWNTIME's parts."""
    seconds = dict.fromkeys(DOWNTIME, 0.0)
    for part, began, ended in self.downtime_segments:
      seconds[part] += ended - began
    seconds["other"] = self.began - previous_end - sum(seconds.values())
    return seconds


@dataclasses.dataclass
class Account:
  """The run's starts in order; `seconds`: each kind's total over them, between starts included, and `downtime`:
  between starts by DOWNTIME's parts."""
  starts: List[Start]
  seconds: Dict[str, float]
  downtime: Dict[str, float]

  @property
  def wall_seconds(self) -> float:
    return self.starts[-1].ended - self.starts[0].began

  @property
  def goodput_share(self) -> float:
    return self.seconds[GOODPUT] / max(self.wall_seconds, 1e-9)

  def start(self, start_id: str) -> Start:
    return next(s for s in self.starts if s.id == start_id)


def read_records(model_dir: str) -> List[dict]:
  """The records of MODEL_DIR/goodput.jsonl; unreadable lines are skipped (`read_records_and_unreadable`)."""
  return read_records_and_unreadable(model_dir)[0]


def read_records_and_unreadable(model_dir: str) -> Tuple[List[dict], int]:
  """(the records of MODEL_DIR/goodput.jsonl, how many lines were skipped as unreadable): a line cut short (a
  process killed while appending), or damaged (not JSON, or without the fields the report reads)."""
  path = epath.Path(model_dir) / FILE_NAME
  if not path.exists():
    raise FileNotFoundError(f"{model_dir} has no {FILE_NAME}: no run has started there, or none since goodput "
                            "was recorded")
  return _json_lines(path, lambda kind: ("start", "kind", "time", *_FIELDS_READ.get(kind, ())))


def read_launcher_records(model_dir: str) -> List[dict]:
  """The records `launch.tpu run` wrote in MODEL_DIR/goodput_launcher/, all its launches'; none if it wrote none."""
  paths = sorted((epath.Path(model_dir) / run_events.RECORDS_DIR).glob("*.jsonl"))
  return [record for path in paths for record in _json_lines(path, lambda kind: ("kind", "time"))[0]]


# The fields the report reads of a start's records of each kind, besides `start`, `kind` and `time`.
_FIELDS_READ = {"steps": ("step", "skipped", "seconds", "input_seconds"), "end": ("step", "how"),
                **{kind: ("seconds",) for kind in TIMED_KINDS}}


def _json_lines(path: epath.Path, fields: Callable[[str], Tuple[str, ...]]) -> Tuple[List[dict], int]:
  """(the lines' records, each with the `fields` its kind needs; how many lines were not such a record)."""
  records, unreadable = [], 0
  for line in path.read_bytes().splitlines():
    try:
      record = json.loads(line)
      usable = isinstance(record, dict) and all(name in record for name in fields(record.get("kind")))
    except ValueError:  # not UTF-8, or not JSON
      usable = False
    if usable:
      records.append(record)
    else:
      unreadable += 1
  return records, unreadable


def account(records: Sequence[dict], launcher_records: Sequence[dict] = ()) -> Account:
  """Splits the run's wall time by kind (see the module's docstring); `records` as read, starts in order;
  `launcher_records` (any order) split the time between starts."""
  by_start: Dict[str, List[dict]] = {}
  for record in records:
    by_start.setdefault(record["start"], []).append(record)
  if not by_start:
    raise ConfigError(f"{FILE_NAME} holds no records")
  launcher_records = sorted(launcher_records, key=lambda r: r["time"])
  starts, furthest_step, previous_end = [], 0, None
  totals = dict.fromkeys((GOODPUT, *LOSSES), 0.0)
  downtime = dict.fromkeys(DOWNTIME, 0.0)
  for start_id, start_records in by_start.items():
    start = _account_start(start_id, start_records, furthest_step, previous_end)
    if previous_end is not None:
      totals["between starts"] += start.began - previous_end
      start.downtime_segments = _downtime_segments(previous_end, start.began, launcher_records)
      for part, seconds in start.downtime(previous_end).items():
        downtime[part] += seconds
    for kind, seconds in start.seconds.items():
      totals[kind] += seconds
    starts.append(start)
    furthest_step, previous_end = max(furthest_step, start.reached), start.ended
  return Account(starts, totals, downtime)


def _downtime_segments(begin: float, end: float, launcher_records: List[dict]) -> List[Tuple[str, float, float]]:
  """(part, began, ended) of the launcher's records (in time order) within `begin` to `end`, clipped to it and to
  each other: a detection covers the time since the previous segment (or `begin`), a timed record its seconds."""
  segments, cursor = [], begin
  for record in launcher_records:
    kind = record["kind"]
    part = "detection" if kind == run_events.PREEMPTION_DETECTED else LAUNCHER_TIMED_KINDS.get(kind)
    record_began = record["time"] - record.get("seconds", 0.0)
    if part is None or record["time"] <= begin or record_began >= end:  # not in this gap
      continue
    began = cursor if part == "detection" else max(record_began, cursor)
    ended = min(record["time"], end)
    if ended > began:
      segments.append((part, began, ended))
      cursor = ended
  return segments


def _account_start(start_id: str, records: List[dict], furthest_step: int, previous_end: Optional[float]) -> Start:
  """One start's seconds by kind; `furthest_step`: the furthest step an earlier start reached."""
  first = {r["kind"]: r for r in reversed(records)}  # each kind's first record
  process_start = first["start"]["time"] if "start" in first else min(r["time"] - r.get("seconds", 0) for r in records)
  began = process_start if previous_end is None else max(process_start, previous_end)
  ended = max(r["time"] for r in records)
  seconds = dict.fromkeys((GOODPUT, *LOSSES[:-1]), 0.0)
  timed = [r for r in records if r["kind"] in TIMED_KINDS]
  for record in timed:
    seconds[TIMED_KINDS[record["kind"]]] += record["seconds"]
  windows = [r for r in records if r["kind"] == "steps"]
  seconds["input waits"] = sum(w["input_seconds"] for w in windows)
  ready = first.get("first_step", {}).get("time")  # the first step's dispatch: start-up ends
  step_seconds = 0.0 if ready is None else (ended - ready - sum(r["seconds"] for r in timed if r["time"] > ready) -
                                            seconds["input waits"])
  seconds["start-up"] = ended - began - sum(r["seconds"] for r in timed) - seconds["input waits"] - step_seconds
  state = first.get("restore") or first.get("init") or {}
  first_step = state.get("step", 0)
  reached = max([first_step] + [r["step"] for r in records if r["kind"] in ("steps", "end")])
  steps_run = reached - first_step
  recomputed = max(min(furthest_step, reached) - first_step, 0)
  skipped = min(sum(w["skipped"] for w in windows if w["step"] > furthest_step), steps_run - recomputed)
  if steps_run:
    seconds["recomputed steps"] = recomputed * step_seconds / steps_run
    seconds["skipped updates"] = skipped * step_seconds / steps_run
  else:  # steps dispatched, none logged: none counts
    seconds["recomputed steps"] = step_seconds
  seconds[GOODPUT] = step_seconds - seconds["recomputed steps"] - seconds["skipped updates"]
  end = first.get("end")
  how = "no end record" if end is None else end["how"] + (f" ({end['error']})" if "error" in end else "")
  return Start(start_id, began, ended, how, first_step, reached, recomputed, skipped, seconds, records)


def report(model_dir: str, run: Account) -> str:
  """The lines `python -m pretrain.goodput` prints."""
  wall = run.wall_seconds
  lines = [
      f"{model_dir}: {len(run.starts)} start(s), {_seconds(wall)} from the first start to the last record",
      f"  {'goodput':<18}{_seconds(run.seconds[GOODPUT]):>12}  {_share(run.seconds[GOODPUT], wall)}  steps that "
      "count"
  ]
  recomputed, skipped = sum(s.recomputed_steps for s in run.starts), sum(s.skipped_updates for s in run.starts)
  notes = {"recomputed steps": f"{recomputed} step(s)", "skipped updates": f"{skipped} update(s)"}
  for kind in LOSSES:
    lines.append(f"  {kind:<18}{_seconds(run.seconds[kind]):>12}  {_share(run.seconds[kind], wall)}  "
                 f"{notes.get(kind, '')}".rstrip())
  if any(start.downtime_segments for start in run.starts):  # the launcher restarted the slice
    lines += [
        f"    {part:<16}{_seconds(run.downtime[part]):>12}  {_share(run.downtime[part], wall)}  {DOWNTIME_NOTES[part]}"
        for part in DOWNTIME
    ]
  lines.append(f"  {'total':<18}{_seconds(sum(run.seconds.values())):>12}  "
               f"{_share(sum(run.seconds.values()), wall)}")
  lines.append("  start  began (UTC)          steps          goodput  ended")
  for number, start in enumerate(run.starts, 1):
    began = datetime.datetime.fromtimestamp(start.began, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    lines.append(f"  {number:>5}  {began}  {start.first_step:>6} -> {start.reached:<6} "
                 f"{start.goodput_share:>6.1%}  {start.how}")
  return "\n".join(lines)


def _seconds(seconds: float) -> str:
  return f"{seconds:,.1f} s"


def _share(seconds: float, wall: float) -> str:
  return f"{seconds / max(wall, 1e-9):>6.1%}"


def plot(run: Account, path: str) -> None:
  """The timeline PNG: a row per start, time from the first start on the x axis. Records are drawn where they
  happened; input waits at the end of their window; the steps' split is drawn in proportion, recomputed first."""
  try:
    import matplotlib
  except ImportError:
    raise ConfigError("--png needs matplotlib: pip install -e '.[goodput]'") from None
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt
  from matplotlib.patches import Patch
  origin = run.starts[0].began
  hours = run.wall_seconds > 3 * 3600
  scale = 3600 if hours else 1
  figure, axes = plt.subplots(figsize=(9, 1.4 + 0.45 * len(run.starts)), dpi=80)
  previous_end = None
  for row, start in enumerate(run.starts):
    for kind, begin, end in _segments(start, previous_end):
      axes.barh(row, (end - begin) / scale, left=(begin - origin) / scale, height=0.6, color=COLOURS[kind],
                edgecolor="lightgray" if kind == "between starts" else "none", linewidth=0.5)
    previous_end = start.ended
  axes.set_yticks(range(len(run.starts)), [f"start {n} ({s.goodput_share:.0%})" for n, s in enumerate(run.starts, 1)])
  axes.invert_yaxis()
  axes.set_xlabel(f"{'hours' if hours else 'seconds'} since the first start")
  axes.set_title(f"goodput {run.goodput_share:.1%} of {_seconds(run.wall_seconds)}")
  used = [k for k in (GOODPUT, *LOSSES) if run.seconds[k] > 0] + [k for k in DOWNTIME[:-1] if run.downtime[k] > 0]
  axes.legend(handles=[Patch(color=COLOURS[k], label=k) for k in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(run.starts) < 3 else -0.2), ncol=5, fontsize="small", frameon=False)
  figure.savefig(path, bbox_inches="tight")
  plt.close(figure)


def _segments(start: Start, previous_end: Optional[float]):
  """(kind, begin, end) to draw for one start, later segments over earlier ones."""
  ready = next((r["time"] for r in start.records if r["kind"] == "first_step"), start.ended)
  step_seconds = start.seconds[GOODPUT] + start.seconds["recomputed steps"] + start.seconds["skipped updates"]
  span = start.ended - ready
  if previous_end is not None and start.began > previous_end:
    yield "between starts", previous_end, start.began
    yield from start.downtime_segments
  yield "start-up", start.began, ready
  cursor = ready
  for kind in ("recomputed steps", "skipped updates", GOODPUT):
    width = span * start.seconds[kind] / step_seconds if step_seconds else 0.0
    yield kind, cursor, cursor + width
    cursor += width
  for record in start.records:
    if record["kind"] in TIMED_KINDS:
      yield TIMED_KINDS[record["kind"]], record["time"] - record["seconds"], record["time"]
    elif record["kind"] == "steps":
      yield "input waits", record["time"] - record["input_seconds"], record["time"]


def main(argv: Sequence[str]) -> None:
  parser = argparse.ArgumentParser(prog="python -m pretrain.goodput", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("model_dir", help="the run's MODEL_DIR (local path or gs://)")
  parser.add_argument("--png", help="write the timeline here")
  args = parser.parse_args(argv)
  records, unreadable = read_records_and_unreadable(args.model_dir)
  run = account(records, read_launcher_records(args.model_dir))
  print(report(args.model_dir, run))
  if unreadable:
    print(f"{unreadable} line(s) of {FILE_NAME} skipped: cut short (a process killed while writing) or damaged")
  if args.png:
    plot(run, args.png)
    print(f"timeline: {args.png}")


if __name__ == "__main__":
  cli.run("pretrain.goodput", lambda: main(sys.argv[1:]))
