"""Talking to the nodes: SSH transport, fact gathering, shipping the worker, assets, setup, sync, nettest."""
