"""Training jobs: submission and control on the coordinator, one supervisor per job, each member's share
(through its job API on nodes), and the worker wrapper inside torchrun."""
