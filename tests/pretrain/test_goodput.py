"""Goodput's accounting over hand-built records, its report and timeline, and the records' timing.
A real run that is preempted and resumed is checked in tests/reliability/test_preemption.py, which runs one."""
import json
import time

import pytest

from pretrain import cli, goodput, goodput_events


def records_of(start_id, began, *events):
  """A start's records: its process start at `began`, then (kind, time, fields) at seconds after it."""
  return [{"start": start_id, "kind": "start", "time": began},
          *({"start": start_id, "kind": kind, "time": began + at, **fields} for kind, at, fields in events)]


def window(at, step, steps, seconds=None, input_seconds=0.0, skipped=0):
  return ("steps", at, {
      "step": step, "steps": steps, "seconds": seconds or steps, "input_seconds": input_seconds, "skipped": skipped
  })


def launcher(kind, time, **fields):
  """A record of launch.tpu's."""
  return {"launch": "L", "kind": kind, "time": time, **fields}


def assert_adds_up(run):
  assert sum(run.seconds.values()) == pytest.approx(run.wall_seconds, rel=1e-9)
  for start in run.starts:
    assert sum(start.seconds.values()) == pytest.approx(start.ended - start.began, rel=1e-9)
    assert all(seconds >= 0 for seconds in start.seconds.values()), start.seconds


def test_a_crash_after_the_last_checkpoint_costs_the_steps_recomputed_and_the_time_after_the_last_record():
  crashed = records_of("a", 1000.0, ("init", 10, {"seconds": 4.0, "step": 0}),
                       ("compile", 20, {"seconds": 8.0, "what": "train_step"}), ("first_step", 20, {"step": 1}),
                       window(30, 10, 10), ("save", 31, {"seconds": 1.0, "step": 10}), window(40, 20, 10),
                       window(50, 30, 10, input_seconds=2.0))  # killed after step 30: no end record
  resumed = records_of("b", 1080.0, ("restore", 5, {"seconds": 3.0, "step": 10}),
                       ("compile", 10, {"seconds": 2.0, "what": "train_step"}), ("first_step", 10, {"step": 11}),
                       window(20, 20, 10), window(30, 30, 10), window(40, 40, 10),
                       ("end", 40, {"how": "finished", "step": 40}))
  run = goodput.account(crashed + resumed)
  assert_adds_up(run)
  first, second = run.starts
  assert (first.how, first.first_step, first.reached, first.recomputed_steps) == ("no end record", 0, 30, 0)
  assert (second.how, second.first_step, second.reached, second.recomputed_steps) == ("finished", 10, 40, 20)
  assert first.seconds["start-up"] == pytest.approx(20 - 4 - 8)
  assert first.seconds["input waits"] == 2.0 and first.seconds["saves"] == 1.0
  assert first.seconds[goodput.GOODPUT] == pytest.approx(50 - 20 - 1 - 2)
  # Start 2 ran 30 steps in 30 s; the 20 up to step 30, which start 1 had reached, are lost again.
  assert second.seconds["recomputed steps"] == pytest.approx(20.0)
  assert second.seconds[goodput.GOODPUT] == pytest.approx(10.0)
  assert run.seconds["between starts"] == pytest.approx(1080 - 1050)
  assert run.wall_seconds == pytest.approx(1120 - 1000)


def test_a_preemption_saved_at_the_step_reached_recomputes_nothing_and_skipped_updates_are_a_loss():
  preempted = records_of("a", 0.0, ("init", 2, {"seconds": 1.0, "step": 0}), ("first_step", 3, {"step": 1}),
                         window(13, 10, 10, skipped=2), ("preemption", 14, {"step": 12}),
                         ("save", 15, {"seconds": 1.0, "step": 12}), ("end", 15, {"how": "preempted", "step": 12}))
  resumed = records_of("b", 20.0, ("restore", 2, {"seconds": 1.0, "step": 12}), ("first_step", 3, {"step": 13}),
                       window(11, 20, 8), ("end", 11, {"how": "finished", "step": 20}))
  run = goodput.account(preempted + resumed)
  assert_adds_up(run)
  assert [s.recomputed_steps for s in run.starts] == [0, 0] and run.seconds["recomputed steps"] == 0
  assert run.starts[0].skipped_updates == 2
  # 12 steps in 15 - 3 - 1 (the save) = 11 s, 2 of them skipped.
  assert run.seconds["skipped updates"] == pytest.approx(2 * 11 / 12)
  assert run.seconds["between starts"] == pytest.approx(5.0)


def test_a_start_in_a_process_that_began_before_the_last_one_ended_begins_at_its_last_record():
  """train() called again in one process (tests, notebooks): the process's start is before the previous start's end."""
  finished = {"how": "finished", "step": 0}
  first = records_of("a", 100.0, ("init", 1, {"seconds": 1.0, "step": 0}), ("end", 2, finished))
  again = records_of("b", 50.0, ("init", 60, {"seconds": 1.0, "step": 0}), ("end", 61, finished))
  run = goodput.account(first + again)
  assert_adds_up(run)
  assert run.starts[1].began == 102.0 and run.seconds["between starts"] == 0
  assert run.starts[1].seconds["start-up"] == pytest.approx(8.0)


def test_steps_of_a_start_that_died_before_logging_one_are_all_lost():
  died = records_of("a", 0.0, ("first_step", 5, {"step": 1}), ("eval", 7, {"seconds": 1.0, "step": 0}))
  run = goodput.account(died)
  assert_adds_up(run)
  assert run.seconds["recomputed steps"] == pytest.approx(1.0) and run.seconds[goodput.GOODPUT] == 0


def test_the_report_prints_each_kind_and_start_and_plots_the_timeline(tmp_path, capsys):
  records = records_of("a", 0.0, ("init", 2, {"seconds": 1.0, "step": 0}), ("first_step", 3, {"step": 1}),
                       window(13, 10, 10), ("end", 13, {"how": "preempted", "step": 10}))
  records += records_of("b", 20.0, ("end", 1, {"how": "stopped", "error": "X", "step": 0}))
  lines = [json.dumps(r) for r in records]
  (tmp_path / goodput.FILE_NAME).write_text("\n".join(lines) + '\n{"start": "c", "ki')  # the last line cut short
  (tmp_path / "goodput_launcher").mkdir()
  (tmp_path / "goodput_launcher" / "L.jsonl").write_text(
      json.dumps(launcher("preemption_detected", 15.0)) + "\n" + json.dumps(launcher("create", 18.0, seconds=2.0)))
  goodput.main([str(tmp_path), f"--png={tmp_path / 'timeline.png'}"])
  out = capsys.readouterr().out
  assert f"{tmp_path}: 2 start(s), 21.0 s from the first start to the last record" in out
  for kind in ("goodput", *goodput.LOSSES, *goodput.DOWNTIME, "total"):
    assert f"  {kind} " in out
  assert "preempted" in out and "stopped (X)" in out
  assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_damaged_lines_are_skipped_and_counted_and_the_rest_reported_as_before(tmp_path, capsys):
  """Bytes flipped on disk: one to a byte that is not UTF-8, one in a field's name (valid JSON, a field gone), one
  in the JSON's syntax; the records that are left report as they did, and the run's done line reads them too."""
  records = records_of("a", 0.0, ("init", 2, {"seconds": 1.0, "step": 0}), ("first_step", 3, {"step": 1}),
                       window(13, 10, 10), ("end", 13, {"how": "finished", "step": 10}))
  path = tmp_path / goodput.FILE_NAME
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  goodput.main([str(tmp_path)])
  clean = capsys.readouterr().out
  damaged = records_of("b", 20.0, ("init", 2, {"seconds": 1.0, "step": 0}), window(13, 10, 10))
  path.write_text("".join(json.dumps(r) + "\n" for r in records + damaged))
  data = bytearray(path.read_bytes())
  flips = (('"start": "b"', 1, 0x80), ('"seconds": 1.0, "step": 0}', 2, 0x01), ('"step": 10, ', 6, 0x08))
  for text, offset, flip in flips:  # 's' -> 0xf3, "seconds" -> "sdconds", "step": -> "step"2
    at = data.index(text.encode(), len(data) - sum(len(json.dumps(r)) + 1 for r in damaged)) + offset
    data[at] ^= flip
  path.write_bytes(bytes(data))
  assert len(goodput.read_records(str(tmp_path))) == len(records)
  goodput.main([str(tmp_path)])
  assert capsys.readouterr().out == clean + f"3 line(s) of {goodput.FILE_NAME} skipped: cut short (a process killed " \
                                            "while writing) or damaged\n"
  with goodput_events.EventLog(str(tmp_path), write=True, called_at=time.time()) as events:
    this_start, the_run = events.goodput_shares()
  assert this_start == 0.0 and 0.0 < the_run < goodput.account(records).goodput_share


def test_a_model_dir_without_records_is_one_line_and_exit_1(tmp_path, capsys):
  with pytest.raises(SystemExit) as exited:
    cli.run("pretrain.goodput", lambda: goodput.main([str(tmp_path)]))
  assert exited.value.code == 1
  assert capsys.readouterr().err.strip() == f"pretrain.goodput: error: {tmp_path} has no goodput.jsonl: no run has " \
                                            "started there, or none since goodput was recorded"


def test_timed_records_leave_out_what_was_recorded_inside_them_and_only_process_0_writes(tmp_path):
  events = goodput_events.EventLog(str(tmp_path), write=True, called_at=time.time())
  with events:
    evaluate = events.compiled_on_first_call(lambda: time.sleep(0.2), "eval_step")
    with events.timed("eval", step=1):
      evaluate()  # compiles
      evaluate()
  records = goodput.read_records(str(tmp_path))
  assert [r["kind"] for r in records] == ["start", "compile", "eval"]
  compile_record, eval_record = records[1:]
  assert 0.2 <= compile_record["seconds"] < 0.3 and 0.2 <= eval_record["seconds"] < 0.3

  quiet = goodput_events.EventLog(str(tmp_path / "other"), write=False, called_at=time.time())
  with pytest.raises(RuntimeError), quiet:
    raise RuntimeError("a fault")
  assert not (tmp_path / "other").exists()
  with pytest.raises(RuntimeError), events:
    raise RuntimeError("a fault")
  assert goodput.read_records(str(tmp_path))[-1]["how"] == "stopped"


def test_only_a_process_launched_to_train_begins_its_first_start_at_the_process_start(tmp_path, monkeypatch):
  """`make demo` trains its runs in one process: the second run's start-up is not the first run's time. A notebook
  that calls train() was not launched to train: its idle time before the call is not start-up either."""
  monkeypatch.setattr(goodput_events, "_process_start_unclaimed", False)  # as in a new process
  called_at = time.time()

  def start_of(name: str) -> float:
    (tmp_path / name).mkdir()
    with goodput_events.EventLog(str(tmp_path / name), write=True, called_at=called_at):
      pass
    return goodput.read_records(str(tmp_path / name))[0]["time"]

  assert start_of("notebook") == called_at
  goodput_events.launched_to_train()
  first = start_of("first")
  assert first == pytest.approx(goodput_events.process_start_time(), abs=1.0) and first <= called_at - 1
  assert start_of("later") == called_at


def test_records_append_in_a_bucket_and_read_back(gcs_bucket):
  """On gs:// an object cannot be appended to: each record rewrites it, and none is lost."""
  model_dir = f"{gcs_bucket}/goodput_run"
  with goodput_events.EventLog(model_dir, write=True, called_at=time.time()) as events:
    events.state_ready(1.0, 0, 0)
    events.record("end", how="finished", step=0)
  assert [r["kind"] for r in goodput.read_records(model_dir)] == ["start", "init", "end"]
  assert events.goodput_shares() == (0.0, 0.0)


def test_the_launchers_records_split_the_time_between_starts_exactly_clipped_to_each_gap():
  finished = {"how": "finished", "step": 0}
  first = records_of("a", 0.0, ("end", 10, {"how": "preempted", "step": 0}))
  second = records_of("b", 500.0, ("end", 10, {"how": "preempted", "step": 0}))
  third = records_of("c", 1000.0, ("end", 10, finished))
  launcher_records = [
      launcher("train_command", -5.0),  # before the first start: outside the run's wall time
      launcher("preemption_detected", 100.0, state="PREEMPTED"),  # 90 s after start 1's last record
      launcher("delete", 160.0, seconds=60.0), launcher("create", 400.0, seconds=240.0),
      launcher("setup", 480.0, seconds=80.0), launcher("train_command", 481.0),
      # The second restart: no delete (the slice was gone); setup's end reads later than start 3's process start
      # (the launcher's clock ahead): clipped to it.
      launcher("preemption_detected", 600.0, state="gone"), launcher("create", 900.0, seconds=300.0),
      launcher("setup", 1002.0, seconds=99.0), launcher("train_command", 1003.0),
  ]
  run = goodput.account(first + second + third, reversed(launcher_records))  # any order
  assert_adds_up(run)
  assert run.starts[0].downtime_segments == []
  assert run.starts[1].downtime(run.starts[0].ended) == pytest.approx(
      {"detection": 90.0, "recreate": 300.0, "setup": 80.0, "other": 20.0})
  assert run.starts[2].downtime(run.starts[1].ended) == pytest.approx(
      {"detection": 90.0, "recreate": 300.0, "setup": 97.0, "other": 3.0})
  assert run.downtime == pytest.approx({"detection": 180.0, "recreate": 600.0, "setup": 177.0, "other": 23.0})
  assert sum(run.downtime.values()) == pytest.approx(run.seconds["between starts"], rel=1e-12)
  report = goodput.report("gs://b/run", run)
  assert "    recreate             600.0 s   59.4%  delete and create the slice" in report


def test_without_the_launchers_records_the_time_between_starts_is_other_and_the_report_shows_no_split():
  run = goodput.account(records_of("a", 0.0, ("end", 1, {"how": "preempted", "step": 0})) +
                        records_of("b", 5.0, ("end", 1, {"how": "finished", "step": 0})))
  assert run.downtime == {"detection": 0.0, "recreate": 0.0, "setup": 0.0, "other": 4.0}
  assert "    detection" not in goodput.report("run", run)
