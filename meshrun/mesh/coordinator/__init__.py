"""The coordinator: network creation (setup), operator actions (admin), the daemon (service) with its
enrolment API, overlay API, member roster and pair-path driver."""
