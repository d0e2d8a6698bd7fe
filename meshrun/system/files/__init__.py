"""Files on this machine: a member's state directory with atomic writes (`statedir`), job directories and
bounded logs (`joblogs`), a project's persistent directory (`projects`), what a project ships and pulls
back (`archive`), and tensors read without running code (`tensorfiles`)."""
