from coordinator.cli import entry

entry()
