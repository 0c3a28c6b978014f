"""Shared test helpers: free ports, child processes, a real etcd server."""
