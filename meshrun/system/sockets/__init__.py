"""Sockets and the servers on them: HTTP servers and clients (`transport`), the event-loop server skeleton
(`loopserver`) under the public TLS port (`frontdoor`) and the members' long-polls (`longpoll`), probes of
paths and round trips (`probe`), a relay's per-pair UDP ports (`udprelay`), the bench's TCP tests
(`tcpbench`) and overlay-bound TCPStores (`tcpstore`)."""
