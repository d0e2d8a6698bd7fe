"""Pure logic: data shapes, keys, tokens, address plans, peer and path decisions, launch plans.

Nothing here runs a process, opens a socket or touches a file; it imports nothing from
meshrun.system, .mesh, .jobs or .cli (tests/unit/project/test_layers.py enforces it).
"""
