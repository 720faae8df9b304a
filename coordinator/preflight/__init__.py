"""The judge: the eight checks, the playbook lint, launch --fix's plan, and the one preflight pipeline."""
