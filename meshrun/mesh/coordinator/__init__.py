"""The coordinator: network creation (setup), operator actions (admin), the daemon with its enrolment API,
overlay API, member roster and pair-path driver. The node side mirrors it in meshrun.mesh.node."""
