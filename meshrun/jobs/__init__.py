"""Training jobs: the coordinator-side runner, the node-side job API, the worker wrapper."""
