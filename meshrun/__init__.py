"""meshrun: one PyTorch job across NAT'd datacenters over a WireGuard overlay."""

__version__ = "0.1.0"
