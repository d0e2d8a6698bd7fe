"""The overlay: the coordinator (enrolment, overlay API, pair paths), the node agent, status."""
