"""Starting several processes, behind one `Launcher` protocol (`launcher.py`).

`local` runs the ranks of one node through torchrun's agent (`stx launch`); `local_jobs` is the
first `Launcher`: a job as `stx launch -n N` in a child process. Cluster launchers (Slurm, PBS,
hostfiles) plug in beside it.

Nothing is imported here: `stx` must not pay for torch.distributed unless it launches.
"""
