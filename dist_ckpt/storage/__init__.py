"""Where checkpoints live, and the only code that renames or deletes them.

Local directories: ``commit`` (staging directory, atomic swap onto the target), ``lock``,
``leftovers`` (the names of what a save leaves beside its target), ``entries`` (which files of a
directory belong to the checkpoint and which to other tools), ``clean`` (recovery after an
interrupted save), ``locations`` (what a path holds: errors that say where the checkpoint is),
``formats`` (other tools' checkpoints, recognised by their files). URLs: ``object_store``
(commit by one pointer PUT, the local download cache). A training run's root: ``run_root``
(local or URL) and ``commit_order`` (the order in which saves committed).
"""
