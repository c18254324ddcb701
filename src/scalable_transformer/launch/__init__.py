"""Starting several processes: `local` (this node, through torchrun's agent); cluster launchers later.

Nothing is imported here: `stx` must not pay for torch.distributed unless it launches.
"""
