"""What runs beside the loop: supervision (`supervision`: the step heartbeat, checkpoints by
policy, preemption, collective timeouts), observation (`observe`: metrics, trackers, progress),
the records (`metrics`), the trackers (`trackers`), tensor bytes by role (`memory`) and
`shardwise report` (`report`)."""
