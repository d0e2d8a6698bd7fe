"""This machine: running a program (`cmd`, the one subprocess wrapper and its fixes), processes and daemons
(`procs`), and what the host has (`host`: GPUs, the interpreter's torch, free disk, kernel WireGuard)."""
