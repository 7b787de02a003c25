"""What watching a job records: stacks (hang/stacks.json, the ranks' stacks grouped),
flight_recorder (which collective an NCCL job hung in), debug_session (debug/), tracker_runs
(trackers.json), fabric_check_record (check.json, checks.jsonl), replica_membership
(replicas.jsonl)."""
