"""The train loop: start (resume, imported weights or fresh), steps, logs, eval, checkpoints.

It knows models only through a `Family` (pretrain/families/base.py) and data only through a seqio
task name and `data_pipelines.input_pipeline`; the state and the jitted steps are `pretrain.steps`.
"""
import functools
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import jax
import numpy as np
import optax
from etils import epath
from jax.experimental import multihost_utils

from data_pipelines import input_pipeline, tasks
from data_pipelines.background import Background
from models import layers
from pretrain import (checkpoints, compilation_cache, goodput_events, lease, optimizers, partitioning, replayed_reads,
                      run_files, signals, step_cache, steps)
from pretrain.errors import ConfigError, TrainingStopped, one_line, user_settings
from pretrain.families.base import Family
from pretrain.metrics import MetricsWriter, say
from pretrain.profiling import StepProfiler
from pretrain.throughput import Throughput


def fitted_family(family: Family, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int]) -> Family:
  """The family fitted to the task's vocabulary and objective (`Family.fit_to_data`)."""
  with user_settings():
    task = tasks.get_task_or_mixture(mixture_or_task_name)
    objective = tasks.objective_of(task)
  return family.fit_to_data(tasks.vocabulary(task).vocab_size, objective, task_feature_lengths)


def input_pipeline_for_run(family: Family, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
                           batch_size: int, data_parallel_groups: int, seed: int, data_shards: Optional[int],
                           **process) -> input_pipeline.InputPipeline:
  """This process's batches of the run's task, shaped for the family. `process`: process_index and
  process_count when not this JAX process's (benchmarks/input_pipeline.py plays one host of many)."""
  batch_shapes = family.feature_shapes(batch_size, task_feature_lengths)
  with user_settings():
    return input_pipeline.InputPipeline(mixture_or_task_name, task_feature_lengths, batch_size,
                                        {k: (s.shape[1:], s.dtype) for k, s in batch_shapes.items()},
                                        data_parallel_groups=data_parallel_groups, seed=seed,
                                        num_data_shards=data_shards, bi_data=family.bi_data(),
                                        **process)


def restore_or_initialize(setup: steps.Setup, run_config: run_files.RunConfig, model_dir: str, manager,
                          train_iterator, seed: int, before_loading: Callable[[int], None] = lambda step: None
                          ) -> Tuple[steps.TrainState, List[str]]:
  """The state a run starts from, and lines that say how it was found (none: fresh):
  - resume: the newest checkpoint that restores intact, with the data iterator where it stopped, if
    `run_config` matches it. Damaged newer ones are named and set aside; if none is intact the run
    stops: it never starts over in a MODEL_DIR that holds checkpoints;
  - imported weights (a weights-only checkpoint from pretrain.import_hf): a fresh state around them;
  - fresh: a new state from `seed`.
  `before_loading(step)` is called with the step the state will be at before it is made or read (before each
  checkpoint tried), after the checks that a user's settings fail (a checkpoint's run_config): what runs beside
  the loading starts there.
  """
  saved = sorted(manager.all_steps(), reverse=True)
  if not saved:
    before_loading(0)
    return jax.jit(setup.init_state, out_shardings=setup.state_shardings)(jax.random.PRNGKey(seed)), []
  where = checkpoints.checkpoint_dir(model_dir)
  if not checkpoints.has_data_iterator(model_dir, saved[0]):
    before_loading(0)
    return _around_imported_weights(setup, model_dir, saved[0], seed), [
        f"starting from the weights in {where}: fresh optimizer, step 0"]
  damaged = []
  for step in saved:
    try:
      saved_config = run_files.read_run_config(model_dir, step)[1]
    except checkpoints.READ_ERRORS as e:
      damaged.append((step, f"its run_config is unreadable ({type(e).__name__})"))
      continue
    differences = saved_config.differences(run_config)
    if differences:
      raise ConfigError(f"this run does not match the checkpoint at step {step} in {where} ({'; '.join(differences)})"
                        ": resume with the checkpoint's settings, or train in a new MODEL_DIR")
    before_loading(step)
    try:
      state, restore_notes = checkpoints.restore(manager, step, setup.sharded_abstract_state(), train_iterator)
    except checkpoints.DamagedCheckpoint as e:
      damaged.append((step, str(e)))
      continue
    notes = [f"checkpoint {where / str(bad)} is damaged: {why}; set aside in {checkpoints.set_aside(model_dir, bad)}"
             for bad, why in damaged]
    if damaged:
      manager.reload()
    return state, notes + [f"resumed from step {step} in {where}"] + restore_notes
  raise TrainingStopped(f"no checkpoint in {where} can be restored (" +
                        "; ".join(f"step {step}: {why}" for step, why in damaged) +
                        "); nothing was moved or deleted. Repair or remove them, or train in a new MODEL_DIR")


def _around_imported_weights(setup: steps.Setup, model_dir: str, step: int, seed: int) -> steps.TrainState:
  """A fresh state around a weights-only checkpoint's params, unrolled as pretrain.import_hf writes them;
  one program, so XLA never holds two sets of params."""
  abstract = setup.sharded_abstract_state().params
  params = run_files.in_layout(checkpoints.restore_params(model_dir, step), setup.family.config.scan_layers)
  params = jax.tree.map(lambda target, value: jax.make_array_from_callback(target.shape, target.sharding,
                                                                           lambda index: value[index]),
                        abstract, params)
  return jax.jit(setup.state_around, out_shardings=setup.state_shardings)(params, jax.random.PRNGKey(seed))


def _evaluate(setup: steps.Setup, eval_fn, params, batches) -> Dict[str, float]:
  """Mean metrics over held-out batches, read in order (XLNet's memory carries from one to the next)."""
  carry, rows = steps.initial_eval_carry(setup), []
  for batch in batches:
    metrics, carry = eval_fn(params, partitioning.global_batch(batch, setup.mesh), carry)
    rows.append(jax.device_get(metrics))
  return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _write_logged_step(step: int, metrics, throughput: Throughput, writer: MetricsWriter,
                       events: goodput_events.EventLog) -> Dict[str, Any]:
  """Writes a logged step's metrics and the speed of the window it ends; returns them, on the host."""
  metrics = jax.device_get(metrics)  # here the step has finished: the window ends
  speed = throughput.window(step)
  metrics.update(speed)
  events.window(step, speed, int(metrics["skipped_steps"]))
  writer.write(step, metrics)
  warning = throughput.input_warning(step, metrics["input_wait"])
  if warning:
    say(warning)
  return metrics


def _stop_if_diverging(step: int, metrics, max_skipped_in_a_row: int, manager, model_dir: str) -> None:
  """Stops the run once `max_skipped_in_a_row` updates in a row were skipped for non-finite gradients."""
  in_a_row = int(jax.device_get(metrics["skipped_in_a_row"]))
  if in_a_row < max_skipped_in_a_row:
    return
  manager.wait_until_finished()
  where = checkpoints.checkpoint_dir(model_dir)
  raise TrainingStopped(
      f"the gradients were not finite at {in_a_row} steps in a row, up to step {step}: stopping (the params stayed "
      f"finite; the last checkpoint is step {manager.latest_step()} in {where}). Lower LEARNING_RATE or CLIP_NORM, "
      "or raise WARMUP_STEPS, then resume")


def _input_failed(error: Exception, step: int, model_dir: str, iterator, new_iterator: Callable[[], Any],
                  alone: bool, saved: bool = False) -> TrainingStopped:
  """The stop after the train input failed to make the batch of step `step + 1`; `saved`: step `step` was saved.
  Where this process reads a text input alone and the file that failed reads now, the checkpoints that hold the
  failed read are set aside (`pretrain.replayed_reads`), so that the same command goes on from the newest that
  does not."""
  where = checkpoints.checkpoint_dir(model_dir)
  failed = f"the train input failed to make the batch of step {step + 1} ({type(error).__name__}: {one_line(error)})"
  text_input = not iterator.position_survives_failure
  mended = alone and text_input and iterator.mended_file(error)
  if mended:
    holding, resume_at = replayed_reads.holding_the_failure(model_dir, new_iterator, step + 1, mended)
    if not holding:
      going_on = (f"no checkpoint in {where} holds the failed read: the same command resumes from step {resume_at}"
                  if resume_at is not None else f"no checkpoint yet in {where}: the same command starts again")
      return TrainingStopped(f"{failed}; {mended} reads now, and {going_on}")
    steps_held = f"{', '.join(map(str, holding))} in {where}"
    why = "(tf.data saved it with their data position)"
    if resume_at is None:
      return TrainingStopped(f"{failed}; {mended} reads now, but every checkpoint ({steps_held}) holds the failed read "
                             f"{why}: nothing was moved. Train in a new MODEL_DIR")
    moved = [checkpoints.set_aside(model_dir, s, into=replayed_reads.SET_ASIDE) for s in holding]
    return TrainingStopped(f"{failed}; {mended} reads now, but checkpoint(s) {steps_held} hold the failed read {why}: "
                           f"set aside in {moved[0].parent}. The same command resumes from step {resume_at}")
  newest = checkpoints.newest_step(where)
  kept = (f"saved step {step}" if saved else "no checkpoint yet" if newest is None
          else f"the newest checkpoint is step {newest}")
  note = ""
  if text_input and newest is not None:
    note = (" (tf.data saves the batches a text input has read ahead with its position, a failed read among them: "
            + ("a resume that meets it again once the input is mended sets aside the checkpoints that hold it)"
               if alone else f"if a resume fails the same way once the input is mended, move the checkpoint it resumed "
               f"from, and any newer, out of {where.name}/ and resume again)"))
  return TrainingStopped(f"{failed}; {kept} in {where}{note}. Mend the input, then resume")


@signals.handled
def train(*, model_dir: str, family: Family, mixture_or_task_name: str, task_feature_lengths: Mapping[str, int],
          batch_size: int, train_steps: int, mesh_shape: Mapping[str, int], optimizer: optax.GradientTransformation,
          schedule: optax.Schedule, log_every_steps: int = 10, checkpoint_every_steps: int = 1000,
          eval_every_steps: int = 1000, eval_steps: int = 10, keep_checkpoints: int = 3, seed: int = 0,
          microbatches: int = 1, microbatch_rows_per_group: Optional[int] = None, num_slices: int = 1,
          data_shards: Optional[int] = None, max_skipped_in_a_row: int = 10, save_attempts: int = 4,
          profile_steps: Optional[Tuple[int, int]] = None,
          compilation_cache_dir: Optional[str] = None) -> Dict[str, Any]:
  """Trains until `train_steps`, resuming from the latest checkpoint in model_dir if there is one.

  Faults: an update with non-finite gradients is skipped (and counted); `max_skipped_in_a_row` of them
  stop the run. A preemption notice (SIGTERM) makes every process finish its step, save a checkpoint
  at the step they agree on, and return; the same command resumes there. A damaged newest checkpoint
  is set aside for the newest intact one; a checkpoint that storage refuses is written again
  (`save_attempts`); another live run on model_dir stops this one before it starts (`pretrain.lease`).
  SIGTERM or Ctrl-C before the first step stops the run, saying where it was (`pretrain.signals`). An input
  that fails to make a batch stops the run too, after saving the step reached where one process runs alone
  on an input whose position survives the failure (row streams); alone on text, once the file that failed reads
  again, the checkpoints that hold the failed read are set aside (`pretrain.replayed_reads`).

  Gradient accumulation: `microbatches` slices per step, or as many as give each data-parallel group
  of the mesh `microbatch_rows_per_group` rows at a time.
  `data_shards`: how many seqio shards make up the global batch (default: one per process).
  The train step compiles in a thread beside the state's restore or init, from the state's shapes and shardings;
  its trace goes first, since its compile is the longer way to the first step.
  Each logged step shows the speed of the steps since the last one (`pretrain.throughput`): step time,
  examples and tokens per second, MFU and the share of time spent waiting for input. The next batch is
  put on the devices while a step runs. `profile_steps` (first, last): a trace of those steps in
  MODEL_DIR/profile (`pretrain.profiling`). Compiled programs are cached in `compilation_cache_dir`
  (`pretrain.compilation_cache`; default MODEL_DIR/compilation_cache), the train step also under what it is
  made of, so that a start that finds it does not trace it (`pretrain.step_cache`); a line after start-up says
  how many were loaded from the cache and how many compiled. Process 0 records where the start's time goes in
  MODEL_DIR/goodput.jsonl (`pretrain.goodput_events`; `python -m pretrain.goodput` reports).
  Returns a summary: first and last logged loss, the step reached, whether it was preempted, the
  checkpoint directory, the programs the run `compiled` and `loaded` from the compilation cache, and
  `goodput`: (this start's share of goodput, the run's so far) on process 0, else None.
  """
  called_at = time.time()  # where goodput's records begin this start, unless it is the process's first
  with user_settings():  # by the macros of runs/pretrain.gin
    layers.check_at_least(1, TRAIN_STEPS=train_steps, BATCH_SIZE=batch_size, LOG_EVERY_STEPS=log_every_steps,
                          CHECKPOINT_EVERY_STEPS=checkpoint_every_steps, EVAL_STEPS=eval_steps,
                          KEEP_CHECKPOINTS=keep_checkpoints, MICROBATCHES=microbatches,
                          MICROBATCH_ROWS_PER_GROUP=microbatch_rows_per_group, NUM_SLICES=num_slices,
                          DATA_SHARDS=data_shards, MAX_SKIPPED_IN_A_ROW=max_skipped_in_a_row)
    layers.check_at_least(0, EVAL_EVERY_STEPS=eval_every_steps, SEED=seed, SAVE_ATTEMPTS=save_attempts)
  profiler = StepProfiler(model_dir, profile_steps)
  directory = epath.Path(model_dir)
  if directory.exists() and not directory.is_dir():
    raise ConfigError(f"MODEL_DIR={model_dir!r} is a file; it must be a directory (or not exist yet)")
  signals.at("reading the task and building the input pipeline")
  family = fitted_family(family, mixture_or_task_name, task_feature_lengths)
  mesh = partitioning.make_mesh(mesh_shape, num_slices=num_slices)
  setup = steps.make_setup(family, task_feature_lengths, batch_size, mesh, optimizer, schedule, microbatches,
                           microbatch_rows_per_group)
  data = input_pipeline_for_run(family, mixture_or_task_name, task_feature_lengths, batch_size,
                                partitioning.data_parallel_groups(mesh), seed, data_shards)
  directory.mkdir(parents=True, exist_ok=True)
  with (lease.held(model_dir, jax.process_index() == 0) as took_over, partitioning.tracing_context(mesh, setup.rules),
        profiler, compilation_cache.used(compilation_cache_dir, model_dir) as compiles,
        goodput_events.EventLog(model_dir, write=jax.process_index() == 0, called_at=called_at) as events):
    run_files.keep_vocabulary(model_dir, data.vocabulary.sentencepiece_model_file, write=jax.process_index() == 0)
    run_config = run_files.RunConfig(family, mixture_or_task_name, task_feature_lengths, batch_size)
    unfinished = checkpoints.unfinished_saves(model_dir)
    signals.at("opening the train input (tokenizing it on first use)")
    with user_settings():  # an empty corpus, text the objective makes no example of, a TOKEN_DIR of another vocabulary
      train_iterator = data.iterator("train", say=say)
      if eval_every_steps and data.has_split("validation"):
        data.check_examples("validation", say=say)  # now, not at the first eval
    saver = checkpoints.Saver(model_dir, keep_checkpoints, train_iterator, run_config.to_json(), say, save_attempts)
    # The train step compiles beside the state's restore or init: it needs only their shapes and shardings.
    # Its trace goes first: its compile is the longer way to the first step, and the state's trace beside it
    # would only share Python's lock with it.
    compiling: List[Background] = []
    waited_for_trace = 0.0

    def compile_beside(step_loaded: int) -> None:
      nonlocal waited_for_trace
      if step_loaded >= train_steps or compiling:
        return
      traced = threading.Event()

      def compile_step():
        try:
          return step_cache.compiled_train_step(setup, compiles.directory, write=jax.process_index() == 0,
                                                warn=say, traced=traced.set)
        finally:
          traced.set()

      compiling.append(Background(compile_step, name="train-step-compile"))
      began = time.time()
      traced.wait()
      waited_for_trace = time.time() - began

    signals.at("restoring or initializing the train state (the train step compiles meanwhile)")
    state_began = time.time()
    try:
      state, notes = restore_or_initialize(setup, run_config, model_dir, saver.manager, train_iterator, seed,
                                           before_loading=compile_beside)
    except Exception:
      for background in compiling:  # an exit while it compiles would abort the process
        say("waiting for the train step's compile to end before stopping")
        background.wait()
      raise
    events.state_ready(time.time() - state_began - waited_for_trace, int(state.step),
                       int(jax.device_get(optimizers.skipped_updates(state.opt_state)["skipped_steps"])))
    writer = MetricsWriter(model_dir, train_steps, start_step=int(state.step))
    if took_over:
      say(took_over)
    if unfinished:
      say(f"ignoring {len(unfinished)} unfinished save(s) in {checkpoints.checkpoint_dir(model_dir)} left by a "
          f"process stopped while saving, to be removed before the next save: {', '.join(unfinished)}")
    for note in notes:
      say(note)
    eval_fn = events.compiled_on_first_call(steps.jit_eval_step(setup), "eval_step")
    num_params = sum(x.size for x in jax.tree.leaves(state.params))
    say(f"{family.name}: {num_params / 1e6:.2f}M parameters, mesh {dict(mesh.shape)}, "
        f"global batch {batch_size}, {jax.process_count()} process(es)")

    losses, step, preempted = [], int(state.step), False
    position_survives, alone = train_iterator.position_survives_failure, jax.process_count() == 1
    new_train_iterator = functools.partial(data.iterator, "train", say=say)  # to read a saved position again
    batch = None
    if step < train_steps:
      # The first batch's start-up (reading, tokenizing, filling the shuffle buffers) happens once, while the
      # step compiles (each mostly in native code, on a core of its own), and is not counted as waiting.
      first_batch = Background(lambda: next(train_iterator), name="first-batch")
      signals.at("compiling the train step")
      waited = time.time()
      step_fn, untraced = compiling[0].result()
      if untraced:
        compiles.count_untraced_load()
      events.record("compile", what="train_step", seconds=time.time() - waited + waited_for_trace,
                    overall_seconds=compiling[0].seconds, untraced=untraced)
      profiler.use_program(step_fn)
      signals.at("waiting for the first batch")
      try:
        host_batch = first_batch.result()
      except Exception as e:
        raise _input_failed(e, step, model_dir, train_iterator, new_train_iterator, alone) from e
      batch = partitioning.global_batch(host_batch, mesh)
    signals.training_begins()
    throughput = Throughput(setup, batch_size, steps.tokens_per_batch(batch_size, task_feature_lengths), step)
    say(compiles.line())

    def logged(s: int) -> bool:
      return s % log_every_steps == 0 or s == train_steps

    def finish(s: int, metrics) -> None:
      """Step s's outputs, read once the step after it is dispatched: reading them leaves no device idle."""
      if logged(s):
        metrics = _write_logged_step(s, metrics, throughput, writer, events)
        losses.append(float(metrics["loss"]))
      _stop_if_diverging(s, metrics, max_skipped_in_a_row, saver.manager, model_dir)

    unread = None  # (step, metrics) of the step dispatched last
    if step < train_steps:
      events.record("first_step", step=step + 1)
    while step < train_steps and not preempted:
      profiler.before(step + 1)
      state, metrics = step_fn(state, batch)
      step += 1
      profiler.after(step, metrics)
      if unread:
        finish(*unread)
      unread = step, metrics
      if logged(step):
        saver.check(step, state)
      if eval_every_steps and step % eval_every_steps == 0 and data.has_split("validation"):
        finish(*unread)  # the eval waits for this step anyway; its line comes after the step's
        unread = None
        with events.timed("eval", step=step):
          eval_metrics = _evaluate(setup, eval_fn, state.params, data.take("validation", eval_steps))
        writer.write(step, eval_metrics, split="eval")
      # Every process calls this at every step; after a SIGTERM to any of them, all return True at one step.
      preempted = multihost_utils.reached_preemption_sync_point(step)
      if preempted:
        events.record("preemption", step=step)
      if step % checkpoint_every_steps == 0 or step == train_steps or preempted:
        jax.block_until_ready(state)  # the step's own run, which a save waits for, counts as the step's
        with events.timed("save", step=step):
          saver.save(step, state)
      if step < train_steps and not preempted:
        # Onto the devices while this step runs; only now, after any save of this step: a checkpoint holds
        # the data iterator, which must stand after this step's batch, not the next one's.
        with throughput.waiting_for_input():
          try:
            host_batch = next(train_iterator)
          except Exception as e:
            # Alone, this process keeps the steps since the last checkpoint where its data position still stands
            # before the failed batch (row streams). With others it cannot: they are in the next step's
            # collectives, not in a save.
            if alone:
              finish(*unread)
              with events.timed("save", step=step):
                if position_survives:
                  if step % checkpoint_every_steps:  # else saved just above
                    saver.save(step, state)
                  saver.finish(step, state)
                else:
                  saver.land()
            raise _input_failed(e, step, model_dir, train_iterator, new_train_iterator, alone,
                                saved=alone and position_survives) from e
          batch = partitioning.global_batch(host_batch, mesh)
    if unread:
      finish(*unread)
    with events.timed("save", step=step):
      saver.finish(step, state)
    if preempted:
      say(f"preempted: saved a checkpoint at step {step} in {checkpoints.checkpoint_dir(model_dir)}; "
          "the same command resumes there")
    events.record("end", how="preempted" if preempted else "finished", step=step)
  writer.close()
  return {"first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
          "steps": step, "preempted": preempted, "checkpoint_dir": str(checkpoints.checkpoint_dir(model_dir)),
          "compiled": compiles.compiled, "loaded": compiles.loaded, "goodput": events.goodput_shares()}
