"""What watches a task: the collectives' listeners, the trackers, the log, the debugger."""
