"""The kernel boundary for cgroups v2: create, limit, fill, kill and remove cgroups; the eBPF device program."""
