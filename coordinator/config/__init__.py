"""The user's files: inventories (three formats), playbooks, and the YAML loader that keeps file:line."""
