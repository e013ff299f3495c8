"""``grad-check run -- COMMAND...``: check the training script you already have.

The command runs once per split of one global batch G into N ranks x k micro-steps
(``{batch}``, ``{accum}``, ``{nproc}`` and ``{global_batch}`` substituted in it), each
rank a real process with torchrun's environment. A capture module, loaded before the
script by a startup hook (``startup/sitecustomize.py``), records what every optimizer
step receives and leaves behind, and compares it, shard by shard on the split's own
ranks, with what the reference split's first run wrote (the check's engine:
harness/check/compare.py, shards.py); the launcher process judges the fits
(harness/check/judge.py, fix.py).

- ``splits.py``: the splits and the command's placeholders (names and arithmetic);
- ``script_config.py``: the run's settings, refusing bad values; ``wire.py``: what
  grad-check tells each process of a split and what each rank reports back, typed;
- ``launchers.py``: a launcher at the command's head (torchrun, accelerate launch, tune
  run with torchrun's options, ...), which runs once per split and starts the ranks
  itself;
- ``processes.py``: one run of the command at a split, its processes watched and none
  left behind; ``failures.py``: the rank that failed first, or hung, in one line;
- ``guard.py``: what watches every process of a split from inside (grad-check's death,
  progress, a RANK claimed twice); ``capture.py``: what records the steps in a rank
  (``installed.py`` installs both; ``wrappers.py``: the functions it wraps);
  ``sharded.py`` and ``engines.py``: how it reads FSDP's and DeepSpeed's shards
  (``engines.py``: DeepSpeed's boundary step); ``points.py``: each point written (the
  reference) or compared; ``files.py``: where;
- ``slurm.py``: each rank an ``srun`` step, inside scripts/slurm/check-run.sbatch;
- ``records.py``: a run's capture, read back;
- ``split_judge.py``: rows from the captures (same data, verdicts, fixes);
  ``repeatable.py``: whether the reference's two runs agree;
- ``schema.py``: the columns of ``script.csv``; ``grad_check_run.py``: the command line;
  ``runs.py``: the reference twice, then every split.
"""
