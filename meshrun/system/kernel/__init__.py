"""The kernel's network: the WireGuard device (`device`, kernel or wireguard-go; `fakedevice`), nftables
tables and job cgroups (`firewall`; `fakefirewall`), routes and addresses (`net`), the site LAN path's VXLAN
device (`lanlink`), and a relay's fast path in the ingress hook (`relaykernel`)."""
