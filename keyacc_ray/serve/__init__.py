"""Thin Ray Serve shells over the engine and the policies: ingress, router, pools, monitor."""
