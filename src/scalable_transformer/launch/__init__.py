"""Starting several processes, behind one `Launcher` protocol (`launcher.py`).

`local` runs the ranks of one node through torchrun's agent (`stx launch`); `local_jobs` is the
first `Launcher`: a job as `stx launch -n N` in a child process. `batch` writes and submits Slurm
and PBS batch scripts and reads their jobs' states (the `BatchLauncher` of sweeps and `stx
submit`); `hostfile` starts one `stx launch` per host over ssh (`ssh_node` on each host stops the
ranks when the session closes).

Nothing is imported here: `stx` must not pay for torch.distributed unless it launches.
"""
