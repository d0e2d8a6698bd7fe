"""The overlay: the coordinator (meshrun.mesh.coordinator), the node (meshrun.mesh.node), and what both share:
the member record, the interface, the daemon process, status and doctor."""
