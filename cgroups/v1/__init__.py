"""The cgroup v1 side of the package: one module per controller, beside the cgroup2 ones of the same name.

`cgroups.cpu` writes cpu.max, `cgroups.v1.cpu` writes cpu.cfs_quota_us and
cpu.shares for the same share; likewise cpuset, memory, hugetlb, and devices
(v1's allow/deny lists, where cgroup2 has the eBPF program). Each has the
same shape: `desired_x(...)` (file -> value, in the form the kernel reads
back, so applying twice writes nothing and drift compares strings),
`apply_x(dir, share)` and `stat_x(dir)` returning the cgroup2 module's stat
type. The typed reads and the device entries use cgroupspy's controllers,
bound to cgroups.files by `spy`; every write still goes through
cgroups.files.write_file.
"""
