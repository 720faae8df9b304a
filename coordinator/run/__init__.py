"""A job's life: the launch, the monitor's state machine, supervision, resume, quarantine, run files, metrics."""
