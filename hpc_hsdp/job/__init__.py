"""What a job is (no torch), below every place that runs it: the typed sections of its spec, the
one option registry read from them, its config files, a sweep's points, and the path of what a
task runs (so nothing that submits imports the task)."""
