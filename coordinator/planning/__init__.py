"""Pure decisions about a job: memory estimates, the calibrated split, map shards, the strategy, the hostfile."""
