"""``grad-check run -- COMMAND...``: check the training script you already have.

The command runs once per split of one global batch G into N ranks x k micro-steps
(``{batch}``, ``{accum}``, ``{nproc}`` and ``{global_batch}`` substituted in it), each
rank a real process with torchrun's environment. A capture module, loaded before the
script by a startup hook (``startup/sitecustomize.py``), records what every optimizer
step receives and leaves behind, and compares it, shard by shard on the split's own
ranks, with what the reference split's first run wrote (the check's engine:
harness/check/compare.py, shards.py); the launcher process judges the fits
(harness/check/judge.py, fix.py).

- ``splits.py``: the splits and the command's placeholders;
- ``config.py``: the run's settings, refusing bad values;
- ``launch.py``: one run of the command on N ranks, and its first failure in one line;
- ``capture.py``: what runs inside the user's processes; ``sharded.py`` and ``engines.py``:
  how it reads FSDP's and DeepSpeed's shards (``engines.py``: DeepSpeed's boundary step);
  ``points.py``: each point written (the reference) or compared; ``files.py``: where;
- ``slurm.py``: each rank an ``srun`` step, inside scripts/slurm/check-run.sbatch;
- ``records.py``: a run's capture, read back;
- ``judge.py``: rows from the captures (same data, determinism, verdicts, fixes);
- ``schema.py``: the columns of ``script.csv``; ``cli.py``: the command line.
"""
