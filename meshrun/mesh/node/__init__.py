"""A node's side of the mesh, mirroring meshrun.mesh.coordinator: `setup` (join, resume, leave) and
`daemon` (the agent that keeps the peers in sync)."""
