"""The lab: NAT'd datacenters in network namespaces (the testbed), and `meshrun demo` on top of it."""
