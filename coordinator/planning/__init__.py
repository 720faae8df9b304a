"""Pure decisions about a job: memory estimates, the calibrated split, map shards, the strategy (dp, pipeline,
fsdp) and a pipeline's layer split, the hostfile."""
